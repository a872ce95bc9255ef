//! The policy kinds users write today, on real packets: a ClusterNetworkPolicy Admin Deny that
//! beats a NetworkPolicy's Allow, a Baseline rule that applies only where no NetworkPolicy
//! speaks, a rule matching a Kubernetes Service's endpoints, and a staged policy that changes
//! nothing in the kernel. A host network namespace runs calc-server (file datastore) and
//! `dataplane-agent --driver linux` or `--driver nftables` (one test each); workload namespaces
//! hang off it by veth pairs; TCP connects show which pairs policy lets through, and
//! `calc-server explain` must give the same verdicts.
//!
//! Needs root, iptables, ipset, nc, ping and nft: `#[ignore]`d with that reason and run by
//! `make test`; a missing tool fails the test (see `integration::netns::require`).

use std::path::Path;
use std::process::Command;

use integration::driver_tests;
use integration::netns::{
    ControlPlane, Driver, Netns, Probe, Workload, expect_eventually, namespace_profile, nft_list,
    wep_manifest, write_manifest,
};

const NODE: &str = "node-a";

fn wep(ns: &str, pod: &str, app: &str, w: &Workload) -> String {
    wep_manifest(NODE, ns, pod, &w.iface)
        .label("app", app)
        .ipv4(&w.ipv4)
        .render()
}

/// The tiers Calico creates in every datastore, and the default tier.
const TIERS: &str = "apiVersion: projectcalico.org/v3
kind: Tier
metadata: {name: default}
spec: {order: 1000000, defaultAction: Deny}
---
";

/// - web accepts anything (a NetworkPolicy), except 9090 from the client: an Admin Deny;
/// - prod's pods are denied ingress at the Baseline: the client (no NetworkPolicy selects it)
///   is closed, web (its NetworkPolicy allows) is not;
/// - db (dev) may only talk to the endpoints of the Service `prod/web-svc` (port 8080);
/// - a staged policy that would deny web everything changes nothing.
const POLICIES: &str = "apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {name: web-open, namespace: prod}
spec:
  selector: app == 'web'
  ingress: [{action: Allow}]
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: no-9090-from-client}
spec:
  tier: Admin
  priority: 10
  subject:
    pods:
      namespaceSelector: {matchLabels: {env: prod}}
      podSelector: {matchLabels: {app: web}}
  ingress:
  - name: client-may-not-use-9090
    action: Deny
    from:
    - pods:
        namespaceSelector: {matchLabels: {env: prod}}
        podSelector: {matchLabels: {app: client}}
    protocols:
    - tcp: {destinationPort: {number: 9090}}
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: prod-closed-by-default}
spec:
  tier: Baseline
  priority: 50
  subject:
    namespaces: {matchLabels: {env: prod}}
  ingress:
  - name: deny-all
    action: Deny
    from:
    - namespaces: {}
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {name: db-egress, namespace: dev}
spec:
  selector: app == 'db'
  types: [Egress]
  egress:
  - action: Allow
    protocol: TCP
    destination:
      services: {name: web-svc, namespace: prod}
---
apiVersion: projectcalico.org/v3
kind: StagedNetworkPolicy
metadata: {name: web-lockdown, namespace: prod}
spec:
  stagedAction: Set
  order: 1
  selector: app == 'web'
  ingress: [{action: Deny}]
---
";

fn service(web_ip: Option<&str>) -> String {
    let endpoints = match web_ip {
        Some(ip) => format!("endpoints:\n- addresses: [{ip}]\n  conditions: {{ready: true}}\n"),
        None => "endpoints: []\n".to_owned(),
    };
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: web-svc, namespace: prod}}
spec:
  selector: {{app: web}}
  ports: [{{name: http, port: 80, targetPort: 8080, protocol: TCP}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-svc-1
  namespace: prod
  labels: {{kubernetes.io/service-name: web-svc}}
addressType: IPv4
{endpoints}ports:
- {{name: http, port: 8080, protocol: TCP}}
"
    )
}

fn tcp<'a>(from: &'a Workload, to: &str, port: u16, allowed: bool) -> Probe<'a> {
    Probe {
        from,
        to: to.to_owned(),
        port: Some(port),
        allowed,
    }
}

