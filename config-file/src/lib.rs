//! `--config-file`: settings from a YAML file, beneath flags and environment variables; and
//! `--print-config`, which shows the settings in force and where each came from.
//!
//! Every key is a long flag name without the dashes (`listen`, `tls-ca-file`, …); a value is a
//! string, number or boolean, or a sequence for flags that take several values. The file's
//! values become the flags' defaults before the command line is parsed, so clap's own order
//! gives the precedence: flags, then environment variables, then the file, then the built-in
//! defaults. An unknown key is an error (a typo is not silently ignored).
//!
//! `--print-config` is answered by [`parse_args`], as clap answers `--help`: one
//! `key: value  # source` line per setting, in this file format (so the output is a valid
//! config file), the source being `flag`, `env NAME`, `file PATH` or `default`. Required flags
//! are not required for it (a missing one shows as `""`). Values of flags marked
//! `hide_env_values` (clap's mark for sensitive values) and passwords in URLs are not shown.
//!
//! Shared by calc-server and dataplane-agent.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fmt;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command, CommandFactory, FromArgMatches};

/// The long flag [`parse_args`] answers with the settings in force (on the command, or on the
/// subcommand the file configures).
pub const PRINT_FLAG: &str = "print-config";

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

/// Why the config file cannot be used: the file, and what is wrong with it.
#[derive(Debug, thiserror::Error)]
#[error("config file {}: {problem}", path.display())]
pub struct FileError {
    pub path: PathBuf,
    pub problem: Problem,
}

/// What is wrong with a config file.
#[derive(Debug, thiserror::Error)]
pub enum Problem {
    #[error("{0}")]
    Read(io::Error),
    #[error("not a YAML mapping: {0}")]
    NotAMapping(Box<serde_saphyr::Error>),
    #[error("{key}: expected a string, number or boolean, got {value}")]
    NotAScalar {
        key: String,
        value: serde_json::Value,
    },
    /// A key that is no long flag name of the command; `closest`: the flag it most likely
    /// meant, when one is close enough.
    #[error("unknown setting {key:?} {}", did_you_mean(closest.as_deref()))]
    UnknownSetting {
        key: String,
        closest: Option<String>,
    },
    /// `--config-file` itself or `--print-config`.
    #[error("{0:?} cannot be set inside the config file")]
    NotASetting(String),
}

fn did_you_mean(closest: Option<&str>) -> String {
    match closest {
        Some(name) => format!("(did you mean {name:?}?)"),
        None => "(settings are long flag names without the dashes; see --help)".to_owned(),
    }
}

/// The file's settings as flag name → values.
pub fn load(path: &Path) -> Result<BTreeMap<String, Vec<String>>, FileError> {
    let at = |problem| FileError {
        path: path.to_path_buf(),
        problem,
    };
    let text = std::fs::read_to_string(path).map_err(|e| at(Problem::Read(e)))?;
    parse(&text).map_err(at)
}

