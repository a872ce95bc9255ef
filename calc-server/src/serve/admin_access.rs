//! Who may read the admin endpoint: the decision for one request, from the caller's verified
//! client certificate (if any) and its `Authorization` header.
//!
//! Contract: `/liveness`, `/readiness` and `/metrics` are open (the router never asks);
//! everything else is answered only to an admin once any admin authentication is configured —
//! a client certificate whose CN or URI SAN is allowed (or any certificate of the separate
//! admin CA), or the bearer token of `--admin-token-file`. A certificate that names a node the
//! cluster knows is never an admin, even when its CN is listed: an agent's key on a compromised
//! node must not read the cluster's policy. Without configuration the endpoint is open, which
//! `serve` allows only on a loopback address (checked at start, see [`AdminAccess::new`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::Context;
use parking_lot::Mutex;

use super::listener::IdentitySource;
use crate::args::AdminArgs;

/// What the TLS handshake proved about the caller (nothing without TLS or a certificate).
#[derive(Clone, Debug, Default)]
pub(super) struct Caller {
    /// The verified client certificate's subject CN and URI SANs.
    pub cert: Option<CertNames>,
}

pub(super) use calico_names::cert::CertNames;

/// The node a certificate would be on the Sync listener.
fn node_of<'a>(names: &'a CertNames, source: &IdentitySource) -> Option<&'a str> {
    match source {
        IdentitySource::CommonName => names.cn.as_deref(),
        IdentitySource::UriSanPrefix(prefix) => names.uri_suffix(prefix),
    }
}

/// Why a request is refused: 401 (no usable credentials) or 403 (credentials of someone who is
/// not an admin). The text is the answer's body and names what would be accepted.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    Unauthenticated(String),
    Forbidden(String),
}

/// The bearer token, re-read when its file changes so a rotated Secret takes effect.
struct TokenFile {
    path: PathBuf,
    state: Mutex<(Option<SystemTime>, Option<Vec<u8>>)>,
}

/// A token is a secret: shorter than this is refused at start.
const MIN_TOKEN_BYTES: usize = 16;

fn read_token(path: &Path) -> anyhow::Result<Vec<u8>> {
    let text =
        std::fs::read(path).with_context(|| format!("--admin-token-file {}", path.display()))?;
    let token = text.trim_ascii();
    anyhow::ensure!(
        token.len() >= MIN_TOKEN_BYTES && token.iter().all(u8::is_ascii_graphic),
        "--admin-token-file {}: the token must be one word of at least {MIN_TOKEN_BYTES} printable ASCII bytes",
        path.display()
    );
    Ok(token.to_vec())
}

impl TokenFile {
    fn load(path: &Path) -> anyhow::Result<TokenFile> {
        let token = read_token(path)?;
        let mtime = std::fs::metadata(path).and_then(|m| m.modified()).ok();
        Ok(TokenFile {
            path: path.to_path_buf(),
            state: Mutex::new((mtime, Some(token))),
        })
    }

    /// The token in force: the file's, re-read when its modification time changed; none while
    /// the file is unreadable or invalid (closed, not the old token, after a failed rotation).
    fn matches(&self, offered: &[u8]) -> bool {
        let mtime = std::fs::metadata(&self.path)
            .and_then(|m| m.modified())
            .ok();
        let mut state = self.state.lock();
        if mtime.is_none() || mtime != state.0 {
            state.0 = mtime;
            state.1 = match read_token(&self.path) {
                Ok(t) => Some(t),
                Err(error) => {
                    tracing::warn!(
                        error = format!("{error:#}"),
                        "admin token unusable; bearer tokens are refused until it is fixed"
                    );
                    None
                }
            };
        }
        state
            .1
            .as_deref()
            .is_some_and(|t| constant_time_eq(t, offered))
    }
}

