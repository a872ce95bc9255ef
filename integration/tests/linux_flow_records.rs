//! Flow records from a real kernel, end to end: `calc-server serve --flow-logs` and an agent
//! with `--flow-logs` (iptables on its nft backend, and the nftables driver) in one node's
//! namespace; a client workload opens a TCP connection to web through the allow rule of
//! `np/prod/web-allow`. The agent reads the NFLOG packet and conntrack's counters, aggregates
//! them into the 15 s interval and sends it; the server's `calc-server flows --output json`
//! then holds the flow reported by the destination: action Allow, the enforced trace naming the
//! policy, packets and bytes both ways, one connection started. A connection to a port no rule
//! allows is reported denied by the tier's end.
//!
//! Needs root, iptables, ipset, nc and nft: `#[ignore]`d with that reason and run by
//! `make test`.

use std::time::{Duration, Instant};

use fantoccini::Locator;
use integration::browser::Ui;
use integration::netns::{ControlPlane, Driver, Netns, client_and, write_manifest};
use serde_json::Value;

const NODE: &str = "node-a";

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
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: prod}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, targetPort: 8080}]
";

fn key(f: &Value) -> &Value {
    if f["Key"].is_object() {
        &f["Key"]
    } else {
        &f["key"]
    }
}

/// The flow to `port` reported by the destination's node, once the server has it.
fn wait_flow(host: &Netns, cp: &ControlPlane, port: &str) -> Value {
    wait_flow_where(host, cp, port, "Dst", |_| true)
}

