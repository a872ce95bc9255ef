//! The packaging in `docker/`, checked without a cluster or a Docker engine (neither exists on
//! the build machine): every Kubernetes YAML document parses and has the fields its kind needs
//! (the DaemonSet is host-network, privileged, mounts `/run/xtables.lock` and tolerates every
//! taint; the Deployment has replicas, probes and ports; the Service and PodDisruptionBudget
//! select the Deployment's pods; RBAC only reads), every flag and environment variable the
//! manifests pass exists in the binaries' `--help`, and the Dockerfiles build the right crates
//! and install the agent's tools.

use std::path::{Path, PathBuf};

use integration::{binary, workspace_root};
use serde_json::Value;

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            yaml_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            out.push(p);
        }
    }
}

fn documents() -> Vec<(String, Value)> {
    let mut files = Vec::new();
    yaml_files(&workspace_root().join("docker/k8s"), &mut files);
    files.sort();
    assert!(!files.is_empty());
    let mut docs = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let parsed: Vec<Value> =
            serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        for d in parsed.into_iter().filter(|d| !d.is_null()) {
            docs.push((f.display().to_string(), d));
        }
    }
    docs
}

fn s<'a>(v: &'a Value, path: &str) -> &'a str {
    let mut cur = v;
    for k in path.split('.') {
        cur = &cur[k];
    }
    cur.as_str()
        .unwrap_or_else(|| panic!("{path} missing or not a string in {v}"))
}

fn arr<'a>(v: &'a Value, what: &str) -> &'a Vec<Value> {
    v.as_array()
        .unwrap_or_else(|| panic!("{what}: expected a list, got {v}"))
}

fn labels_match(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .is_some_and(|m| !m.is_empty() && m.iter().all(|(k, v)| &labels[k] == v))
}

/// Checks a pod spec: containers with images, mounts of declared volumes, probes on declared
/// ports (or explicit numbers).
fn check_pod(where_: &str, spec: &Value, need_probes: bool) {
    let volumes: Vec<&str> = spec["volumes"]
        .as_array()
        .map(|v| v.iter().map(|v| s(v, "name")).collect())
        .unwrap_or_default();
    for c in arr(&spec["containers"], "containers") {
        let name = s(c, "name");
        assert!(!s(c, "image").is_empty(), "{where_}/{name}: image");
        for m in c["volumeMounts"].as_array().into_iter().flatten() {
            assert!(
                volumes.contains(&s(m, "name")),
                "{where_}/{name}: mount of undeclared volume {m}"
            );
        }
        let ports: Vec<&str> = c["ports"]
            .as_array()
            .map(|p| p.iter().filter_map(|p| p["name"].as_str()).collect())
            .unwrap_or_default();
        if need_probes {
            for probe in ["livenessProbe", "readinessProbe"] {
                let get = &c[probe]["httpGet"];
                assert!(get.is_object(), "{where_}/{name}: {probe}.httpGet");
                assert!(s(get, "path").starts_with('/'));
                match &get["port"] {
                    Value::Number(_) => {}
                    Value::String(p) => assert!(ports.contains(&p.as_str()), "{where_}: {p}"),
                    other => panic!("{where_}/{name}: {probe} port {other}"),
                }
            }
        }
    }
}

fn host_path_volume<'a>(spec: &'a Value, path: &str) -> Option<&'a Value> {
    spec["volumes"]
        .as_array()?
        .iter()
        .find(|v| v["hostPath"]["path"] == path)
}

fn check_privileged_agent(where_: &str, spec: &Value) {
    assert_eq!(spec["hostNetwork"], true, "{where_}: hostNetwork");
    assert!(
        !arr(&spec["tolerations"], "tolerations").is_empty(),
        "{where_}: tolerations"
    );
    let lock = host_path_volume(spec, "/run/xtables.lock")
        .unwrap_or_else(|| panic!("{where_}: hostPath /run/xtables.lock"));
    let agent = arr(&spec["containers"], "containers")
        .iter()
        .find(|c| s(c, "image").contains("dataplane-agent"))
        .unwrap_or_else(|| panic!("{where_}: a dataplane-agent container"));
    assert_eq!(agent["securityContext"]["privileged"], true, "{where_}");
    assert!(
        arr(&agent["volumeMounts"], "volumeMounts")
            .iter()
            .any(|m| m["mountPath"] == "/run/xtables.lock" && m["name"] == lock["name"]),
        "{where_}: /run/xtables.lock mounted"
    );
}