/// Equality whose time does not depend on where the first difference is.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The access policy of one admin listener.
pub(super) struct AdminAccess {
    open: bool,
    allowed_cn: Vec<String>,
    allowed_uri_san: Vec<String>,
    /// Every certificate that passed the handshake is an admin (a separate admin CA, no lists).
    any_certificate: bool,
    token: Option<TokenFile>,
    /// How the Sync listener names a node from a certificate (node certificates are refused).
    node_identity: IdentitySource,
}

impl AdminAccess {
    /// The policy for `args`; refuses to start an unauthenticated endpoint on a non-loopback
    /// address, and certificate identities without TLS.
    pub(super) fn new(
        args: &AdminArgs,
        listen: SocketAddr,
        tls: bool,
        node_identity: IdentitySource,
    ) -> anyhow::Result<AdminAccess> {
        let by_certificate = !args.admin_allowed_cn.is_empty()
            || !args.admin_allowed_uri_san.is_empty()
            || args.admin_ca_file.is_some();
        anyhow::ensure!(
            tls || !by_certificate,
            "--admin-allowed-cn, --admin-allowed-uri-san and --admin-ca-file need TLS \
             (--tls-ca-file, --tls-cert-file, --tls-key-file): the admin endpoint then serves \
             HTTPS with the server's certificate and asks for client certificates"
        );
        anyhow::ensure!(
            args.authenticates() || listen.ip().is_loopback(),
            "--admin-listen {listen} is not a loopback address and the admin endpoint has no \
             authentication: anyone who reaches it could read every policy and endpoint. Set \
             --admin-token-file, or TLS (--tls-ca-file, --tls-cert-file, --tls-key-file) with \
             --admin-allowed-cn, --admin-allowed-uri-san or --admin-ca-file; or listen on \
             127.0.0.1 (see docs/tls.md, \"Who can read what\")"
        );
        for (flag, list) in [
            ("--admin-allowed-cn", &args.admin_allowed_cn),
            ("--admin-allowed-uri-san", &args.admin_allowed_uri_san),
        ] {
            anyhow::ensure!(
                list.iter().all(|v| !v.trim().is_empty()),
                "{flag}: an empty entry would match nothing; remove it"
            );
        }
        Ok(AdminAccess {
            open: !args.authenticates(),
            allowed_cn: args.admin_allowed_cn.clone(),
            allowed_uri_san: args.admin_allowed_uri_san.clone(),
            any_certificate: args.admin_ca_file.is_some()
                && args.admin_allowed_cn.is_empty()
                && args.admin_allowed_uri_san.is_empty(),
            token: args
                .admin_token_file
                .as_deref()
                .map(TokenFile::load)
                .transpose()?,
            node_identity,
        })
    }

    /// How the caller would be described to an operator reading the log.
    pub(super) fn describe(caller: &Caller) -> String {
        match &caller.cert {
            None => "no client certificate".into(),
            Some(c) => format!(
                "client certificate CN {:?} URI SANs {:?}",
                calc_graph::untrusted::Untrusted(c.cn.as_deref().unwrap_or("")),
                c.uri_sans
                    .iter()
                    .map(|u| calc_graph::untrusted::Untrusted(u.as_str()).to_string())
                    .collect::<Vec<_>>()
            ),
        }
    }

