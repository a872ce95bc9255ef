//! Every command the README and docs/ show, run as a reader would run it: from a directory
//! outside the repository (the example cluster's paths made absolute), against the example
//! cluster. Offline commands run as written; `status` and `explain --server` run against a
//! server serving the example cluster with one agent; `serve` and the dry-run agent start and
//! become ready. Where the text shows the output after `$ command`, its first line must be
//! what the command prints first. A command that cannot run here (another datastore,
//! credentials the text makes, a real node) is listed with the reason; nothing else is
//! skipped, and the run fails if fewer commands ran than the docs hold runnable ones.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use integration::{Agent, Server, binary, example_datastore, free_port, http_get, workspace_root};

/// One command from a document, with the first line of the output the text shows for it.
#[derive(Debug)]
struct DocCommand {
    file: String,
    line: usize,
    text: String,
    shown_output: Option<String>,
}

fn documents() -> Vec<PathBuf> {
    let root = workspace_root();
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// Whether a line in a code block is a command of ours (not a diagram or a log line).
fn is_command(line: &str) -> bool {
    let mut words = line.split_whitespace();
    match (words.next(), words.next()) {
        (Some("calc-server"), Some(sub)) => [
            "serve",
            "status",
            "policies",
            "compute",
            "explain",
            "validate",
            "selector",
            "gen-cluster",
            "bench",
            "bench-sync",
        ]
        .contains(&sub),
        (Some("dataplane-agent"), Some(next)) => next.starts_with("--") || next == "...",
        _ => false,
    }
}

fn commands() -> Vec<DocCommand> {
    let root = workspace_root();
    let mut out = Vec::new();
    for path in documents() {
        let text = std::fs::read_to_string(&path).unwrap();
        let file = path.strip_prefix(&root).unwrap().display().to_string();
        let lines: Vec<&str> = text.lines().collect();
        let mut in_block = false;
        let mut i = 0;
        while i < lines.len() {
            let l = lines[i];
            if l.trim_start().starts_with("```") {
                in_block = !in_block;
                i += 1;
                continue;
            }
            let trimmed = l.trim_start();
            let (prompt, body) = match trimmed.strip_prefix("$ ") {
                Some(b) => (true, b),
                None => (false, trimmed),
            };
            if !in_block || !is_command(body) {
                i += 1;
                continue;
            }
            let start = i + 1;
            let mut full = body.to_string();
            while full.ends_with('\\') && i + 1 < lines.len() {
                i += 1;
                full.pop();
                full.push(' ');
                full.push_str(lines[i].trim());
            }
            // The output the text shows: the next line, when the command had a prompt.
            let shown_output = lines
                .get(i + 1)
                .filter(|next| prompt && !next.starts_with("```") && !next.starts_with("$ "))
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty() && s != "…" && s != "...");
            out.push(DocCommand {
                file: file.clone(),
                line: start,
                text: full,
                shown_output,
            });
            i += 1;
        }
    }
    out
}

/// The words of a command line as a POSIX shell splits them (quotes, a trailing comment and a
/// trailing `&` removed); `None` for what needs a real shell (substitutions, elisions).
fn words(line: &str) -> Option<Vec<String>> {
    if line.contains("$(") || line.contains("...") || line.contains('`') {
        return None;
    }
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                for c in chars.by_ref() {
                    if c == '\'' {
                        break;
                    }
                    cur.push(c);
                }
            }
            '"' => {
                in_word = true;
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => cur.extend(chars.next()),
                        c => cur.push(c),
                    }
                }
            }
            '#' if !in_word => break,
            c if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        out.push(cur);
    }
    if out.last().is_some_and(|w| w == "&") {
        out.pop();
    }
    Some(out)
}

