//! Per-interface kernel settings, written under `/proc/sys` (a seam: tests record instead).

#[cfg(any(test, feature = "test-util"))]
use std::collections::BTreeMap;
use std::io;

/// Writes sysctls, e.g. `net/ipv4/conf/cali1/proxy_arp`, and reads them (`kernel/osrelease`).
pub trait Sysctl: Send {
    fn write(&mut self, key: &str, value: &str) -> io::Result<()>;
    fn read(&self, key: &str) -> io::Result<String>;
}

/// The real `/proc/sys`.
#[derive(Debug, Default)]
pub(crate) struct ProcSysctl;

impl Sysctl for ProcSysctl {
    fn write(&mut self, key: &str, value: &str) -> io::Result<()> {
        let path = format!("/proc/sys/{key}");
        if std::fs::read_to_string(&path).is_ok_and(|v| v.trim() == value) {
            return Ok(());
        }
        std::fs::write(&path, value).map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))
    }

    fn read(&self, key: &str) -> io::Result<String> {
        let path = format!("/proc/sys/{key}");
        std::fs::read_to_string(&path)
            .map(|v| v.trim().to_owned())
            .map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))
    }
}

/// Records writes (tests and the `test-util` feature).
#[cfg(any(test, feature = "test-util"))]
#[derive(Debug, Default, Clone)]
pub(crate) struct FakeSysctl {
    pub values: BTreeMap<String, String>,
}

#[cfg(any(test, feature = "test-util"))]
impl Sysctl for FakeSysctl {
    fn write(&mut self, key: &str, value: &str) -> io::Result<()> {
        self.values.insert(key.to_owned(), value.to_owned());
        Ok(())
    }

    fn read(&self, key: &str) -> io::Result<String> {
        self.values
            .get(key)
            .cloned()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no sysctl {key}")))
    }
}

/// The settings Calico makes on a workload interface, as (key, value) pairs.
pub(crate) fn workload_interface_settings(iface: &str, ipv6: bool) -> Vec<(String, &'static str)> {
    let mut s = vec![
        (format!("net/ipv4/conf/{iface}/forwarding"), "1"),
        (format!("net/ipv4/conf/{iface}/rp_filter"), "1"),
        (format!("net/ipv4/conf/{iface}/route_localnet"), "0"),
        (format!("net/ipv4/conf/{iface}/proxy_arp"), "1"),
        (format!("net/ipv4/neigh/{iface}/proxy_delay"), "0"),
    ];
    if ipv6 {
        s.push((format!("net/ipv6/conf/{iface}/forwarding"), "1"));
        s.push((format!("net/ipv6/conf/{iface}/proxy_ndp"), "1"));
        s.push((format!("net/ipv6/conf/{iface}/accept_ra"), "0"));
    }
    s
}
