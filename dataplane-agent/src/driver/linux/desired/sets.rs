//! The desired IP sets: the calc-server's set ids (one id, v4 and v6 members mixed) as one set
//! per family, named `cali40<id>` / `cali60<id>` as Calico names them, with members checked
//! and normalised the way `ipset save` prints them (the form every writer starts from).
//!
//! Contract: `replace` / `delta` / `remove` only record; a member that fails the check is left
//! out and its reason returned. Every set replaced, changed or removed enters the change log
//! [`Sets::take_changes`] hands to the writer.

use std::collections::{HashMap, HashSet};

use crate::driver::linux::rules::{IpVersion, ipset_name};
use crate::driver::linux::validate::{self, AddrError, MemberKind};

/// The type of a proto set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SetKind {
    Ip,
    IpPort,
    Net,
}

impl SetKind {
    /// From `IPSetUpdate.type`.
    pub(crate) fn from_proto(t: crate::message::IpSetType) -> Self {
        use crate::message::IpSetType;
        match t {
            IpSetType::Ip => SetKind::Ip,
            IpSetType::IpAndPort => SetKind::IpPort,
            IpSetType::Net => SetKind::Net,
        }
    }
}

/// A member in the form `ipset save` prints it, with its family, checked and normalised by
/// [`validate::ipset_members`] (a `/0` gives two members); the reason when it is refused.
pub(crate) fn normalize_member(
    kind: SetKind,
    member: &str,
) -> Result<Vec<(IpVersion, String)>, AddrError> {
    let vkind = match kind {
        SetKind::Ip => MemberKind::Ip,
        SetKind::IpPort => MemberKind::IpPort,
        SetKind::Net => MemberKind::Net,
    };
    Ok(validate::ipset_members(vkind, member)?
        .into_iter()
        .map(|m| {
            let addr_end = m.find([',', '/']).unwrap_or(m.len());
            let version = if m[..addr_end].contains(':') {
                IpVersion::V6
            } else {
                IpVersion::V4
            };
            // `ipset save` leaves out a full-length prefix.
            let m = match version {
                IpVersion::V4 => m.strip_suffix("/32").map(str::to_owned).unwrap_or(m),
                IpVersion::V6 => m.strip_suffix("/128").map(str::to_owned).unwrap_or(m),
            };
            (version, m)
        })
        .collect())
}

/// Members of `members` that [`normalize_member`] accepts; the reasons of the others go to
/// `refused`.
fn normalized(
    kind: SetKind,
    members: &[String],
    refused: &mut Vec<String>,
) -> Vec<(IpVersion, String)> {
    let mut out = Vec::with_capacity(members.len());
    for m in members {
        match normalize_member(kind, m) {
            Ok(ms) => out.extend(ms),
            Err(reason) => refused.push(reason.to_string()),
        }
    }
    out
}

/// One desired set of one family.
#[derive(Clone, Debug)]
pub(crate) struct DesiredSet {
    /// The calc-server's id of the set.
    pub id: String,
    pub kind: SetKind,
    pub version: IpVersion,
    pub members: HashSet<String>,
}

/// The sets (by kernel name) replaced or changed, and removed, since the last look.
#[derive(Clone, Debug, Default)]
pub(crate) struct SetChanges {
    pub changed: HashSet<String>,
    pub removed: HashSet<String>,
}

/// Our desired IP sets, by kernel name.
pub(crate) struct Sets {
    desired: HashMap<String, DesiredSet>,
    /// Families to program (IPv6 sets are left out when IPv6 is off).
    versions: Vec<IpVersion>,
    changes: SetChanges,
}

impl Sets {
    pub(crate) fn new(versions: Vec<IpVersion>) -> Self {
        Self {
            desired: HashMap::new(),
            versions,
            changes: SetChanges::default(),
        }
    }

    /// Replaces a set's type and members (`IPSetUpdate`). Returns the reasons members were
    /// refused (they are left out).
    pub(crate) fn replace(&mut self, id: &str, kind: SetKind, members: &[String]) -> Vec<String> {
        let mut refused = Vec::new();
        let members = normalized(kind, members, &mut refused);
        for v in self.versions.clone() {
            let name = ipset_name(v, id);
            let set = DesiredSet {
                id: id.to_owned(),
                kind,
                version: v,
                members: members
                    .iter()
                    .filter(|(mv, _)| *mv == v)
                    .map(|(_, m)| m.clone())
                    .collect(),
            };
            self.desired.insert(name.clone(), set);
            self.changes.changed.insert(name);
        }
        refused
    }