#[test]
fn kubernetes_manifests_have_what_each_kind_needs() {
    let docs = documents();
    let mut kinds = std::collections::BTreeMap::<String, usize>::new();
    let deployments: Vec<&Value> = docs
        .iter()
        .filter(|(_, d)| d["kind"] == "Deployment")
        .map(|(_, d)| d)
        .collect();
    let deployment_selects = |sel: &Value| {
        deployments
            .iter()
            .any(|d| labels_match(sel, &d["spec"]["template"]["metadata"]["labels"]))
    };
    for (file, d) in &docs {
        let kind = s(d, "kind");
        let name = s(d, "metadata.name");
        assert!(!s(d, "apiVersion").is_empty());
        let where_ = format!("{file}: {kind}/{name}");
        *kinds.entry(kind.to_string()).or_default() += 1;
        match kind {
            "Deployment" => {
                let spec = &d["spec"];
                assert!(spec["replicas"].as_u64().unwrap_or(0) >= 2, "{where_}");
                assert!(labels_match(
                    &spec["selector"]["matchLabels"],
                    &spec["template"]["metadata"]["labels"]
                ));
                check_pod(&where_, &spec["template"]["spec"], true);
            }
            "DaemonSet" => {
                let spec = &d["spec"];
                assert!(labels_match(
                    &spec["selector"]["matchLabels"],
                    &spec["template"]["metadata"]["labels"]
                ));
                check_pod(&where_, &spec["template"]["spec"], true);
                check_privileged_agent(&where_, &spec["template"]["spec"]);
            }
            "Pod" => {
                check_pod(&where_, &d["spec"], false);
                check_privileged_agent(&where_, &d["spec"]);
            }
            "Service" => {
                for p in arr(&d["spec"]["ports"], "ports") {
                    assert!(p["port"].as_u64().is_some(), "{where_}: port");
                }
                assert!(deployment_selects(&d["spec"]["selector"]), "{where_}");
            }
            "PodDisruptionBudget" => {
                assert!(
                    d["spec"]["minAvailable"].is_number()
                        || d["spec"]["maxUnavailable"].is_number(),
                    "{where_}"
                );
                assert!(
                    deployment_selects(&d["spec"]["selector"]["matchLabels"]),
                    "{where_}"
                );
            }
            "ClusterRole" | "Role" => {
                // Cluster-wide calc-server only reads. It writes only ConfigMaps (its policy hit
                // counters), and only in its own namespace: a Role, never a ClusterRole.
                for rule in arr(&d["rules"], "rules") {
                    let config_maps = arr(&rule["resources"], "resources")
                        .iter()
                        .all(|r| r.as_str() == Some("configmaps"));
                    for verb in arr(&rule["verbs"], "verbs") {
                        let verb = verb.as_str().unwrap();
                        let writes_hits = kind == "Role"
                            && config_maps
                            && ["create", "patch", "delete"].contains(&verb);
                        assert!(
                            ["get", "list", "watch"].contains(&verb) || writes_hits,
                            "{where_}: verb {verb} (calc-server only reads, and writes only \
                             ConfigMaps in its own namespace)"
                        );
                    }
                }
            }
            "ClusterRoleBinding" | "RoleBinding" => {
                s(d, "roleRef.name");
                assert!(!arr(&d["subjects"], "subjects").is_empty());
            }
            "ServiceAccount" | "Namespace" | "Secret" | "ConfigMap" => {}
            other => panic!("{where_}: no check for kind {other}"),
        }
    }
    for k in [
        "Deployment",
        "DaemonSet",
        "Service",
        "PodDisruptionBudget",
        "Pod",
    ] {
        assert!(kinds.contains_key(k), "no {k} in docker/k8s: {kinds:?}");
    }
}

