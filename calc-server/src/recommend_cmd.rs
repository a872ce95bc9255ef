//! `calc-server recommend --server ADMIN --namespace NS [--since DURATION] [--output yaml|json]
//! [--tier T] [--include-denied] [--min-samples N]`: asks a running server (`/recommend`) for
//! least-privilege staged policies made from the namespace's flows and prints them as YAML
//! documents (what was left out, and why, as comments above them) or the whole answer as JSON.
//! `--check` asks `/recommend/check` and prints, per staged policy of the namespace, the flows
//! it would deny that the enforced policies allow (exit 1 when there is one); `--promote`
//! prints the enforced equivalent of staged policies (from `--file`, else the current
//! recommendation). The work is the pure [`crate::recommend`] module's, on the server.

use std::io::Write;
use std::process::ExitCode;

use anyhow::{Context, bail};
use serde_json::Value;

use crate::admin_client::{get, query_escape};
use crate::args::{RecommendArgs, RecommendOutput};
use crate::datastore::file::manifest_dir;
use crate::recommend::yaml::comment;
use crate::recommend::{self, yaml};

/// The `/recommend` or `/recommend/check` path for the arguments.
pub(crate) fn path(args: &RecommendArgs, ns: &str, check: bool) -> String {
    let mut q = vec![format!("namespace={}", query_escape(ns))];
    if let Some(since) = args.since {
        let secs = since.as_secs() + u64::from(since.subsec_nanos() > 0);
        q.push(format!("since={secs}"));
    }
    if check {
        return format!("/recommend/check?{}", q.join("&"));
    }
    if args.tier != "default" {
        q.push(format!("tier={}", query_escape(&args.tier)));
    }
    if args.include_denied {
        q.push("include_denied=true".into());
    }
    if args.min_samples != 1 {
        q.push(format!("min_samples={}", args.min_samples));
    }
    format!("/recommend?{}", q.join("&"))
}