    /// Whether `caller`, with this `Authorization` header, may read a sensitive path;
    /// `is_node` says whether a name is a node of the cluster.
    pub(super) fn check(
        &self,
        caller: &Caller,
        authorization: Option<&[u8]>,
        is_node: impl Fn(&str) -> bool,
    ) -> Result<(), Refusal> {
        if self.open {
            return Ok(());
        }
        if let Some(cert) = &caller.cert {
            if let Some(node) = node_of(cert, &self.node_identity).filter(|n| is_node(n)) {
                return Err(Refusal::Forbidden(format!(
                    "the client certificate is node {:?}'s: node certificates are not admin identities",
                    calc_graph::untrusted::Untrusted(node)
                )));
            }
            let listed = cert
                .cn
                .as_ref()
                .is_some_and(|cn| self.allowed_cn.contains(cn))
                || cert
                    .uri_sans
                    .iter()
                    .any(|u| self.allowed_uri_san.contains(u));
            if self.any_certificate || listed {
                return Ok(());
            }
        }
        if let Some(header) = authorization {
            let Some(offered) = header.strip_prefix(b"Bearer ") else {
                return Err(Refusal::Unauthenticated(
                    "the Authorization header is not `Bearer <token>`".into(),
                ));
            };
            return match &self.token {
                Some(t) if t.matches(offered.trim_ascii()) => Ok(()),
                Some(_) => Err(Refusal::Forbidden(
                    "the bearer token is not the admin token".into(),
                )),
                None => Err(Refusal::Unauthenticated(
                    "bearer tokens are not accepted here (serve has no --admin-token-file)".into(),
                )),
            };
        }
        let ways = self.ways();
        match &caller.cert {
            Some(_) => Err(Refusal::Forbidden(format!(
                "{} is not an admin identity; this endpoint needs {ways}",
                Self::describe(caller)
            ))),
            None => Err(Refusal::Unauthenticated(format!(
                "authentication required: {ways}"
            ))),
        }
    }

