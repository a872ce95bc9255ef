//! The Sync listener: TCP accept, optional mutual TLS, connection limit, handshake timeout, and
//! the node identity taken from the client certificate.
//!
//! Handshakes are done here rather than inside tonic so that each one runs in its own task with
//! its own deadline (`--tls-handshake-timeout`): a client that opens a socket and sends nothing,
//! or stalls half way, is dropped when its deadline passes and never delays anyone else. Only
//! established connections reach the gRPC server, each carrying a [`PeerInfo`] (peer address
//! and, with TLS, the node name its certificate proves) that the service reads from the request.
//!
//! With `--tls-*` every client must present a certificate that chains to `--tls-ca-file`
//! (and is valid now, for client authentication); there is no plaintext fallback.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;

use super::metrics::Metrics;
use super::parse_duration;

/// Flags of the Sync listener: TLS and connection limits.
#[derive(Clone, Debug, clap::Args)]
pub struct ListenerArgs {
    /// PEM bundle of the CA that signs agents' client certificates. Setting any of
    /// --tls-ca-file, --tls-cert-file, --tls-key-file requires all three; then every agent must
    /// present a certificate chaining to this CA (no plaintext fallback).
    #[arg(long, env = "CALC_SERVER_TLS_CA_FILE", value_name = "PATH")]
    pub tls_ca_file: Option<PathBuf>,
    /// PEM certificate (chain) this server presents to agents.
    #[arg(long, env = "CALC_SERVER_TLS_CERT_FILE", value_name = "PATH")]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of --tls-cert-file.
    #[arg(long, env = "CALC_SERVER_TLS_KEY_FILE", value_name = "PATH")]
    pub tls_key_file: Option<PathBuf>,
    /// Take the node name from the client certificate's URI SAN instead of its CN: the URI SAN
    /// that starts with this prefix, minus the prefix, is the node name (e.g.
    /// `spiffe://cluster.local/calico-node/` and a SAN `spiffe://cluster.local/calico-node/node-1`).
    #[arg(
        long,
        env = "CALC_SERVER_TLS_CLIENT_URI_SAN_PREFIX",
        value_name = "PREFIX"
    )]
    pub tls_client_uri_san_prefix: Option<String>,
    /// Time a client has to complete the TLS handshake before its socket is closed.
    #[arg(long, env = "CALC_SERVER_TLS_HANDSHAKE_TIMEOUT", value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub tls_handshake_timeout: Duration,
    /// Most connections (established or handshaking) at once; further ones are closed at once.
    #[arg(long, env = "CALC_SERVER_MAX_CONNECTIONS", default_value_t = 10_000)]
    pub max_connections: usize,
    /// Most concurrent HTTP/2 streams per connection (an agent uses one).
    #[arg(long, env = "CALC_SERVER_MAX_CONCURRENT_STREAMS", default_value_t = 16)]
    pub max_concurrent_streams: u32,
}

/// How the node name is read from a verified client certificate.
#[derive(Clone, Debug)]
pub enum IdentitySource {
    /// The subject's common name.
    CommonName,
    /// The URI SAN starting with this prefix, without the prefix.
    UriSanPrefix(String),
}

/// What the service learns about a connection.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    pub remote: Option<SocketAddr>,
    /// With TLS: the node the client certificate names, or why it names none.
    pub identity: Option<Result<String, String>>,
}

/// TLS settings ready to accept with.
pub struct TlsSettings {
    acceptor: tokio_rustls::TlsAcceptor,
    identity: IdentitySource,
}

