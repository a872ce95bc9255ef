//! The Sync listener: TCP accept, optional mutual TLS, connection limits, handshake deadlines,
//! and the node identity taken from the client certificate.
//!
//! Handshakes are done here rather than inside tonic so that each one runs in its own task with
//! its own deadline (`--tls-handshake-timeout`): the TLS handshake (with TLS) and the HTTP/2
//! client preface must both arrive in time, or the socket is closed; a client that opens a
//! socket and sends nothing, or stalls half way, never delays anyone else. Only established
//! connections reach the gRPC server, each carrying a [`PeerInfo`] (peer address, with TLS the
//! node name its certificate proves, and its [`Admission`]) that the service reads.
//!
//! Admission: a connection is *pending* until the service accepts an AgentHello on it. Pending
//! connections are limited in all (`--max-pending-connections`) and per source address
//! (`--max-pending-per-address`), and one still pending after the handshake and hello timeouts is
//! closed. Accepted agents hold one of `--max-connections` slots, which pending connections
//! never touch: a flood of idle or handshaking sockets cannot lock out agents.
//!
//! The listening socket is opened with an accept backlog of [`ACCEPT_BACKLOG`] (the kernel caps
//! it at `net.core.somaxconn`): with the 128 of `TcpListener::bind`, a thousand agents
//! connecting at once (a server restart, a fail-over) overflowed the queue, the kernel fell back
//! to SYN cookies and reset the connections whose cookie it could not honour, and agents saw
//! their connection closed before the server ever accepted it.
//!
//! With `--tls-*` every client must present a certificate that chains to `--tls-ca-file`
//! (and is valid now, for client authentication); there is no plaintext fallback.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;

use parking_lot::Mutex;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;

use super::metrics::Metrics;
use crate::args::ListenerArgs;
use crate::pem::{read_certs, read_key};

/// How the node name is read from a verified client certificate.
#[derive(Clone, Debug)]
pub enum IdentitySource {
    /// The subject's common name.
    CommonName,
    /// The URI SAN starting with this prefix, without the prefix.
    UriSanPrefix(String),
}

/// Why a TLS client names no node.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum IdentityError {
    #[error("no client certificate")]
    NoCertificate,
    #[error("the client certificate: {0}")]
    Unparseable(calico_names::cert::CertError),
    #[error("the client certificate has no CN (as text)")]
    NoCommonName,
    #[error("no URI SAN of the client certificate starts with {prefix:?} (it has {uri_sans:?})")]
    NoUriSan {
        prefix: String,
        uri_sans: Vec<String>,
    },
}

/// What the service learns about a connection.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    pub remote: Option<SocketAddr>,
    /// With TLS: the node the client certificate names, or why it names none.
    pub identity: Option<Result<String, IdentityError>>,
    /// The connection's slot; the service admits it on an accepted hello.
    pub admission: Option<Arc<Admission>>,
}

/// The limits that admit connections (see the module documentation).
pub struct Limits {
    metrics: Arc<Metrics>,
    agents: Arc<Semaphore>,
    pending: Arc<Semaphore>,
    per_address: Mutex<HashMap<IpAddr, usize>>,
    max_per_address: usize,
}

impl Limits {
    pub fn new(
        max_agents: usize,
        max_pending: usize,
        max_per_address: usize,
        metrics: Arc<Metrics>,
    ) -> Arc<Limits> {
        Arc::new(Limits {
            metrics,
            agents: Arc::new(Semaphore::new(max_agents.max(1))),
            pending: Arc::new(Semaphore::new(max_pending.max(1))),
            per_address: Mutex::new(HashMap::new()),
            max_per_address: max_per_address.max(1),
        })
    }

    /// A pending slot for a new connection from `ip`, or why there is none.
    fn pending(self: &Arc<Self>, ip: IpAddr) -> Result<Arc<Admission>, &'static str> {
        let permit = self
            .pending
            .clone()
            .try_acquire_owned()
            .map_err(|_| "pending_limit")?;
        let mut per = self.per_address.lock();
        let n = per.entry(ip).or_default();
        if *n >= self.max_per_address {
            return Err("pending_per_address");
        }
        *n += 1;
        Ok(Arc::new(Admission {
            limits: self.clone(),
            ip,
            state: Mutex::new(Slot {
                admitted: false,
                _permit: permit,
            }),
        }))
    }

    fn release_address(&self, ip: IpAddr) {
        let mut per = self.per_address.lock();
        if let Some(n) = per.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                per.remove(&ip);
            }
        }
    }
}

