//! An in-memory kernel for unit tests: answers `ip[6]tables-{legacy,nft}-{save,restore}` and
//! `ipset {save,restore,destroy}` like the real tools, strictly enough to catch what the
//! kernel would refuse (jumps to missing chains, deleting a chain still referenced, adding to a
//! missing set, destroying a set in use), and records every call.

use std::collections::{BTreeMap, BTreeSet};

use super::rules::IpVersion;
use super::runner::{CommandRunner, Output};

type Tables = BTreeMap<(IpVersion, String), BTreeMap<String, Vec<String>>>;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeSet {
    pub kind: String,
    pub family: String,
    pub members: BTreeSet<String>,
}

/// The fake kernel. Cloning gives an independent copy.
#[derive(Clone, Debug, Default)]
pub struct FakeKernel {
    tables: Tables,
    sets: BTreeMap<String, FakeSet>,
    /// Every call: program, args, stdin.
    pub calls: Vec<(String, Vec<String>, String)>,
    /// When set, every `*-restore` fails with this message.
    pub fail_restores: Option<String>,
    /// Text the kernel refuses: a restore or ipset line holding one of these fails (stands for
    /// whatever the agent's own checks did not foresee).
    pub refuse: Vec<String>,
    /// Packet and byte counters of rules, by family, chain and the rule's spec (what
    /// `-save -c` prints as `[packets:bytes]`); a chain written by a restore starts again at
    /// zero, as the kernel's do.
    pub counters: BTreeMap<(IpVersion, String, String), (u64, u64)>,
}

const BUILTIN: &[(&str, &[&str])] = &[
    ("filter", &["INPUT", "FORWARD", "OUTPUT"]),
    ("raw", &["PREROUTING", "OUTPUT"]),
    (
        "mangle",
        &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"],
    ),
    ("nat", &["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"]),
];

fn is_target_keyword(t: &str) -> bool {
    t.chars().all(|c| c.is_ascii_uppercase() || c == '_')
}

fn jump_target(spec: &str) -> Option<String> {
    let args = super::rules::quote::split_restore_line(spec).unwrap_or_default();
    let mut it = args.into_iter();
    while let Some(tok) = it.next() {
        if matches!(tok.as_str(), "-j" | "--jump" | "-g" | "--goto") {
            return it.next();
        }
    }
    None
}

/// The IP sets a rule spec matches on.
fn match_sets(spec: &str) -> impl Iterator<Item = String> {
    let args = super::rules::quote::split_restore_line(spec).unwrap_or_default();
    let mut out = Vec::new();
    let mut it = args.into_iter();
    while let Some(tok) = it.next() {
        if tok == "--match-set"
            && let Some(s) = it.next()
        {
            out.push(s);
        }
    }
    out.into_iter()
}

impl FakeKernel {
    pub fn new() -> Self {
        let mut k = Self::default();
        for v in IpVersion::BOTH {
            for (table, chains) in BUILTIN {
                let t = k.tables.entry((v, (*table).to_owned())).or_default();
                for c in *chains {
                    t.insert((*c).to_owned(), Vec::new());
                }
            }
        }
        k
    }

    /// Rule specs of a chain (without `-A <chain>`).
    pub fn chain_rules(&self, v: IpVersion, table: &str, chain: &str) -> Vec<String> {
        self.tables
            .get(&(v, table.to_owned()))
            .and_then(|t| t.get(chain))
            .cloned()
            .unwrap_or_default()
    }

    pub fn has_chain(&self, v: IpVersion, table: &str, chain: &str) -> bool {
        self.tables
            .get(&(v, table.to_owned()))
            .is_some_and(|t| t.contains_key(chain))
    }

    pub fn chain_names(&self, v: IpVersion, table: &str) -> Vec<String> {
        self.tables
            .get(&(v, table.to_owned()))
            .map(|t| t.keys().cloned().collect())
            .unwrap_or_default()
    }

    pub fn set(&self, name: &str) -> Option<&FakeSet> {
        self.sets.get(name)
    }

    pub fn set_names(&self) -> Vec<String> {
        self.sets.keys().cloned().collect()
    }

    /// How many `*-restore` calls (iptables and ipset) were made.
    pub fn restore_calls(&self) -> usize {
        self.calls
            .iter()
            .filter(|c| c.0.ends_with("restore") || c.1.first().is_some_and(|a| a == "restore"))
            .count()
    }

