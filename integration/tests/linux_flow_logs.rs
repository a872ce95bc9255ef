//! The agent's flow-log rules in a real kernel: with `--flow-logs`, each deciding rule also
//! sends the packet to NFLOG with Felix's group (1 inbound, 2 outbound) and prefix
//! (`API0|np/prod/web-allow`, the tier's end `DPI|default`, the no-profile drop `DRI`), and the
//! kernel accepts and lists them, on each iptables backend and with the nftables driver; without
//! the flag no NFLOG rule is programmed. Real packets still pass and drop as the policy says.
//!
//! Needs root, iptables (nft and legacy), ipset, nc, ping and nft: `#[ignore]`d with that
//! reason and run by `make test`; a missing tool fails the test (see
//! `integration::netns::require`).

use integration::netns::{ControlPlane, Driver, Ipt, Netns, client_and, nft_list, write_manifest};

const NODE: &str = "node-a";

/// web accepts the client on TCP 8080; anything else to web falls off the end of tier default.
const POLICY: &str = "apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata: {name: web-allow, namespace: prod}
spec:
  selector: app == 'web'
  types: [Ingress]
  ingress:
  - action: Allow
    protocol: TCP
    source: {selector: app == 'client'}
    destination: {ports: [8080]}
";

#[derive(Clone, Copy, Debug)]
enum Plane {
    Iptables(Ipt),
    Nftables,
}

/// What the kernel holds of ours, as text: `iptables-save` of the filter table, or the
/// `calico` table of nft.
fn kernel_text(host: &Netns, plane: Plane) -> String {
    match plane {
        Plane::Iptables(ipt) => host.exec(&[&ipt.tool(4, "save"), "-t", "filter"]),
        Plane::Nftables => nft_list(host, "ip"),
    }
}

/// The lines of `text` that log to NFLOG.
fn nflog_lines(text: &str, plane: Plane) -> Vec<String> {
    text.lines()
        .filter(|l| match plane {
            Plane::Iptables(_) => l.contains("-j NFLOG"),
            Plane::Nftables => l.contains(" log ") && l.contains(" group "),
        })
        .map(str::to_owned)
        .collect()
}

/// Whether one of `lines` logs to `group` with exactly `prefix`.
fn logs(lines: &[String], plane: Plane, group: u16, prefix: &str) -> bool {
    lines.iter().any(|l| match plane {
        Plane::Iptables(_) => {
            l.contains(&format!("--nflog-prefix \"{prefix}\""))
                || l.contains(&format!("--nflog-prefix {prefix} "))
        }
        Plane::Nftables => l.contains(&format!("prefix \"{prefix}\"")),
    } && match plane {
        Plane::Iptables(_) => l.contains(&format!("--nflog-group {group}")),
        Plane::Nftables => l.contains(&format!("group {group}")),
    })
}

fn flow_log_rules(plane: Plane) {
    integration::netns::require();
    let host = Netns::new("host");
    host.make_host();
    let dir = tempfile::tempdir().expect("temp dir");
    let (client, mut web) = client_and(&host, NODE, "web", "cali0web00002", dir.path());
    write_manifest(dir.path(), "policy.yaml", POLICY);
    let (driver, backend) = match plane {
        Plane::Iptables(ipt) => (Driver::Linux, ipt.name()),
        Plane::Nftables => (Driver::Nftables, "auto"),
    };

    // Without the flag: no NFLOG rule at all.
    let mut cp = ControlPlane::start_with_driver(
        driver,
        &host,
        dir.path(),
        NODE,
        &["--iptables-backend", backend],
    );
    cp.wait_programmed();
    let text = kernel_text(&host, plane);
    assert_eq!(
        nflog_lines(&text, plane),
        Vec::<String>::new(),
        "{plane:?}: flow logs are off by default\n{text}"
    );
    cp.stop_agent();

    // With it: the policy rule, the tier's end and the no-profile drop log, inbound to group 1
    // and outbound to group 2.
    cp.agent_extra.push("--flow-logs".into());
    cp.start_agent(&host);
    let want = [
        (1, "API0|np/prod/web-allow"),
        (1, "DPI|default"),
        (2, "DRE"),
    ];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let lines = loop {
        let lines = nflog_lines(&kernel_text(&host, plane), plane);
        if want.iter().all(|(g, p)| logs(&lines, plane, *g, p)) {
            break lines;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{plane:?}: the NFLOG rules {want:?} in the kernel; it has:\n{}\n{}",
            lines.join("\n"),
            cp.agent_log_text()
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    // Each logging rule keeps Felix's snapshot length.
    for l in &lines {
        let snaplen = match plane {
            Plane::Iptables(_) => l.contains("--nflog-size 80"),
            Plane::Nftables => l.contains("snaplen 80"),
        };
        assert!(snaplen, "{plane:?}: {l}");
    }

    // Packets still go where the policy says.
    web.listen(8080);
    web.listen(9090);
    assert!(
        client.connects(&web.ipv4, 8080),
        "{plane:?}: 8080 is allowed\n{}",
        cp.agent_log_text()
    );
    assert!(
        !client.connects(&web.ipv4, 9090),
        "{plane:?}: 9090 falls off the end of the tier\n{}",
        cp.agent_log_text()
    );
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn flow_log_rules_nft() {
    flow_log_rules(Plane::Iptables(Ipt::Nft));
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn flow_log_rules_legacy() {
    flow_log_rules(Plane::Iptables(Ipt::Legacy));
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc, ping): `make test` runs it"]
fn flow_log_rules_nftables_driver() {
    flow_log_rules(Plane::Nftables);
}
