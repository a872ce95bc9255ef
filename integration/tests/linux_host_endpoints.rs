//! Host endpoints on a real kernel: a HostEndpoint on the host's interface towards an
//! "outside" network turns on Calico's host protection for it — only what policy allows (and
//! the failsafe ports) reaches the host through that interface; replies flow back. On both
//! drivers (`linux`, `nftables`).

use std::time::{Duration, Instant};

use integration::driver_tests;
use integration::netns::{ControlPlane, Driver, Netns, nft_chain, nft_list, write_manifest};

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

driver_tests! {
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    a_host_endpoint_protects_the_host_except_for_policy_and_failsafes => host_protection;
}

fn host_protection(driver: Driver) {
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
    let cp = ControlPlane::start_with_driver(driver, &host, dir.path(), NODE, &[]);
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
    match driver {
        Driver::Linux => {
            let save = host.exec(&["iptables-save", "-t", "filter"]);
            assert!(
                save.contains("-A cali-from-host-endpoint -i ext0"),
                "{save}"
            );
            assert!(save.contains(":cali-fh-ext0"), "{save}");
        }
        Driver::Nftables => {
            let table = nft_list(&host, "ip");
            assert!(table.contains("chain filter-cali-fh-ext0 {"), "{table}");
            let dispatch = nft_chain(&host, "ip", "filter-cali-from-host-endpoint");
            assert!(
                dispatch
                    .lines()
                    .any(|l| l.contains("iifname \"ext0\"") && l.contains("filter-cali-fh-ext0")),
                "{dispatch}"
            );
        }
    }

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