/// Why a command cannot run here; `None` when it runs.
fn not_runnable(w: &[String]) -> Option<&'static str> {
    let has = |flag: &str| {
        w.iter()
            .any(|x| x == flag || x.starts_with(&format!("{flag}=")))
    };
    let value = |flag: &str| {
        w.iter()
            .position(|x| x == flag)
            .and_then(|i| w.get(i + 1))
            .map(String::as_str)
    };
    if value("--datastore-type").is_some_and(|t| t != "file") {
        return Some("another datastore (etcd.rs and kubernetes.rs run those)");
    }
    if has("--tls-ca-file") || has("--token-file") {
        return Some("credentials the text makes by hand (admin_auth.rs and tls.rs run them)");
    }
    if ["gen-cluster", "bench", "bench-sync"].contains(&w[1].as_str()) {
        return Some("a benchmark (make bench runs it)");
    }
    if value("--file-dir").is_some_and(|d| !d.starts_with("examples/")) {
        return Some("a directory of the reader's, not the example cluster");
    }
    if w[0] == "dataplane-agent" && value("--driver") != Some("dry-run") {
        return Some("programs a real node (the linux_* namespace tests run the drivers)");
    }
    if value("--server").is_some_and(|s| s.starts_with("calc-server:")) {
        return Some("names a cluster's Service");
    }
    None
}

/// The example cluster's paths made absolute; `/tmp/…` outputs moved into `scratch`.
fn rewrite(w: &[String], scratch: &Path) -> Vec<String> {
    let root = workspace_root();
    w.iter()
        .map(|x| {
            if let Some(rest) = x.strip_prefix("examples/") {
                root.join("examples").join(rest).display().to_string()
            } else if let Some(rest) = x.strip_prefix("/tmp/") {
                scratch.join(rest).display().to_string()
            } else {
                x.clone()
            }
        })
        .collect()
}

/// A server on the example cluster with node-1's agent in sync: what `status` and `explain
/// --server` in the docs talk to.
struct Live {
    _ds: tempfile::TempDir,
    _agent_dir: tempfile::TempDir,
    server: Server,
    _agent: Agent,
}

fn live() -> Live {
    let ds = example_datastore();
    let server = Server::start(ds.path(), &[]);
    let agent_dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(agent_dir.path(), &server.grpc, "node-1");
    agent.wait_for("in sync", |s| s["in_sync"] == true);
    Live {
        _ds: ds,
        _agent_dir: agent_dir,
        server,
        _agent: agent,
    }
}

fn run(cwd: &Path, w: &[String]) -> Output {
    Command::new(binary(&w[0]))
        .args(&w[1..])
        .current_dir(cwd)
        .output()
        .unwrap_or_else(|e| panic!("running {w:?}: {e}"))
}