fn parse(text: &str) -> Result<BTreeMap<String, Vec<String>>, Problem> {
    if text.trim().is_empty() {
        return Ok(BTreeMap::new());
    }
    let map: BTreeMap<String, serde_json::Value> =
        serde_saphyr::from_str(text).map_err(|e| Problem::NotAMapping(Box::new(e)))?;
    let scalar = |key: &str, v: &serde_json::Value| match v {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Number(n) => Ok(n.to_string()),
        serde_json::Value::Bool(b) => Ok(b.to_string()),
        other => Err(Problem::NotAScalar {
            key: key.to_owned(),
            value: other.clone(),
        }),
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

/// "unknown setting", with the closest flag name of `cmd` (or its subcommand `sub`) when one
/// is close enough to be the intended one.
fn unknown_setting(key: &str, cmd: &Command, sub: Option<&str>) -> Problem {
    let names = cmd
        .get_arguments()
        .chain(
            sub.and_then(|s| cmd.find_subcommand(s))
                .into_iter()
                .flat_map(Command::get_arguments),
        )
        .filter_map(|a| a.get_long())
        .filter(|n| *n != PRINT_FLAG);
    let best = names
        .map(|n| (strsim::jaro_winkler(key, n), n))
        .filter(|(score, _)| *score > 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0));
    Problem::UnknownSetting {
        key: key.to_owned(),
        closest: best.map(|(_, name)| name.to_owned()),
    }
}

/// Makes each setting the default of the flag with that long name, in `cmd` or (when given)
/// its subcommand `sub`.
pub fn apply(
    mut cmd: Command,
    sub: Option<&str>,
    settings: &BTreeMap<String, Vec<String>>,
    file_flag: &str,
) -> Result<Command, Problem> {
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
                find(&cmd).ok_or_else(|| unknown_setting(key, &cmd, sub))?,
                false,
            ),
        };
        if format!("--{key}") == file_flag || key == PRINT_FLAG {
            return Err(Problem::NotASetting(key.clone()));
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
///
/// With `--print-config` (see [`PRINT_FLAG`]) it prints the settings in force instead and exits
/// 0, as clap does for `--help`; a closed stdout (`| head -1`) is not an error.
pub fn parse_args<C: CommandFactory + FromArgMatches>(
    file_flag: &str,
    env: &str,
    sub: Option<&str>,
) -> C {
    let args: Vec<OsString> = std::env::args_os().collect();
    match print_config_from::<C>(&args, file_flag, env, sub) {
        Some(Ok(settings)) => {
            if let Err(e) = write_settings(&mut io::stdout().lock(), &settings) {
                eprintln!("error: writing the settings: {e}");
                std::process::exit(1);
            }
            std::process::exit(0);
        }
        Some(Err(e)) => exit_with(e),
        None => {}
    }
    match try_parse_from::<C>(&args, file_flag, env, sub) {
        Ok(c) => c,
        Err(e) => exit_with(e),
    }
}

fn exit_with(e: Error) -> ! {
    match e {
        Error::Clap(e) => e.exit(),
        Error::File(e) => {
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

/// Why the command line and config file do not parse.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Clap(clap::Error),
    #[error(transparent)]
    File(FileError),
}

pub fn try_parse_from<C: CommandFactory + FromArgMatches>(
    args: &[OsString],
    file_flag: &str,
    env: &str,
    sub: Option<&str>,
) -> Result<C, Error> {
    let (cmd, _) = layered::<C>(args, file_flag, env, sub)?;
    let mut matches = cmd.try_get_matches_from(args).map_err(Error::Clap)?;
    C::from_arg_matches_mut(&mut matches).map_err(Error::Clap)
}

/// The config file named for this run and its settings.
struct FileLayer {
    path: PathBuf,
    keys: BTreeSet<String>,
}

/// `C`'s command with the config file (when one is named and `sub` is used) applied.
fn layered<C: CommandFactory>(
    args: &[OsString],
    file_flag: &str,
    env: &str,
    sub: Option<&str>,
) -> Result<(Command, Option<FileLayer>), Error> {
    let cmd = C::command();
    let uses_sub = sub.is_none_or(|s| args.iter().skip(1).any(|a| a == s));
    if !uses_sub {
        return Ok((cmd, None));
    }
    let Some(path) = config_path(args, file_flag, env) else {
        return Ok((cmd, None));
    };
    let settings = load(&path).map_err(Error::File)?;
    let cmd = apply(cmd, sub, &settings, file_flag).map_err(|problem| {
        Error::File(FileError {
            path: path.clone(),
            problem,
        })
    })?;
    let keys = settings.into_keys().collect();
    Ok((cmd, Some(FileLayer { path, keys })))
}

/// Where a setting's value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The command line.
    Flag,
    /// This environment variable.
    Env(String),
    /// This config file.
    File(PathBuf),
    /// The built-in default (or no value at all).
    Default,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The source ends a line: a line break in a name would forge the next setting.
        let one_line = |s: &str| {
            if s.chars().any(char::is_control) {
                format!("{s:?}")
            } else {
                s.to_owned()
            }
        };
        match self {
            Source::Flag => f.write_str("flag"),
            Source::Env(name) => write!(f, "env {}", one_line(name)),
            Source::File(path) => write!(f, "file {}", one_line(&path.to_string_lossy())),
            Source::Default => f.write_str("default"),
        }
    }
}

/// One setting as `--print-config` shows it: `key: value  # source`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    /// The long flag name, which is also the config file key.
    pub key: String,
    /// The value as YAML: a scalar, a flow sequence, `null` when unset or secret, `""` when a
    /// required flag is missing.
    pub value: String,
    pub source: Source,
    /// The value is secret and not shown.
    pub hidden: bool,
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}  # {}", self.key, self.value, self.source)?;
        if self.hidden {
            f.write_str(" (secret: not shown)")?;
        }
        Ok(())
    }
}

