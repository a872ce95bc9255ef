//! The worked example of `docs/drivers.md`, kept compiling and tested here. Keep the two in step.

use std::collections::BTreeMap;

use dataplane_agent::driver::{
    Driver, DriverError, EndpointStatuses, Message, WorkloadEndpointKey,
};

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
    fn on_update(&mut self, msg: &Message) {
        // Cheap, no IO: just record the desired state. The key and the endpoint are always
        // there: the session refuses a message without them before it gets here.
        match msg {
            Message::WorkloadEndpointUpdate { key, endpoint } => {
                let ips = endpoint
                    .ipv4_nets
                    .iter()
                    .chain(&endpoint.ipv6_nets)
                    .cloned()
                    .collect();
                // An update replaces whatever we had for this endpoint.
                self.endpoints.insert(key.clone(), ips);
                self.dirty = true;
            }
            Message::WorkloadEndpointRemove { key } => {
                // Removing something we do not have is harmless.
                self.dirty |= self.endpoints.remove(key).is_some();
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
    use dataplane_agent::message::{Inbound, Received};
    use felix_proto::ToDataplane;
    use felix_proto::to_dataplane::Payload;
    // What the session does with each message from the stream before a driver sees it.
    let convert = |payload: Payload| match Inbound::try_from(ToDataplane {
        sequence_number: 0,
        payload: Some(payload),
    })
    .map(|i| i.received)
    {
        Ok(Received::Message(m)) => m,
        other => panic!("{other:?}"),
    };
    let update = |w: &str, ip: &str| convert(test_support::wep(w).ipv4(ip).update());
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
    d.on_update(&convert(test_support::wep("ns/b").remove()));
    assert_eq!(d.endpoint_statuses().workloads.len(), 1);
    assert_eq!(
        d.render(),
        "1 workload endpoints\n  k8s/ns/a/eth0: 10.0.0.3/32\n"
    );
}
