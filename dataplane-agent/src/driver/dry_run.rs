//! The dry-run driver: keeps the full desired state, logs every change, and (with
//! `--state-file`) writes that state as pretty JSON on each apply. It touches nothing else, so it
//! is safe anywhere: for trying the agent, for tests, and as the reference for driver authors.
//!
//! The state file is rewritten atomically (a temporary file in the same directory, then a
//! rename), so a reader never sees a half-written file. Its shape, with keys in a fixed order and
//! every map sorted:
//!
//! ```json
//! {
//!   "node": "node-1",
//!   "in_sync": true,
//!   "config": {"LogSeverityScreen": "Info"},
//!   "ipsets": {"s:abc": {"type": "IP", "members": ["10.0.0.1"]}},
//!   "policies": {"GlobalNetworkPolicy/allow-dns": {…}, "NetworkPolicy/ns/web": {…}},
//!   "profiles": {"kns.default": {…}},
//!   "workload_endpoints": {"k8s/default/web-0/eth0": {…}},
//!   "host_endpoints": {"eth0-hep": {…}},
//!   "host_metadata": {"node-1": {…}},
//!   "ipam_pools": {"10.0.0.0-16": {…}},
//!   "routes": {"10.0.1.0/26": {…}},
//!   "vteps": {"node-2": {…}},
//!   "encapsulation": {…} | null
//! }
//! ```
//!
//! Objects are the proto3 canonical JSON mapping of the felixbackend messages (`docs/proto.md`).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use felix_proto::{
    Encapsulation, HostEndpoint, HostMetadataUpdate, IpamPool, Policy, Profile, RouteUpdate,
    VxlanTunnelEndpointUpdate, WorkloadEndpoint,
};
use serde::Serialize;
use tracing::{debug, info, warn};

use super::{Driver, DriverError, EndpointStatuses, WorkloadEndpointKey};
use crate::message::{
    HostEndpointKey, HostName, IpSetId, IpamPoolId, Message, PolicyKey, ProfileKey, RouteDst,
    VtepNode,
};

/// One IP set as the dry-run driver keeps it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct IpSet {
    /// `IP`, `IP_AND_PORT` or `NET`.
    #[serde(rename = "type")]
    pub set_type: String,
    /// Members, sorted.
    pub members: BTreeSet<String>,
}

/// Records the desired dataplane state; optionally writes it to a file on apply.
#[derive(Debug, Default)]
pub struct DryRunDriver {
    node: String,
    state_file: Option<PathBuf>,
    state: State,
    /// Changes recorded since the last successful apply.
    pending: usize,
    /// Whether the state file has been written by this process.
    written: bool,
    applies: u64,
}

#[derive(Debug, Default)]
struct State {
    in_sync: bool,
    config: BTreeMap<String, String>,
    ipsets: BTreeMap<IpSetId, IpSet>,
    policies: BTreeMap<PolicyKey, Policy>,
    profiles: BTreeMap<ProfileKey, Profile>,
    workload_endpoints: BTreeMap<WorkloadEndpointKey, WorkloadEndpoint>,
    host_endpoints: BTreeMap<HostEndpointKey, HostEndpoint>,
    host_metadata: BTreeMap<HostName, HostMetadataUpdate>,
    ipam_pools: BTreeMap<IpamPoolId, IpamPool>,
    routes: BTreeMap<RouteDst, RouteUpdate>,
    vteps: BTreeMap<VtepNode, VxlanTunnelEndpointUpdate>,
    encapsulation: Option<Encapsulation>,
}

