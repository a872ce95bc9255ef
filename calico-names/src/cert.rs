//! The identity a certificate carries, read the same way by both ends: the agent checks the
//! server's certificate against `--tls-server-cn` / `--tls-server-uri-san`, the calc-server
//! reads a node name (or an admin identity) from a client certificate.
//!
//! Contract: pure parsing of a DER certificate that the TLS layer has already verified; a
//! certificate that does not parse is a [`CertError`] with the parser's reason, never a panic.

/// A certificate that does not parse, with the parser's reason.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("cannot parse the certificate: {0}")]
pub struct CertError(x509_parser::nom::Err<x509_parser::error::X509Error>);

/// A certificate's subject CN (the first, when text) and its URI SANs, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CertNames {
    pub cn: Option<String>,
    pub uri_sans: Vec<String>,
}

impl CertNames {
    /// The names of the DER certificate `der`.
    pub fn of(der: &[u8]) -> Result<CertNames, CertError> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(CertError)?;
        let cn = cert
            .subject()
            .iter_common_name()
            .next()
            .and_then(|c| c.as_str().ok())
            .map(str::to_owned);
        let uri_sans = match cert.subject_alternative_name() {
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
        Ok(CertNames { cn, uri_sans })
    }

    /// The name after `prefix` in the first URI SAN that starts with it (a SPIFFE-style
    /// identity: `spiffe://cluster.local/calico-node/` + node), if not empty.
    pub fn uri_suffix(&self, prefix: &str) -> Option<&str> {
        self.uri_sans
            .iter()
            .find_map(|u| u.strip_prefix(prefix))
            .filter(|n| !n.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_come_from_the_subject_and_the_uri_sans() {
        let mut p = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "node-1");
        for u in ["spiffe://c/node/node-7", "https://x/y"] {
            p.subject_alt_names
                .push(rcgen::SanType::URI(u.try_into().unwrap()));
        }
        let key = rcgen::KeyPair::generate().unwrap();
        let der = p.self_signed(&key).unwrap().der().to_vec();
        let names = CertNames::of(&der).unwrap();
        assert_eq!(names.cn.as_deref(), Some("node-1"));
        assert_eq!(names.uri_sans, ["spiffe://c/node/node-7", "https://x/y"]);
        assert_eq!(names.uri_suffix("spiffe://c/node/"), Some("node-7"));
        assert_eq!(names.uri_suffix("spiffe://c/node/node-7"), None, "empty");
        assert_eq!(names.uri_suffix("spiffe://other/"), None);
        let junk = CertNames::of(b"junk").unwrap_err().to_string();
        assert!(junk.starts_with("cannot parse the certificate: "), "{junk}");
    }
}
