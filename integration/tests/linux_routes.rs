//! The Linux driver's routes, interface monitor and endpoint status on a real kernel: the
//! harness creates veth pairs but no host routes and no host-side settings; the agent must
//! add the routes (with its route protocol), configure the interfaces, follow links going down
//! and up, report status through the calc-server's status writer, repair a route deleted by
//! hand and never touch a foreign route. Each test runs on both drivers (`linux`, `nftables`:
//! they share the route and interface managers; the rule checks read each one's own state).

use std::path::Path;
use std::time::{Duration, Instant};

use integration::driver_tests;
use integration::netns::{
    ControlPlane, Driver, Netns, Probe, Workload, expect_eventually, failing, nft_chain, nft_list,
    nft_packets, wep_manifest, write_manifest,
};

const NODE: &str = "node-a";

fn wep(pod: &str, w: &Workload) -> String {
    wep_manifest(NODE, "prod", pod, &w.iface)
        .label("app", pod)
        .calico_labels()
        .mac(&w.mac())
        .ipv4(&w.ipv4)
        .ipv6(&w.ipv6)
        .render()
}

const PROFILE: &str = "apiVersion: projectcalico.org/v3
kind: Profile
metadata:
  name: kns.prod
spec:
  ingress: [{action: Allow}]
  egress: [{action: Allow}]
---
";

/// The endpoint statuses the calc-server's status writer wrote for the node.
fn statuses(dir: &Path) -> serde_json::Value {
    std::fs::read_to_string(dir.join("status").join(format!("{NODE}.json")))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .map(|v| v["workload_endpoints"].clone())
        .unwrap_or(serde_json::Value::Null)
}

fn wait(what: &str, cp: &ControlPlane, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for: {what}\nagent log:\n{}",
            cp.agent_log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn routes(host: &Netns) -> String {
    host.exec(&["ip", "route", "show", "proto", "80"])
        + &host.exec(&["ip", "-6", "route", "show", "proto", "80"])
}

fn tcp<'a>(from: &'a Workload, to: &str, port: u16) -> Probe<'a> {
    Probe {
        from,
        to: to.to_owned(),
        port: Some(port),
        allowed: true,
    }
}

driver_tests! {
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    routes_interfaces_and_status_follow_endpoints_and_links => routes_and_status;
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    a_new_interface_drops_everything_until_its_endpoint_arrives => new_interface_drops;
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    nat_outgoing_pools_masquerade_traffic_leaving_the_pools => nat_outgoing;
    #[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
    felix_configuration_in_the_datastore_opens_workload_to_host_traffic => felix_configuration;
}

fn routes_and_status(driver: Driver) {
    integration::netns::require();
    let host = Netns::new("host");
    host.make_host();
    let mut a = Workload::attach_without_routes(&host, "cali0aaaaaaa01", "10.65.0.1", "fd00:65::1");
    let mut b = Workload::attach_without_routes(&host, "cali0bbbbbbb02", "10.65.0.2", "fd00:65::2");
    a.listen(7070);
    b.listen(8080);
    // A route that is not ours, on a workload interface: it must survive everything.
    host.exec(&[
        "ip",
        "route",
        "add",
        "10.99.0.0/24",
        "dev",
        &b.iface,
        "proto",
        "static",
    ]);

    let dir = tempfile::tempdir().expect("temp dir");
    write_manifest(dir.path(), "profile.yaml", PROFILE);
    write_manifest(dir.path(), "a.yaml", &wep("a", &a));
    write_manifest(dir.path(), "b.yaml", &wep("b", &b));
    let cp = ControlPlane::start_with_driver(
        driver,
        &host,
        dir.path(),
        NODE,
        &["--refresh-interval", "1s"],
    );
    cp.wait_programmed();

    // Routes with our protocol, v4 and v6, out of each endpoint's interface.
    wait("routes for both endpoints", &cp, || {
        let r = routes(&host);
        r.contains(&format!("10.65.0.1 dev {}", a.iface))
            && r.contains(&format!("10.65.0.2 dev {}", b.iface))
            && r.contains(&format!("fd00:65::1 dev {}", a.iface))
            && r.contains(&format!("fd00:65::2 dev {}", b.iface))
    });
    // The interfaces got Calico's settings and a permanent neighbour for the workload's MAC.
    let proxy_arp = host.exec(&[
        "cat",
        &format!("/proc/sys/net/ipv4/conf/{}/proxy_arp", a.iface),
    ]);
    assert_eq!(proxy_arp.trim(), "1");
    let neigh = host.exec(&["ip", "neigh", "show", "dev", &a.iface]);
    assert!(
        neigh.contains(&format!("10.65.0.1 lladdr {} PERMANENT", a.mac())),
        "static neighbour for a: {neigh}"
    );
    // Traffic: workload to workload (both families) and host to workload.
    expect_eventually(
        "traffic over the agent's routes",
        &[
            tcp(&a, &b.ipv4, 8080),
            tcp(&b, &a.ipv4, 7070),
            tcp(&a, &b.ipv6, 8080),
        ],
        &cp,
    );
    assert!(
        host.try_exec(&["nc", "-z", "-w", "1", &a.ipv4, "7070"]),
        "host to workload"
    );
    wait("both endpoints reported up", &cp, || {
        let s = statuses(dir.path());
        s["k8s/prod/a/eth0"] == "up" && s["k8s/prod/b/eth0"] == "up"
    });

    // The link goes down: status down, route withdrawn; up again: both back.
    host.exec(&["ip", "link", "set", &a.iface, "down"]);
    wait("a reported down and its route withdrawn", &cp, || {
        statuses(dir.path())["k8s/prod/a/eth0"] == "down" && !routes(&host).contains("10.65.0.1 ")
    });
    host.exec(&["ip", "link", "set", &a.iface, "up"]);
    wait("a reported up again with its route", &cp, || {
        statuses(dir.path())["k8s/prod/a/eth0"] == "up" && routes(&host).contains("10.65.0.1 ")
    });

    // A route deleted by hand comes back (refresh every second here).
    host.exec(&["ip", "route", "del", "10.65.0.2/32"]);
    wait("the deleted route is repaired", &cp, || {
        routes(&host).contains("10.65.0.2 ")
    });
    expect_eventually("traffic after the repair", &[tcp(&a, &b.ipv4, 8080)], &cp);

    // Deleting the endpoint removes its routes and its status.
    std::fs::remove_file(dir.path().join("a.yaml")).expect("remove a.yaml");
    wait("a's routes and status are gone", &cp, || {
        let r = routes(&host);
        !r.contains("10.65.0.1 ")
            && !r.contains("fd00:65::1 ")
            && statuses(dir.path()).get("k8s/prod/a/eth0").is_none()
    });
    assert!(
        host.exec(&["ip", "route", "show", "proto", "static"])
            .contains("10.99.0.0/24"),
        "a foreign route is never touched"
    );
}