/// The serialised form, borrowing the state. Field order here is the key order in the file.
#[derive(Serialize)]
struct StateFile<'a> {
    node: &'a str,
    in_sync: bool,
    config: &'a BTreeMap<String, String>,
    ipsets: &'a BTreeMap<IpSetId, IpSet>,
    /// Keyed by the key's text: its order, not the key's, is the file's.
    policies: BTreeMap<String, &'a Policy>,
    profiles: &'a BTreeMap<ProfileKey, Profile>,
    workload_endpoints: BTreeMap<String, &'a WorkloadEndpoint>,
    host_endpoints: &'a BTreeMap<HostEndpointKey, HostEndpoint>,
    host_metadata: &'a BTreeMap<HostName, HostMetadataUpdate>,
    ipam_pools: &'a BTreeMap<IpamPoolId, IpamPool>,
    routes: &'a BTreeMap<RouteDst, RouteUpdate>,
    vteps: &'a BTreeMap<VtepNode, VxlanTunnelEndpointUpdate>,
    encapsulation: &'a Option<Encapsulation>,
}

fn verb(existed: bool) -> &'static str {
    if existed { "updated" } else { "added" }
}

impl DryRunDriver {
    /// A driver for `node`, writing its state to `state_file` on each apply if given.
    pub fn new(node: impl Into<String>, state_file: Option<PathBuf>) -> Self {
        Self {
            node: node.into(),
            state_file,
            ..Self::default()
        }
    }

    /// How many times `apply` succeeded.
    pub fn apply_count(&self) -> u64 {
        self.applies
    }

    /// Whether an `InSync` was recorded.
    pub fn in_sync(&self) -> bool {
        self.state.in_sync
    }

    /// The members of an IP set, sorted, if the set exists.
    pub fn ipset(&self, id: &str) -> Option<&IpSet> {
        self.state.ipsets.get(id)
    }

    /// The effective config.
    pub fn config(&self) -> &BTreeMap<String, String> {
        &self.state.config
    }

    /// The state as the pretty JSON written to the state file (ends with a newline).
    pub fn render(&self) -> String {
        let s = &self.state;
        let file = StateFile {
            node: &self.node,
            in_sync: s.in_sync,
            config: &s.config,
            ipsets: &s.ipsets,
            policies: s.policies.iter().map(|(k, v)| (k.to_string(), v)).collect(),
            profiles: &s.profiles,
            workload_endpoints: s
                .workload_endpoints
                .iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            host_endpoints: &s.host_endpoints,
            host_metadata: &s.host_metadata,
            ipam_pools: &s.ipam_pools,
            routes: &s.routes,
            vteps: &s.vteps,
            encapsulation: &s.encapsulation,
        };
        // Serialising plain maps and prost/pbjson messages into a String cannot fail.
        let mut out = serde_json::to_string_pretty(&file).unwrap_or_default();
        out.push('\n');
        out
    }

