//! The client side of serve's admin endpoint, for `status`, `policies` and `explain --server`:
//! one GET over HTTP/1.0, in clear text or over TLS (the server's certificate verified against
//! `--tls-ca-file`, an optional client certificate), with an optional bearer token.
//!
//! Kept to a blocking socket and rustls (which the binary links for the Sync listener anyway)
//! rather than an HTTP client crate: one request per command, no pooling, no redirects. A user
//! who gives the gRPC address (`--listen`) instead gets told so, not a "connection reset": the
//! first bytes of the answer tell an HTTP/2 or TLS listener apart.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rustls::pki_types::ServerName;

use crate::args::{AdminClientArgs, DEFAULT_ADMIN};
use crate::pem::{read_certs, read_key};

/// What the first bytes of an answer say about the listener that sent them.
fn not_http1(addr: &str, head: &[u8], tls: bool) -> String {
    let hint = format!(
        "`calc-server status` needs the admin address (serve's --admin-listen, default {DEFAULT_ADMIN})"
    );
    // An HTTP/2 server answers a request it cannot read with a SETTINGS frame (type 4) and
    // GOAWAY; a TLS server with an alert record (0x15) or a handshake record (0x16).
    if head.len() >= 4 && head[3] == 4 || head.starts_with(b"\0\0") {
        format!("{addr} answers HTTP/2: this is the gRPC port (serve's --listen); {hint}")
    } else if !tls && head.first().is_some_and(|b| *b == 0x15 || *b == 0x16) {
        format!(
            "{addr} answers TLS: give --server https://{addr} with --tls-ca-file (an admin \
             endpoint of a server run with --tls-*), or this is the gRPC --listen; {hint}"
        )
    } else if head.is_empty() {
        format!("{addr} closed the connection without answering: is this the gRPC port? {hint}")
    } else {
        format!("{addr} does not answer HTTP/1; {hint}")
    }
}

/// `http://`, `https://` or a bare `host:port` (HTTPS when a CA is given).
fn split_scheme<'a>(server: &'a str, client: &AdminClientArgs) -> (bool, &'a str) {
    let server = server.trim_end_matches('/');
    if let Some(rest) = server.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = server.strip_prefix("http://") {
        (false, rest)
    } else {
        (client.ca_file.is_some(), server)
    }
}

/// The host part of `host:port` / `[v6]:port`, for the certificate check.
fn host_of(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    addr.rsplit_once(':').map_or(addr, |(h, _)| h)
}