/// `calc-server explain` on the same manifests: its verdict for one probe.
fn explain(dir: &Path, from: &str, to: &str, port: u16) -> serde_json::Value {
    let out = Command::new(integration::binary("calc-server"))
        .args(["explain", "--file-dir"])
        .arg(dir)
        .args(["--from", from, "--to", to, "--port", &port.to_string()])
        .args(["--output", "json"])
        .output()
        .expect("run calc-server explain");
    assert!(
        out.status.success(),
        "explain {from} -> {to}:{port}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("explain prints JSON")
}

driver_tests! {
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    admin_baseline_service_and_staged_policies_on_real_traffic => policy_kinds;
}

fn policy_kinds(driver: Driver) {
    integration::netns::require();
    let host = Netns::new("host");
    host.make_host();
    let mut client = Workload::attach(&host, "cali0client001", "10.65.0.1", "fd00:65::1");
    let mut web = Workload::attach(&host, "cali0web000002", "10.65.0.2", "fd00:65::2");
    let mut db = Workload::attach(&host, "cali0db0000003", "10.65.0.3", "fd00:65::3");
    client.listen(7070);
    web.listen(8080);
    web.listen(9090);
    db.listen(5432);
    let dir = tempfile::tempdir().expect("temp dir");
    let mut manifests = String::from(TIERS);
    manifests.push_str(&namespace_profile("prod", "prod"));
    manifests.push_str(&namespace_profile("dev", "dev"));
    manifests.push_str(&wep("prod", "client", "client", &client));
    manifests.push_str(&wep("prod", "web", "web", &web));
    manifests.push_str(&wep("dev", "db", "db", &db));
    write_manifest(dir.path(), "workloads.yaml", &manifests);
    write_manifest(dir.path(), "policies.yaml", POLICIES);
    write_manifest(dir.path(), "service.yaml", &service(Some(&web.ipv4)));

    let cp = ControlPlane::start_with_driver(driver, &host, dir.path(), NODE, &[]);
    cp.wait_programmed();
    // (probe, explain's names for its two ends)
    let expected = [
        // web's NetworkPolicy allows 8080 from the client …
        (
            tcp(&client, &web.ipv4, 8080, true),
            "prod/client",
            "prod/web",
        ),
        // … but the Admin tier denies 9090 from it first.
        (
            tcp(&client, &web.ipv4, 9090, false),
            "prod/client",
            "prod/web",
        ),
        // Nothing selects the client in the default tier: the Baseline deny applies.
        (
            tcp(&web, &client.ipv4, 7070, false),
            "prod/web",
            "prod/client",
        ),
        // db's egress reaches the Service's endpoint and port only.
        (tcp(&db, &web.ipv4, 8080, true), "dev/db", "prod/web"),
        (tcp(&db, &web.ipv4, 9090, false), "dev/db", "prod/web"),
        // Nothing limits the client's egress or db's ingress (its profile allows).
        (tcp(&client, &db.ipv4, 5432, true), "prod/client", "dev/db"),
    ];
    for (probe, from, to) in &expected {
        let e = explain(dir.path(), from, to, probe.port.expect("tcp"));
        let want = if probe.allowed { "allow" } else { "deny" };
        assert_eq!(
            e["verdict"], want,
            "explain disagrees with the policy: {e:#}"
        );
    }
    let probes: Vec<Probe<'_>> = expected.into_iter().map(|(p, ..)| p).collect();
    expect_eventually("initial policy", &probes, &cp);
    // The staged lockdown is in the pending verdict only.
    let e = explain(dir.path(), "prod/client", "prod/web", 8080);
    assert_eq!(e["pending"]["verdict"], "deny", "{e:#}");

    // Nothing staged reaches the kernel: no chain for the staged policy.
    let save = match driver {
        Driver::Linux => host.exec(&["iptables-save", "-t", "filter"]),
        Driver::Nftables => nft_list(&host, "ip"),
    };
    assert!(save.contains("cali-pi-np/prod/web-open"), "{save}");
    assert!(!save.contains("snp/prod/web-lockdown"), "{save}");
    assert!(save.contains("Start of tier kube-admin"), "{save}");
    assert!(save.contains("Start of tier kube-baseline"), "{save}");

    // The Service loses its endpoint: db's egress to web is denied.
    write_manifest(dir.path(), "service.yaml", &service(None));
    expect_eventually(
        "after the Service lost its endpoint",
        &[tcp(&db, &web.ipv4, 8080, false)],
        &cp,
    );
}
