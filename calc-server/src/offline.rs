//! The offline tools: selector evaluation and normalisation, and manifest validation. They
//! read their arguments (and, for `validate`, files) and print; no server is involved.
//! Exit codes: 0 success, 1 invalid manifests found (validate); errors are the caller's to
//! report (2).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use calc_graph::selector;

use crate::datastore::file::manifest_dir;

/// The selector exactly as given: the CLI must agree with the parser the datastore's
/// selectors go through (a newline is refused there, so it is here).
fn parse_selector(input: &str) -> anyhow::Result<selector::Selector> {
    selector::parse(input)
        .with_context(|| format!("selector {:?}", calc_graph::untrusted::Untrusted(input)))
}

pub fn selector_eval(labels: &str, sel: &str) -> anyhow::Result<ExitCode> {
    let labels: BTreeMap<String, String> = serde_json::from_str(labels)
        .context("--labels must be a JSON object whose values are strings")?;
    let sel = parse_selector(sel)?;
    println!("{}", sel.evaluate(&labels));
    Ok(ExitCode::SUCCESS)
}

pub fn selector_normalize(sel: &str) -> anyhow::Result<ExitCode> {
    let sel = parse_selector(sel)?;
    let out = serde_json::json!({"canonical": sel.canonical(), "unique_id": sel.unique_id()});
    println!("{out}");
    Ok(ExitCode::SUCCESS)
}

pub fn validate(paths: &[PathBuf]) -> anyhow::Result<ExitCode> {
    let report = manifest_dir::load(paths);
    let mut out = std::io::stdout().lock();
    for problem in &report.problems {
        writeln!(out, "{problem}")?;
    }
    eprintln!(
        "checked {} object(s) in {} file(s): {} valid, {} ignored (not used by the policy dataplane), {} problem(s)",
        report.objects,
        report.files,
        report.resources.len(),
        report.ignored,
        report.problems.len()
    );
    Ok(if report.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