    /// The stdin of the last iptables restore.
    pub fn last_restore_input(&self) -> String {
        self.calls
            .iter()
            .rev()
            .find(|c| c.0.ends_with("-restore"))
            .map(|c| c.2.clone())
            .unwrap_or_default()
    }

    /// The stdin of the last `ipset restore`.
    pub fn last_ipset_input(&self) -> String {
        self.calls
            .iter()
            .rev()
            .find(|c| c.0 == "ipset" && c.1.iter().any(|a| a == "restore"))
            .map(|c| c.2.clone())
            .unwrap_or_default()
    }

    /// Counts `packets` packets of `bytes` bytes on the rule of `chain` whose spec holds
    /// `needle` (the first such rule, in any table).
    pub fn hit(&mut self, v: IpVersion, chain: &str, needle: &str, packets: u64, bytes: u64) {
        let spec = self
            .tables
            .iter()
            .filter(|((tv, _), _)| *tv == v)
            .filter_map(|(_, t)| t.get(chain))
            .flatten()
            .find(|r| r.contains(needle))
            .unwrap_or_else(|| panic!("no rule of {chain} holds {needle}"))
            .clone();
        let c = self
            .counters
            .entry((v, chain.to_owned(), spec))
            .or_default();
        c.0 += packets;
        c.1 += bytes;
    }

    fn save(&self, v: IpVersion, table: &str, counters: bool) -> String {
        let mut out = format!("# Generated by fake\n*{table}\n");
        if let Some(t) = self.tables.get(&(v, table.to_owned())) {
            for name in t.keys() {
                let builtin = BUILTIN
                    .iter()
                    .any(|(tb, cs)| *tb == table && cs.contains(&name.as_str()));
                let policy = if builtin { "ACCEPT" } else { "-" };
                out.push_str(&format!(":{name} {policy} [0:0]\n"));
            }
            for (name, rules) in t {
                for r in rules {
                    if counters {
                        let (p, b) = self
                            .counters
                            .get(&(v, name.clone(), r.clone()))
                            .copied()
                            .unwrap_or_default();
                        out.push_str(&format!("[{p}:{b}] "));
                    }
                    out.push_str(&format!("-A {name} {r}\n"));
                }
            }
        }
        out.push_str("COMMIT\n");
        out
    }

