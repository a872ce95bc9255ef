//! Mutual TLS to the calc-server.
//!
//! The agent presents `--tls-cert-file` (its CN, or URI SAN, is its node identity on the
//! server) and accepts the server only if the server's certificate chains to `--tls-ca-file`,
//! is valid now for server authentication, and carries the expected identity: its subject CN
//! equals `--tls-server-cn`, or one of its URI SANs equals `--tls-server-uri-san` (either
//! suffices when both are set). As with Felix and Typha, the identity check replaces the usual
//! host-name check, so one server certificate serves every address the calc-server Service has.
//! There is no fallback: a failed check fails the connection.
//!
//! A server that refuses *our* certificate does so after the TLS 1.3 handshake has completed on
//! our side: the alert arrives on the first read, under HTTP/2, and the call above often only
//! learns "connection closed". [`ConnectionErrors`] keeps the first errors the TLS stream itself
//! met, so the session can log the real reason (e.g. `received fatal alert: UnknownCA`).

use std::fmt;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;

use parking_lot::Mutex;
use std::task::{Context, Poll};

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

/// Why a TLS connection to a calc-server could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("{url}: {error}")]
    Uri {
        url: String,
        error: tonic::codegen::http::uri::InvalidUri,
    },
    #[error("{0}: no host")]
    NoHost(String),
    #[error("{url}: {error}")]
    Endpoint {
        url: String,
        error: tonic::transport::Error,
    },
    #[error("{url}: {error}")]
    ServerName {
        url: String,
        error: rustls::pki_types::InvalidDnsNameError,
    },
    /// The connection itself (TCP, the handshake, HTTP/2), its cause chain on one line.
    #[error("{}", crate::session::error_chain(.0))]
    Connection(tonic::transport::Error),
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
    /// tonic) with the errors its TLS connections meet. `endpoint_settings` applies timeouts
    /// and keep-alive to the endpoint.
    pub async fn connect(
        &self,
        url: &str,
        endpoint_settings: impl FnOnce(Endpoint) -> Endpoint,
    ) -> Result<(Channel, ConnectionErrors), ConnectError> {
        let uri: Uri = url.parse().map_err(|error| ConnectError::Uri {
            url: url.to_owned(),
            error,
        })?;
        let host = uri
            .host()
            .ok_or_else(|| ConnectError::NoHost(url.to_owned()))?
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
        let endpoint = Endpoint::from_shared(format!("http://{authority}")).map_err(|error| {
            ConnectError::Endpoint {
                url: url.to_owned(),
                error,
            }
        })?;
        let endpoint = endpoint_settings(endpoint);
        let connector = tokio_rustls::TlsConnector::from(self.config.clone());
        let server_name =
            ServerName::try_from(host.clone()).map_err(|error| ConnectError::ServerName {
                url: url.to_owned(),
                error,
            })?;
        let errors = ConnectionErrors::default();
        let recorder = errors.clone();
        let service = tower::service_fn(move |_: Uri| {
            let connector = connector.clone();
            let server_name = server_name.clone();
            let addr = (host.clone(), port);
            let errors = recorder.clone();
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                let _ = tcp.set_nodelay(true);
                let tls = connector
                    .connect(server_name, tcp)
                    .await
                    .map_err(explain_handshake_error)?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(Recorded {
                    inner: tls,
                    errors,
                }))
            }
        });
        let channel = endpoint
            .connect_with_connector(service)
            .await
            .map_err(ConnectError::Connection)?;
        Ok((channel, errors))
    }
}

/// One line saying what a failed TLS handshake means and what to check, in place of rustls'
/// debug-formatted error; `None` for errors whose own text says it.
fn certificate_hint(e: &rustls::Error) -> Option<String> {
    use rustls::InvalidMessage;
    Some(match e {
        rustls::Error::InvalidCertificate(CertificateError::Other(other)) => {
            match other.0.downcast_ref::<IdentityMismatch>() {
                Some(m) => m.to_string(),
                None => format!("the server's certificate is refused: {other}"),
            }
        }
        rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer) => {
            "the server's certificate is not signed by a CA in --tls-ca-file (UnknownIssuer): \
             check that --tls-ca-file holds the CA that issued calc-server's certificate"
                .into()
        }
        rustls::Error::InvalidCertificate(
            c @ (CertificateError::Expired
            | CertificateError::ExpiredContext { .. }
            | CertificateError::NotValidYet
            | CertificateError::NotValidYetContext { .. }),
        ) => format!(
            "the server's certificate is outside its validity period ({c}): renew calc-server's \
             certificate, or check this node's clock"
        ),
        rustls::Error::InvalidMessage(InvalidMessage::InvalidContentType) => {
            "the server answered without TLS (InvalidContentType): it is not a TLS listener \
             (use http:// for a server without --tls-*, and check the port is serve's --listen)"
                .into()
        }
        rustls::Error::AlertReceived(alert) => format!(
            "the server refused the TLS handshake (received fatal alert: {alert:?}): for \
             UnknownCA, BadCertificate or CertificateRequired, the server's --tls-ca-file does not \
             trust this agent's --tls-cert-file"
        ),
        _ => return None,
    })
}

