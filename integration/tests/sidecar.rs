//! The agent as a sidecar: a dataplane-agent container joined to an application container's
//! network namespace (`--network container:APP`) with only NET_ADMIN and NET_RAW, programming
//! that namespace and nothing else. The application's `eth0` is a host endpoint of the node
//! the sidecar names; its inbound traffic is enforced by the sidecar, and killing the sidecar
//! leaves the rules in place (nothing in the agent tears them down on exit).
//!
//! Needs root and a Docker engine: `#[ignore]`d with that reason and run by `make test`. Without
//! an engine the test fails when CI is set; when it is unset it runs nothing and is counted as
//! not run (`integration::docker::not_run`). The images come from `make images` (built here
//! when missing).

use std::time::{Duration, Instant};

use integration::docker::{Docker, Network, require_engine};

const NODE: &str = "app-1";

/// The datastore: the application's `eth0` as a host endpoint, inbound 8080 from the allowed
/// client only, outbound open (the sidecar's own connection to calc-server leaves from there).
fn manifests(app_ip: &str, allowed_ip: &str) -> String {
    format!(
        "apiVersion: projectcalico.org/v3
kind: Tier
metadata: {{name: default}}
spec: {{order: 1000000, defaultAction: Deny}}
---
apiVersion: projectcalico.org/v3
kind: HostEndpoint
metadata:
  name: app-eth0
  labels: {{role: app}}
spec:
  node: {NODE}
  interfaceName: eth0
  expectedIPs: [{app_ip}]
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {{name: app-ingress}}
spec:
  selector: role == 'app'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    source: {{nets: [{allowed_ip}/32]}}
    destination: {{ports: [8080]}}
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata: {{name: app-egress}}
spec:
  selector: role == 'app'
  types: [Egress]
  egress: [{{action: Allow}}]
"
    )
}

/// Waits until `probe` returns `want`, or panics with `what` and the sidecar's log.
fn wait_for(d: &Docker, what: &str, sidecar: &str, mut probe: impl FnMut() -> bool, want: bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if probe() == want {
            return;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    panic!(
        "{what}: still not {want}; sidecar log:\n{}",
        d.logs(sidecar)
    );
}

#[test]
#[ignore = "needs root and a Docker engine: `make test` runs it"]
fn a_sidecar_enforces_its_applications_inbound_traffic_and_its_death_leaves_the_rules() {
    let Some(d) = require_engine() else {
        return;
    };
    d.ensure_images();
    let net = Network::create(&d, "sidecar");
    let (server_ip, app_ip, allowed_ip, denied_ip) =
        (net.ip(2), net.ip(10), net.ip(20), net.ip(21));

    // The datastore goes into the container with `docker cp`, not a bind mount: the engine
    // may not see this process's files (`make fresh-check` runs the tests in a chroot).
    // The file goes into nonroot's home, which the image's user (65532) owns: calc-server
    // writes status files beside the manifests.
    let dir = tempfile::tempdir().expect("temp dir");
    let manifest = dir.path().join("cluster.yaml");
    std::fs::write(&manifest, manifests(&app_ip, &allowed_ip)).expect("write manifests");
    let server = net.create_container(
        "server",
        &server_ip,
        &[],
        "split-felix/calc-server:dev",
        &[
            "serve",
            "--file-dir",
            "/home/nonroot",
            "--listen",
            "0.0.0.0:50051",
            "--admin-listen",
            "127.0.0.1:9096",
        ],
    );
    d.ok(&[
        "cp",
        manifest.to_str().expect("UTF-8"),
        &format!("{server}:/home/nonroot/cluster.yaml"),
    ]);
    d.ok(&["start", &server]);
    let app = net.run(
        "app",
        &app_ip,
        &[],
        "split-felix/workload:bookworm",
        &["sh", "-c", "nc -lk 8080 >/dev/null"],
    );
    let allowed = net.run(
        "allowed",
        &allowed_ip,
        &[],
        "split-felix/workload:bookworm",
        &[],
    );
    let denied = net.run(
        "denied",
        &denied_ip,
        &[],
        "split-felix/workload:bookworm",
        &[],
    );
    let connects = |from: &str| d.connects(from, &app_ip, 8080);

    // No sidecar yet: nothing is enforced.
    wait_for(
        &d,
        "before the sidecar, allowed client",
        &app,
        || connects(&allowed),
        true,
    );
    assert!(connects(&denied), "before the sidecar, nothing is enforced");

    // The sidecar: the application's network namespace, NET_ADMIN and NET_RAW, nothing else.
    let sidecar = d.run_detached(&[
        "--name",
        &format!("{app}-agent"),
        "--network",
        &format!("container:{app}"),
        "--cap-add",
        "NET_ADMIN",
        "--cap-add",
        "NET_RAW",
        "split-felix/dataplane-agent:dev",
        "--server",
        &format!("http://{server_ip}:50051"),
        "--node",
        NODE,
        "--driver",
        "linux",
    ]);
    net.adopt(&sidecar);
    wait_for(
        &d,
        "with the sidecar, denied client",
        &sidecar,
        || connects(&denied),
        false,
    );
    assert!(connects(&allowed), "the policy's source is let in");
    let rules = d.exec_ok(&sidecar, &["iptables-save", "-t", "filter"]);
    assert!(rules.contains("cali-fh-eth0"), "{rules}");
    // NET_ADMIN and NET_RAW are enough: nothing failed (a read-only /proc/sys only warns).
    let log = d.logs(&sidecar);
    assert!(!log.contains(" ERROR "), "{log}");

    // Only the application's namespace is programmed: the host's has no chain of it.
    let host = integration::netns::run(&["iptables-save", "-t", "filter"]);
    assert!(
        !host.contains("cali-fh-eth0"),
        "the sidecar programmed the host's namespace:\n{host}"
    );

    // Killed (no chance to clean up), the sidecar leaves the rules: still enforced.
    d.kill(&sidecar);
    for _ in 0..5 {
        assert!(!connects(&denied), "the rules went with the sidecar");
        assert!(connects(&allowed), "the rules went with the sidecar");
    }
    drop(server);
}
