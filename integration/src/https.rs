//! HTTPS GETs for the tests of the admin endpoints: as an operator's client would make them
//! (the server verified against a CA, a client certificate, a bearer token), or as a kubelet
//! probe does (no verification, no credentials).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

/// Who is asking.
#[derive(Clone, Debug, Default)]
pub struct Client {
    /// The CA that must sign the server's certificate; `None`: accept any (a probe).
    pub ca: Option<PathBuf>,
    /// A client certificate and its key.
    pub cert: Option<(PathBuf, PathBuf)>,
    /// `Authorization: Bearer <token>`.
    pub token: Option<String>,
}

/// Accepts any server certificate, as a kubelet's HTTPS probe does.
#[derive(Debug)]
struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

fn config(client: &Client) -> rustls::ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("TLS versions");
    let builder = match &client.ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(ca).expect("CA file") {
                roots.add(c.expect("CA PEM")).expect("CA");
            }
            builder.with_root_certificates(roots)
        }
        None => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyServer(provider))),
    };
    match &client.cert {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                CertificateDer::pem_file_iter(cert)
                    .expect("cert file")
                    .map(|c| c.expect("cert PEM"))
                    .collect(),
                PrivateKeyDer::from_pem_file(key).expect("key file"),
            )
            .expect("client certificate"),
        None => builder.with_no_client_auth(),
    }
}

/// `GET path` over TLS (server name `localhost`); the status code and body, or `None` when
/// the connection or handshake failed.
pub fn get(addr: &str, path: &str, client: &Client) -> Option<(u16, String)> {
    let tcp = TcpStream::connect(addr).ok()?;
    tcp.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let conn = rustls::ClientConnection::new(
        Arc::new(config(client)),
        ServerName::try_from("localhost").expect("name"),
    )
    .ok()?;
    let mut stream = rustls::StreamOwned::new(conn, tcp);
    let mut request = format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n");
    if let Some(t) = &client.token {
        request.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut resp = Vec::new();
    let _ = stream.read_to_end(&mut resp);
    crate::parse_response(&resp)
}