/// The slot a connection holds: pending, or an agent's (the permit is held for its Drop).
struct Slot {
    admitted: bool,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

/// One connection's place in the limits; released when the connection goes.
pub struct Admission {
    limits: Arc<Limits>,
    ip: IpAddr,
    state: Mutex<Slot>,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("ip", &self.ip)
            .field("admitted", &self.admitted())
            .finish()
    }
}

impl Admission {
    /// Moves the connection from pending to an agent slot (idempotent); `false` when every
    /// agent slot is taken.
    pub fn admit(&self) -> bool {
        let mut state = self.state.lock();
        if state.admitted {
            return true;
        }
        let Ok(permit) = self.limits.agents.clone().try_acquire_owned() else {
            return false;
        };
        *state = Slot {
            admitted: true,
            _permit: permit,
        };
        self.limits.release_address(self.ip);
        true
    }

    fn admitted(&self) -> bool {
        self.state.lock().admitted
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if !self.state.get_mut().admitted {
            self.limits.release_address(self.ip);
        }
    }
}

impl ListenerArgs {
    /// How a client certificate names its node (`--tls-client-uri-san-prefix`, else the CN).
    pub fn identity_source(&self) -> IdentitySource {
        match &self.tls_client_uri_san_prefix {
            Some(p) if !p.is_empty() => IdentitySource::UriSanPrefix(p.clone()),
            _ => IdentitySource::CommonName,
        }
    }
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
        let config = server_config(ClientCa::Required(ca, "--tls-ca-file"), cert, key)?;
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

/// Which client certificates a listener asks for: required (the Sync listener) or optional
/// (the admin listener, where probes and token callers have none), from the CA in the file
/// that the flag names.
enum ClientCa<'a> {
    Required(&'a Path, &'static str),
    Optional(&'a Path, &'static str),
}

impl ListenerArgs {
    /// The admin listener's TLS: the Sync listener's certificate, HTTP/1.1 or HTTP/2, client
    /// certificates asked for but optional, verified against `admin_ca` (`--admin-ca-file`) or
    /// else the agents' CA. `None` without TLS flags (the errors are [`ListenerArgs::tls`]'s).
    pub fn admin_tls(
        &self,
        admin_ca: Option<&Path>,
    ) -> anyhow::Result<Option<rustls::ServerConfig>> {
        let (Some(ca), Some(cert), Some(key)) =
            (&self.tls_ca_file, &self.tls_cert_file, &self.tls_key_file)
        else {
            return Ok(None);
        };
        let client_ca = match admin_ca {
            Some(a) => ClientCa::Optional(a, "--admin-ca-file"),
            None => ClientCa::Optional(ca, "--tls-ca-file"),
        };
        let mut config = server_config(client_ca, cert, key)?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Some(config))
    }
}

fn server_config(
    client_ca: ClientCa<'_>,
    cert: &Path,
    key: &Path,
) -> anyhow::Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    let (ClientCa::Required(ca, flag) | ClientCa::Optional(ca, flag)) = client_ca;
    for c in read_certs(ca, flag)? {
        roots
            .add(c)
            .with_context(|| format!("{flag} {}: unusable CA", ca.display()))?;
    }
    let builder = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    );
    let builder = match client_ca {
        ClientCa::Required(..) => builder,
        ClientCa::Optional(..) => builder.allow_unauthenticated(),
    };
    let verifier = builder
        .build()
        .context("building the client certificate verifier")?;
    let chain = read_certs(cert, "--tls-cert-file")?;
    let key = read_key(key, "--tls-key-file")?;
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
pub fn node_identity(der: &[u8], source: &IdentitySource) -> Result<String, IdentityError> {
    let names = calico_names::cert::CertNames::of(der).map_err(IdentityError::Unparseable)?;
    match source {
        IdentitySource::CommonName => names.cn.ok_or(IdentityError::NoCommonName),
        IdentitySource::UriSanPrefix(prefix) => match names.uri_suffix(prefix) {
            Some(node) => Ok(node.to_string()),
            None => Err(IdentityError::NoUriSan {
                prefix: prefix.clone(),
                uri_sans: names.uri_sans,
            }),
        },
    }
}