/// Says what a failed handshake means: certificate problems in one line with what to check
/// (see [`certificate_hint`]), and what a bare reset during the handshake usually means.
fn explain_handshake_error(e: std::io::Error) -> std::io::Error {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    if let Some(hint) = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .and_then(certificate_hint)
    {
        return std::io::Error::new(e.kind(), hint);
    }
    if matches!(
        e.kind(),
        ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof
    ) {
        std::io::Error::new(
            e.kind(),
            format!(
                "{e}: the server closed the connection during the TLS handshake (a server \
                 without TLS, or one at its connection limit, does that)"
            ),
        )
    } else {
        e
    }
}

/// The first read and write errors met by the TLS connections of one channel. A read error
/// (the peer's alert) says more than the write error it usually causes (broken pipe), so it
/// is preferred.
#[derive(Clone, Debug, Default)]
pub struct ConnectionErrors(Arc<Mutex<RecordedErrors>>);

#[derive(Debug, Default)]
struct RecordedErrors {
    read: Option<String>,
    write: Option<String>,
}

impl ConnectionErrors {
    /// The most telling error recorded so far, if any.
    pub fn first(&self) -> Option<String> {
        let e = self.0.lock();
        e.read.clone().or_else(|| e.write.clone())
    }

    fn has_read_error(&self) -> bool {
        self.0.lock().read.is_some()
    }

    fn record(&self, read: bool, error: &std::io::Error) {
        let mut e = self.0.lock();
        let slot = if read { &mut e.read } else { &mut e.write };
        if slot.is_none() {
            *slot = Some(crate::session::error_chain(error));
        }
    }
}

/// A TLS stream that records its IO errors (see [`ConnectionErrors`]).
struct Recorded<S> {
    inner: S,
    errors: ConnectionErrors,
}

impl<S: tokio::io::AsyncRead + Unpin> Recorded<S> {
    fn note_read<T>(&self, r: Poll<std::io::Result<T>>) -> Poll<std::io::Result<T>> {
        if let Poll::Ready(Err(e)) = &r {
            self.errors.record(true, e);
        }
        r
    }

