//! Containers for the tests: the Docker engine, the project's images, throwaway networks and
//! containers that are removed when the test ends (whatever its outcome).
//!
//! A test that needs the engine calls [`require_engine`]: without one it fails when `CI` is set,
//! as every other prerequisite of `make test` does; when `CI` is unset it returns `None` and the
//! test returns at once, having run nothing. The harness can only report such a test as
//! passed, so [`require_engine`] records it as not run (see [`not_run`]): `scripts/test.sh`
//! counts it under "not run" and names it, never under "passed".
//! [`Docker::ensure_images`] builds the images with `scripts/images.sh` once per test process,
//! and only those missing.

use std::process::{Command, Output};
use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::workspace_root;

/// The images `make images` builds.
pub const IMAGES: [&str; 4] = [
    "split-felix/calc-server:dev",
    "split-felix/dataplane-agent:dev",
    "split-felix/etcd:bookworm",
    "split-felix/workload:bookworm",
];

/// The Docker CLI, talking to a running engine.
#[derive(Clone, Copy, Debug)]
pub struct Docker;

/// The variable naming the file a test that did not run is recorded in (`scripts/test.sh`
/// sets it).
pub const NOT_RUN_FILE_ENV: &str = "SPLIT_FELIX_NOT_RUN_FILE";

/// Records that the calling test did not run, and why: one line `<test binary>::<test>:
/// <reason>` appended to the file [`NOT_RUN_FILE_ENV`] names (if set), and the same line on
/// the process's stderr, past the harness's output capture, so a plain `cargo test` shows it
/// too. The test then returns without asserting anything.
pub fn not_run(reason: &str) {
    use std::io::Write;
    let binary = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .map(|s| match s.rsplit_once('-') {
            Some((name, hash)) if hash.bytes().all(|b| b.is_ascii_hexdigit()) => name.to_owned(),
            _ => s,
        })
        .unwrap_or_default();
    // The harness runs each test on a thread named after it.
    let test = std::thread::current()
        .name()
        .unwrap_or("an unnamed test")
        .to_owned();
    let line = format!("{binary}::{test}: {reason}\n");
    if let Some(path) = std::env::var_os(NOT_RUN_FILE_ENV) {
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = written {
            panic!(
                "cannot record a test that did not run in {}: {e}",
                std::path::Path::new(&path).display()
            );
        }
    }
    let _ = std::io::stderr().write_all(format!("not run: {line}").as_bytes());
}

/// The engine, or `None` when there is none and `CI` is unset: the test was recorded as not
/// run ([`not_run`]) and must return at once.
pub fn require_engine() -> Option<Docker> {
    let ok = Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(Docker);
    }
    if std::env::var_os("CI").is_some() {
        panic!(
            "CI is set and no Docker engine answers `docker info`: the container tests cannot run"
        );
    }
    not_run("no Docker engine (`docker info` failed) and CI is unset");
    None
}

impl Docker {
    /// Runs `docker ARGS`, returning its output whatever the exit status.
    pub fn output(&self, args: &[&str]) -> Output {
        Command::new("docker")
            .args(args)
            .output()
            .expect("run the docker CLI")
    }