/// An accepted connection (plain or TLS) handed to the gRPC server. Holds its admission (a
/// pending or an agent slot) until dropped; while pending, reads fail once `deadline` passes,
/// which makes the server close it.
pub struct Connection {
    io: Io,
    info: PeerInfo,
    admission: Arc<Admission>,
    /// The HTTP/2 preface, read to check it, handed to the server first.
    replay: Option<(Vec<u8>, usize)>,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
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
        if let Some((bytes, at)) = &mut self.replay {
            let n = buf.remaining().min(bytes.len() - *at);
            buf.put_slice(&bytes[*at..*at + n]);
            *at += n;
            if *at == bytes.len() {
                self.replay = None;
            }
            return Poll::Ready(Ok(()));
        }
        if let Some(deadline) = &mut self.deadline
            && deadline.as_mut().poll(cx).is_ready()
        {
            if !self.admission.admitted() {
                self.admission.limits.metrics.refused("hello_timeout");
                tracing::debug!(remote = ?self.info.remote, "no accepted AgentHello in time; connection closed");
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no accepted AgentHello within the hello timeout",
                )));
            }
            self.deadline = None;
        }
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

/// Connections the kernel queues for the Sync listener before it accepts them (see the module
/// documentation).
pub const ACCEPT_BACKLOG: u32 = 4096;

/// The Sync listener's socket on `addr`, with an accept backlog of [`ACCEPT_BACKLOG`]
/// (`SO_REUSEADDR` set, as `TcpListener::bind` does).
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(ACCEPT_BACKLOG)
}

/// The HTTP/2 client connection preface (RFC 9113 section 3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

fn is_http1(first: &[u8]) -> bool {
    first.starts_with(b"GET ") || first.starts_with(b"POST ") || first.starts_with(b"HEAD ")
}

/// What an HTTP/1 client (a browser, curl, `calc-server status` pointed at this port) is told.
const HTTP1_ANSWER: &str = "this is calc-server's gRPC port (the Sync stream for dataplane \
agents); /status, /metrics, /liveness and /readiness are on the admin address (serve's \
--admin-listen, default 127.0.0.1:9096)\n";

/// Answers an HTTP/1 request with a 400 that names the admin address, so the client reads a
/// reason instead of a reset. The request head is read first (bounded, by the deadline): closing
/// a socket with unread bytes makes the kernel reset it, and the answer would be lost.
async fn answer_http1(io: &mut Io, mut head: Vec<u8>, deadline: tokio::time::Instant) {
    use tokio::io::AsyncWriteExt;
    let respond = async {
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
            let n = match io {
                Io::Plain(s) => s.read(&mut buf).await?,
                Io::Tls(s) => s.read(&mut buf).await?,
            };
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        let answer = format!(
            "HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{HTTP1_ANSWER}",
            HTTP1_ANSWER.len()
        );
        match io {
            Io::Plain(s) => {
                s.write_all(answer.as_bytes()).await?;
                s.shutdown().await
            }
            Io::Tls(s) => {
                s.write_all(answer.as_bytes()).await?;
                s.shutdown().await
            }
        }
    };
    let _ = tokio::time::timeout_at(deadline, respond).await;
}

/// Why the first bytes are not an HTTP/2 client: a hint for the log.
fn not_http2(first: &[u8]) -> &'static str {
    if first.first() == Some(&0x16) {
        "a TLS client on a plaintext listener (set --tls-* here, or use http:// on the agent)"
    } else if is_http1(first) {
        "an HTTP/1 request on the gRPC port (the admin endpoint is --admin-listen)"
    } else {
        "not an HTTP/2 client"
    }
}

/// Timing of the accept path.
#[derive(Clone, Copy, Debug)]
pub struct Deadlines {
    /// TLS handshake and HTTP/2 preface, from accept.
    pub handshake: Duration,
    /// Then the accepted AgentHello.
    pub hello: Duration,
}