    fn note_write<T>(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        if let Poll::Ready(Err(e)) = &r {
            use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
            self.errors.record(false, e);
            // A server refusing our certificate sends its alert and closes; our next write
            // then fails (broken pipe) while the alert may still wait, unread, in the socket.
            // The connection is lost either way: read it for the reason.
            let lost = matches!(e.kind(), BrokenPipe | ConnectionAborted | ConnectionReset);
            if lost && !self.errors.has_read_error() {
                let mut scratch = [0u8; 256];
                let mut buf = tokio::io::ReadBuf::new(&mut scratch);
                if let Poll::Ready(Err(e)) = Pin::new(&mut self.inner).poll_read(cx, &mut buf) {
                    self.errors.record(true, &e);
                }
            }
        }
        r
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Recorded<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        self.note_read(r)
    }
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite
    for Recorded<S>
{
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.note_write(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.note_write(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.note_write(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.note_write(cx, r)
    }
}

/// Chain to the CA (webpki, with the time and server-auth usage checks) plus the identity check.
#[derive(Debug)]
struct IdentityVerifier {
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
    expected: ServerIdentity,
}

/// The server certificate does not carry the identity the agent expects, or cannot be read.
#[derive(Debug, thiserror::Error)]
enum IdentityMismatch {
    #[error(transparent)]
    Unparseable(calico_names::cert::CertError),
    #[error(
        "server certificate identity mismatch: the server's certificate has {found}, this agent \
         expects {wanted}: check --tls-server-cn / --tls-server-uri-san against calc-server's \
         certificate",
        found = found_names(cn.as_deref(), uri_sans),
        wanted = expected_names(expected)
    )]
    Names {
        expected: ServerIdentity,
        cn: Option<String>,
        uri_sans: Vec<String>,
    },
}

fn expected_names(expected: &ServerIdentity) -> String {
    match (&expected.cn, &expected.uri_san) {
        (Some(c), Some(u)) => format!("CN \"{c}\" or URI SAN {u}"),
        (Some(c), None) => format!("CN \"{c}\" (--tls-server-cn)"),
        (None, Some(u)) => format!("URI SAN {u} (--tls-server-uri-san)"),
        (None, None) => "no identity".into(),
    }
}

fn found_names(cn: Option<&str>, uris: &[String]) -> String {
    match (cn, uris.is_empty()) {
        (Some(c), true) => format!("CN \"{c}\" and no URI SAN"),
        (Some(c), false) => format!("CN \"{c}\" and URI SANs {}", uris.join(", ")),
        (None, true) => "no CN and no URI SAN".into(),
        (None, false) => format!("no CN and URI SANs {}", uris.join(", ")),
    }
}

/// Whether names match the expected identity; `Err` holds what was found instead.
fn check_identity(
    expected: &ServerIdentity,
    cn: Option<&str>,
    uris: &[String],
) -> Result<(), IdentityMismatch> {
    let cn_ok = expected.cn.as_deref().is_some_and(|e| cn == Some(e));
    let uri_ok = expected
        .uri_san
        .as_deref()
        .is_some_and(|e| uris.iter().any(|u| u == e));
    if cn_ok || uri_ok {
        return Ok(());
    }
    Err(IdentityMismatch::Names {
        expected: expected.clone(),
        cn: cn.map(str::to_owned),
        uri_sans: uris.to_vec(),
    })
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
        let refused = |e: IdentityMismatch| {
            rustls::Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(
                Arc::new(e),
            )))
        };
        let names = calico_names::cert::CertNames::of(end_entity.as_ref())
            .map_err(|e| refused(IdentityMismatch::Unparseable(e)))?;
        check_identity(&self.expected, names.cn.as_deref(), &names.uri_sans).map_err(refused)?;
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
        let err = check_identity(&both, Some("other"), &["spiffe://c/x".into()])
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "server certificate identity mismatch: the server's certificate has CN \"other\" and \
             URI SANs spiffe://c/x, this agent expects CN \"calc-server\" or URI SAN \
             spiffe://c/calc: check --tls-server-cn / --tls-server-uri-san against calc-server's \
             certificate"
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
        let names = calico_names::cert::CertNames::of(cert.der()).unwrap();
        assert_eq!(names.cn.as_deref(), Some("calc-server"));
        assert_eq!(names.uri_sans, ["spiffe://c/calc"]);
    }

    /// A socket whose peer sent an alert and hung up: reads fail with the alert, writes with
    /// `write_error`.
    struct HungUp {
        write_error: std::io::ErrorKind,
    }

    impl tokio::io::AsyncRead for HungUp {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &mut tokio::io::ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "received fatal alert: UnknownCA",
            )))
        }
    }

    impl tokio::io::AsyncWrite for HungUp {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            Poll::Ready(Err(self.write_error.into()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[test]
    fn a_lost_write_reads_the_alert_that_explains_it() {
        use tokio::io::AsyncWrite as _;
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let mut write = |kind| {
            let errors = ConnectionErrors::default();
            let mut s = Recorded {
                inner: HungUp { write_error: kind },
                errors: errors.clone(),
            };
            assert!(Pin::new(&mut s).poll_write(&mut cx, b"PRI *").is_ready());
            errors.first()
        };
        assert_eq!(
            write(std::io::ErrorKind::BrokenPipe).as_deref(),
            Some("received fatal alert: UnknownCA"),
            "the peer's reason wins over the broken pipe it caused"
        );
        assert_eq!(
            write(std::io::ErrorKind::TimedOut).as_deref(),
            Some("timed out"),
            "only a lost connection is read for its reason"
        );
        assert_eq!(ConnectionErrors::default().first(), None);
    }

    #[test]
    fn a_reset_during_the_handshake_says_what_it_usually_means() {
        let e = explain_handshake_error(std::io::ErrorKind::ConnectionReset.into());
        assert!(e.to_string().contains("a server without TLS"), "{e}");
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset);
        let tls = std::io::Error::new(std::io::ErrorKind::InvalidData, "invalid peer certificate");
        assert_eq!(
            explain_handshake_error(tls).to_string(),
            "invalid peer certificate"
        );
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