    /// Runs an `iptables-restore --noflush` script atomically.
    pub fn exec_restore(&mut self, v: IpVersion, script: &str) -> Result<(), String> {
        let mut tables = self.tables.clone();
        let mut flushed: Vec<String> = Vec::new();
        let mut current: Option<String> = None;
        let mut work: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (n, line) in script.lines().enumerate() {
            let line = line.trim();
            let err = |m: &str| format!("line {}: {m}: {line}", n + 1);
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some(t) = line.strip_prefix('*') {
                current = Some(t.to_owned());
                work = tables
                    .get(&(v, t.to_owned()))
                    .cloned()
                    .ok_or_else(|| err("no such table"))?;
                continue;
            }
            let table = current.clone().ok_or_else(|| err("no table"))?;
            if self.refuse.iter().any(|r| line.contains(r.as_str())) {
                return Err(err("refused by the kernel"));
            }
            if line == "COMMIT" {
                for (chain, rules) in &work {
                    for r in rules {
                        if let Some(t) = jump_target(r)
                            && !is_target_keyword(&t)
                            && !work.contains_key(&t)
                        {
                            return Err(err(&format!("{chain}: jump to missing chain {t}")));
                        }
                        if let Some(set) = match_sets(r).find(|s| !self.sets.contains_key(s)) {
                            return Err(err(&format!("{chain}: set {set} does not exist")));
                        }
                    }
                }
                tables.insert((v, table), std::mem::take(&mut work));
                current = None;
                continue;
            }
            if let Some(decl) = line.strip_prefix(':') {
                let name = decl.split_whitespace().next().unwrap_or_default();
                work.insert(name.to_owned(), Vec::new());
                flushed.push(name.to_owned());
                continue;
            }
            super::rules::quote::split_restore_line(line).map_err(|e| err(&e))?;
            let (op, rest) = line.split_once(' ').ok_or_else(|| err("bad line"))?;
            let (chain, spec) = rest.split_once(' ').unwrap_or((rest, ""));
            match op {
                "-A" => work
                    .get_mut(chain)
                    .ok_or_else(|| err("no such chain"))?
                    .push(spec.to_owned()),
                "-I" => {
                    let rules = work.get_mut(chain).ok_or_else(|| err("no such chain"))?;
                    let (pos, spec) = match spec.split_once(' ') {
                        Some((p, s)) if p.parse::<usize>().is_ok() => {
                            (p.parse::<usize>().unwrap(), s)
                        }
                        _ => (1, spec),
                    };
                    if pos == 0 || pos > rules.len() + 1 {
                        return Err(err("index out of range"));
                    }
                    rules.insert(pos - 1, spec.to_owned());
                }
                "-D" => {
                    let rules = work.get_mut(chain).ok_or_else(|| err("no such chain"))?;
                    if let Ok(i) = spec.parse::<usize>() {
                        if i == 0 || i > rules.len() {
                            return Err(err("index out of range"));
                        }
                        rules.remove(i - 1);
                    } else {
                        let i = rules
                            .iter()
                            .position(|r| r == spec)
                            .ok_or_else(|| err("rule does not exist"))?;
                        rules.remove(i);
                    }
                }
                "-R" => {
                    let rules = work.get_mut(chain).ok_or_else(|| err("no such chain"))?;
                    let (pos, spec) = spec.split_once(' ').ok_or_else(|| err("bad -R"))?;
                    let i: usize = pos.parse().map_err(|_| err("bad index"))?;
                    if i == 0 || i > rules.len() {
                        return Err(err("index out of range"));
                    }
                    rules[i - 1] = spec.to_owned();
                }
                "-F" => work
                    .get_mut(chain)
                    .ok_or_else(|| err("no such chain"))?
                    .clear(),
                "-X" => {
                    if !work.contains_key(chain) {
                        return Err(err("no such chain"));
                    }
                    let referenced = work.iter().any(|(c, rules)| {
                        c != chain
                            && rules
                                .iter()
                                .any(|r| jump_target(r).as_deref() == Some(chain))
                    });
                    if referenced {
                        return Err(err("chain is still referenced"));
                    }
                    work.remove(chain);
                }
                _ => return Err(err("unknown command")),
            }
        }
        if current.is_some() {
            return Err("missing COMMIT".to_owned());
        }
        self.tables = tables;
        self.counters
            .retain(|(cv, chain, _), _| *cv != v || !flushed.contains(chain));
        Ok(())
    }

    fn referenced_sets(&self) -> BTreeSet<String> {
        self.tables
            .values()
            .flat_map(|t| t.values().flatten())
            .flat_map(|r| match_sets(r))
            .collect()
    }

    /// Runs an `ipset restore` script (line by line, like the real tool: not atomic).
    pub fn exec_ipset(&mut self, script: &str, exist: bool) -> Result<(), String> {
        for (n, line) in script.lines().enumerate() {
            let err = |m: &str| format!("Error in line {}: {m}", n + 1);
            if self.refuse.iter().any(|r| line.contains(r.as_str())) {
                return Err(err("refused by the kernel"));
            }
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                [] => {}
                ["create", name, kind, rest @ ..] => {
                    let family = rest
                        .windows(2)
                        .find(|w| w[0] == "family")
                        .map(|w| w[1].to_owned())
                        .unwrap_or_else(|| "inet".to_owned());
                    if let Some(s) = self.sets.get(*name) {
                        if !exist || s.kind != *kind || s.family != family {
                            return Err(err("set with the same name already exists"));
                        }
                    } else {
                        self.sets.insert(
                            (*name).to_owned(),
                            FakeSet {
                                kind: (*kind).to_owned(),
                                family,
                                members: BTreeSet::new(),
                            },
                        );
                    }
                }
                ["add", name, member] => {
                    let s = self
                        .sets
                        .get_mut(*name)
                        .ok_or_else(|| err("set does not exist"))?;
                    if !s.members.insert((*member).to_owned()) && !exist {
                        return Err(err("element is already added"));
                    }
                }
                ["del", name, member] => {
                    let s = self
                        .sets
                        .get_mut(*name)
                        .ok_or_else(|| err("set does not exist"))?;
                    if !s.members.remove(*member) && !exist {
                        return Err(err("element is missing"));
                    }
                }
                ["flush", name] => {
                    self.sets
                        .get_mut(*name)
                        .ok_or_else(|| err("set does not exist"))?
                        .members
                        .clear();
                }
                ["swap", a, b] => {
                    let sa = self
                        .sets
                        .remove(*a)
                        .ok_or_else(|| err("set does not exist"))?;
                    let Some(sb) = self.sets.remove(*b) else {
                        self.sets.insert((*a).to_owned(), sa);
                        return Err(err("set does not exist"));
                    };
                    self.sets.insert((*a).to_owned(), sb);
                    self.sets.insert((*b).to_owned(), sa);
                }
                ["destroy", name] => self.destroy(name).map_err(|m| err(&m))?,
                _ => return Err(err("unknown command")),
            }
        }
        Ok(())
    }

    fn destroy(&mut self, name: &str) -> Result<(), String> {
        if self.referenced_sets().contains(name) {
            return Err("Set cannot be destroyed: it is in use by a kernel component".to_owned());
        }
        self.sets
            .remove(name)
            .map(|_| ())
            .ok_or_else(|| "The set with the given name does not exist".to_owned())
    }

    fn ipset_save(&self) -> String {
        let mut out = String::new();
        for (name, s) in &self.sets {
            out.push_str(&format!(
                "create {name} {} family {} hashsize 1024 maxelem 1048576\n",
                s.kind, s.family
            ));
            for m in &s.members {
                out.push_str(&format!("add {name} {m}\n"));
            }
        }
        out
    }
}