/// The settings in force when `args` ask for `--print-config`; `None` when they do not, or
/// when they do not parse (the ordinary parse then reports why). Required flags need not be
/// given.
pub fn print_config_from<C: CommandFactory>(
    args: &[OsString],
    file_flag: &str,
    env: &str,
    sub: Option<&str>,
) -> Option<Result<Vec<Setting>, Error>> {
    let flag = format!("--{PRINT_FLAG}");
    // Cheap test first: most runs do not ask, and need no second parse.
    if !args
        .iter()
        .skip(1)
        .take_while(|a| *a != "--")
        .any(|a| *a == *flag)
    {
        return None;
    }
    let (cmd, file) = match layered::<C>(args, file_flag, env, sub) {
        Ok(l) => l,
        Err(e) => return Some(Err(e)),
    };
    let mut required = BTreeSet::new();
    let mut cmd = relaxed(cmd, &mut required);
    if let Some(s) = sub {
        cmd = cmd.mut_subcommand(s, |c| relaxed(c, &mut required));
    }
    let matches = cmd.try_get_matches_from_mut(args).ok()?;
    // The command and its matches, outermost first.
    let mut scopes = vec![(&cmd, &matches)];
    if let Some(s) = sub {
        scopes.push((cmd.find_subcommand(s)?, matches.subcommand_matches(s)?));
    }
    let (inner, inner_matches) = *scopes.last()?;
    let asked = inner
        .get_arguments()
        .find(|a| a.get_long() == Some(PRINT_FLAG))
        .is_some_and(|a| {
            inner_matches.value_source(a.get_id().as_str()) == Some(ValueSource::CommandLine)
        });
    if !asked {
        return None;
    }
    // Applying the file moves the args it sets to the end: show them in the order `C` declares
    // them (which is also --help's).
    let pristine = C::command();
    let declared: Vec<&clap::Id> = pristine
        .get_arguments()
        .chain(
            sub.and_then(|s| pristine.find_subcommand(s))
                .into_iter()
                .flat_map(Command::get_arguments),
        )
        .map(Arg::get_id)
        .collect();
    let rank = |a: &Arg| {
        declared
            .iter()
            .position(|id| *id == a.get_id())
            .unwrap_or(usize::MAX)
    };
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for (c, m) in scopes {
        let mut args: Vec<&Arg> = c.get_arguments().collect();
        args.sort_by_key(|a| rank(a));
        for arg in args {
            let Some(long) = arg.get_long() else { continue };
            let not_a_setting = long == PRINT_FLAG
                || format!("--{long}") == file_flag
                || matches!(
                    arg.get_action(),
                    ArgAction::Help
                        | ArgAction::HelpShort
                        | ArgAction::HelpLong
                        | ArgAction::Version
                );
            // A global flag appears in every scope once built; it is shown once.
            if not_a_setting || !seen.insert(long.to_owned()) {
                continue;
            }
            let is_required = required.contains(arg.get_id().as_str());
            out.push(setting(arg, long, m, file.as_ref(), is_required));
        }
    }
    Some(Ok(out))
}

/// `cmd` with no flag required (printing the settings needs none), noting which were.
fn relaxed(cmd: Command, required: &mut BTreeSet<String>) -> Command {
    cmd.mut_args(|a| {
        if a.is_required_set() {
            required.insert(a.get_id().to_string());
        }
        a.required(false)
    })
}