/// The flow to `port` reported by `reporter` for which `also` holds, once the server has it.
fn wait_flow_where(
    host: &Netns,
    cp: &ControlPlane,
    port: &str,
    reporter: &str,
    also: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let all = integration::netns::flow_listing(host, "127.0.0.1:9099");
        if let Some(f) = all
            .iter()
            .find(|f| key(f)["dest_port"] == port && key(f)["reporter"] == reporter && also(f))
        {
            return f.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no flow to {port} reported by {reporter}; flows: {all:?}\nagent:\n{}\nserver:\n{}",
            cp.agent_log_text(),
            cp.server_log_text()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn as_u64(v: &Value) -> u64 {
    v.as_u64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
        .unwrap_or(0)
}

fn flow_records(driver: Driver, backend: &str) {
    integration::netns::require();
    let host = Netns::new("host");
    host.make_host();
    let dir = tempfile::tempdir().expect("temp dir");
    let (client, mut web) = client_and(&host, NODE, "web", "cali0web00002", dir.path());
    write_manifest(dir.path(), "policy.yaml", POLICY);
    let cp = ControlPlane::start_with_server(
        driver,
        &host,
        dir.path(),
        NODE,
        &["--flow-logs", "--iptables-backend", backend],
        "127.0.0.1:50051",
        &["--flow-logs"],
    );
    cp.wait_programmed();
    web.listen(8080);
    web.listen(9090);
    // The NFLOG rules are programmed with the policy; give the agent's first read (which
    // binds the NFLOG groups) a flow period to happen.
    std::thread::sleep(Duration::from_secs(6));
    assert!(
        client.connects(&web.ipv4, 8080),
        "8080 is allowed\n{}",
        cp.agent_log_text()
    );
    assert!(!client.connects(&web.ipv4, 9090), "9090 is not");

    let allowed = wait_flow(&host, &cp, "8080");
    let k = key(&allowed);
    assert_eq!(k["action"], "Allow", "{allowed}");
    assert_eq!(k["source_name"], "client", "{allowed}");
    assert_eq!(k["dest_name"], "web", "{allowed}");
    assert_eq!(k["proto"], "tcp", "{allowed}");
    let enforced = k["policies"]["enforced_policies"]
        .as_array()
        .unwrap_or_else(|| panic!("an enforced trace: {allowed}"));
    assert_eq!(enforced.len(), 1, "{allowed}");
    assert_eq!(enforced[0]["name"], "web-allow", "{allowed}");
    assert_eq!(enforced[0]["namespace"], "prod", "{allowed}");
    assert_eq!(enforced[0]["action"], "Allow", "{allowed}");
    // nc -z: the handshake and the close; the destination received the SYN, its ACK and the
    // FIN (at least), each of at least 40 bytes, and answered.
    assert!(as_u64(&allowed["packets_in"]) >= 2, "{allowed}");
    assert!(as_u64(&allowed["bytes_in"]) >= 2 * 40, "{allowed}");
    assert!(as_u64(&allowed["packets_out"]) >= 1, "{allowed}");
    assert_eq!(as_u64(&allowed["num_connections_started"]), 1, "{allowed}");

    // Through the Service's cluster IP, translated on the node as kube-proxy would: the flow
    // names the Service, from what conntrack says the client addressed.
    host.exec(&["nft", "add", "table", "ip", "svcnat"]);
    host.exec(&[
        "nft",
        "add chain ip svcnat pre { type nat hook prerouting priority -100 ; }",
    ]);
    host.exec(&[
        "nft",
        "add rule ip svcnat pre ip daddr 10.96.0.10 tcp dport 80 dnat to 10.65.0.2:8080",
    ]);
    assert!(
        client.connects("10.96.0.10", 80),
        "the Service's address leads to web:8080"
    );
    for reporter in ["Src", "Dst"] {
        let via = wait_flow_where(&host, &cp, "8080", reporter, |f| {
            key(f)["dest_service_name"] == "web"
        });
        let k = key(&via);
        assert_eq!(
            (
                &k["dest_service_namespace"],
                &k["dest_service_port_name"],
                &k["dest_service_port"],
                &k["dest_name"]
            ),
            (
                &serde_json::json!("prod"),
                &serde_json::json!("http"),
                &serde_json::json!("80"),
                &serde_json::json!("web")
            ),
            "{via}"
        );
    }
    assert_eq!(
        key(&allowed)["dest_service_name"],
        "-",
        "the direct connection names no Service: {allowed}"
    );

    let denied = wait_flow(&host, &cp, "9090");
    let k = key(&denied);
    assert_eq!(k["action"], "Deny", "{denied}");
    let enforced = k["policies"]["enforced_policies"].as_array().unwrap();
    assert_eq!(enforced.last().unwrap()["kind"], "EndOfTier", "{denied}");
    assert_eq!(enforced.last().unwrap()["tier"], "default", "{denied}");

    // The same flows in the console, once per run (the iptables plane).
    if driver == Driver::Linux {
        console_flows(&host);
    }
}

/// The console's flows page over the flows the kernel reported: the rows name both sides and
/// the deciding policy, a row opens into its traces, and a trace's policy links to its page.
/// The browser runs outside the node's namespace and reaches its admin endpoint through a
/// forwarded port.
fn console_flows(host: &Netns) {
    let Some(driver) = integration::browser::chromedriver() else {
        return;
    };
    let admin = host.forward("127.0.0.1:9099".parse().expect("address"));
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let ui = Ui::start(&driver, &admin).await;
        ui.open("/ui/flows?since=600").await;
        let table = ui.wait_text("#flows", "web-allow", 30).await;
        assert!(table.contains("prod/client"), "{table}");
        assert!(table.contains("deny"), "the denied connection too: {table}");
        // Keep the rows still while they are clicked.
        ui.c.find(Locator::Css("#live-toggle"))
            .await
            .expect("live toggle")
            .click()
            .await
            .expect("pause");
        let allowed =
            ui.c.find(Locator::XPath(
                "//table[@id='flows']//tr[contains(., 'web-allow')]//details/summary",
            ))
            .await
            .expect("an allowed row's rule");
        allowed.click().await.expect("open the trace");
        let trace = ui
            .wait_text("#flows details[open] .trace", "enforced", 10)
            .await;
        assert!(trace.contains("pending"), "{trace}");
        ui.shot("flows").await;
        ui.assert_clean("/ui/flows").await;
        ui.c.find(Locator::Css("#flows details[open] .trace a"))
            .await
            .expect("a policy link in the trace")
            .click()
            .await
            .expect("follow it");
        ui.wait_text("h1", "web-allow", 10).await;
        ui.assert_clean("the policy page from a flow").await;
        ui.c.close().await.expect("close the browser");
    });
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc): `make test` runs it"]
fn flow_records_iptables_nft() {
    flow_records(Driver::Linux, "nft");
}

#[test]
#[ignore = "needs root and the namespace tools (ip, iptables, ipset, nft, nc): `make test` runs it"]
fn flow_records_nftables_driver() {
    flow_records(Driver::Nftables, "auto");
}
