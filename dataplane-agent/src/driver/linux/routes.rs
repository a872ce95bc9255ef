//! Workload routes: one /32 (v4) or /128 (v6) per endpoint address, out of the endpoint's
//! interface, tagged with our route protocol so we can tell ours from everyone else's.
//!
//! Contract: [`Routes::apply`] is given the complete desired set; it reads the kernel's routes
//! of our protocol when it has no view (first apply, after a failure, after `invalidate`), adds
//! what is missing (replace), and deletes routes of ours nobody wants. Routes of other
//! protocols are never touched.

use std::collections::BTreeSet;

use super::netlink::{Netlink, RouteEntry};
use super::rules::IpVersion;

/// Why routes could not be programmed.
#[derive(Debug, thiserror::Error)]
#[error("route {what} {route:?}: {source}")]
pub struct RouteError {
    what: &'static str,
    route: Option<RouteEntry>,
    source: std::io::Error,
}

/// What one apply changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteStats {
    pub added: usize,
    pub removed: usize,
    pub read_back: bool,
}

/// Our routes in the main table.
pub struct Routes {
    protocol: u8,
    kernel: Option<BTreeSet<RouteEntry>>,
    versions: Vec<IpVersion>,
}

impl Routes {
    pub fn new(protocol: u8, versions: Vec<IpVersion>) -> Self {
        Self {
            protocol,
            kernel: None,
            versions,
        }
    }

    pub fn invalidate(&mut self) {
        self.kernel = None;
    }

    /// Routes of ours the kernel holds, as last seen.
    pub fn count(&self) -> usize {
        self.kernel.as_ref().map_or(0, BTreeSet::len)
    }

    pub fn apply(
        &mut self,
        nl: &mut dyn Netlink,
        desired: &BTreeSet<RouteEntry>,
    ) -> Result<RouteStats, RouteError> {
        let mut stats = RouteStats::default();
        if self.kernel.is_none() {
            let mut seen = BTreeSet::new();
            for v in &self.versions {
                let routes = nl.routes(*v, self.protocol).map_err(|source| RouteError {
                    what: "list",
                    route: None,
                    source,
                })?;
                seen.extend(routes);
            }
            self.kernel = Some(seen);
            stats.read_back = true;
        }
        let kernel = self.kernel.as_mut().expect("read above");
        let stale: Vec<RouteEntry> = kernel.difference(desired).cloned().collect();
        let missing: Vec<RouteEntry> = desired.difference(kernel).cloned().collect();
        for r in stale {
            match nl.del_route(&r, self.protocol) {
                Ok(()) => {}
                // Gone already (its interface was deleted): that is what we wanted.
                Err(e) if e.to_string().contains("No such process") => {}
                Err(source) => {
                    self.kernel = None;
                    return Err(RouteError {
                        what: "delete",
                        route: Some(r),
                        source,
                    });
                }
            }
            kernel.remove(&r);
            stats.removed += 1;
        }
        let results = nl.add_routes(&missing, self.protocol);
        let mut failure = None;
        for (r, result) in missing.into_iter().zip(results) {
            match result {
                Ok(()) => {
                    kernel.insert(r);
                    stats.added += 1;
                }
                Err(source) => {
                    failure.get_or_insert(RouteError {
                        what: "add",
                        route: Some(r),
                        source,
                    });
                }
            }
        }
        if let Some(e) = failure {
            self.kernel = None;
            return Err(e);
        }
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::super::netlink::{FakeNetlink, LinkInfo};
    use super::*;

    fn route(ip: &str, ifindex: u32) -> RouteEntry {
        let dst: std::net::IpAddr = ip.parse().unwrap();
        RouteEntry {
            prefix: if dst.is_ipv4() { 32 } else { 128 },
            dst,
            ifindex,
        }
    }

    #[test]
    fn adds_missing_removes_stale_and_leaves_foreign_routes() {
        let mut nl = FakeNetlink {
            links: vec![LinkInfo {
                index: 7,
                name: "cali1".into(),
                oper_up: true,
            }],
            ..Default::default()
        };
        nl.routes.insert((route("10.0.0.9", 7), 80)); // ours, stale
        nl.routes.insert((route("192.168.0.0", 7), 4)); // someone else's
        let mut r = Routes::new(80, IpVersion::BOTH.to_vec());
        let desired: BTreeSet<_> = [route("10.0.0.1", 7), route("fd00::1", 7)].into();
        let st = r.apply(&mut nl, &desired).unwrap();
        assert_eq!((st.added, st.removed, st.read_back), (2, 1, true));
        assert!(nl.routes.contains(&(route("192.168.0.0", 7), 4)));
        assert_eq!(nl.routes.len(), 3);
        // Converged: nothing written.
        let writes = nl.writes;
        r.apply(&mut nl, &desired).unwrap();
        assert_eq!(nl.writes, writes);
        // Deleted by hand: repaired after a read-back.
        nl.routes.remove(&(route("10.0.0.1", 7), 80));
        r.invalidate();
        let st = r.apply(&mut nl, &desired).unwrap();
        assert_eq!((st.added, st.removed), (1, 0));
    }
}