fn setting(
    arg: &Arg,
    long: &str,
    m: &ArgMatches,
    file: Option<&FileLayer>,
    required: bool,
) -> Setting {
    let id = arg.get_id().as_str();
    let source = match m.value_source(id) {
        Some(ValueSource::CommandLine) => Source::Flag,
        Some(ValueSource::EnvVariable) => Source::Env(
            arg.get_env()
                .map(|e| e.to_string_lossy().into_owned())
                .unwrap_or_default(),
        ),
        // The file's values are the flags' defaults: only the file knows it set them.
        _ => match file {
            Some(f) if f.keys.contains(long) => Source::File(f.path.clone()),
            _ => Source::Default,
        },
    };
    let values: Option<Vec<String>> = m.try_get_raw(id).ok().flatten().map(|raw| {
        raw.map(|v| hide_url_password(&v.to_string_lossy()))
            .collect()
    });
    let hidden = arg.is_hide_env_values_set() && values.is_some();
    let list = matches!(arg.get_action(), ArgAction::Append) || arg.get_value_delimiter().is_some();
    let value = match values {
        _ if hidden => "null".to_owned(),
        None if required => "\"\"".to_owned(),
        None => "null".to_owned(),
        Some(v) if list || v.len() != 1 => {
            let items: Vec<String> = v.iter().map(|s| yaml_scalar(s, true)).collect();
            format!("[{}]", items.join(", "))
        }
        Some(v) => yaml_scalar(&v[0], false),
    };
    Setting {
        key: long.to_owned(),
        value,
        source,
        hidden,
    }
}

/// `s` as a YAML scalar that this crate's loader reads back as `s`: plain when it does, else
/// double-quoted (JSON's escapes are YAML's).
fn yaml_scalar(s: &str, in_sequence: bool) -> String {
    // Asking the loader itself catches every YAML surprise (`null`, `yes`, `1e3`, `a #b`, `*x`,
    // sexagesimals) without listing them.
    let doc = if in_sequence {
        format!("k: [{s}]")
    } else {
        format!("k: {s}")
    };
    let reads_back = parse(&doc)
        .ok()
        .is_some_and(|m| m.get("k").is_some_and(|v| *v == [s]));
    if reads_back {
        s.to_owned()
    } else {
        serde_json::to_string(s).unwrap_or_default()
    }
}