/// Accepts connections on `listener` until the returned stream is dropped (or `tasks` is
/// cancelled): each one gets a pending slot (or is closed at once), then its TLS handshake and
/// HTTP/2 preface run in its own task (span `handshake`) under the handshake deadline.
/// Only established connections come out of the stream.
pub fn incoming(
    listener: TcpListener,
    tls: Option<TlsSettings>,
    limits: Arc<Limits>,
    deadlines: Deadlines,
    metrics: Arc<Metrics>,
    tasks: &common::Tasks,
) -> ReceiverStream<io::Result<Connection>> {
    let (tx, rx) = mpsc::channel::<io::Result<Connection>>(64);
    let tls = tls.map(Arc::new);
    let span = tracing::info_span!(
        "listener",
        listen = %listener.local_addr().map_or_else(|e| e.to_string(), |a| a.to_string())
    );
    let spawner = tasks.clone();
    tasks.spawn(span, async move {
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
            let admission = match limits.pending(remote.ip()) {
                Ok(a) => a,
                Err(reason) => {
                    metrics.refused(reason);
                    tracing::debug!(%remote, reason, "too many pending connections; closing the new one");
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let (tx, tls, metrics) = (tx.clone(), tls.clone(), metrics.clone());
            // Its events name the remote address themselves.
            spawner.spawn(tracing::info_span!("handshake"), async move {
                let started = tokio::time::Instant::now();
                match establish(
                    tcp,
                    tls.as_deref(),
                    remote,
                    admission,
                    started + deadlines.handshake,
                )
                .await
                {
                    Ok(mut conn) => {
                        tracing::debug!(%remote, identity = ?conn.info.identity, elapsed = ?started.elapsed(), "connection established");
                        conn.deadline = Some(Box::pin(tokio::time::sleep_until(
                            started + deadlines.handshake + deadlines.hello,
                        )));
                        let _ = tx.send(Ok(conn)).await;
                    }
                    Err((reason, error)) => {
                        metrics.refused(reason);
                        tracing::warn!(%remote, %error, "connection closed during its handshake");
                    }
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// The TLS handshake (with TLS) and the HTTP/2 preface, both by `deadline`; on failure the
/// metric reason and a message for the log.
async fn establish(
    tcp: TcpStream,
    tls: Option<&TlsSettings>,
    remote: SocketAddr,
    admission: Arc<Admission>,
    deadline: tokio::time::Instant,
) -> Result<Connection, (&'static str, String)> {
    let (mut io, identity) = match tls {
        None => (Io::Plain(tcp), None),
        Some(tls) => {
            let stream = tokio::time::timeout_at(deadline, tls.acceptor.accept(tcp))
                .await
                .map_err(|_| {
                    (
                        "tls_handshake_timeout",
                        "TLS handshake not completed in time; connection closed".to_string(),
                    )
                })?
                .map_err(|e| ("tls_handshake", format!("TLS handshake failed: {e}")))?;
            let identity = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .map(|leaf| node_identity(leaf.as_ref(), &tls.identity))
                .unwrap_or(Err(IdentityError::NoCertificate));
            (Io::Tls(Box::new(stream)), Some(identity))
        }
    };
    let mut first = vec![0u8; PREFACE.len()];
    let read = async {
        match &mut io {
            Io::Plain(s) => s.read_exact(&mut first).await,
            Io::Tls(s) => s.read_exact(&mut first).await,
        }
    };
    match tokio::time::timeout_at(deadline, read).await {
        Err(_) => {
            return Err((
                "preface_timeout",
                "no HTTP/2 preface in time (an idle socket); connection closed".into(),
            ));
        }
        Ok(Err(e)) => {
            return Err((
                "not_http2",
                format!("closed before the HTTP/2 preface: {e}"),
            ));
        }
        Ok(Ok(_)) => {}
    }
    if first != PREFACE {
        let reason = not_http2(&first).to_string();
        if is_http1(&first) {
            answer_http1(&mut io, first, deadline).await;
        }
        return Err(("not_http2", reason));
    }
    Ok(Connection {
        io,
        info: PeerInfo {
            remote: Some(remote),
            identity,
            admission: Some(admission.clone()),
        },
        admission,
        replay: Some((first, 0)),
        deadline: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

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
        assert_eq!(
            err.to_string(),
            "no URI SAN of the client certificate starts with \"spiffe://other/\" (it has \
             [\"spiffe://c.local/node/node-7\", \"https://x/y\"])"
        );
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
            max_pending_connections: 1,
            max_pending_per_address: 1,
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