/// Starts a long-running command (serve, the agent) and checks it gets going, then stops it.
fn start_and_stop(
    cwd: &Path,
    w: &[String],
    ready: impl Fn(&[String]) -> bool,
) -> Result<(), String> {
    let log = cwd.join(format!("{}.log", w[0]));
    let out = std::fs::File::create(&log).unwrap();
    let mut child = Command::new(binary(&w[0]))
        .args(&w[1..])
        .current_dir(cwd)
        .stdout(Stdio::from(out.try_clone().unwrap()))
        .stderr(Stdio::from(out))
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let result = loop {
        if ready(w) {
            break Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            break Err(format!("exited {status}"));
        }
        if Instant::now() > deadline {
            break Err("not ready in 20 s".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = child.kill();
    let _ = child.wait();
    result.map_err(|e| {
        format!(
            "{e}; log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        )
    })
}

/// Whether a printed line holds the shown words (tables are as wide as their widest cell, so
/// the spacing of an example differs).
fn same_words(printed: Option<&str>, shown: &str) -> bool {
    printed.is_some_and(|p| p.split_whitespace().eq(shown.split_whitespace()))
}

/// Replaces every `old` word (an address, alone or inside a URL) with `new`.
fn swap(w: &mut [String], old: &str, new: &str) {
    for x in w.iter_mut() {
        if x.contains(old) {
            *x = x.replace(old, new);
        }
    }
}

#[test]
fn every_command_in_the_docs_runs_from_outside_the_repository() {
    let cwd = tempfile::tempdir().unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let live = live();
    let mut ran = 0;
    let mut skipped = Vec::new();
    let mut failures = Vec::new();
    let all = commands();
    assert!(
        all.len() >= 30,
        "found only {} commands: {all:#?}",
        all.len()
    );
    for c in &all {
        let place = format!("{}:{}: {}", c.file, c.line, c.text);
        let Some(w) = words(&c.text) else {
            skipped.push(format!("{place} (needs a shell)"));
            continue;
        };
        if let Some(why) = not_runnable(&w) {
            skipped.push(format!("{place} ({why})"));
            continue;
        }
        let mut w = rewrite(&w, scratch.path());
        let result = match (w[0].as_str(), w[1].as_str()) {
            ("calc-server", "serve") => {
                // The documented ports may be taken on a test machine: two free ones instead.
                let (grpc, admin) = (free_port(), free_port());
                swap(&mut w, "127.0.0.1:50051", &format!("127.0.0.1:{grpc}"));
                swap(&mut w, "0.0.0.0:50051", &format!("127.0.0.1:{grpc}"));
                swap(&mut w, "127.0.0.1:9096", &format!("127.0.0.1:{admin}"));
                if !w.iter().any(|x| x == "--admin-listen") {
                    w.extend(["--admin-listen".into(), format!("127.0.0.1:{admin}")]);
                }
                let admin = format!("127.0.0.1:{admin}");
                start_and_stop(cwd.path(), &w, |_| {
                    http_get(&admin, "/readiness").is_some_and(|(c, _)| c == 200)
                })
            }
            ("dataplane-agent", _) => {
                let grpc = live.server.grpc.trim_start_matches("http://").to_string();
                swap(&mut w, "127.0.0.1:50051", &grpc);
                let state = w
                    .iter()
                    .position(|x| x == "--state-file")
                    .and_then(|i| w.get(i + 1))
                    .cloned();
                start_and_stop(cwd.path(), &w, |_| {
                    state.as_ref().is_some_and(|s| {
                        std::fs::read_to_string(s).is_ok_and(|t| t.contains("\"in_sync\": true"))
                    })
                })
            }
            _ => {
                swap(&mut w, "127.0.0.1:9096", &live.server.admin);
                let out = run(cwd.path(), &w);
                let stdout = String::from_utf8_lossy(&out.stdout);
                match (&c.shown_output, out.status.success()) {
                    (_, false) => Err(format!(
                        "exit {}: {}",
                        out.status,
                        String::from_utf8_lossy(&out.stderr)
                    )),
                    (Some(shown), true) if !same_words(stdout.lines().next(), shown) => {
                        Err(format!(
                            "the text shows {shown:?} first; the command printed {:?}",
                            stdout.lines().next()
                        ))
                    }
                    _ => Ok(()),
                }
            }
        };
        match result {
            Ok(()) => ran += 1,
            Err(e) => failures.push(format!("{place}\n    {e}")),
        }
    }
    eprintln!(
        "ran {ran} documented commands; not run here:\n  {}",
        skipped.join("\n  ")
    );
    assert!(
        failures.is_empty(),
        "documented commands that fail:\n{}",
        failures.join("\n")
    );
    assert!(
        ran >= 20,
        "only {ran} commands ran; skipped:\n{}",
        skipped.join("\n")
    );
}

#[test]
fn the_command_splitter_reads_quotes_comments_and_continuations() {
    assert_eq!(
        words(r#"calc-server selector eval --labels '{"app":"web"}' "app == 'web'"   # prints"#),
        Some(vec![
            "calc-server".to_string(),
            "selector".into(),
            "eval".into(),
            "--labels".into(),
            r#"{"app":"web"}"#.into(),
            "app == 'web'".into(),
        ])
    );
    assert_eq!(words("dataplane-agent --node \"$(hostname)\""), None);
    assert!(is_command("calc-server status --server 127.0.0.1:9096"));
    assert!(!is_command(
        "calc-server      calc-ingest, calc-graph, felix-proto[grpc,json],"
    ));
}