fn ok(stdout: String) -> Output {
    Output {
        success: true,
        code: Some(0),
        stdout: stdout.into_bytes(),
        stderr: Vec::new(),
    }
}

fn fail(msg: String) -> Output {
    Output {
        success: false,
        code: Some(1),
        stdout: Vec::new(),
        stderr: msg.into_bytes(),
    }
}

impl CommandRunner for FakeKernel {
    fn run(
        &mut self,
        program: &str,
        args: &[&str],
        stdin: Option<&[u8]>,
    ) -> std::io::Result<Output> {
        let input = stdin
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .unwrap_or_default();
        self.calls.push((
            program.to_owned(),
            args.iter().map(|s| (*s).to_owned()).collect(),
            input.clone(),
        ));
        let v = if program.starts_with("ip6tables") {
            IpVersion::V6
        } else {
            IpVersion::V4
        };
        if program == "ipset" {
            let exist = args.contains(&"-exist");
            return Ok(if args.contains(&"save") || args.contains(&"list") {
                ok(self.ipset_save())
            } else if args.contains(&"restore") {
                match self.exec_ipset(&input, exist) {
                    Ok(()) => ok(String::new()),
                    Err(e) => fail(format!("ipset v7.17: {e}")),
                }
            } else if let Some(i) = args.iter().position(|a| *a == "destroy") {
                match args.get(i + 1).map(|n| self.destroy(n)) {
                    Some(Ok(())) => ok(String::new()),
                    Some(Err(e)) => fail(format!("ipset v7.17: {e}")),
                    None => fail("ipset: destroy needs a name".into()),
                }
            } else {
                fail(format!("fake ipset: unsupported {args:?}"))
            });
        }
        if program.ends_with("-save") {
            let counters = args.contains(&"-c");
            let text = match args.windows(2).find(|w| w[0] == "-t") {
                Some(w) => self.save(v, w[1], counters),
                // No table: every table, like the real tool.
                None => BUILTIN
                    .iter()
                    .map(|(t, _)| self.save(v, t, counters))
                    .collect(),
            };
            return Ok(ok(text));
        }
        if program.ends_with("-restore") && args == ["--version"] {
            return Ok(ok(format!("{program} v1.8.9 (nf_tables)\n")));
        }
        if program.ends_with("-restore") {
            if let Some(msg) = &self.fail_restores {
                return Ok(fail(msg.clone()));
            }
            return Ok(match self.exec_restore(v, &input) {
                Ok(()) => ok(String::new()),
                Err(e) => fail(format!("{program}: {e}")),
            });
        }
        if program == "iptables" && args == ["--version"] {
            return Ok(ok("iptables v1.8.9 (nf_tables)\n".to_owned()));
        }
        Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("fake kernel: no program {program}"),
        ))
    }
}
