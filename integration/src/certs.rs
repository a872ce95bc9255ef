//! Certificates for the TLS tests, made with rcgen: a CA, and leaf certificates for servers
//! and clients with a CN, URI SANs, and optionally already expired.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

pub struct Ca {
    pub issuer: Issuer<'static, KeyPair>,
    pub pem: String,
}

pub fn ca(name: &str) -> Ca {
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.distinguished_name.push(DnType::CommonName, name);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().unwrap();
    let cert = p.self_signed(&key).unwrap();
    Ca {
        issuer: Issuer::new(p, key),
        pem: cert.pem(),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Server,
    Client,
}

/// Writes `<name>.pem`, `<name>.key` (and the CA as `<name>-ca.pem`) into `dir`; returns
/// (ca, cert, key) paths.
pub fn leaf(
    dir: &Path,
    name: &str,
    ca: &Ca,
    cn: &str,
    uris: &[&str],
    role: Role,
    expired: bool,
) -> (String, String, String) {
    let mut p = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    p.subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
    for u in uris {
        p.subject_alt_names
            .push(SanType::URI((*u).try_into().unwrap()));
    }
    p.distinguished_name.push(DnType::CommonName, cn);
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![match role {
        Role::Server => ExtendedKeyUsagePurpose::ServerAuth,
        Role::Client => ExtendedKeyUsagePurpose::ClientAuth,
    }];
    if expired {
        p.not_before = rcgen::date_time_ymd(2020, 1, 1);
        p.not_after = rcgen::date_time_ymd(2021, 1, 1);
    }
    let key = KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, &ca.issuer).unwrap();
    let path = |ext: &str| dir.join(format!("{name}{ext}"));
    std::fs::write(path(".pem"), cert.pem()).unwrap();
    std::fs::write(path(".key"), key.serialize_pem()).unwrap();
    std::fs::write(path("-ca.pem"), &ca.pem).unwrap();
    let s = |p: PathBuf| p.to_str().unwrap().to_string();
    (s(path("-ca.pem")), s(path(".pem")), s(path(".key")))
}
