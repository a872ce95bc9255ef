//! Mutual TLS to the calc-server.
//!
//! The agent presents `--tls-cert-file` (its CN, or URI SAN, is its node identity on the
//! server) and accepts the server only if the server's certificate chains to `--tls-ca-file`,
//! is valid now for server authentication, and carries the expected identity: its subject CN
//! equals `--tls-server-cn`, or one of its URI SANs equals `--tls-server-uri-san` (either
//! suffices when both are set). As with Felix and Typha, the identity check replaces the usual
//! host-name check, so one server certificate serves every address the calc-server Service has.
//! There is no fallback: a failed check fails the connection.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tonic::transport::{Channel, Endpoint, Uri};

/// Why the TLS settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or holds no usable PEM.
    #[error("{flag} {path}: {reason}")]
    File {
        /// The flag naming the file.
        flag: &'static str,
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// rustls refused the configuration (e.g. certificate and key do not match).
    #[error("{0}")]
    Config(String),
}

/// The expected server identity.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServerIdentity {
    /// Required subject CN.
    pub cn: Option<String>,
    /// Required URI SAN.
    pub uri_san: Option<String>,
}

/// A ready client TLS configuration.
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<rustls::ClientConfig>,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClientTls")
    }
}

fn read_certs(flag: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let err = |reason: String| TlsError::File {
        flag,
        path: path.display().to_string(),
        reason,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| err(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(err("no certificate in the file".to_owned()));
    }
    Ok(certs)
}

impl ClientTls {
    /// Loads the CA, the client certificate and key, and sets up the server check.
    pub fn load(
        ca: &Path,
        cert: &Path,
        key: &Path,
        server: ServerIdentity,
    ) -> Result<Self, TlsError> {
        if server.cn.is_none() && server.uri_san.is_none() {
            return Err(TlsError::Config(
                "TLS needs --tls-server-cn or --tls-server-uri-san: the server's identity must be checked".to_owned(),
            ));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        for c in read_certs("--tls-ca-file", ca)? {
            roots.add(c).map_err(|e| TlsError::File {
                flag: "--tls-ca-file",
                path: ca.display().to_string(),
                reason: format!("unusable CA certificate: {e}"),
            })?;
        }
        let chain = read_certs("--tls-cert-file", cert)?;
        let key = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::File {
            flag: "--tls-key-file",
            path: key.display().to_string(),
            reason: format!("no PEM private key: {e}"),
        })?;
        let verifier = IdentityVerifier {
            roots: Arc::new(roots),
            provider: provider.clone(),
            expected: server,
        };
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_auth_cert(chain, key)
            .map_err(|e| {
                TlsError::Config(format!(
                    "--tls-cert-file and --tls-key-file do not make a usable pair: {e}"
                ))
            })?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Self {
            config: Arc::new(config),
        })
    }

    /// Connects to `https://host[:port]` and returns the channel (TLS done here, HTTP/2 by
    /// tonic). `endpoint_settings` applies timeouts and keep-alive to the endpoint.
    pub async fn connect(
        &self,
        url: &str,
        endpoint_settings: impl FnOnce(Endpoint) -> Endpoint,
    ) -> Result<Channel, String> {
        let uri: Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
        let host = uri
            .host()
            .ok_or_else(|| format!("{url}: no host"))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = uri.port_u16().unwrap_or(443);
        // tonic sees a plain http:// endpoint: the connector below hands it an established
        // TLS stream.
        let authority = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let endpoint = Endpoint::from_shared(format!("http://{authority}"))
            .map_err(|e| format!("{url}: {e}"))?;
        let endpoint = endpoint_settings(endpoint);
        let connector = tokio_rustls::TlsConnector::from(self.config.clone());
        let server_name = ServerName::try_from(host.clone()).map_err(|e| format!("{url}: {e}"))?;
        let service = tower::service_fn(move |_: Uri| {
            let connector = connector.clone();
            let server_name = server_name.clone();
            let addr = (host.clone(), port);
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                let _ = tcp.set_nodelay(true);
                let tls = connector.connect(server_name, tcp).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        });
        endpoint
            .connect_with_connector(service)
            .await
            .map_err(|e| crate::session::error_chain(&e))
    }
}