    /// The credentials this endpoint accepts, in words.
    fn ways(&self) -> String {
        let mut ways = Vec::new();
        if self.any_certificate {
            ways.push("a client certificate from the admin CA".to_string());
        }
        if !self.allowed_cn.is_empty() || !self.allowed_uri_san.is_empty() {
            ways.push(
                "an admin client certificate (--admin-allowed-cn / --admin-allowed-uri-san)".into(),
            );
        }
        if self.token.is_some() {
            ways.push("the admin bearer token (`Authorization: Bearer …`)".into());
        }
        ways.join(" or ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> AdminArgs {
        AdminArgs {
            admin_allowed_cn: vec![],
            admin_allowed_uri_san: vec![],
            admin_ca_file: None,
            admin_token_file: None,
            admin_max_concurrent_queries: 2,
            admin_query_timeout: std::time::Duration::from_secs(10),
            admin_max_response_bytes: 1 << 20,
            admin_max_connections: 8,
        }
    }

    fn cert(cn: &str, uris: &[&str]) -> Caller {
        Caller {
            cert: Some(CertNames {
                cn: Some(cn.into()),
                uri_sans: uris.iter().map(|u| u.to_string()).collect(),
            }),
        }
    }

    const LOOPBACK: &str = "127.0.0.1:9096";
    const ANY: &str = "0.0.0.0:9096";

    #[test]
    fn without_authentication_only_loopback_is_served_and_it_is_open() {
        let err = AdminAccess::new(
            &args(),
            ANY.parse().unwrap(),
            false,
            IdentitySource::CommonName,
        )
        .err()
        .unwrap()
        .to_string();
        for flag in [
            "--admin-token-file",
            "--admin-allowed-cn",
            "--admin-ca-file",
            "127.0.0.1",
        ] {
            assert!(err.contains(flag), "{err}");
        }
        let open = AdminAccess::new(
            &args(),
            LOOPBACK.parse().unwrap(),
            false,
            IdentitySource::CommonName,
        )
        .unwrap();
        assert_eq!(open.check(&Caller::default(), None, |_| false), Ok(()));
        let v6 = AdminAccess::new(
            &args(),
            "[::1]:9096".parse().unwrap(),
            true,
            IdentitySource::CommonName,
        );
        assert!(v6.is_ok());
    }

    #[test]
    fn certificate_identities_need_tls() {
        let mut a = args();
        a.admin_allowed_cn = vec!["ops".into()];
        let err = AdminAccess::new(&a, ANY.parse().unwrap(), false, IdentitySource::CommonName)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--tls-ca-file"), "{err}");
    }

    #[test]
    fn listed_identities_pass_others_and_nodes_do_not() {
        let mut a = args();
        a.admin_allowed_cn = vec!["ops".into(), "node-1".into()];
        a.admin_allowed_uri_san = vec!["spiffe://c/ops".into()];
        let access =
            AdminAccess::new(&a, ANY.parse().unwrap(), true, IdentitySource::CommonName).unwrap();
        let nodes = |n: &str| n == "node-1" || n == "node-2";
        assert_eq!(access.check(&cert("ops", &[]), None, nodes), Ok(()));
        assert_eq!(
            access.check(&cert("x", &["spiffe://c/ops"]), None, nodes),
            Ok(())
        );
        // A node's certificate, even listed by mistake, is refused.
        let refused = access.check(&cert("node-1", &[]), None, nodes).unwrap_err();
        assert!(
            matches!(&refused, Refusal::Forbidden(m) if m.contains("node certificates")),
            "{refused:?}"
        );
        assert!(matches!(
            access.check(&cert("node-2", &[]), None, nodes),
            Err(Refusal::Forbidden(_))
        ));
        assert!(matches!(
            access.check(&cert("eve", &["spiffe://c/opsx"]), None, nodes),
            Err(Refusal::Forbidden(_))
        ));
        assert!(matches!(
            access.check(&Caller::default(), None, nodes),
            Err(Refusal::Unauthenticated(_))
        ));
        // No token configured: a bearer header does not help.
        assert!(matches!(
            access.check(&Caller::default(), Some(b"Bearer whatever-whatever"), nodes),
            Err(Refusal::Unauthenticated(m)) if m.contains("--admin-token-file")
        ));
    }

    #[test]
    fn uri_san_node_identities_are_refused_too() {
        let mut a = args();
        a.admin_ca_file = Some("/admin-ca.pem".into());
        let access = AdminAccess::new(
            &a,
            ANY.parse().unwrap(),
            true,
            IdentitySource::UriSanPrefix("spiffe://c/node/".into()),
        )
        .unwrap();
        let nodes = |n: &str| n == "node-1";
        assert_eq!(
            access.check(&cert("anyone", &[]), None, nodes),
            Ok(()),
            "any admin-CA certificate"
        );
        assert!(matches!(
            access.check(&cert("anyone", &["spiffe://c/node/node-1"]), None, nodes),
            Err(Refusal::Forbidden(_))
        ));
    }

    #[test]
    fn the_token_is_checked_and_rotates_with_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "short\n").unwrap();
        let mut a = args();
        a.admin_token_file = Some(path.clone());
        let err = AdminAccess::new(&a, ANY.parse().unwrap(), false, IdentitySource::CommonName)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("at least 16"), "{err}");
        std::fs::write(&path, "  first-token-0123456789\n").unwrap();
        let access =
            AdminAccess::new(&a, ANY.parse().unwrap(), false, IdentitySource::CommonName).unwrap();
        let none = |_: &str| false;
        let anon = Caller::default();
        assert_eq!(
            access.check(&anon, Some(b"Bearer first-token-0123456789"), none),
            Ok(())
        );
        assert!(matches!(
            access.check(&anon, Some(b"Bearer first-token-012345678"), none),
            Err(Refusal::Forbidden(_))
        ));
        assert!(matches!(
            access.check(&anon, Some(b"Basic Zm9vOmJhcg=="), none),
            Err(Refusal::Unauthenticated(_))
        ));
        assert!(
            matches!(access.check(&anon, None, none), Err(Refusal::Unauthenticated(m)) if m.contains("bearer token"))
        );
        // Rotation: the new token works, the old one no longer does.
        std::fs::write(&path, "second-token-0123456789").unwrap();
        let later = SystemTime::now() + std::time::Duration::from_secs(5);
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(later)
            .unwrap();
        assert_eq!(
            access.check(&anon, Some(b"Bearer second-token-0123456789"), none),
            Ok(())
        );
        assert!(
            access
                .check(&anon, Some(b"Bearer first-token-0123456789"), none)
                .is_err()
        );
        // A file gone bad closes the door rather than keeping the old token.
        std::fs::remove_file(&path).unwrap();
        assert!(
            access
                .check(&anon, Some(b"Bearer second-token-0123456789"), none)
                .is_err()
        );
    }

    #[test]
    fn comparison_does_not_accept_prefixes() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"abc", b"abd"));
    }
}