impl ListenerArgs {
    /// `None` without TLS flags; an error if only some are set or a file is unusable.
    pub fn tls(&self) -> anyhow::Result<Option<TlsSettings>> {
        let files = [
            ("--tls-ca-file", &self.tls_ca_file),
            ("--tls-cert-file", &self.tls_cert_file),
            ("--tls-key-file", &self.tls_key_file),
        ];
        let set: Vec<&str> = files
            .iter()
            .filter(|(_, v)| v.is_some())
            .map(|(n, _)| *n)
            .collect();
        if set.is_empty() {
            anyhow::ensure!(
                self.tls_client_uri_san_prefix.is_none(),
                "--tls-client-uri-san-prefix needs --tls-ca-file, --tls-cert-file and --tls-key-file"
            );
            return Ok(None);
        }
        if set.len() != files.len() {
            let missing: Vec<&str> = files
                .iter()
                .filter(|(_, v)| v.is_none())
                .map(|(n, _)| *n)
                .collect();
            anyhow::bail!(
                "TLS needs all of --tls-ca-file, --tls-cert-file and --tls-key-file: {} given, {} missing",
                set.join(", "),
                missing.join(", ")
            );
        }
        let (ca, cert, key) = (
            self.tls_ca_file.as_deref().unwrap_or(Path::new("")),
            self.tls_cert_file.as_deref().unwrap_or(Path::new("")),
            self.tls_key_file.as_deref().unwrap_or(Path::new("")),
        );
        let config = server_config(ca, cert, key)?;
        let identity = match &self.tls_client_uri_san_prefix {
            Some(p) if p.is_empty() => {
                anyhow::bail!("--tls-client-uri-san-prefix must not be empty")
            }
            Some(p) => IdentitySource::UriSanPrefix(p.clone()),
            None => IdentitySource::CommonName,
        };
        Ok(Some(TlsSettings {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            identity,
        }))
    }
}

fn read_certs(path: &Path, what: &str) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .with_context(|| format!("{what} {}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{what} {}: not PEM certificates", path.display()))?;
    anyhow::ensure!(
        !certs.is_empty(),
        "{what} {}: no certificate in the file",
        path.display()
    );
    Ok(certs)
}

fn server_config(ca: &Path, cert: &Path, key: &Path) -> anyhow::Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in read_certs(ca, "--tls-ca-file")? {
        roots
            .add(c)
            .with_context(|| format!("--tls-ca-file {}: unusable CA", ca.display()))?;
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .context("building the client certificate verifier")?;
    let chain = read_certs(cert, "--tls-cert-file")?;
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("--tls-key-file {}: no PEM private key", key.display()))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .context("--tls-cert-file and --tls-key-file do not make a usable pair")?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// The node name a (verified) client certificate names.
pub fn node_identity(der: &[u8], source: &IdentitySource) -> Result<String, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("cannot parse the client certificate: {e}"))?;
    match source {
        IdentitySource::CommonName => {
            let cn = cert
                .subject()
                .iter_common_name()
                .next()
                .ok_or("the client certificate has no CN")?;
            let cn = cn
                .as_str()
                .map_err(|e| format!("the client certificate's CN is not text: {e}"))?;
            Ok(cn.to_string())
        }
        IdentitySource::UriSanPrefix(prefix) => {
            let uris = uri_sans(&cert);
            uris.iter()
                .find_map(|u| u.strip_prefix(prefix.as_str()))
                .filter(|n| !n.is_empty())
                .map(str::to_string)
                .ok_or_else(|| {
                    format!("no URI SAN of the client certificate starts with {prefix:?} (it has {uris:?})")
                })
        }
    }
}