/// Chain to the CA (webpki, with the time and server-auth usage checks) plus the identity check.
#[derive(Debug)]
struct IdentityVerifier {
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
    expected: ServerIdentity,
}

/// The server certificate does not carry the identity the agent expects.
#[derive(Debug)]
struct IdentityMismatch(String);

impl fmt::Display for IdentityMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for IdentityMismatch {}

/// The subject CN and URI SANs of a certificate.
pub fn cert_names(der: &[u8]) -> Result<(Option<String>, Vec<String>), String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("cannot parse the certificate: {e}"))?;
    let cn = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|c| c.as_str().ok())
        .map(str::to_owned);
    let uris = match cert.subject_alternative_name() {
        Ok(Some(ext)) => ext
            .value
            .general_names
            .iter()
            .filter_map(|g| match g {
                x509_parser::extensions::GeneralName::URI(u) => Some((*u).to_owned()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    Ok((cn, uris))
}

/// Whether names match the expected identity; `Err` says what was found instead.
fn check_identity(
    expected: &ServerIdentity,
    cn: Option<&str>,
    uris: &[String],
) -> Result<(), String> {
    let cn_ok = expected.cn.as_deref().is_some_and(|e| cn == Some(e));
    let uri_ok = expected
        .uri_san
        .as_deref()
        .is_some_and(|e| uris.iter().any(|u| u == e));
    if cn_ok || uri_ok {
        return Ok(());
    }
    Err(format!(
        "server certificate identity mismatch: expected CN {:?} or URI SAN {:?}, certificate has CN {:?} and URI SANs {:?}",
        expected.cn, expected.uri_san, cn, uris
    ))
}

impl ServerCertVerifier for IdentityVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        let (cn, uris) = cert_names(end_entity.as_ref()).map_err(|e| {
            rustls::Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(
                Arc::new(IdentityMismatch(e)),
            )))
        })?;
        check_identity(&self.expected, cn.as_deref(), &uris).map_err(|e| {
            rustls::Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(
                Arc::new(IdentityMismatch(e)),
            )))
        })?;
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
            &self.provider.signature_verification_algorithms,
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
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_needs_cn_or_uri_san_match() {
        let both = ServerIdentity {
            cn: Some("calc-server".into()),
            uri_san: Some("spiffe://c/calc".into()),
        };
        let uris = vec!["spiffe://c/calc".to_owned()];
        assert!(check_identity(&both, Some("calc-server"), &[]).is_ok());
        assert!(check_identity(&both, Some("other"), &uris).is_ok());
        let err = check_identity(&both, Some("other"), &["spiffe://c/x".into()]).unwrap_err();
        assert!(
            err.contains("\"other\"") && err.contains("spiffe://c/x"),
            "{err}"
        );
        let cn_only = ServerIdentity {
            cn: Some("calc-server".into()),
            uri_san: None,
        };
        assert!(check_identity(&cn_only, None, &uris).is_err());
        let uri_only = ServerIdentity {
            cn: None,
            uri_san: Some("spiffe://c/calc".into()),
        };
        assert!(check_identity(&uri_only, Some("calc-server"), &[]).is_err());
    }

    #[test]
    fn names_are_read_from_certificates() {
        let mut p = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "calc-server");
        p.subject_alt_names
            .push(rcgen::SanType::URI("spiffe://c/calc".try_into().unwrap()));
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        let (cn, uris) = cert_names(cert.der()).unwrap();
        assert_eq!(cn.as_deref(), Some("calc-server"));
        assert_eq!(uris, ["spiffe://c/calc"]);
    }

    #[test]
    fn load_requires_an_identity_and_files() {
        let none = ServerIdentity::default();
        let err = ClientTls::load(Path::new("/a"), Path::new("/b"), Path::new("/c"), none)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--tls-server-cn"), "{err}");
        let cn = ServerIdentity {
            cn: Some("x".into()),
            uri_san: None,
        };
        let err = ClientTls::load(
            Path::new("/nonexistent"),
            Path::new("/b"),
            Path::new("/c"),
            cn,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("--tls-ca-file /nonexistent"), "{err}");
    }
}