    fn record(&mut self, msg: &Message) -> bool {
        let s = &mut self.state;
        match msg {
            Message::InSync => {
                info!("dry-run: in sync");
                s.in_sync = true;
            }
            Message::Config(u) => {
                info!(entries = u.config.len(), "dry-run: config updated");
                s.config = u.config.clone();
            }
            Message::IpSetUpdate {
                id,
                set_type,
                members,
            } => {
                let set = IpSet {
                    set_type: set_type.as_str_name().to_owned(),
                    members: members.iter().cloned().collect(),
                };
                let existed = s.ipsets.insert(id.clone(), set).is_some();
                info!(ipset = %id, set_type = %set_type.as_str_name(), members = members.len(), "dry-run: ipset {}", verb(existed));
            }
            Message::IpSetDeltaUpdate { id, added, removed } => match s.ipsets.get_mut(id) {
                Some(set) => {
                    for m in removed {
                        set.members.remove(m);
                    }
                    set.members.extend(added.iter().cloned());
                    info!(ipset = %id, added = added.len(), removed = removed.len(), members = set.members.len(), "dry-run: ipset members changed");
                }
                None => {
                    warn!(ipset = %id, "dry-run: delta for an IP set that was never sent; ignored");
                    return false;
                }
            },
            Message::IpSetRemove { id } => {
                if s.ipsets.remove(id).is_none() {
                    return false;
                }
                info!(ipset = %id, "dry-run: ipset removed");
            }
            Message::PolicyUpdate { key, policy } => {
                let existed = s.policies.insert(key.clone(), policy.clone()).is_some();
                info!(policy = %key, "dry-run: policy {}", verb(existed));
            }
            Message::PolicyRemove { key } => {
                if s.policies.remove(key).is_none() {
                    return false;
                }
                info!(policy = %key, "dry-run: policy removed");
            }
            Message::ProfileUpdate { key, profile } => {
                let existed = s.profiles.insert(key.clone(), profile.clone()).is_some();
                info!(profile = %key, "dry-run: profile {}", verb(existed));
            }
            Message::ProfileRemove { key } => {
                if s.profiles.remove(key).is_none() {
                    return false;
                }
                info!(profile = %key, "dry-run: profile removed");
            }
            Message::WorkloadEndpointUpdate { key, endpoint: ep } => {
                info!(endpoint = %key, iface = %ep.name, ipv4 = ?ep.ipv4_nets, ipv6 = ?ep.ipv6_nets, tiers = ep.tiers.len(), "dry-run: workload endpoint {}", verb(s.workload_endpoints.contains_key(key)));
                s.workload_endpoints.insert(key.clone(), (**ep).clone());
            }
            Message::WorkloadEndpointRemove { key } => {
                if s.workload_endpoints.remove(key).is_none() {
                    return false;
                }
                info!(endpoint = %key, "dry-run: workload endpoint removed");
            }
            Message::HostEndpointUpdate { key, endpoint: ep } => {
                info!(endpoint = %key, iface = %ep.name, tiers = ep.tiers.len(), "dry-run: host endpoint {}", verb(s.host_endpoints.contains_key(key)));
                s.host_endpoints.insert(key.clone(), (**ep).clone());
            }
            Message::HostEndpointRemove { key } => {
                if s.host_endpoints.remove(key).is_none() {
                    return false;
                }
                info!(endpoint = %key, "dry-run: host endpoint removed");
            }
            Message::HostMetadataUpdate { host, metadata } => {
                let existed = s.host_metadata.insert(host.clone(), metadata.clone());
                info!(host = %host, ipv4 = %metadata.ipv4_addr, "dry-run: host metadata {}", verb(existed.is_some()));
            }
            Message::HostMetadataRemove { host, .. } => {
                if s.host_metadata.remove(host).is_none() {
                    return false;
                }
                info!(host = %host, "dry-run: host metadata removed");
            }
            Message::IpamPoolUpdate { id, pool } => {
                let existed = s.ipam_pools.insert(id.clone(), pool.clone());
                info!(pool = %id, "dry-run: IPAM pool {}", verb(existed.is_some()));
            }
            Message::IpamPoolRemove { id } => {
                if s.ipam_pools.remove(id).is_none() {
                    return false;
                }
                info!(pool = %id, "dry-run: IPAM pool removed");
            }
            Message::RouteUpdate { dst, route } => {
                let existed = s.routes.insert(dst.clone(), route.clone());
                info!(dst = %dst, "dry-run: route {}", verb(existed.is_some()));
            }
            Message::RouteRemove { dst } => {
                if s.routes.remove(dst).is_none() {
                    return false;
                }
                info!(dst = %dst, "dry-run: route removed");
            }
            Message::VtepUpdate { node, vtep } => {
                let existed = s.vteps.insert(node.clone(), vtep.clone());
                info!(node = %node, "dry-run: VXLAN tunnel endpoint {}", verb(existed.is_some()));
            }
            Message::VtepRemove { node } => {
                if s.vteps.remove(node).is_none() {
                    return false;
                }
                info!(node = %node, "dry-run: VXLAN tunnel endpoint removed");
            }
            Message::Encapsulation(u) => {
                info!(
                    ipip = u.ipip_enabled,
                    vxlan = u.vxlan_enabled,
                    "dry-run: encapsulation updated"
                );
                s.encapsulation = Some(*u);
            }
            Message::ServiceAccountUpdate { .. }
            | Message::ServiceAccountRemove { .. }
            | Message::NamespaceUpdate { .. }
            | Message::NamespaceRemove { .. }
            | Message::WireguardEndpointUpdate { .. }
            | Message::WireguardEndpointRemove { .. }
            | Message::WireguardEndpointV6Update { .. }
            | Message::WireguardEndpointV6Remove { .. }
            | Message::GlobalBgpConfig(_)
            | Message::ServiceUpdate { .. }
            | Message::ServiceRemove { .. } => {
                debug!(message = ?msg, "dry-run: message not modelled; ignored");
                return false;
            }
        }
        true
    }