fn uri_sans(cert: &x509_parser::certificate::X509Certificate<'_>) -> Vec<String> {
    match cert.subject_alternative_name() {
        Ok(Some(ext)) => ext
            .value
            .general_names
            .iter()
            .filter_map(|g| match g {
                x509_parser::extensions::GeneralName::URI(u) => Some(u.to_string()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// An accepted connection (plain or TLS) handed to the gRPC server. Holds its slot of
/// `--max-connections` until dropped.
pub struct Connection {
    io: Io,
    info: PeerInfo,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

enum Io {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl tonic::transport::server::Connected for Connection {
    type ConnectInfo = PeerInfo;
    fn connect_info(&self) -> PeerInfo {
        self.info.clone()
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }
    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Accepts connections on `listener` until the returned stream is dropped: each one gets a
/// slot of `max_connections` (or is closed at once), then its TLS handshake runs in its own
/// task under `handshake_timeout`. Only established connections come out of the stream.
pub fn incoming(
    listener: TcpListener,
    tls: Option<TlsSettings>,
    max_connections: usize,
    handshake_timeout: Duration,
    metrics: Arc<Metrics>,
) -> ReceiverStream<io::Result<Connection>> {
    let (tx, rx) = mpsc::channel::<io::Result<Connection>>(64);
    let slots = Arc::new(Semaphore::new(max_connections.max(1)));
    let tls = tls.map(Arc::new);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                () = tx.closed() => return,
                a = listener.accept() => a,
            };
            let (tcp, remote) = match accepted {
                Ok(a) => a,
                Err(error) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!(%error, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                metrics.refused_limit.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%remote, max_connections, "connection limit reached; closing the new connection");
                drop(tcp);
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let Some(tls) = tls.clone() else {
                let conn = Connection {
                    io: Io::Plain(tcp),
                    info: PeerInfo {
                        remote: Some(remote),
                        identity: None,
                    },
                    _permit: permit,
                };
                if tx.send(Ok(conn)).await.is_err() {
                    return;
                }
                continue;
            };
            let tx = tx.clone();
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let started = std::time::Instant::now();
                match tokio::time::timeout(handshake_timeout, tls.acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let identity = stream
                            .get_ref()
                            .1
                            .peer_certificates()
                            .and_then(|c| c.first())
                            .map(|leaf| node_identity(leaf.as_ref(), &tls.identity))
                            .unwrap_or_else(|| Err("no client certificate".to_string()));
                        tracing::debug!(%remote, ?identity, elapsed = ?started.elapsed(), "TLS handshake done");
                        let conn = Connection {
                            io: Io::Tls(Box::new(stream)),
                            info: PeerInfo {
                                remote: Some(remote),
                                identity: Some(identity),
                            },
                            _permit: permit,
                        };
                        let _ = tx.send(Ok(conn)).await;
                    }
                    Ok(Err(error)) => {
                        metrics.refused_handshake.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(%remote, %error, "TLS handshake failed; connection closed");
                    }
                    Err(_) => {
                        metrics
                            .refused_handshake_timeout
                            .fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(%remote, timeout = ?handshake_timeout, "TLS handshake not completed in time; connection closed");
                    }
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(cn: &str, uris: &[&str]) -> Vec<u8> {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, cn.to_string());
        for u in uris {
            p.subject_alt_names
                .push(rcgen::SanType::URI((*u).try_into().unwrap()));
        }
        let key = rcgen::KeyPair::generate().unwrap();
        p.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn identity_from_cn_or_uri_san() {
        let der = cert("node-1", &["spiffe://c.local/node/node-7", "https://x/y"]);
        assert_eq!(
            node_identity(&der, &IdentitySource::CommonName),
            Ok("node-1".into())
        );
        assert_eq!(
            node_identity(
                &der,
                &IdentitySource::UriSanPrefix("spiffe://c.local/node/".into())
            ),
            Ok("node-7".into())
        );
        let err = node_identity(
            &der,
            &IdentitySource::UriSanPrefix("spiffe://other/".into()),
        )
        .unwrap_err();
        assert!(err.contains("spiffe://other/"), "{err}");
        assert!(node_identity(b"junk", &IdentitySource::CommonName).is_err());
    }

    #[test]
    fn tls_flags_come_together() {
        let args = |ca: Option<&str>, cert: Option<&str>, key: Option<&str>| ListenerArgs {
            tls_ca_file: ca.map(PathBuf::from),
            tls_cert_file: cert.map(PathBuf::from),
            tls_key_file: key.map(PathBuf::from),
            tls_client_uri_san_prefix: None,
            tls_handshake_timeout: Duration::from_secs(10),
            max_connections: 1,
            max_concurrent_streams: 1,
        };
        assert!(args(None, None, None).tls().unwrap().is_none());
        let err = args(Some("/ca"), None, Some("/k"))
            .tls()
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--tls-cert-file"), "{err}");
        let err = args(Some("/nonexistent/ca"), Some("/c"), Some("/k"))
            .tls()
            .err()
            .unwrap();
        assert!(format!("{err:#}").contains("/nonexistent/ca"), "{err:#}");
    }
}