fn help(bin: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(binary(bin))
        .args(args)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

/// A container's value for a flag, from `--flag=value` / `--flag value` in its args or the
/// flag's environment variable.
fn setting(c: &Value, flag: &str, env: &str) -> Option<String> {
    let args: Vec<&str> = c["args"]
        .as_array()
        .into_iter()
        .chain(c["command"].as_array())
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    for (i, a) in args.iter().enumerate() {
        if let Some(v) = a.strip_prefix(&format!("{flag}=")) {
            return Some(v.to_string());
        }
        if *a == flag {
            return args.get(i + 1).map(|v| v.to_string());
        }
    }
    c["env"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["name"] == env)
        .and_then(|e| e["value"].as_str().map(str::to_string))
}

/// The admin endpoint shows the whole cluster's policy: a calc-server container that listens
/// for it beyond loopback must authenticate admins, its probes must speak its scheme, and no
/// Service may expose the admin port.
#[test]
fn the_admin_endpoint_is_not_exposed_unauthenticated() {
    let docs = documents();
    let mut admin_ports = Vec::new();
    let mut checked = 0;
    for (file, d) in &docs {
        let spec = match s(d, "kind") {
            "Deployment" | "DaemonSet" => &d["spec"]["template"]["spec"],
            "Pod" => &d["spec"],
            _ => continue,
        };
        for c in arr(&spec["containers"], "containers") {
            if !s(c, "image").contains("calc-server") {
                continue;
            }
            checked += 1;
            let listen = setting(c, "--admin-listen", "CALC_SERVER_ADMIN_LISTEN")
                .unwrap_or_else(|| "127.0.0.1:9096".into());
            let ip: std::net::IpAddr = listen
                .rsplit_once(':')
                .map(|(h, _)| h.trim_matches(['[', ']']))
                .unwrap_or_default()
                .parse()
                .unwrap_or_else(|e| panic!("{file}: --admin-listen {listen}: {e}"));
            if ip.is_loopback() {
                continue;
            }
            let auth = [
                ("--admin-allowed-cn", "CALC_SERVER_ADMIN_ALLOWED_CN"),
                (
                    "--admin-allowed-uri-san",
                    "CALC_SERVER_ADMIN_ALLOWED_URI_SAN",
                ),
                ("--admin-ca-file", "CALC_SERVER_ADMIN_CA_FILE"),
                ("--admin-token-file", "CALC_SERVER_ADMIN_TOKEN_FILE"),
            ];
            assert!(
                auth.iter().any(|(f, e)| setting(c, f, e).is_some()),
                "{file}: the admin endpoint listens on {listen} without authentication"
            );
            let tls = setting(c, "--tls-cert-file", "CALC_SERVER_TLS_CERT_FILE").is_some();
            for probe in ["livenessProbe", "readinessProbe"] {
                let scheme = c[probe]["httpGet"]["scheme"].as_str().unwrap_or("HTTP");
                assert_eq!(
                    scheme,
                    if tls { "HTTPS" } else { "HTTP" },
                    "{file}: {probe} speaks the admin endpoint's scheme"
                );
            }
            let port = listen.rsplit_once(':').map(|(_, p)| p.to_string()).unwrap();
            admin_ports.push(port.clone());
            for p in c["ports"].as_array().into_iter().flatten() {
                if p["containerPort"].as_u64().map(|n| n.to_string()) == Some(port.clone()) {
                    admin_ports.extend(p["name"].as_str().map(str::to_string));
                }
            }
        }
    }
    assert!(checked > 0, "no calc-server container found");
    for (file, d) in docs.iter().filter(|(_, d)| d["kind"] == "Service") {
        for p in arr(&d["spec"]["ports"], "ports") {
            let target = match &p["targetPort"] {
                Value::String(t) => t.clone(),
                Value::Number(n) => n.to_string(),
                _ => p["port"].to_string(),
            };
            assert!(
                !admin_ports.contains(&target),
                "{file}: Service {} exposes the admin port {target}",
                s(d, "metadata.name")
            );
        }
    }
}

#[test]
fn manifest_flags_and_env_exist_in_the_binaries() {
    let server = help("calc-server", &["serve"]);
    let agent = help("dataplane-agent", &[]);
    for (file, d) in documents() {
        let spec = match s(&d, "kind") {
            "Deployment" | "DaemonSet" => &d["spec"]["template"]["spec"],
            "Pod" => &d["spec"],
            _ => continue,
        };
        for c in arr(&spec["containers"], "containers") {
            let image = s(c, "image");
            let help = if image.contains("calc-server") {
                &server
            } else if image.contains("dataplane-agent") {
                &agent
            } else {
                continue;
            };
            for a in c["args"].as_array().into_iter().flatten() {
                let a = a.as_str().unwrap();
                if let Some(flag) = a.strip_prefix("--") {
                    let flag = flag.split('=').next().unwrap();
                    assert!(
                        help.contains(&format!("--{flag}")),
                        "{file}: {image}: --{flag}"
                    );
                }
            }
            for e in c["env"].as_array().into_iter().flatten() {
                let name = s(e, "name");
                assert!(
                    help.contains(&format!("env: {name}")),
                    "{file}: {image}: env {name}"
                );
            }
        }
    }
}

#[test]
fn dockerfiles_build_the_binaries_and_ship_the_agents_tools() {
    let root = workspace_root();
    for (file, krate, tools) in [
        ("docker/calc-server.Dockerfile", "calc-server", &[][..]),
        (
            "docker/dataplane-agent.Dockerfile",
            "dataplane-agent",
            &["iptables", "ipset", "iproute2"][..],
        ),
    ] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let froms: Vec<&str> = text.lines().filter(|l| l.starts_with("FROM ")).collect();
        assert!(
            froms.len() >= 2 && froms[0].ends_with(" AS build"),
            "{file}: multi-stage"
        );
        assert!(
            text.contains(&format!("-p {krate} --bin {krate}")),
            "{file}"
        );
        assert!(
            text.contains(&format!("COPY --from=build /{krate} ")),
            "{file}"
        );
        let runtime = &text[text.rfind("\nFROM ").unwrap()..];
        for t in tools {
            assert!(runtime.contains(t), "{file}: runtime stage installs {t}");
        }
    }
}