    fn write_state_file(&self, path: &Path) -> Result<(), DriverError> {
        let io = |source| DriverError::Io {
            path: path.to_owned(),
            source,
        };
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        };
        let name = path
            .file_name()
            .ok_or_else(|| DriverError::Other(format!("{}: not a file path", path.display())))?;
        let tmp = dir.join(format!(
            ".{}.tmp-{}",
            name.to_string_lossy(),
            std::process::id()
        ));
        let result = (|| {
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(self.render().as_bytes())?;
            file.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result.map_err(io)
    }
}

impl Driver for DryRunDriver {
    fn on_update(&mut self, msg: &Message) {
        if self.record(msg) {
            self.pending += 1;
        }
    }

    fn apply(&mut self) -> Result<(), DriverError> {
        if self.pending == 0 && self.written {
            return Ok(());
        }
        if let Some(path) = &self.state_file {
            self.write_state_file(path)?;
            self.written = true;
        }
        let s = &self.state;
        info!(
            changes = self.pending,
            ipsets = s.ipsets.len(),
            policies = s.policies.len(),
            profiles = s.profiles.len(),
            workload_endpoints = s.workload_endpoints.len(),
            host_endpoints = s.host_endpoints.len(),
            "dry-run: would program the dataplane"
        );
        self.pending = 0;
        self.applies += 1;
        Ok(())
    }

    fn endpoint_statuses(&self) -> EndpointStatuses {
        EndpointStatuses {
            workloads: self
                .state
                .workload_endpoints
                .keys()
                .map(|k| (k.clone(), "up".to_owned()))
                .collect(),
            hosts: self
                .state
                .host_endpoints
                .keys()
                .map(|k| (k.clone(), "up".to_owned()))
                .collect(),
        }
    }

    fn workload_endpoint(&self, id: &WorkloadEndpointKey) -> Option<WorkloadEndpoint> {
        self.state.workload_endpoints.get(id).cloned()
    }

    /// The recorded state's sizes (no rules: the dry-run driver renders none).
    fn metrics(&self) -> super::DriverMetrics {
        let s = &self.state;
        super::DriverMetrics {
            rules: None,
            ipsets: Some(s.ipsets.len() as u64),
            ipset_members: Some(s.ipsets.values().map(|i| i.members.len() as u64).sum()),
            routes: Some(s.routes.len() as u64),
            rejected: None,
        }
    }