fn new_interface_drops(driver: Driver) {
    integration::netns::require();
    let host = Netns::new("host");
    host.make_host();
    let mut a = Workload::attach_without_routes(&host, "cali0aaaaaaa01", "10.65.0.1", "fd00:65::1");
    a.listen(7070);
    let dir = tempfile::tempdir().expect("temp dir");
    write_manifest(dir.path(), "profile.yaml", PROFILE);
    write_manifest(dir.path(), "a.yaml", &wep("a", &a));
    let cp = ControlPlane::start_with_driver(driver, &host, dir.path(), NODE, &[]);
    cp.wait_programmed();

    // A pod's interface appears; its endpoint (and policy) have not reached the agent. The
    // harness routes it itself so that only policy can stop the packets.
    let late = Workload::attach(&host, "cali0late00003", "10.65.0.3", "fd00:65::3");
    // Send at once, 20 pings 10 ms apart, in both directions: nothing may get through.
    let burst = |from: &Workload, to: &str| {
        from.ns
            .try_exec(&["ping", "-c", "20", "-i", "0.01", "-W", "1", "-w", "2", to])
    };
    assert!(
        !burst(&late, &a.ipv4),
        "late -> a got through before its policy"
    );
    assert!(
        !burst(&a, &late.ipv4),
        "a -> late got through before its policy"
    );
    let drops = match driver {
        Driver::Linux => host.exec(&["iptables-save", "-c", "-t", "filter"]),
        Driver::Nftables => {
            nft_chain(&host, "ip", "filter-cali-from-wl-dispatch")
                + &nft_chain(&host, "ip", "filter-cali-to-wl-dispatch")
        }
    };
    let unknown: Vec<&str> = drops
        .lines()
        .filter(|l| l.contains("Unknown interface"))
        .collect();
    let counted = |l: &&str| match driver {
        Driver::Linux => !l.starts_with("[0:"),
        Driver::Nftables => nft_packets(l) > 0,
    };
    assert!(
        unknown.iter().any(counted),
        "{driver:?}: the dispatch chains' unknown-interface drop counted the packets: \
         {unknown:?}\n{drops}"
    );

    // The endpoint arrives: traffic flows.
    write_manifest(dir.path(), "late.yaml", &wep("late", &late));
    expect_eventually(
        "the late endpoint's traffic",
        &[tcp(&late, &a.ipv4, 7070)],
        &cp,
    );
    let ping = [Probe {
        from: &a,
        to: late.ipv4.clone(),
        port: None,
        allowed: true,
    }];
    let bad = failing(&ping);
    assert!(bad.is_empty(), "ping to the late endpoint once programmed");
}

