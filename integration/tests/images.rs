//! `make images` from a clean state: the product images are removed, `scripts/images.sh`
//! builds them again (from the host's release build and the locally made bases; nothing is
//! pulled), and each runs its `--help`, as the user the manifests say, without build tools.
//!
//! Needs root and a Docker engine: `#[ignore]`d with that reason and run by `make test`.
//! Without an engine the test fails when CI is set; when it is unset it runs nothing and is
//! counted as not run (`integration::docker::not_run`). The debootstrap tarball under /var/tmp
//! is a download cache, like cargo's registry: kept.

use integration::docker::{IMAGES, require_engine};

/// Sizes the images must stay under (the agent's base is a trimmed Debian minbase).
const MAX_SERVER_MB: f64 = 60.0;
const MAX_AGENT_MB: f64 = 160.0;

#[test]
#[ignore = "needs root and a Docker engine: `make test` runs it"]
fn images_build_from_a_clean_state_and_run() {
    let Some(d) = require_engine() else {
        return;
    };
    for image in IMAGES {
        let _ = d.output(&["rmi", "-f", image]);
    }
    for base in [
        "split-felix/runtime-base:bookworm",
        "split-felix/static-base:bookworm",
    ] {
        let _ = d.output(&["rmi", "-f", base]);
    }
    d.ensure_images();
    for image in IMAGES {
        assert!(
            d.output(&["image", "inspect", image]).status.success(),
            "{image} was not built"
        );
    }

    for (image, first_line) in [
        (
            "split-felix/calc-server:dev",
            "Calico policy calculation server",
        ),
        (
            "split-felix/dataplane-agent:dev",
            "Follows a calc-server's Sync stream",
        ),
    ] {
        let help = d.ok(&["run", "--rm", image, "--help"]);
        assert!(help.starts_with(first_line), "{image} --help:\n{help}");
    }

    // calc-server: the manifests' non-root user (numeric, so runAsNonRoot can check it), and
    // nothing but the binary and its libraries: no shell.
    let user = d.ok(&[
        "image",
        "inspect",
        "-f",
        "{{.Config.User}}",
        "split-felix/calc-server:dev",
    ]);
    assert_eq!(user, "65532:65532");
    let shell = d.output(&[
        "run",
        "--rm",
        "--entrypoint",
        "/bin/sh",
        "split-felix/calc-server:dev",
        "-c",
        "true",
    ]);
    assert!(!shell.status.success(), "calc-server's image has a shell");

    // The agent: root, the tools its Linux driver runs, no compiler.
    let tools = d.ok(&[
        "run",
        "--rm",
        "--entrypoint",
        "sh",
        "split-felix/dataplane-agent:dev",
        "-c",
        "id -u; for t in iptables-nft-restore iptables-legacy-restore ip6tables-nft-restore ipset ip nft; do command -v $t >/dev/null || echo missing $t; done; for t in cc gcc cargo rustc make; do command -v $t >/dev/null && echo build tool $t; done; true",
    ]);
    assert_eq!(tools, "0", "agent image: {tools}");

    let size_mb = |image: &str| -> f64 {
        d.ok(&["image", "inspect", "-f", "{{.Size}}", image])
            .parse::<f64>()
            .expect("a size")
            / 1e6
    };
    let (server, agent) = (
        size_mb("split-felix/calc-server:dev"),
        size_mb("split-felix/dataplane-agent:dev"),
    );
    eprintln!("image sizes: calc-server {server:.1} MB, dataplane-agent {agent:.1} MB");
    assert!(
        server < MAX_SERVER_MB,
        "calc-server image is {server:.1} MB"
    );
    assert!(
        agent < MAX_AGENT_MB,
        "dataplane-agent image is {agent:.1} MB"
    );
}
