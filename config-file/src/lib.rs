//! `--config-file`: settings from a YAML file, beneath flags and environment variables.
//!
//! Every key is a long flag name without the dashes (`listen`, `tls-ca-file`, …); a value is a
//! string, number or boolean, or a sequence for flags that take several values. The file's
//! values become the flags' defaults before the command line is parsed, so clap's own order
//! gives the precedence: flags, then environment variables, then the file, then the built-in
//! defaults. An unknown key is an error (a typo is not silently ignored).
//!
//! Shared by calc-server and dataplane-agent.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::{Command, CommandFactory, FromArgMatches};

/// Finds `--config-file PATH` / `--config-file=PATH` in `args`, else the environment variable.
pub fn config_path(args: &[OsString], flag: &str, env: &str) -> Option<PathBuf> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let Some(a) = a.to_str() else { continue };
        if a == "--" {
            break;
        }
        if a == flag {
            return it.next().map(PathBuf::from);
        }
        if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            return Some(PathBuf::from(v));
        }
    }
    std::env::var_os(env)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The file's settings as flag name → values.
pub fn load(path: &Path) -> Result<BTreeMap<String, Vec<String>>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("config file {}: {e}", path.display()))?;
    parse(&text).map_err(|e| format!("config file {}: {e}", path.display()))
}

fn parse(text: &str) -> Result<BTreeMap<String, Vec<String>>, String> {
    if text.trim().is_empty() {
        return Ok(BTreeMap::new());
    }
    let map: BTreeMap<String, serde_json::Value> =
        serde_saphyr::from_str(text).map_err(|e| format!("not a YAML mapping: {e}"))?;
    let scalar = |key: &str, v: &serde_json::Value| match v {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Number(n) => Ok(n.to_string()),
        serde_json::Value::Bool(b) => Ok(b.to_string()),
        other => Err(format!(
            "{key}: expected a string, number or boolean, got {other}"
        )),
    };
    let mut out = BTreeMap::new();
    for (key, value) in &map {
        let values = match value {
            serde_json::Value::Null => continue,
            serde_json::Value::Array(items) => items
                .iter()
                .map(|v| scalar(key, v))
                .collect::<Result<Vec<_>, _>>()?,
            v => vec![scalar(key, v)?],
        };
        out.insert(key.clone(), values);
    }
    Ok(out)
}

/// Makes each setting the default of the flag with that long name, in `cmd` or (when given)
/// its subcommand `sub`.
pub fn apply(
    mut cmd: Command,
    sub: Option<&str>,
    settings: &BTreeMap<String, Vec<String>>,
    file_flag: &str,
) -> Result<Command, String> {
    for (key, values) in settings {
        let find = |c: &Command| {
            c.get_arguments()
                .find(|a| a.get_long() == Some(key.as_str()))
                .map(|a| (a.get_id().clone(), a.get_value_delimiter()))
        };
        let in_sub = sub.and_then(|s| cmd.find_subcommand(s)).and_then(find);
        let (found, on_sub) = match in_sub {
            Some(f) => (f, true),
            None => (
                find(&cmd).ok_or_else(|| format!("unknown setting {key:?}"))?,
                false,
            ),
        };
        if format!("--{key}") == file_flag {
            return Err(format!("{key:?} cannot be set inside the config file"));
        }
        let (id, delimiter) = found;
        let values: Vec<String> = match (delimiter, values.as_slice()) {
            (Some(d), [one]) => one.split(d).map(str::to_string).collect(),
            _ => values.clone(),
        };
        // A required flag is satisfied by the file (clap does not count defaults as given).
        let set = move |a: clap::Arg| a.default_values(values.clone()).required(false);
        cmd = if on_sub {
            let sub = sub.unwrap_or_default().to_string();
            cmd.mut_subcommand(sub, |s| s.mut_arg(id, set))
        } else {
            cmd.mut_arg(id, set)
        };
    }
    Ok(cmd)
}