fn tls_config(client: &AdminClientArgs) -> anyhow::Result<rustls::ClientConfig> {
    let ca = client
        .ca_file
        .as_deref()
        .context("an https:// --server needs --tls-ca-file (the CA of the server's certificate)")?;
    let mut roots = rustls::RootCertStore::empty();
    for c in read_certs(ca, "--tls-ca-file")? {
        roots
            .add(c)
            .with_context(|| format!("--tls-ca-file {}: unusable CA", ca.display()))?;
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .context("TLS protocol versions")?
    .with_root_certificates(roots);
    let mut config = match (&client.cert_file, &client.key_file) {
        (Some(cert), Some(key)) => {
            let chain = read_certs(cert, "--tls-cert-file")?;
            let key = read_key(key, "--tls-key-file")?;
            builder
                .with_client_auth_cert(chain, key)
                .context("--tls-cert-file and --tls-key-file do not make a usable pair")?
        }
        _ => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The token of `--token-file`, surrounding whitespace removed.
fn token(client: &AdminClientArgs) -> anyhow::Result<Option<String>> {
    let Some(path) = &client.token_file else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--token-file {}", path.display()))?;
    let token = text.trim();
    anyhow::ensure!(
        !token.is_empty() && token.bytes().all(|b| b.is_ascii_graphic()),
        "--token-file {}: empty, or not one word of printable ASCII",
        path.display()
    );
    Ok(Some(token.to_string()))
}

/// A GET's status line and body, whatever the status.
pub(crate) fn fetch(
    server: &str,
    path: &str,
    client: &AdminClientArgs,
) -> anyhow::Result<(String, String)> {
    let (tls, addr) = split_scheme(server, client);
    anyhow::ensure!(
        tls || client.cert_file.is_none(),
        "--tls-cert-file needs an https:// --server"
    );
    let token = token(client)?;
    // Every setting is checked before the network is touched.
    let config = if tls {
        Some(Arc::new(tls_config(client)?))
    } else {
        None
    };
    let tcp = TcpStream::connect(addr).with_context(|| {
        format!("connecting to {addr} (is `calc-server serve` running with --admin-listen {addr}?)")
    })?;
    tcp.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n");
    if let Some(t) = &token {
        request.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    request.push_str("\r\n");
    let mut resp = Vec::new();
    let read = if let Some(config) = config {
        let name = client
            .server_name
            .clone()
            .unwrap_or_else(|| host_of(addr).to_string());
        let name = ServerName::try_from(name.clone())
            .with_context(|| format!("--tls-server-name {name:?} is not a DNS name or address"))?;
        let conn = rustls::ClientConnection::new(config, name).context("starting TLS")?;
        let mut stream = rustls::StreamOwned::new(conn, tcp);
        stream.write_all(request.as_bytes()).with_context(|| {
            format!(
                "TLS to {addr} (with --tls-server-name when the certificate names another host)"
            )
        })?;
        stream.read_to_end(&mut resp)
    } else {
        let mut tcp = tcp;
        tcp.write_all(request.as_bytes())?;
        tcp.read_to_end(&mut resp)
    };
    if let Err(e) = read {
        // A gRPC server resets a connection that spoke HTTP/1 at it; a peer that closes without
        // TLS's close_notify after a whole answer is still an answer.
        if !resp.starts_with(b"HTTP/1.") {
            anyhow::bail!("{} ({e})", not_http1(addr, &resp, tls));
        }
        if e.kind() != std::io::ErrorKind::UnexpectedEof {
            return Err(e).with_context(|| format!("reading {addr}{path}"));
        }
    }
    if !resp.starts_with(b"HTTP/1.") {
        anyhow::bail!(not_http1(addr, &resp, tls));
    }
    let resp = String::from_utf8_lossy(&resp);
    let (head, body) = resp
        .split_once("\r\n\r\n")
        .context("malformed HTTP response")?;
    let status = head.lines().next().unwrap_or_default().to_string();
    Ok((status, body.to_string()))
}

/// The body of a GET the server answered 200. Any other answer is an error naming the path,
/// the status and the server's reason (the admin endpoint answers errors as `{"error": …}`),
/// with what to try when it refused the caller.
pub(crate) fn get(server: &str, path: &str, client: &AdminClientArgs) -> anyhow::Result<String> {
    let (status, body) = fetch(server, path, client)?;
    if !status.contains(" 200") {
        let why = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_string))
            .unwrap_or_else(|| body.trim().to_string());
        anyhow::bail!("{path}: {status}: {why}{}", refusal_hint(&status));
    }
    Ok(body)
}

/// `s` percent-encoded: every byte but the unreserved characters (RFC 3986) and `keep`.
fn percent_encode(s: &str, keep: &[u8]) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) || keep.contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `s` percent-encoded for a URL path or query value; `/` and `:` stay readable (they separate
/// namespace and name, or an IPv6 address's groups, and mean nothing else there).
pub(crate) fn url_escape(s: &str) -> String {
    percent_encode(s, b"/:")
}

/// `s` percent-encoded as one query value or path segment: only unreserved characters stay.
pub(crate) fn query_escape(s: &str) -> String {
    percent_encode(s, b"")
}

/// What to try when the admin endpoint refused the caller (appended to its reason).
pub(crate) fn refusal_hint(status: &str) -> &'static str {
    if status.contains(" 401") {
        " (give the admin credentials: --token-file, or --tls-cert-file and --tls-key-file of an admin certificate)"
    } else if status.contains(" 403") {
        " (these credentials are not an admin's: see serve's --admin-allowed-cn, --admin-allowed-uri-san, --admin-ca-file and --admin-token-file)"
    } else {
        ""
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grpc_port_is_named_as_such() {
        // The start of an HTTP/2 SETTINGS frame.
        let m = not_http1("127.0.0.1:50051", &[0, 0, 6, 4, 0, 0, 0, 0, 0], false);
        assert!(
            m.contains("gRPC port") && m.contains("--admin-listen"),
            "{m}"
        );
        let m = not_http1("127.0.0.1:50051", &[0x15, 3, 3, 0, 2], false);
        assert!(m.contains("TLS") && m.contains("https://"), "{m}");
    }

    #[test]
    fn scheme_and_host_come_from_the_server_argument() {
        let plain = AdminClientArgs::default();
        let with_ca = AdminClientArgs {
            ca_file: Some("/ca.pem".into()),
            ..Default::default()
        };
        assert_eq!(
            split_scheme("127.0.0.1:9096", &plain),
            (false, "127.0.0.1:9096")
        );
        assert_eq!(
            split_scheme("10.0.0.1:9096", &with_ca),
            (true, "10.0.0.1:9096")
        );
        assert_eq!(split_scheme("http://h:1/", &with_ca), (false, "h:1"));
        assert_eq!(split_scheme("https://h:1", &plain), (true, "h:1"));
        assert_eq!(
            host_of("calc-server.calico-system.svc:9096"),
            "calc-server.calico-system.svc"
        );
        assert_eq!(host_of("[fd00::1]:9096"), "fd00::1");
    }

    #[test]
    fn https_without_a_ca_is_refused_before_connecting() {
        let err = fetch(
            "https://127.0.0.1:1",
            "/status",
            &AdminClientArgs::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("--tls-ca-file"), "{err}");
    }
}
