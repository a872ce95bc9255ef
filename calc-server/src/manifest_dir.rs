//! Reads manifests from files and directories: the IO half of the file datastore.
//!
//! Directories are walked recursively in name order; `*.yaml`, `*.yml` and `*.json` files are
//! read; hidden entries and a top-level `status/` directory (where endpoint status is written)
//! are skipped. Every problem is collected with its file and document number; good objects are
//! kept. When two files define the same object, the later one (in path order) wins and the
//! duplicate is reported.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use calc_graph::manifest::{Outcome, parse_manifest};
use calc_graph::model::{Resource, ResourceKey};

/// One problem with its location.
#[derive(Debug)]
pub struct Problem {
    pub file: PathBuf,
    /// 1-based document number, when the problem belongs to one object.
    pub document: Option<usize>,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.document {
            Some(d) => write!(f, "{}: document {d}: {}", self.file.display(), self.message),
            None => write!(f, "{}: {}", self.file.display(), self.message),
        }
    }
}

/// What loading produced.
#[derive(Debug, Default)]
pub struct Report {
    pub files: usize,
    pub objects: usize,
    pub ignored: usize,
    /// Valid resources by key, with the file each came from.
    pub resources: BTreeMap<ResourceKey, (PathBuf, Resource)>,
    pub problems: Vec<Problem>,
}

/// Loads every manifest under `paths`.
pub fn load(paths: &[PathBuf]) -> Report {
    let mut report = Report::default();
    for root in paths {
        let mut files = Vec::new();
        if let Err(e) = collect(root, root, &mut files) {
            report.problems.push(Problem {
                file: root.clone(),
                document: None,
                message: format!("cannot read: {e}"),
            });
        }
        for file in files {
            load_file(&file, &mut report);
        }
    }
    report
}

/// Whether a path is a manifest file by its extension (editor backups such as `a.yaml~` are not).
pub fn is_manifest(p: &Path) -> bool {
    matches!(
        p.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml" | "json")
    )
}

fn collect(root: &Path, p: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    let meta = std::fs::metadata(p)?;
    if meta.is_file() {
        out.push(p.to_path_buf());
        return Ok(());
    }
    let mut entries: Vec<PathBuf> = std::fs::read_dir(p)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    entries.sort();
    for e in entries {
        let name = e.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name.starts_with('.') || (p == root && name == "status") {
            continue;
        }
        if e.is_dir() {
            collect(root, &e, out)?;
        } else if is_manifest(&e) {
            out.push(e);
        }
    }
    Ok(())
}

fn load_file(file: &Path, report: &mut Report) {
    report.files += 1;
    let problem = |document, message| Problem {
        file: file.to_path_buf(),
        document,
        message,
    };
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) => {
            report
                .problems
                .push(problem(None, format!("cannot read: {e}")));
            return;
        }
    };
    let entries = match parse_manifest(&text) {
        Ok(e) => e,
        Err(e) => {
            report.problems.push(problem(None, e.to_string()));
            return;
        }
    };
    for entry in entries {
        report.objects += 1;
        let doc = Some(entry.document);
        match entry.outcome {
            Outcome::Valid(key, res) => {
                if let Some((prev, _)) = report.resources.get(&key) {
                    report.problems.push(problem(
                        doc,
                        format!(
                            "{key} is defined again (first in {}); the later definition wins",
                            prev.display()
                        ),
                    ));
                }
                report.resources.insert(key, (file.to_path_buf(), res));
            }
            Outcome::Ignored(..) => report.ignored += 1,
            Outcome::Undecodable(e) => report.problems.push(problem(doc, e.to_string())),
            Outcome::Invalid(inv) => {
                for e in &inv.errors {
                    report
                        .problems
                        .push(problem(doc, format!("{}: {e}", inv.key)));
                }
            }
        }
    }
}
