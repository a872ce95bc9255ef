//! Host endpoints on a real kernel: a HostEndpoint on the host's interface towards an
//! "outside" network turns on Calico's host protection for it — only what policy allows (and
//! the failsafe ports) reaches the host through that interface; replies flow back.

use std::time::{Duration, Instant};

use integration::netns::{ControlPlane, Netns, write_manifest};

const NODE: &str = "node-a";

fn connects(from: &Netns, port: u16) -> bool {
    from.try_exec(&["nc", "-z", "-w", "1", "192.0.2.1", &port.to_string()])
}

/// Waits until the verdicts for ports 22, 8080 and 9999 are as expected.
fn expect(what: &str, from: &Netns, cp: &ControlPlane, want: [(u16, bool); 3]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got: Vec<(u16, bool)> = want.iter().map(|(p, _)| (*p, connects(from, *p))).collect();
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: wanted {want:?}, got {got:?}\nagent log:\n{}",
            cp.agent_log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn a_host_endpoint_protects_the_host_except_for_policy_and_failsafes() {
    integration::netns::require();
    let host = Netns::new("host");
    host.make_host();
    let outside = Netns::outside_of(&host);
    let _listeners: Vec<_> = [22, 8080, 9999]
        .iter()
        .map(|p| host.listen(*p, &["-4"]))
        .collect();

    let dir = tempfile::tempdir().expect("temp dir");
    write_manifest(
        dir.path(),
        "node.yaml",
        "apiVersion: projectcalico.org/v3
kind: Node
metadata:
  name: node-a
spec:
  bgp:
    ipv4Address: 192.0.2.1/24
",
    );
    let cp = ControlPlane::start(&host, dir.path(), NODE, &[]);
    cp.wait_programmed();
    // No host endpoint: the host is not policed.
    expect(
        "before the host endpoint",
        &outside,
        &cp,
        [(22, true), (8080, true), (9999, true)],
    );

    write_manifest(
        dir.path(),
        "hep.yaml",
        "apiVersion: projectcalico.org/v3
kind: HostEndpoint
metadata:
  name: node-a-ext0
  labels:
    role: edge
spec:
  node: node-a
  interfaceName: ext0
  expectedIPs: [192.0.2.1]
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: edge-web
spec:
  selector: role == 'edge'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    destination:
      ports: [8080]
",
    );
    // Policy allows 8080; 22 is a failsafe; everything else is dropped at the end of the tier.
    expect(
        "with the host endpoint",
        &outside,
        &cp,
        [(22, true), (8080, true), (9999, false)],
    );
    let save = host.exec(&["iptables-save", "-t", "filter"]);
    assert!(
        save.contains("-A cali-from-host-endpoint -i ext0"),
        "{save}"
    );
    assert!(save.contains(":cali-fh-ext0"), "{save}");

    // Without the policy only the failsafes remain (a host endpoint with no profile drops).
    std::fs::write(
        dir.path().join("hep.yaml"),
        std::fs::read_to_string(dir.path().join("hep.yaml"))
            .unwrap()
            .replace("role == 'edge'", "role == 'nobody'"),
    )
    .unwrap();
    expect(
        "host endpoint without policy",
        &outside,
        &cp,
        [(22, true), (8080, false), (9999, false)],
    );
}