    /// The recorded state, with the chain names the linux driver would program.
    fn programmed_objects(&self) -> Option<super::ProgrammedObjects> {
        let s = &self.state;
        let mut c = super::programmed::Collector::default();
        for (key, policy) in &s.policies {
            c.policy(key, policy);
        }
        s.profiles.keys().for_each(|key| c.profile(key.as_str()));
        for (key, ep) in &s.workload_endpoints {
            c.workload(key, ep, Some(ep.name.as_str()).filter(|n| !n.is_empty()));
        }
        for (id, ep) in &s.host_endpoints {
            // Which interface holds a nameless endpoint's addresses is the kernel's to say.
            let iface = match ep.name.as_str() {
                "" => None,
                "*" => Some(super::linux::rules::endpoint::ALL_INTERFACES),
                name => Some(name),
            };
            c.host(id.as_str(), ep, iface);
        }
        Some(c.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use felix_proto::to_dataplane::Payload;
    use felix_proto::{
        ActivePolicyRemove, ActivePolicyUpdate, ActiveProfileUpdate, ConfigUpdate, HostEndpointId,
        HostEndpointUpdate, InSync, IpSetDeltaUpdate, IpSetRemove, IpSetUpdate, PolicyId,
        ProfileId, Rule, ip_set_update,
    };
    use serde_json::{Value, json};

    fn msg(payload: Payload) -> Message {
        Message::try_from(payload).expect("a valid message")
    }

    fn ipset(id: &str, members: &[&str], t: ip_set_update::IpSetType) -> Message {
        msg(Payload::IpsetUpdate(IpSetUpdate {
            id: id.into(),
            members: members.iter().map(|m| m.to_string()).collect(),
            r#type: t as i32,
        }))
    }

    fn delta(id: &str, added: &[&str], removed: &[&str]) -> Message {
        msg(Payload::IpsetDeltaUpdate(IpSetDeltaUpdate {
            id: id.into(),
            added_members: added.iter().map(|m| m.to_string()).collect(),
            removed_members: removed.iter().map(|m| m.to_string()).collect(),
        }))
    }

    fn pid(kind: &str, ns: &str, name: &str) -> PolicyId {
        PolicyId {
            kind: kind.into(),
            namespace: ns.into(),
            name: name.into(),
        }
    }

    fn wep(wl: &str, ip: &str) -> Message {
        msg(test_support::wep(wl)
            .iface(&format!("cali{wl}"))
            .ipv4(ip)
            .update())
    }

    fn json_of(d: &DryRunDriver) -> Value {
        serde_json::from_str(&d.render()).expect("state renders as JSON")
    }

    #[test]
    fn ipset_update_replaces_delta_edits_remove_deletes() {
        use ip_set_update::IpSetType;
        let mut d = DryRunDriver::new("n1", None);
        d.on_update(&ipset("s:a", &["10.0.0.2", "10.0.0.1"], IpSetType::Ip));
        assert_eq!(
            d.ipset("s:a")
                .map(|s| s.members.iter().cloned().collect::<Vec<_>>()),
            Some(vec!["10.0.0.1".to_owned(), "10.0.0.2".to_owned()])
        );
        d.on_update(&delta("s:a", &["10.0.0.3"], &["10.0.0.1"]));
        assert_eq!(
            json_of(&d)["ipsets"]["s:a"],
            json!({"type": "IP", "members": ["10.0.0.2", "10.0.0.3"]})
        );
        // A full update replaces the membership (and the type).
        d.on_update(&ipset("s:a", &["10.1.0.0/16"], IpSetType::Net));
        assert_eq!(
            json_of(&d)["ipsets"]["s:a"],
            json!({"type": "NET", "members": ["10.1.0.0/16"]})
        );
        // A delta for an unknown set changes nothing and is not counted.
        d.on_update(&delta("s:zz", &["1.2.3.4"], &[]));
        assert!(d.ipset("s:zz").is_none());
        d.on_update(&msg(Payload::IpsetRemove(IpSetRemove { id: "s:a".into() })));
        assert!(d.ipset("s:a").is_none());
        // Removing again is harmless.
        d.on_update(&msg(Payload::IpsetRemove(IpSetRemove { id: "s:a".into() })));
        assert_eq!(json_of(&d)["ipsets"], json!({}));
    }

    #[test]
    fn programmed_objects_use_the_linux_chain_names() {
        use crate::driver::linux::rules;
        let mut d = DryRunDriver::new("n1", None);
        let id = pid(
            "GlobalNetworkPolicy",
            "",
            "a-policy-name-long-enough-to-be-hashed",
        );
        d.on_update(&msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(id.clone()),
            policy: Some(Policy {
                tier: "security".into(),
                ..Default::default()
            }),
        })));
        let mut ep = wep("web-0", "10.0.0.1/32");
        if let Message::WorkloadEndpointUpdate { endpoint: e, .. } = &mut ep {
            e.tiers.push(felix_proto::TierInfo {
                name: "security".into(),
                ingress_policies: vec![id.clone()],
                ..Default::default()
            });
        }
        d.on_update(&ep);
        let dump = d.programmed_objects().expect("the dry-run driver reports");
        let [p] = dump.policies.as_slice() else {
            panic!("{dump:?}")
        };
        assert_eq!(
            p.id,
            "GlobalNetworkPolicy/a-policy-name-long-enough-to-be-hashed"
        );
        assert_eq!(p.tier, "security");
        assert_eq!(
            p.chains,
            [
                rules::policy_chain_name(rules::POLICY_INBOUND_PFX, &id),
                rules::policy_chain_name(rules::POLICY_OUTBOUND_PFX, &id),
            ]
        );
        assert_eq!(p.endpoints, ["k8s/web-0/eth0"]);
        assert_eq!(
            dump.endpoints[0].chains,
            [
                rules::endpoint_chain_name(rules::endpoint::WORKLOAD_FROM_PFX, "caliweb-0"),
                rules::endpoint_chain_name(rules::endpoint::WORKLOAD_TO_PFX, "caliweb-0"),
            ]
        );
        d.on_update(&msg(Payload::ActivePolicyRemove(ActivePolicyRemove {
            id: Some(id),
        })));
        assert!(d.programmed_objects().unwrap().policies.is_empty());
    }

