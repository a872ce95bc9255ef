//! The one builder of felixbackend `WorkloadEndpoint` fixtures: [`wep`] starts from a workload
//! id (orchestrator `k8s`, endpoint `eth0`, an endpoint with every field empty) and each method
//! sets one field, so a test names only what it is about.

use felix_proto::to_dataplane::Payload;
use felix_proto::{
    PolicyId, TierInfo, WorkloadEndpoint, WorkloadEndpointId, WorkloadEndpointRemove,
    WorkloadEndpointUpdate,
};

/// The id of workload `workload_id` (`namespace/pod` for Kubernetes): orchestrator `k8s`,
/// endpoint `eth0`.
pub fn wep_id(workload_id: &str) -> WorkloadEndpointId {
    WorkloadEndpointId {
        orchestrator_id: "k8s".into(),
        workload_id: workload_id.into(),
        endpoint_id: "eth0".into(),
    }
}

/// A workload endpoint of `workload_id` ([`wep_id`]) with every field empty.
pub fn wep(workload_id: &str) -> Wep {
    Wep {
        id: wep_id(workload_id),
        endpoint: WorkloadEndpoint::default(),
    }
}

/// A workload endpoint being built: see [`wep`].
#[derive(Clone, Debug)]
#[must_use]
pub struct Wep {
    id: WorkloadEndpointId,
    endpoint: WorkloadEndpoint,
}

impl Wep {
    /// State `active`.
    pub fn active(mut self) -> Self {
        self.endpoint.state = "active".into();
        self
    }

    /// The host-side interface (`name`).
    pub fn iface(mut self, name: &str) -> Self {
        self.endpoint.name = name.into();
        self
    }

    /// The workload's MAC.
    pub fn mac(mut self, mac: &str) -> Self {
        self.endpoint.mac = mac.into();
        self
    }

    /// One more IPv4 network (`10.0.0.1/32`).
    pub fn ipv4(mut self, net: &str) -> Self {
        self.endpoint.ipv4_nets.push(net.into());
        self
    }

    /// One more IPv6 network (`fd00::1/128`).
    pub fn ipv6(mut self, net: &str) -> Self {
        self.endpoint.ipv6_nets.push(net.into());
        self
    }

    /// One more profile (`kns.prod`).
    pub fn profile(mut self, id: &str) -> Self {
        self.endpoint.profile_ids.push(id.into());
        self
    }

    /// One more tier, applying `ingress` to traffic towards the workload.
    pub fn ingress_tier(mut self, tier: &str, ingress: &[PolicyId]) -> Self {
        self.endpoint.tiers.push(TierInfo {
            name: tier.into(),
            ingress_policies: ingress.to_vec(),
            ..Default::default()
        });
        self
    }

    /// The id.
    pub fn id(&self) -> WorkloadEndpointId {
        self.id.clone()
    }

    /// The endpoint message.
    pub fn endpoint(self) -> WorkloadEndpoint {
        self.endpoint
    }

    /// The `WorkloadEndpointUpdate` payload.
    pub fn update(self) -> Payload {
        Payload::WorkloadEndpointUpdate(WorkloadEndpointUpdate {
            id: Some(self.id),
            endpoint: Some(self.endpoint),
        })
    }

    /// The `WorkloadEndpointRemove` payload of its id.
    pub fn remove(self) -> Payload {
        Payload::WorkloadEndpointRemove(WorkloadEndpointRemove { id: Some(self.id) })
    }
}
