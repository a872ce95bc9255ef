//! The worked example of `docs/drivers.md`, kept compiling and tested here. Keep the two in step.

use std::collections::BTreeMap;

use dataplane_agent::driver::{Driver, DriverError, EndpointStatuses, WorkloadEndpointKey};
use felix_proto::ToDataplane;
use felix_proto::to_dataplane::Payload;

/// Counts this node's workload endpoints and prints their IPs after every change.
#[derive(Default)]
pub struct EndpointCounter {
    /// Desired state: endpoint -> its addresses.
    endpoints: BTreeMap<WorkloadEndpointKey, Vec<String>>,
    /// Something changed since the last successful apply.
    dirty: bool,
}

impl EndpointCounter {
    fn render(&self) -> String {
        let mut out = format!("{} workload endpoints\n", self.endpoints.len());
        for (key, ips) in &self.endpoints {
            out.push_str(&format!("  {key}: {}\n", ips.join(", ")));
        }
        out
    }
}

impl Driver for EndpointCounter {
    fn on_update(&mut self, msg: &ToDataplane) {
        // Cheap, no IO: just record the desired state.
        match &msg.payload {
            Some(Payload::WorkloadEndpointUpdate(u)) => {
                let ep = u.endpoint.clone().unwrap_or_default();
                let ips = ep.ipv4_nets.into_iter().chain(ep.ipv6_nets).collect();
                // An update replaces whatever we had for this endpoint.
                self.endpoints
                    .insert(WorkloadEndpointKey::from_proto(u.id.as_ref()), ips);
                self.dirty = true;
            }
            Some(Payload::WorkloadEndpointRemove(r)) => {
                // Removing something we do not have is harmless.
                let key = WorkloadEndpointKey::from_proto(r.id.as_ref());
                self.dirty |= self.endpoints.remove(&key).is_some();
            }
            // IP sets, policies, profiles, config, InSync, …: not our business.
            _ => {}
        }
    }

    fn apply(&mut self) -> Result<(), DriverError> {
        // The IO happens here, and only here.
        if self.dirty {
            print!("{}", self.render());
            self.dirty = false;
        }
        Ok(())
    }

    fn endpoint_statuses(&self) -> EndpointStatuses {
        EndpointStatuses {
            workloads: self
                .endpoints
                .keys()
                .map(|k| (k.clone(), "up".to_owned()))
                .collect(),
            hosts: BTreeMap::new(),
        }
    }
}

#[test]
fn endpoint_counter_tracks_updates_and_removes() {
    use felix_proto::{
        WorkloadEndpoint, WorkloadEndpointId, WorkloadEndpointRemove, WorkloadEndpointUpdate,
    };
    let id = |w: &str| WorkloadEndpointId {
        orchestrator_id: "k8s".into(),
        workload_id: w.into(),
        endpoint_id: "eth0".into(),
    };
    let update = |w: &str, ip: &str| ToDataplane {
        sequence_number: 0,
        payload: Some(Payload::WorkloadEndpointUpdate(WorkloadEndpointUpdate {
            id: Some(id(w)),
            endpoint: Some(WorkloadEndpoint {
                ipv4_nets: vec![ip.into()],
                ..Default::default()
            }),
        })),
    };
    let mut d = EndpointCounter::default();
    d.on_update(&update("ns/a", "10.0.0.1/32"));
    d.on_update(&update("ns/b", "10.0.0.2/32"));
    d.on_update(&update("ns/a", "10.0.0.3/32"));
    assert!(d.dirty);
    d.apply().expect("apply");
    assert!(!d.dirty);
    assert_eq!(
        d.render(),
        "2 workload endpoints\n  k8s/ns/a/eth0: 10.0.0.3/32\n  k8s/ns/b/eth0: 10.0.0.2/32\n"
    );
    d.on_update(&ToDataplane {
        sequence_number: 0,
        payload: Some(Payload::WorkloadEndpointRemove(WorkloadEndpointRemove {
            id: Some(id("ns/b")),
        })),
    });
    assert_eq!(d.endpoint_statuses().workloads.len(), 1);
    assert_eq!(
        d.render(),
        "1 workload endpoints\n  k8s/ns/a/eth0: 10.0.0.3/32\n"
    );
}