    #[test]
    fn policies_profiles_endpoints_are_keyed_and_replaced() {
        let mut d = DryRunDriver::new("n1", None);
        let rule = Rule {
            action: "allow".into(),
            src_ip_set_ids: vec!["s:a".into()],
            ..Default::default()
        };
        d.on_update(&msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(pid("GlobalNetworkPolicy", "", "g1")),
            policy: Some(Policy {
                tier: "default".into(),
                inbound_rules: vec![rule.clone()],
                ..Default::default()
            }),
        })));
        d.on_update(&msg(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(pid("NetworkPolicy", "prod", "web")),
            policy: Some(Policy::default()),
        })));
        d.on_update(&msg(Payload::ActiveProfileUpdate(ActiveProfileUpdate {
            id: Some(ProfileId {
                name: "kns.prod".into(),
            }),
            profile: Some(Profile {
                outbound_rules: vec![rule],
                ..Default::default()
            }),
        })));
        d.on_update(&wep("prod/web-0", "10.0.0.1/32"));
        d.on_update(&wep("prod/web-0", "10.0.0.9/32"));
        d.on_update(&msg(Payload::HostEndpointUpdate(HostEndpointUpdate {
            id: Some(HostEndpointId {
                endpoint_id: "hep1".into(),
            }),
            endpoint: Some(HostEndpoint {
                name: "eth0".into(),
                ..Default::default()
            }),
        })));

        let v = json_of(&d);
        assert_eq!(
            v["policies"]["GlobalNetworkPolicy/g1"],
            json!({"inboundRules": [{"action": "allow", "srcIpSetIds": ["s:a"]}], "tier": "default"})
        );
        assert_eq!(v["policies"]["NetworkPolicy/prod/web"], json!({}));
        assert_eq!(
            v["profiles"]["kns.prod"]["outboundRules"][0]["action"],
            "allow"
        );
        assert_eq!(
            v["workload_endpoints"]["k8s/prod/web-0/eth0"],
            json!({"name": "caliprod/web-0", "ipv4Nets": ["10.0.0.9/32"]})
        );
        assert_eq!(v["host_endpoints"]["hep1"], json!({"name": "eth0"}));

        let statuses = d.endpoint_statuses();
        assert_eq!(
            statuses.workloads.values().collect::<Vec<_>>(),
            vec!["up"],
            "every endpoint is up"
        );
        assert_eq!(statuses.hosts.get("hep1").map(String::as_str), Some("up"));

        d.on_update(&msg(Payload::ActivePolicyRemove(ActivePolicyRemove {
            id: Some(pid("NetworkPolicy", "prod", "web")),
        })));
        d.on_update(&msg(test_support::wep("prod/web-0").remove()));
        let v = json_of(&d);
        assert!(v["policies"].get("NetworkPolicy/prod/web").is_none());
        assert!(v["policies"].get("GlobalNetworkPolicy/g1").is_some());
        assert_eq!(v["workload_endpoints"], json!({}));
        assert!(d.endpoint_statuses().workloads.is_empty());
    }

    #[test]
    fn state_file_is_written_on_apply_only_and_atomically() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.json");
        let mut d = DryRunDriver::new("node-a", Some(path.clone()));
        let mut config = BTreeMap::new();
        config.insert("LogSeverityScreen".to_owned(), "Info".to_owned());
        d.on_update(&msg(Payload::ConfigUpdate(ConfigUpdate {
            config,
            ..Default::default()
        })));
        d.on_update(&ipset(
            "s:b",
            &["10.0.0.1,tcp:80"],
            ip_set_update::IpSetType::IpAndPort,
        ));
        d.on_update(&msg(Payload::InSync(InSync {})));
        assert!(!path.exists(), "on_update does no IO");

        d.apply().expect("apply");
        assert_eq!(d.apply_count(), 1);
        let text = std::fs::read_to_string(&path).expect("state file");
        assert_eq!(text, d.render());
        let v: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["node"], "node-a");
        assert_eq!(v["in_sync"], true);
        assert_eq!(v["config"], json!({"LogSeverityScreen": "Info"}));
        assert_eq!(
            v["ipsets"],
            json!({"s:b": {"type": "IP_AND_PORT", "members": ["10.0.0.1,tcp:80"]}})
        );
        // Top-level keys come out in a fixed order.
        let keys: Vec<&str> = v
            .as_object()
            .expect("object")
            .keys()
            .map(String::as_str)
            .collect();
        let first = text.lines().nth(1).expect("second line").trim().to_owned();
        assert!(first.starts_with("\"node\""), "{first}");
        assert!(keys.contains(&"workload_endpoints"));
        // No temporary files are left behind.
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .expect("read_dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["state.json".to_owned()]);

        // Nothing recorded: apply is a no-op. A change: the file is rewritten.
        d.apply().expect("apply");
        assert_eq!(d.apply_count(), 1);
        d.on_update(&delta("s:b", &["10.0.0.2,tcp:80"], &[]));
        assert_eq!(std::fs::read_to_string(&path).expect("state"), text);
        d.apply().expect("apply");
        assert_eq!(d.apply_count(), 2);
        let v: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("state")).expect("json");
        assert_eq!(
            v["ipsets"]["s:b"]["members"],
            json!(["10.0.0.1,tcp:80", "10.0.0.2,tcp:80"])
        );
    }

    #[test]
    fn failed_write_keeps_work_pending() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("missing-dir").join("state.json");
        let mut d = DryRunDriver::new("n", Some(path.clone()));
        d.on_update(&ipset("s:a", &["10.0.0.1"], ip_set_update::IpSetType::Ip));
        let err = d.apply().expect_err("directory does not exist");
        assert!(err.to_string().contains("state.json"), "{err}");
        assert_eq!(d.apply_count(), 0);
        std::fs::create_dir(dir.path().join("missing-dir")).expect("mkdir");
        d.apply().expect("retry succeeds");
        assert!(
            std::fs::read_to_string(&path)
                .expect("state")
                .contains("10.0.0.1")
        );
    }

    #[test]
    fn render_is_deterministic() {
        let build = |order: &[usize]| {
            let msgs = [
                ipset("s:b", &["2", "1"], ip_set_update::IpSetType::Ip),
                ipset("s:a", &["3"], ip_set_update::IpSetType::Ip),
                wep("ns/b", "10.0.0.2/32"),
                wep("ns/a", "10.0.0.1/32"),
            ];
            let mut d = DryRunDriver::new("n", None);
            for &i in order {
                d.on_update(&msgs[i]);
            }
            d.render()
        };
        assert_eq!(build(&[0, 1, 2, 3]), build(&[3, 2, 1, 0]));
    }
}
