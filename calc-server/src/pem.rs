//! PEM files named by TLS flags, read once for every TLS user of calc-server: the Sync and
//! admin listeners, and the admin client of `status` / `explain --server`.
//!
//! Contract: an error names the flag and the file, and says whether the file could not be read,
//! held no PEM of that kind, or held no certificate at all.

use std::path::Path;

use anyhow::Context;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The certificates of `path` (at least one), given with `flag`.
pub(crate) fn read_certs(path: &Path, flag: &str) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .with_context(|| format!("{flag} {}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{flag} {}: not PEM certificates", path.display()))?;
    anyhow::ensure!(
        !certs.is_empty(),
        "{flag} {}: no certificate in the file",
        path.display()
    );
    Ok(certs)
}

/// The private key of `path`, given with `flag`.
pub(crate) fn read_key(path: &Path, flag: &str) -> anyhow::Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path)
        .with_context(|| format!("{flag} {}: no PEM private key", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_flag_and_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let err = format!("{:#}", read_certs(&empty, "--tls-ca-file").unwrap_err());
        assert!(
            err.contains("--tls-ca-file") && err.contains("no certificate"),
            "{err}"
        );
        let missing = dir.path().join("missing.pem");
        let err = format!("{:#}", read_certs(&missing, "--admin-ca-file").unwrap_err());
        assert!(
            err.contains("--admin-ca-file") && err.contains("missing.pem"),
            "{err}"
        );
        let err = format!("{:#}", read_key(&empty, "--tls-key-file").unwrap_err());
        assert!(
            err.contains("--tls-key-file") && err.contains("no PEM private key"),
            "{err}"
        );
    }
}