/// Parses the process's command line with the config file (when one is named) beneath it.
/// `sub`: the subcommand the file configures (it applies only when that subcommand is used).
pub fn parse_args<C: CommandFactory + FromArgMatches>(
    file_flag: &str,
    env: &str,
    sub: Option<&str>,
) -> C {
    let args: Vec<OsString> = std::env::args_os().collect();
    match try_parse_from::<C>(&args, file_flag, env, sub) {
        Ok(c) => c,
        Err(Error::Clap(e)) => e.exit(),
        Err(Error::File(e)) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}

/// The long names of the flags the operator set explicitly for this run: on the command line,
/// in the environment, or in the config file. (Defaults are not explicit.)
pub fn explicit_long_flags<C: CommandFactory>(file_flag: &str, env: &str) -> BTreeSet<String> {
    let args: Vec<OsString> = std::env::args_os().collect();
    explicit_long_flags_from::<C>(&args, file_flag, env)
}

pub fn explicit_long_flags_from<C: CommandFactory>(
    args: &[OsString],
    file_flag: &str,
    env: &str,
) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    if let Some(path) = config_path(args, file_flag, env)
        && let Ok(settings) = load(&path)
    {
        out.extend(settings.into_keys());
    }
    let cmd = C::command();
    if let Ok(m) = cmd.clone().ignore_errors(true).try_get_matches_from(args) {
        for a in cmd.get_arguments() {
            let given = matches!(
                m.value_source(a.get_id().as_str()),
                Some(
                    clap::parser::ValueSource::CommandLine | clap::parser::ValueSource::EnvVariable
                )
            );
            if given && let Some(long) = a.get_long() {
                out.insert(long.to_owned());
            }
        }
    }
    out
}

pub enum Error {
    Clap(clap::Error),
    File(String),
}

pub fn try_parse_from<C: CommandFactory + FromArgMatches>(
    args: &[OsString],
    file_flag: &str,
    env: &str,
    sub: Option<&str>,
) -> Result<C, Error> {
    let mut cmd = C::command();
    let uses_sub = sub.is_none_or(|s| args.iter().skip(1).any(|a| a == s));
    if uses_sub && let Some(path) = config_path(args, file_flag, env) {
        let settings = load(&path).map_err(Error::File)?;
        cmd = apply(cmd, sub, &settings, file_flag)
            .map_err(|e| Error::File(format!("config file {}: {e}", path.display())))?;
    }
    let mut matches = cmd.try_get_matches_from(args).map_err(Error::Clap)?;
    C::from_arg_matches_mut(&mut matches).map_err(Error::Clap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct T {
        #[arg(long, default_value = "127.0.0.1:1")]
        listen: String,
        #[arg(long, default_value_t = 5)]
        limit: u32,
        #[arg(long, value_delimiter = ',')]
        endpoints: Vec<String>,
        #[arg(long)]
        verbose: bool,
        #[arg(long)]
        node: String,
        #[arg(long)]
        config_file: Option<PathBuf>,
    }

    fn run(file: &str, argv: &[&str]) -> Result<T, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.yaml");
        std::fs::write(&path, file).unwrap();
        let mut args: Vec<OsString> = vec!["t".into(), "--config-file".into(), path.into()];
        args.extend(argv.iter().map(OsString::from));
        try_parse_from::<T>(&args, "--config-file", "T_UNUSED_CONFIG_FILE", None).map_err(|e| {
            match e {
                Error::Clap(e) => e.to_string(),
                Error::File(e) => e,
            }
        })
    }

    #[test]
    fn file_is_beneath_flags_and_above_defaults() {
        let t = run(
            "listen: 0.0.0.0:9\nlimit: 7\nendpoints: [a, b]\nverbose: true\nnode: n1\n",
            &["--limit", "8"],
        )
        .unwrap();
        assert_eq!(t.node, "n1", "a required flag can come from the file");
        assert_eq!(t.listen, "0.0.0.0:9");
        assert_eq!(t.limit, 8, "the flag wins over the file");
        assert_eq!(t.endpoints, ["a", "b"]);
        assert!(t.verbose);
        let err = run("endpoints: x,y\n", &[]).unwrap_err();
        assert!(
            err.contains("--node"),
            "still required without the file: {err}"
        );
        let t = run("endpoints: x,y\n", &["--node", "n"]).unwrap();
        assert_eq!(t.endpoints, ["x", "y"]);
        assert_eq!(t.limit, 5, "defaults stay for keys not in the file");
        let t = run("", &["--node", "n"]).unwrap();
        assert_eq!(t.listen, "127.0.0.1:1");
    }

    #[test]
    fn bad_files_are_errors() {
        let err = run("lisen: x\n", &[]).unwrap_err();
        assert!(err.contains("unknown setting \"lisen\""), "{err}");
        let err = run("limit: {a: 1}\n", &[]).unwrap_err();
        assert!(err.contains("limit"), "{err}");
        let err = run("limit: many\n", &["--node", "n"]).unwrap_err();
        assert!(err.contains("many"), "{err}");
        let err = run("config-file: /x\n", &[]).unwrap_err();
        assert!(err.contains("cannot be set"), "{err}");
        assert!(run("- a\n- b\n", &[]).is_err());
    }
}