/// A `/recommend/check` answer as text, and whether any flow would break.
pub(crate) fn render_check(answer: &Value) -> (String, bool) {
    let mut out = String::new();
    let mut broken = false;
    let ns = answer["namespace"].as_str().unwrap_or_default();
    let rows: Vec<&Value> = answer["policies"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    if rows.is_empty() {
        out.push_str(&format!("no staged policy in namespace {}\n", comment(ns)));
    }
    for row in rows {
        let breaks: Vec<&Value> = row["breaks"].as_array().into_iter().flatten().collect();
        let name = format!(
            "{} {}/{}",
            row["kind"].as_str().unwrap_or_default(),
            ns,
            row["name"].as_str().unwrap_or_default()
        );
        if breaks.is_empty() {
            out.push_str(&comment(&format!(
                "{name}: 0 flows would break: safe to promote"
            )));
            out.push('\n');
            continue;
        }
        broken = true;
        out.push_str(&comment(&format!(
            "{name}: {} {} would break",
            breaks.len(),
            if breaks.len() == 1 { "flow" } else { "flows" }
        )));
        out.push('\n');
        for f in breaks {
            out.push_str(&comment(&format!(
                "  {} (reported by {}, {} intervals, {} packets)",
                yaml::flow_line(f),
                f["reporter"].as_str().unwrap_or_default(),
                f["samples"],
                f["packets"],
            )));
            out.push('\n');
        }
    }
    (out, broken)
}

fn write(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

fn ask(args: &RecommendArgs, path: &str) -> anyhow::Result<Value> {
    let body = get(&args.server, path, &args.client)?;
    serde_json::from_str(&body).context("decoding the server's answer")
}

/// The staged policies to promote: from the files, or the server's recommendation.
fn staged(args: &RecommendArgs) -> anyhow::Result<Vec<Value>> {
    if args.file.is_empty() {
        let Some(ns) = args.namespace.as_deref() else {
            bail!("--promote needs --file PATH (the staged policies) or --namespace NS");
        };
        let answer = ask(args, &path(args, ns, false))?;
        return Ok(answer["policies"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| p["object"].clone())
            .collect());
    }
    let report = manifest_dir::load(&args.file);
    for p in &report.problems {
        eprintln!("{p}");
    }
    if !report.broken.is_empty() || !report.invalid.is_empty() {
        bail!("the files hold invalid objects (listed above): fix them before promoting");
    }
    Ok(report
        .resources
        .iter()
        .filter(|(k, _)| k.kind.is_staged())
        .filter(|(k, _)| {
            args.namespace
                .as_deref()
                .is_none_or(|ns| k.namespace.as_deref() == Some(ns))
        })
        .map(|(_, (_, v))| v.resource().to_value())
        .collect())
}

fn promote(args: &RecommendArgs) -> anyhow::Result<ExitCode> {
    let mut enforced = Vec::new();
    for s in staged(args)? {
        match recommend::promote(&s) {
            Ok(v) => enforced.push(v),
            Err(e) => eprintln!("not promoted: {e}"),
        }
    }
    if enforced.is_empty() {
        bail!("no staged policy to promote");
    }
    let text = match args.output {
        RecommendOutput::Yaml => yaml::documents(&enforced),
        RecommendOutput::Json => format!("{}\n", serde_json::to_string_pretty(&enforced)?),
    };
    write(&text)?;
    Ok(ExitCode::SUCCESS)
}

pub fn run(args: &RecommendArgs) -> anyhow::Result<ExitCode> {
    if args.promote {
        return promote(args);
    }
    let Some(ns) = args.namespace.as_deref() else {
        bail!("--namespace NS is required");
    };
    let answer = ask(args, &path(args, ns, args.check))?;
    if args.check {
        let (text, broken) = render_check(&answer);
        match args.output {
            RecommendOutput::Yaml => write(&text)?,
            RecommendOutput::Json => {
                write(&format!("{}\n", serde_json::to_string_pretty(&answer)?))?
            }
        }
        return Ok(if broken {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        });
    }
    let text = match args.output {
        RecommendOutput::Yaml => yaml::answer(&answer),
        RecommendOutput::Json => format!("{}\n", serde_json::to_string_pretty(&answer)?),
    };
    write(&text)?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use serde_json::json;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        recommend: RecommendArgs,
    }

    fn args(extra: &[&str]) -> RecommendArgs {
        Cli::parse_from(std::iter::once("recommend").chain(extra.iter().copied())).recommend
    }

    #[test]
    fn the_path_carries_the_question() {
        assert_eq!(
            path(&args(&["--namespace", "shop"]), "shop", false),
            "/recommend?namespace=shop"
        );
        let a = args(&[
            "--namespace",
            "shop",
            "--since",
            "1h",
            "--tier",
            "security",
            "--include-denied",
            "--min-samples",
            "4",
        ]);
        assert_eq!(
            path(&a, "shop", false),
            "/recommend?namespace=shop&since=3600&tier=security&include_denied=true&min_samples=4"
        );
        assert_eq!(
            path(&args(&["--check", "--since", "90s"]), "shop", true),
            "/recommend/check?namespace=shop&since=90"
        );
        // --check judges staged policies: recommendation options do not go with it.
        assert!(Cli::try_parse_from(["recommend", "--check", "--include-denied"]).is_err());
        assert!(Cli::try_parse_from(["recommend", "--file", "x.yaml"]).is_err());
    }

    #[test]
    fn yaml_output_lists_what_was_left_out_as_comments() {
        let answer = json!({
            "namespace": "shop",
            "policies": [{"object": {"apiVersion": "projectcalico.org/v3", "kind": "StagedNetworkPolicy",
                                     "metadata": {"name": "recommended-web", "namespace": "shop"},
                                     "spec": {"selector": "app == 'web'"}}}],
            "left_out": [{"why": "host endpoint or host-networked peer",
                          "flow": {"source": "-/node-1\nkind: Evil", "dest": "shop/web-*", "protocol": "tcp",
                                   "port": 80, "reporter": "dst", "action": "Allow"}}],
            "notes": ["label x"],
        });
        let text = yaml::answer(&answer);
        assert_eq!(
            text,
            "# calc-server recommend: 1 staged policy for namespace shop, from its flows.\n\
             # Left out (1 flows):\n\
             #   -/node-1?kind: Evil -> shop/web-* tcp/80 (dst, Allow): host endpoint or host-networked peer\n\
             # Note: label x\n\
             ---\n\
             apiVersion: \"projectcalico.org/v3\"\n\
             kind: \"StagedNetworkPolicy\"\n\
             metadata:\n  name: \"recommended-web\"\n  namespace: \"shop\"\n\
             spec:\n  selector: \"app == 'web'\"\n"
        );
    }

    #[test]
    fn check_output_says_safe_or_names_the_breaks() {
        let answer = json!({"namespace": "shop", "policies": [
            {"kind": "StagedNetworkPolicy", "name": "recommended-api", "breaks": [
                {"source": "shop/batch-*", "dest": "shop/api-*", "protocol": "tcp", "port": 8080,
                 "reporter": "dst", "samples": 1, "packets": 10}]},
            {"kind": "StagedNetworkPolicy", "name": "recommended-db", "breaks": []}]});
        let (text, broken) = render_check(&answer);
        assert!(broken);
        assert_eq!(
            text,
            "StagedNetworkPolicy shop/recommended-api: 1 flow would break\n  \
             shop/batch-* -> shop/api-* tcp/8080 (reported by dst, 1 intervals, 10 packets)\n\
             StagedNetworkPolicy shop/recommended-db: 0 flows would break: safe to promote\n"
        );
        let (text, broken) = render_check(&json!({"namespace": "x", "policies": []}));
        assert!(!broken);
        assert_eq!(text, "no staged policy in namespace x\n");
    }
}