    /// Runs `docker ARGS`, panicking with its output unless it succeeds; its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.output(args);
        assert!(
            o.status.success(),
            "docker {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    /// Builds the missing images with `scripts/images.sh`, once per test process.
    pub fn ensure_images(&self) {
        static BUILT: OnceLock<Mutex<bool>> = OnceLock::new();
        let mut done = BUILT.get_or_init(|| Mutex::new(false)).lock();
        if *done {
            return;
        }
        let missing: Vec<&str> = IMAGES
            .into_iter()
            .filter(|i| !self.output(&["image", "inspect", i]).status.success())
            .collect();
        if !missing.is_empty() {
            eprintln!("building the images (missing: {})", missing.join(", "));
            let o = Command::new(workspace_root().join("scripts/images.sh"))
                .current_dir(workspace_root())
                .output()
                .expect("run scripts/images.sh");
            assert!(
                o.status.success(),
                "scripts/images.sh failed:\n{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        *done = true;
    }

    /// `docker run -d ARGS`: the new container's id.
    pub fn run_detached(&self, args: &[&str]) -> String {
        let mut all = vec!["run", "-d"];
        all.extend_from_slice(args);
        self.ok(&all)
    }

    /// `docker exec C ARGS`, panicking unless it succeeds; its stdout.
    pub fn exec_ok(&self, container: &str, args: &[&str]) -> String {
        let mut all = vec!["exec", container];
        all.extend_from_slice(args);
        self.ok(&all)
    }

    /// Whether a TCP connection from `container` to `ip:port` is accepted within a second.
    pub fn connects(&self, container: &str, ip: &str, port: u16) -> bool {
        self.output(&[
            "exec",
            container,
            "nc",
            "-z",
            "-w",
            "1",
            ip,
            &port.to_string(),
        ])
        .status
        .success()
    }

    pub fn logs(&self, container: &str) -> String {
        let o = self.output(&["logs", "--tail", "80", container]);
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    }

    /// SIGKILL: no chance to clean up, as in a crash.
    pub fn kill(&self, container: &str) {
        self.ok(&["kill", container]);
    }
}

/// A bridge network of its own (a /24 from 172.28–31.x) and the containers started on it; all
/// are removed on drop.
pub struct Network {
    pub name: String,
    prefix: String,
    containers: Mutex<Vec<String>>,
}

impl Network {
    /// A network named after the test and the process, on a free /24.
    pub fn create(d: &Docker, what: &str) -> Network {
        let name = format!("sf-{what}-{}", std::process::id());
        for third in 0..64u32 {
            let prefix = format!(
                "172.{}.{}",
                28 + third / 16,
                100 + (std::process::id() + third) % 150
            );
            let o = d.output(&[
                "network",
                "create",
                "--subnet",
                &format!("{prefix}.0/24"),
                &name,
            ]);
            if o.status.success() {
                return Network {
                    name,
                    prefix,
                    containers: Mutex::new(Vec::new()),
                };
            }
        }
        panic!("no free /24 for a Docker network");
    }

    /// The address `.n` of the network.
    pub fn ip(&self, n: u8) -> String {
        format!("{}.{n}", self.prefix)
    }

    /// `docker run -d` on this network at `ip`, named `<network>-<role>`: the name.
    pub fn run(&self, role: &str, ip: &str, extra: &[&str], image: &str, cmd: &[&str]) -> String {
        self.container("run", role, ip, extra, image, cmd)
    }

    /// `docker create` (not started), as [`Network::run`]: to `docker cp` files in first.
    pub fn create_container(
        &self,
        role: &str,
        ip: &str,
        extra: &[&str],
        image: &str,
        cmd: &[&str],
    ) -> String {
        self.container("create", role, ip, extra, image, cmd)
    }

    fn container(
        &self,
        verb: &str,
        role: &str,
        ip: &str,
        extra: &[&str],
        image: &str,
        cmd: &[&str],
    ) -> String {
        let name = format!("{}-{role}", self.name);
        let mut args = vec![verb];
        if verb == "run" {
            args.push("-d");
        }
        args.extend_from_slice(&["--name", &name, "--network", &self.name, "--ip", ip]);
        args.extend_from_slice(extra);
        args.push(image);
        args.extend_from_slice(cmd);
        Docker.ok(&args);
        self.adopt(&name);
        name
    }

    /// Removes `container` with the network.
    pub fn adopt(&self, container: &str) {
        self.containers.lock().push(container.to_string());
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        let containers = std::mem::take(&mut *self.containers.lock());
        for c in containers.iter().rev() {
            let _ = Docker.output(&["rm", "-f", "-v", c]);
        }
        let _ = Docker.output(&["network", "rm", &self.name]);
    }
}