fn nat_outgoing(driver: Driver) {
    integration::netns::require();
    let host = Netns::new("host");
    host.make_host();
    let mut a = Workload::attach_without_routes(&host, "cali0aaaaaaa01", "10.65.0.1", "fd00:65::1");
    a.listen(7070);
    // An "outside" network with no route back to the pod range: a reply can only come back if
    // the host masqueraded the pod's address.
    let outside = Netns::outside_of(&host);
    let _listener = outside.listen(9000, &["-4"]);

    let dir = tempfile::tempdir().expect("temp dir");
    write_manifest(dir.path(), "profile.yaml", PROFILE);
    write_manifest(dir.path(), "a.yaml", &wep("a", &a));
    let pool = |nat: bool| {
        format!(
            "apiVersion: projectcalico.org/v3
kind: IPPool
metadata:
  name: pods
spec:
  cidr: 10.65.0.0/16
  natOutgoing: {nat}
"
        )
    };
    write_manifest(dir.path(), "pool.yaml", &pool(false));
    let cp = ControlPlane::start_with_driver(driver, &host, dir.path(), NODE, &[]);
    cp.wait_programmed();
    wait("a's route", &cp, || routes(&host).contains("10.65.0.1 "));
    let out = |allowed| Probe {
        from: &a,
        to: "192.0.2.2".into(),
        port: Some(9000),
        allowed,
    };
    // Without natOutgoing the reply has no way back.
    let blocked = [out(false)];
    assert!(
        failing(&blocked).is_empty(),
        "no masquerade without natOutgoing"
    );
    // As in Felix, the chain holds no rule while no pool has natOutgoing.
    let nat_rules = || match driver {
        Driver::Linux => host.exec(&["iptables-save", "-t", "nat"]),
        Driver::Nftables => nft_chain(&host, "ip", "nat-cali-nat-outgoing"),
    };
    let nat = nat_rules();
    match driver {
        Driver::Linux => assert!(!nat.contains("MASQUERADE"), "{nat}"),
        Driver::Nftables => {
            assert!(nat.contains("chain nat-cali-nat-outgoing {"), "{nat}");
            assert!(!nat.contains("masquerade"), "{nat}");
        }
    }

    write_manifest(dir.path(), "pool.yaml", &pool(true));
    expect_eventually("masqueraded traffic to the outside", &[out(true)], &cp);
    let nat = nat_rules();
    match driver {
        Driver::Linux => {
            let members = host.exec(&["ipset", "list", "cali40masq-ipam-pools"]);
            assert!(members.contains("10.65.0.0/16"), "{members}");
            // This kernel and iptables take --random-fully, so the agent uses it, as Felix does.
            assert!(nat.contains("-j MASQUERADE --random-fully"), "{nat}");
            // Traffic between pods (inside the pools) is not masqueraded: the sets exclude it.
            assert!(
                nat.contains("! --match-set cali40network-ip-pools dst"),
                "{nat}"
            );
        }
        Driver::Nftables => {
            let table = nft_list(&host, "ip");
            let members = table
                .split("set cali40masq-ipam-pools {")
                .nth(1)
                .and_then(|rest| rest.split('}').next())
                .unwrap_or_else(|| panic!("no set cali40masq-ipam-pools in:\n{table}"));
            assert!(members.contains("10.65.0.0/16"), "{members}");
            let masq = nat
                .lines()
                .find(|l| l.contains("masquerade"))
                .unwrap_or_else(|| panic!("no masquerade rule in:\n{nat}"));
            // The kernel takes fully-random, so the agent uses it, as Felix does; only traffic
            // from the pools leaving them (the sets exclude pod-to-pod) is masqueraded.
            assert!(masq.contains("masquerade fully-random"), "{masq}");
            assert!(masq.contains("ip saddr @cali40masq-ipam-pools"), "{masq}");
            assert!(
                masq.contains("ip daddr != @cali40network-ip-pools"),
                "{masq}"
            );
        }
    }
}

fn felix_configuration(driver: Driver) {
    integration::netns::require();
    let host = Netns::new("host");
    host.make_host();
    let a = Workload::attach_without_routes(&host, "cali0aaaaaaa01", "10.65.0.1", "fd00:65::1");
    // A service on the host itself (the node's address).
    let _listener = host.listen(9999, &["-4"]);
    let dir = tempfile::tempdir().expect("temp dir");
    write_manifest(dir.path(), "profile.yaml", PROFILE);
    write_manifest(dir.path(), "a.yaml", &wep("a", &a));
    let cp = ControlPlane::start_with_driver(driver, &host, dir.path(), NODE, &[]);
    cp.wait_programmed();
    wait("a's route", &cp, || routes(&host).contains("10.65.0.1 "));
    // The listener answers from the host itself.
    assert!(host.try_exec(&["nc", "-z", "-w", "1", "10.254.0.1", "9999"]));
    let to_host = |allowed| Probe {
        from: &a,
        to: "10.254.0.1".into(),
        port: Some(9999),
        allowed,
    };
    // Felix's default DefaultEndpointToHostAction is Drop.
    let dropped = [to_host(false)];
    assert!(
        failing(&dropped).is_empty(),
        "workload to host is dropped by default"
    );

    write_manifest(
        dir.path(),
        "felix.yaml",
        "apiVersion: projectcalico.org/v3
kind: FelixConfiguration
metadata:
  name: default
spec:
  defaultEndpointToHostAction: Accept
",
    );
    expect_eventually(
        "workload to host once FelixConfiguration says Accept",
        &[to_host(true)],
        &cp,
    );
}