/// A URL's password replaced by `hidden` (`https://user:hidden@host`); other text unchanged.
fn hide_url_password(value: &str) -> String {
    let Some((scheme, rest)) = value.split_once("://") else {
        return value.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some((userinfo, host)) = rest[..authority_end].rsplit_once('@') else {
        return value.to_owned();
    };
    let Some((user, _password)) = userinfo.split_once(':') else {
        return value.to_owned();
    };
    format!("{scheme}://{user}:hidden@{host}{}", &rest[authority_end..])
}

/// Writes one line per setting. A reader that went away early (`| head -1`) is not an error:
/// it has what it wanted.
pub fn write_settings(out: &mut impl Write, settings: &[Setting]) -> io::Result<()> {
    let written = settings
        .iter()
        .try_for_each(|s| writeln!(out, "{s}"))
        .and_then(|()| out.flush());
    match written {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
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
        #[arg(long, env = "T_UNUSED_SECRET", hide_env_values = true)]
        secret: Option<String>,
        #[arg(long)]
        print_config: bool,
    }

    fn run(file: &str, argv: &[&str]) -> Result<T, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.yaml");
        std::fs::write(&path, file).unwrap();
        let mut args: Vec<OsString> = vec!["t".into(), "--config-file".into(), path.into()];
        args.extend(argv.iter().map(OsString::from));
        try_parse_from::<T>(&args, "--config-file", "T_UNUSED_CONFIG_FILE", None)
            .map_err(|e| e.to_string())
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
        assert!(err.contains("did you mean \"listen\"?"), "{err}");
        let err = run("limit: {a: 1}\n", &[]).unwrap_err();
        assert!(err.contains("limit"), "{err}");
        let err = run("limit: many\n", &["--node", "n"]).unwrap_err();
        assert!(err.contains("many"), "{err}");
        let err = run("config-file: /x\n", &[]).unwrap_err();
        assert!(err.contains("cannot be set"), "{err}");
        let err = run("print-config: true\n", &[]).unwrap_err();
        assert!(err.contains("cannot be set"), "{err}");
        assert!(run("- a\n- b\n", &[]).is_err());
    }

    /// `--print-config`'s lines for `file` beneath `argv`, or `None` when it is not asked for.
    fn printed(file: &str, argv: &[&str]) -> Option<(Vec<String>, PathBuf)> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.yaml");
        std::fs::write(&path, file).unwrap();
        let mut args: Vec<OsString> = vec!["t".into(), "--config-file".into(), (&path).into()];
        args.extend(argv.iter().map(OsString::from));
        let settings =
            print_config_from::<T>(&args, "--config-file", "T_UNUSED_CONFIG_FILE", None)?;
        let Ok(settings) = settings else {
            panic!("the file is valid")
        };
        Some((settings.iter().map(ToString::to_string).collect(), path))
    }

    #[test]
    fn print_config_names_each_settings_source_without_required_flags() {
        let (lines, path) = printed(
            "listen: 0.0.0.0:9\nendpoints: [a, b]\n",
            &["--limit", "8", "--print-config", "--secret", "s3cret"],
        )
        .expect("asked for");
        let file = format!("file {}", path.display());
        assert_eq!(
            lines,
            [
                format!("listen: 0.0.0.0:9  # {file}"),
                "limit: 8  # flag".to_owned(),
                format!("endpoints: [a, b]  # {file}"),
                "verbose: false  # default".to_owned(),
                "node: \"\"  # default".to_owned(),
                "secret: null  # flag (secret: not shown)".to_owned(),
            ],
            "required --node is not required; the config file and print flags are no settings"
        );
        assert!(printed("", &["--node", "n"]).is_none(), "not asked for");
        assert!(
            printed("", &["--print-config", "--limit", "many"]).is_none(),
            "a bad value is left to the ordinary parse to report"
        );
    }

    #[test]
    fn printed_values_read_back_as_themselves() {
        for s in [
            "10s",
            "0.0.0.0:6000",
            "cali",
            "50051",
            "true",
            "null",
            "~",
            "",
            "yes",
            "1e3",
            "0x10",
            "a #b",
            "*x",
            "&a b",
            "a: b",
            "[x]",
            "{",
            "-",
            "line\nbreak",
            " pad ",
            "quote\"s",
            "tab\t",
            "ünï",
            "190:20:30",
            "a,b",
        ] {
            for in_sequence in [false, true] {
                let yaml = yaml_scalar(s, in_sequence);
                let doc = if in_sequence {
                    format!("k: [{yaml}]")
                } else {
                    format!("k: {yaml}")
                };
                let back = parse(&doc).unwrap_or_else(|e| panic!("{doc}: {e}"));
                assert_eq!(back["k"], [s], "{doc}");
            }
        }
        assert_eq!(yaml_scalar("0.0.0.0:6000", false), "0.0.0.0:6000");
        assert_eq!(yaml_scalar("null", false), "\"null\"");
    }

    #[test]
    fn url_passwords_are_hidden() {
        assert_eq!(
            hide_url_password("https://u:p@etcd:2379/x"),
            "https://u:hidden@etcd:2379/x"
        );
        for unchanged in ["http://etcd:2379", "http://u@etcd", "u:p@etcd", "/a/b@c"] {
            assert_eq!(hide_url_password(unchanged), unchanged);
        }
    }

    #[test]
    fn a_reader_that_went_away_is_not_an_error() {
        struct Closed(io::ErrorKind);
        impl Write for Closed {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Err(self.0.into())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let settings = [Setting {
            key: "k".into(),
            value: "v".into(),
            source: Source::Default,
            hidden: false,
        }];
        assert!(write_settings(&mut Closed(io::ErrorKind::BrokenPipe), &settings).is_ok());
        assert!(write_settings(&mut Closed(io::ErrorKind::Other), &settings).is_err());
    }
}