    /// Adds and removes members (`IPSetDeltaUpdate`). Returns the reasons members were refused.
    pub(crate) fn delta(&mut self, id: &str, added: &[String], removed: &[String]) -> Vec<String> {
        let mut refused = Vec::new();
        let Some(kind) = self
            .versions
            .iter()
            .find_map(|v| self.desired.get(&ipset_name(*v, id)).map(|s| s.kind))
        else {
            return refused;
        };
        let removed = normalized(kind, removed, &mut refused);
        let added = normalized(kind, added, &mut refused);
        for v in self.versions.clone() {
            let name = ipset_name(v, id);
            let Some(set) = self.desired.get_mut(&name) else {
                continue;
            };
            for (mv, m) in &removed {
                if *mv == v {
                    set.members.remove(m);
                }
            }
            for (mv, m) in &added {
                if *mv == v {
                    set.members.insert(m.clone());
                }
            }
            self.changes.changed.insert(name);
        }
        refused
    }

    /// Forgets a set (`IPSetRemove`).
    pub(crate) fn remove(&mut self, id: &str) {
        for v in IpVersion::BOTH {
            let name = ipset_name(v, id);
            if self.desired.remove(&name).is_some() {
                self.changes.changed.remove(&name);
                self.changes.removed.insert(name);
            }
        }
    }

    /// Whether the set is known (given by an `IPSetUpdate` and not removed).
    pub(crate) fn contains(&self, id: &str) -> bool {
        self.versions
            .iter()
            .any(|v| self.desired.contains_key(&ipset_name(*v, id)))
    }

    /// Our desired sets by kernel name.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&str, &DesiredSet)> {
        self.desired.iter().map(|(n, d)| (n.as_str(), d))
    }

    /// One desired set by kernel name.
    pub(crate) fn get(&self, name: &str) -> Option<&DesiredSet> {
        self.desired.get(name)
    }

    /// Whether a set of that kernel name is wanted.
    pub(crate) fn wants(&self, name: &str) -> bool {
        self.desired.contains_key(name)
    }

    /// Number of sets and members we want in the kernel.
    pub(crate) fn counts(&self) -> (usize, usize) {
        (
            self.desired.len(),
            self.desired.values().map(|s| s.members.len()).sum(),
        )
    }

    /// The sets changed and removed since the last call.
    pub(crate) fn take_changes(&mut self) -> SetChanges {
        std::mem::take(&mut self.changes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_normalized_as_ipset_prints_them() {
        assert_eq!(
            normalize_member(SetKind::Net, "10.65.0.2/32"),
            Ok(vec![(IpVersion::V4, "10.65.0.2".into())])
        );
        assert_eq!(
            normalize_member(SetKind::Net, "10.65.1.7/24"),
            Ok(vec![(IpVersion::V4, "10.65.1.0/24".into())])
        );
        assert_eq!(
            normalize_member(SetKind::Net, "fd00:0:0::1/128"),
            Ok(vec![(IpVersion::V6, "fd00::1".into())])
        );
        assert_eq!(
            normalize_member(SetKind::IpPort, "10.0.0.1,TCP:8080"),
            Ok(vec![(IpVersion::V4, "10.0.0.1,tcp:8080".into())])
        );
        assert_eq!(
            normalize_member(SetKind::IpPort, "fd00::1,udp:53"),
            Ok(vec![(IpVersion::V6, "fd00::1,udp:53".into())])
        );
        assert!(normalize_member(SetKind::Net, "nonsense").is_err());
        assert_eq!(
            normalize_member(SetKind::Net, "0.0.0.0/0"),
            Ok(vec![
                (IpVersion::V4, "0.0.0.0/1".into()),
                (IpVersion::V4, "128.0.0.0/1".into())
            ])
        );
        // The protocol of an IP-and-port member reaches the restore input: only real ones.
        assert!(normalize_member(SetKind::IpPort, "10.0.0.1,tcp\nflush:80").is_err());
    }

    #[test]
    fn one_id_is_a_set_per_family_and_every_change_is_logged() {
        let mut s = Sets::new(IpVersion::BOTH.to_vec());
        let refused = s.replace(
            "s:abc",
            SetKind::Net,
            &["10.0.0.1/32".into(), "fd00::1/128".into(), "bad".into()],
        );
        assert_eq!(refused.len(), 1);
        assert_eq!(s.get("cali40s:abc").unwrap().members.len(), 1);
        assert_eq!(s.get("cali60s:abc").unwrap().version, IpVersion::V6);
        let c = s.take_changes();
        assert_eq!(c.changed.len(), 2);
        assert!(s.take_changes().changed.is_empty());
        s.delta("s:abc", &["10.0.0.2".into()], &["10.0.0.1".into()]);
        assert_eq!(
            s.get("cali40s:abc").unwrap().members,
            HashSet::from(["10.0.0.2".to_owned()])
        );
        s.remove("s:abc");
        let c = s.take_changes();
        assert!(c.changed.is_empty());
        assert_eq!(c.removed.len(), 2);
        assert!(!s.contains("s:abc"));
        // A delta for an unknown set is nothing.
        assert!(s.delta("s:zzz", &["10.0.0.1".into()], &[]).is_empty());
        assert!(s.take_changes().changed.is_empty());
    }
}
