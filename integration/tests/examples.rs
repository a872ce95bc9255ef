//! The shipped example cluster, through the real binary: it must stay valid (the demo and later
//! tests depend on it), and the file of common mistakes must keep producing its diagnostics.

use std::process::Command;

use integration::{binary, workspace_root};

#[test]
fn example_cluster_is_valid() {
    let root = workspace_root();
    let o = Command::new(binary("calc-server"))
        .arg("validate")
        .arg(root.join("examples/cluster"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}{err}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(o.stdout.is_empty());
    assert!(
        err.contains("0 problem(s)") && err.contains("1 ignored"),
        "{err}"
    );
}

#[test]
fn example_mistakes_are_each_reported() {
    let root = workspace_root();
    let o = Command::new(binary("calc-server"))
        .arg("validate")
        .arg(root.join("examples/broken"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let out = String::from_utf8_lossy(&o.stdout);
    for want in [
        "NetworkPolicy shop/typo-in-selector: spec.selector: invalid selector:",
        "NetworkPolicy shop/typo-in-selector: spec.ingress[0].action:",
        "NetworkPolicy shop/typo-in-selector: spec.ingress[0].destination.ports:",
        "NetworkPolicy shop/typo-in-selector: spec.ingress[0].source.nets[0]:",
        "GlobalNetworkPolicy prednat-without-forward: spec.applyOnForward:",
        "GlobalNetworkPolicy prednat-without-forward: spec.ingress[0].icmp.code:",
        "Tier Security: metadata.name:",
        "Tier Security: spec.defaultAction:",
        "GlobalNetworkPolicy misspelt-fields: spec.selectr: unknown field (did you mean \"selector\"?)",
        "GlobalNetworkPolicy misspelt-fields: spec.ingres: unknown field (did you mean \"ingress\"?)",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
    assert_eq!(out.lines().count(), 10, "{out}");
}

/// A mistyped `--file-dir` is an error naming the path, not an empty cluster (no policy at all).
#[test]
fn compute_refuses_a_file_dir_that_does_not_exist() {
    let o = Command::new(binary("calc-server"))
        .args([
            "compute",
            "--file-dir",
            "/no/such/manifests",
            "--node",
            "n1",
        ])
        .output()
        .unwrap();
    assert_ne!(o.status.code(), Some(0));
    assert!(o.stdout.is_empty(), "no stream is printed");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--file-dir /no/such/manifests is not a directory"),
        "{err}"
    );
}
