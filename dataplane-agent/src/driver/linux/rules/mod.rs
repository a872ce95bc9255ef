//! The pure rule renderer: proto policies, profiles and endpoints in, chains of structured
//! rules out, in Calico's layout (docs/drivers.md, "The Linux driver"). A [`Rule`] is match fragments
//! ([`Frag`]), an action, comments and its [`RuleId`]: the one form every kernel writer reads
//! and renders in its own syntax (iptables-restore input here, [`Match::render_iptables`];
//! nftables in `nft::render` and `nft::expr`).
//!
//! Nothing here does IO. A [`Chain`] is a name and its rules; [`rule_hashes`] gives each rule
//! the position-dependent `cali:` hash that lets the iptables writer recognise, after a
//! read-back, which kernel rules are already right (only that writer computes it).

pub(crate) mod endpoint;
pub(crate) mod nflog;
pub(crate) mod policy;
pub(crate) mod quote;
pub(crate) mod static_chains;

use std::fmt::Write as _;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use sha2::{Digest, Sha224};

/// Longest iptables chain name Calico generates.
pub(crate) const MAX_CHAIN_NAME: usize = 28;
/// Characters of the per-rule hash in the `cali:` comment.
pub(crate) const HASH_LEN: usize = 16;

/// Calico's mark bits, allocated from the default mark mask `0xffff0000`, lowest bit first.
pub(crate) mod marks {
    /// A policy or profile accepted the packet.
    pub(crate) const ACCEPT: u32 = 0x1_0000;
    /// A policy passed the packet to the next tier.
    pub(crate) const PASS: u32 = 0x2_0000;
    /// A rule denied the packet.
    pub(crate) const DROP: u32 = 0x4_0000;
    /// OR-block scratch bit: "all blocks so far matched".
    pub(crate) const SCRATCH0: u32 = 0x8_0000;
    /// OR-block scratch bit: "this block matched".
    pub(crate) const SCRATCH1: u32 = 0x10_0000;
    /// The bits Felix clears before its own processing (`allCalicoMarkBits`): never the
    /// endpoint or drop bits, nor any bit outside the mark mask that other tools may use.
    pub(crate) const CALICO: u32 = ACCEPT | PASS | SCRATCH0 | SCRATCH1;
}

/// IP family of a table or set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpVersion {
    V4,
    V6,
}

impl IpVersion {
    pub const BOTH: [IpVersion; 2] = [IpVersion::V4, IpVersion::V6];

    /// 4 or 6.
    pub fn number(self) -> u8 {
        match self {
            IpVersion::V4 => 4,
            IpVersion::V6 => 6,
        }
    }

    /// Whether an address or CIDR string belongs to this family.
    pub fn matches(self, addr: &str) -> bool {
        addr.contains(':') == (self == IpVersion::V6)
    }
}

/// What a rule does when it matches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Accept,
    Drop,
    Return,
    Jump(String),
    Goto(String),
    /// Sets the given bits.
    SetMark(u32),
    /// Clears the given bits.
    ClearMark(u32),
    /// Sets `mark` within `mask`.
    SetMaskedMark {
        mark: u32,
        mask: u32,
    },
    Log {
        prefix: String,
    },
    /// Sends the packet to NFLOG `group` tagged with `prefix` (flow logs; [`nflog`]) and goes
    /// on to the next rule.
    Nflog {
        group: u16,
        prefix: String,
    },
    NoTrack,
    /// Source NAT to the outgoing interface's address; `--random-fully` (random source ports,
    /// fewer conntrack clashes under load) where iptables and the kernel support it.
    Masquerade {
        fully_random: bool,
    },
}

impl Action {
    fn render(&self, out: &mut String) {
        match self {
            Action::Accept => out.push_str("--jump ACCEPT"),
            Action::Drop => out.push_str("--jump DROP"),
            Action::Return => out.push_str("--jump RETURN"),
            Action::Jump(c) => {
                let _ = write!(out, "--jump {}", quote::arg(c));
            }
            Action::Goto(c) => {
                let _ = write!(out, "--goto {}", quote::arg(c));
            }
            Action::SetMark(m) => {
                let _ = write!(out, "--jump MARK --set-mark {m:#x}/{m:#x}");
            }
            Action::ClearMark(m) => {
                let _ = write!(out, "--jump MARK --set-mark 0/{m:#x}");
            }
            Action::SetMaskedMark { mark, mask } => {
                let _ = write!(out, "--jump MARK --set-mark {mark:#x}/{mask:#x}");
            }
            Action::Log { prefix } => {
                let prefix = format!("{prefix}: ");
                let _ = write!(
                    out,
                    "--jump LOG --log-prefix {} --log-level 5",
                    quote::arg(&prefix)
                );
            }
            Action::Nflog { group, prefix } => {
                let _ = write!(
                    out,
                    "--jump NFLOG --nflog-group {group} --nflog-prefix {} --nflog-size {}",
                    quote::arg(prefix),
                    nflog::SNAPLEN
                );
            }
            Action::NoTrack => out.push_str("--jump NOTRACK"),
            Action::Masquerade { fully_random } => {
                out.push_str("--jump MASQUERADE");
                if *fully_random {
                    out.push_str(" --random-fully");
                }
            }
        }
    }

    /// The chain this action transfers to, if it is one of ours.
    pub fn target_chain(&self) -> Option<&str> {
        match self {
            Action::Jump(c) | Action::Goto(c) => Some(c),
            _ => None,
        }
    }
}

/// Which rule of the stream, or which verdict of ours, a kernel rule enforces: what hit
/// counters and flow logs report a packet against. Kept beside the rule in the desired state;
/// each writer maps a kernel rule back to it (`LinuxDriver::rule_id`). Rules that only steer
/// (jumps, mark clears, returns) have none.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RuleId {
    /// Rule `index` (counted from 0 in the message) of a policy's inbound (`Ingress`) or
    /// outbound (`Egress`) rules; `policy` as [`policy_id_string`] spells it. The tier is the
    /// one whose [`RuleId::EndOfTier`] follows the jump in the endpoint chain.
    Policy {
        policy: String,
        direction: endpoint::Direction,
        index: u32,
    },
    /// Rule `index` of a profile's inbound or outbound rules.
    Profile {
        profile: String,
        direction: endpoint::Direction,
        index: u32,
    },
    /// No policy of the tier decided: the tier's default drop.
    EndOfTier {
        tier: String,
        direction: endpoint::Direction,
    },
    /// No profile of the endpoint accepted: the endpoint's final drop.
    NoProfileMatched { direction: endpoint::Direction },
    /// Forwarded traffic accepted by default (a host endpoint without forward tiers).
    Default { direction: endpoint::Direction },
    /// A failsafe port or the agent's calc-server, accepted before any policy (`Ingress`:
    /// `cali-failsafe-in`).
    Failsafe { direction: endpoint::Direction },
}

/// One rule: match fragments, an action, comments and what it enforces, rendered by each
/// writer in its own syntax.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Rule {
    pub matches: Match,
    pub action: Action,
    pub comments: Vec<String>,
    /// The stream rule or verdict this rule enforces (not part of its hash).
    pub id: Option<RuleId>,
    /// This line's counter is what its rule decided (hit counters read only such lines). A
    /// policy rule is two lines, `match → set mark` and the verdict gated on that mark; both
    /// carry the rule's id, and only the first counts, so a packet is counted once.
    pub counts: bool,
}

impl Rule {
    pub(crate) fn new(matches: Match, action: Action) -> Self {
        Self {
            matches,
            action,
            comments: Vec::new(),
            id: None,
            counts: true,
        }
    }

    /// The rule, its counter left out of hit counts (see [`Rule::counts`]).
    pub(crate) fn uncounted(mut self) -> Self {
        self.counts = false;
        self
    }

    /// The id of the rule whose decisions this line counts, if it counts.
    pub(crate) fn counted_id(&self) -> Option<&RuleId> {
        self.id.as_ref().filter(|_| self.counts)
    }

    /// The rule, recorded as enforcing `id`.
    pub(crate) fn with_id(mut self, id: RuleId) -> Self {
        self.id = Some(id);
        self
    }

    /// Matches everything.
    pub(crate) fn always(action: Action) -> Self {
        Self::new(Match::new(), action)
    }

    pub(crate) fn comment(mut self, comment: impl Into<String>) -> Self {
        self.comments.push(comment.into());
        self
    }

    /// `-A <chain> <hash-fragment> <comments> <matches> <action>`.
    pub(crate) fn render_append(&self, chain: &str, hash_fragment: &str) -> String {
        let mut out = String::with_capacity(96);
        let _ = write!(out, "-A {}", quote::arg(chain));
        if !hash_fragment.is_empty() {
            out.push(' ');
            out.push_str(hash_fragment);
        }
        for c in &self.comments {
            let _ = write!(out, " -m comment --comment {}", quote::comment_arg(c));
        }
        if !self.matches.is_empty() {
            out.push(' ');
            self.matches.render_iptables(&mut out);
        }
        out.push(' ');
        self.action.render(&mut out);
        out
    }

    /// The rule as written to `iptables-restore`, tagged with its hash.
    pub(crate) fn render_with_hash(&self, chain: &str, hash: &str) -> String {
        self.render_append(chain, &hash_comment(hash))
    }
}

/// `-m comment --comment "cali:<hash>"`.
pub(crate) fn hash_comment(hash: &str) -> String {
    format!("-m comment --comment \"cali:{hash}\"")
}

/// Which address of a packet a match looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dir {
    Src,
    Dst,
}

/// How a mark match tests its bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MarkTest {
    /// `(mark & bits) == 0`.
    Clear,
    /// `(mark & bits) == bits`.
    Set,
    /// `(mark & bits) != 0`. No chain uses it yet; every writer renders it and the kernel
    /// tests check both nftables encodings agree.
    #[cfg_attr(not(test), allow(dead_code))]
    NotClear,
}

/// One match criterion. Kept structured so that each backend renders it in its own syntax
/// (`iptables-restore` here, `nft -f` in `nft::render`); strings in it are validated values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Frag {
    /// An interface name; a trailing `+` is iptables' wildcard.
    InIface(String),
    OutIface(String),
    Mark(MarkTest, u32),
    /// Strict reverse-path check failed (with the packet's mark in the lookup).
    RpfFailed,
    /// Conntrack states in iptables' spelling (`RELATED,ESTABLISHED`).
    CtState {
        state: String,
        negated: bool,
    },
    Protocol {
        proto: String,
        negated: bool,
    },
    Net {
        dir: Dir,
        cidr: String,
        negated: bool,
    },
    /// An IP set by kernel name; `ip_port` for `hash:ip,port` sets (address, protocol, port).
    Set {
        dir: Dir,
        name: String,
        ip_port: bool,
        negated: bool,
    },
    /// Ports as `80,443,8000:8080`.
    Ports {
        dir: Dir,
        ports: String,
        negated: bool,
    },
    Icmp {
        v: IpVersion,
        ty: i32,
        code: Option<i32>,
        negated: bool,
    },
}

impl Frag {
    /// The fragment in `iptables-restore` syntax.
    fn render_iptables(&self, out: &mut String) {
        let not = |n: bool| if n { "! " } else { "" };
        let d = |dir: Dir| match dir {
            Dir::Src => "src",
            Dir::Dst => "dst",
        };
        let _ = match self {
            Frag::InIface(i) => write!(out, "--in-interface {}", quote::arg(i)),
            Frag::OutIface(i) => write!(out, "--out-interface {}", quote::arg(i)),
            Frag::Mark(MarkTest::Clear, b) => write!(out, "-m mark --mark 0/{b:#x}"),
            Frag::Mark(MarkTest::Set, b) => write!(out, "-m mark --mark {b:#x}/{b:#x}"),
            Frag::Mark(MarkTest::NotClear, b) => write!(out, "-m mark ! --mark 0/{b:#x}"),
            Frag::RpfFailed => write!(out, "-m rpfilter --validmark --invert"),
            Frag::CtState { state, negated } => write!(
                out,
                "-m conntrack {}--ctstate {}",
                not(*negated),
                quote::arg(state)
            ),
            Frag::Protocol { proto, negated } => {
                write!(out, "{}--protocol {}", not(*negated), quote::arg(proto))
            }
            Frag::Net { dir, cidr, negated } => {
                let opt = match dir {
                    Dir::Src => "--source",
                    Dir::Dst => "--destination",
                };
                write!(out, "{}{opt} {}", not(*negated), quote::arg(cidr))
            }
            Frag::Set {
                dir,
                name,
                ip_port,
                negated,
            } => {
                let flags = if *ip_port {
                    format!("{0},{0}", d(*dir))
                } else {
                    d(*dir).to_owned()
                };
                write!(
                    out,
                    "-m set {}--match-set {} {flags}",
                    not(*negated),
                    quote::arg(name)
                )
            }
            Frag::Ports {
                dir,
                ports,
                negated,
            } => {
                let opt = match dir {
                    Dir::Src => "--source-ports",
                    Dir::Dst => "--destination-ports",
                };
                write!(
                    out,
                    "-m multiport {}{opt} {}",
                    not(*negated),
                    quote::arg(ports)
                )
            }
            Frag::Icmp {
                v,
                ty,
                code,
                negated,
            } => {
                let (m, opt) = icmp_names(*v);
                match code {
                    Some(c) => write!(out, "-m {m} {}--{opt} {ty}/{c}", not(*negated)),
                    None => write!(out, "-m {m} {}--{opt} {ty}", not(*negated)),
                }
            }
        };
    }
}

/// Match criteria built fragment by fragment; all must hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Match(Vec<Frag>);

impl Match {
    pub(crate) fn new() -> Self {
        Self(Vec::new())
    }

    fn push(mut self, frag: Frag) -> Self {
        self.0.push(frag);
        self
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(crate) fn frags(&self) -> &[Frag] {
        &self.0
    }

    /// The criteria in `iptables-restore` syntax.
    pub(crate) fn render_iptables(&self, out: &mut String) {
        for (i, f) in self.0.iter().enumerate() {
            if i > 0 {
                out.push(' ');
            }
            f.render_iptables(out);
        }
    }

    pub(crate) fn in_iface(self, iface: &str) -> Self {
        self.push(Frag::InIface(iface.to_owned()))
    }
    pub(crate) fn out_iface(self, iface: &str) -> Self {
        self.push(Frag::OutIface(iface.to_owned()))
    }
    /// `(mark & bits) == 0`.
    pub(crate) fn mark_clear(self, bits: u32) -> Self {
        self.push(Frag::Mark(MarkTest::Clear, bits))
    }
    /// `(mark & bit) == bit`.
    pub(crate) fn mark_set(self, bit: u32) -> Self {
        self.push(Frag::Mark(MarkTest::Set, bit))
    }
    /// `(mark & bits) != 0`.
    #[cfg(test)]
    pub(crate) fn mark_not_clear(self, bits: u32) -> Self {
        self.push(Frag::Mark(MarkTest::NotClear, bits))
    }
    /// The packet's source fails strict reverse-path filtering (`-m rpfilter --validmark
    /// --invert`): it would not be routed back out of the interface it came in on.
    pub(crate) fn rpf_check_failed(self) -> Self {
        self.push(Frag::RpfFailed)
    }
    pub(crate) fn conntrack_state(self, state: &str) -> Self {
        self.push(Frag::CtState {
            state: state.to_owned(),
            negated: false,
        })
    }
    pub(crate) fn not_conntrack_state(self, state: &str) -> Self {
        self.push(Frag::CtState {
            state: state.to_owned(),
            negated: true,
        })
    }
    pub(crate) fn protocol(self, p: &str) -> Self {
        self.push(Frag::Protocol {
            proto: p.to_owned(),
            negated: false,
        })
    }
    pub(crate) fn not_protocol(self, p: &str) -> Self {
        self.push(Frag::Protocol {
            proto: p.to_owned(),
            negated: true,
        })
    }
    fn net(self, dir: Dir, cidr: &str, negated: bool) -> Self {
        self.push(Frag::Net {
            dir,
            cidr: cidr.to_owned(),
            negated,
        })
    }
    pub(crate) fn src_net(self, cidr: &str) -> Self {
        self.net(Dir::Src, cidr, false)
    }
    pub(crate) fn not_src_net(self, cidr: &str) -> Self {
        self.net(Dir::Src, cidr, true)
    }
    pub(crate) fn dst_net(self, cidr: &str) -> Self {
        self.net(Dir::Dst, cidr, false)
    }
    pub(crate) fn not_dst_net(self, cidr: &str) -> Self {
        self.net(Dir::Dst, cidr, true)
    }
    /// This match with every reference to set `from` naming `to` instead; `None` if it names
    /// no such set.
    pub(crate) fn with_set_renamed(&self, from: &str, to: &str) -> Option<Self> {
        let mut any = false;
        let frags = self
            .0
            .iter()
            .map(|f| match f {
                Frag::Set {
                    dir,
                    name,
                    ip_port,
                    negated,
                } if name == from => {
                    any = true;
                    Frag::Set {
                        dir: *dir,
                        name: to.to_owned(),
                        ip_port: *ip_port,
                        negated: *negated,
                    }
                }
                other => other.clone(),
            })
            .collect();
        any.then_some(Self(frags))
    }

    fn set(self, dir: Dir, name: &str, ip_port: bool, negated: bool) -> Self {
        self.push(Frag::Set {
            dir,
            name: name.to_owned(),
            ip_port,
            negated,
        })
    }
    pub(crate) fn src_set(self, set: &str) -> Self {
        self.set(Dir::Src, set, false, false)
    }
    pub(crate) fn not_src_set(self, set: &str) -> Self {
        self.set(Dir::Src, set, false, true)
    }
    pub(crate) fn dst_set(self, set: &str) -> Self {
        self.set(Dir::Dst, set, false, false)
    }
    pub(crate) fn not_dst_set(self, set: &str) -> Self {
        self.set(Dir::Dst, set, false, true)
    }
    pub(crate) fn src_ip_port_set(self, set: &str) -> Self {
        self.set(Dir::Src, set, true, false)
    }
    pub(crate) fn not_src_ip_port_set(self, set: &str) -> Self {
        self.set(Dir::Src, set, true, true)
    }
    pub(crate) fn dst_ip_port_set(self, set: &str) -> Self {
        self.set(Dir::Dst, set, true, false)
    }
    pub(crate) fn not_dst_ip_port_set(self, set: &str) -> Self {
        self.set(Dir::Dst, set, true, true)
    }
    fn ports(self, dir: Dir, ports: &str, negated: bool) -> Self {
        self.push(Frag::Ports {
            dir,
            ports: ports.to_owned(),
            negated,
        })
    }
    /// `ports` already rendered as `80,443,8000:8080` (at most 15 slots).
    pub(crate) fn src_ports(self, ports: &str) -> Self {
        self.ports(Dir::Src, ports, false)
    }
    pub(crate) fn not_src_ports(self, ports: &str) -> Self {
        self.ports(Dir::Src, ports, true)
    }
    pub(crate) fn dst_ports(self, ports: &str) -> Self {
        self.ports(Dir::Dst, ports, false)
    }
    pub(crate) fn not_dst_ports(self, ports: &str) -> Self {
        self.ports(Dir::Dst, ports, true)
    }
    pub(crate) fn icmp_type(self, v: IpVersion, ty: i32, code: Option<i32>) -> Self {
        self.push(Frag::Icmp {
            v,
            ty,
            code,
            negated: false,
        })
    }
    pub(crate) fn not_icmp_type(self, v: IpVersion, ty: i32, code: Option<i32>) -> Self {
        self.push(Frag::Icmp {
            v,
            ty,
            code,
            negated: true,
        })
    }
}

fn icmp_names(v: IpVersion) -> (&'static str, &'static str) {
    match v {
        IpVersion::V4 => ("icmp", "icmp-type"),
        IpVersion::V6 => ("icmp6", "icmpv6-type"),
    }
}

/// A named chain and its rules, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Chain {
    pub name: String,
    pub rules: Vec<Rule>,
}

impl Chain {
    pub(crate) fn new(name: impl Into<String>, rules: Vec<Rule>) -> Self {
        Self {
            name: name.into(),
            rules,
        }
    }
}

/// Each rule's `cali:` hash as the iptables writer gives it: a SHA-224 chain seeded with the
/// chain name `seed`, so a hash depends on the rule, its position and every rule before it
/// (kernel hook chains are hashed under their own name for inserts and `<name>*appends*` for
/// appends).
pub(crate) fn rule_hashes(seed: &str, rules: &[Rule]) -> Vec<String> {
    let mut hash = Sha224::digest(seed.as_bytes());
    rules
        .iter()
        .map(|rule| {
            let mut h = Sha224::new();
            h.update(hash);
            h.update(rule.render_append(seed, "HASH").as_bytes());
            hash = h.finalize();
            let mut s = URL_SAFE_NO_PAD.encode(hash);
            s.truncate(HASH_LEN);
            s
        })
        .collect()
}

/// Calico's short kind names, used in policy chain names.
pub(crate) fn kind_short_name(kind: &str) -> String {
    match kind {
        "GlobalNetworkPolicy" => "gnp".into(),
        "NetworkPolicy" => "np".into(),
        "StagedNetworkPolicy" => "snp".into(),
        "StagedGlobalNetworkPolicy" => "sgnp".into(),
        "StagedKubernetesNetworkPolicy" => "sknp".into(),
        "KubernetesNetworkPolicy" => "knp".into(),
        "ClusterNetworkPolicy" | "KubernetesClusterNetworkPolicy" => "kcnp".into(),
        other => other.to_ascii_lowercase(),
    }
}

/// `"<kindshort>/<name>"` or `"<kindshort>/<ns>/<name>"`.
pub(crate) fn policy_id_string(id: &felix_proto::PolicyId) -> String {
    let kind = kind_short_name(&id.kind);
    if id.namespace.is_empty() {
        format!("{kind}/{}", id.name)
    } else {
        format!("{kind}/{}/{}", id.namespace, id.name)
    }
}

/// Policy chain prefixes.
pub(crate) const POLICY_INBOUND_PFX: &str = "cali-pi-";
pub(crate) const POLICY_OUTBOUND_PFX: &str = "cali-po-";
pub(crate) const PROFILE_INBOUND_PFX: &str = "cali-pri-";
pub(crate) const PROFILE_OUTBOUND_PFX: &str = "cali-pro-";

/// A policy chain name, length-limited as Calico does.
pub(crate) fn policy_chain_name(prefix: &str, id: &felix_proto::PolicyId) -> String {
    chain_name(prefix, &policy_id_string(id))
}

/// A profile chain name, length-limited as Calico does.
pub(crate) fn profile_chain_name(prefix: &str, profile: &str) -> String {
    chain_name(prefix, profile)
}

/// An endpoint chain name (`cali-tw-<iface>` …), length-limited as Calico does.
pub(crate) fn endpoint_chain_name(prefix: &str, iface: &str) -> String {
    chain_name(prefix, iface)
}

/// `prefix + id` as Calico names it (the id itself while it fits, else its hash). An id with a
/// character that a chain-declaration line cannot carry (those lines take no quoting) is always
/// hashed: valid Calico names never have one, so this only changes names the validator refuses,
/// and it keeps every chain name safe by construction.
fn chain_name(prefix: &str, id: &str) -> String {
    if !id.is_empty() && id.bytes().all(quote::is_bare) {
        return calico_names::hash::length_limited_id(prefix, id, MAX_CHAIN_NAME);
    }
    let hash = URL_SAFE_NO_PAD.encode(sha2::Sha256::digest(id.as_bytes()));
    let keep = MAX_CHAIN_NAME
        .saturating_sub(prefix.len() + 1)
        .min(hash.len());
    format!("{prefix}_{}", &hash[..keep])
}

/// Longest ipset name the kernel accepts.
pub(crate) const MAX_IPSET_NAME: usize = 31;

/// The kernel name of an IP set id for one family: `cali40<id>` / `cali60<id>`, cut to 31.
pub(crate) fn ipset_name(v: IpVersion, id: &str) -> String {
    let mut name = format!("cali{}0{id}", v.number());
    if name.len() > MAX_IPSET_NAME {
        let mut cut = MAX_IPSET_NAME;
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        name.truncate(cut);
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_chain_names_match_calico() {
        let id = felix_proto::PolicyId {
            name: "pol-1".into(),
            namespace: String::new(),
            kind: "GlobalNetworkPolicy".into(),
        };
        assert_eq!(
            policy_chain_name(POLICY_INBOUND_PFX, &id),
            "cali-pi-gnp/pol-1"
        );
        let long = felix_proto::PolicyId {
            name: "long-policy-name-that-gets-hashed".into(),
            namespace: String::new(),
            kind: "GlobalNetworkPolicy".into(),
        };
        // Calico's own test vector (felix/rules).
        assert_eq!(
            policy_chain_name(POLICY_INBOUND_PFX, &long),
            "cali-pi-_PymyFHQQg3808jiz1OJ"
        );
        let ns = felix_proto::PolicyId {
            name: "allow-web".into(),
            namespace: "prod".into(),
            kind: "NetworkPolicy".into(),
        };
        assert_eq!(
            policy_chain_name(POLICY_OUTBOUND_PFX, &ns),
            "cali-po-np/prod/allow-web"
        );
    }

    #[test]
    fn names_with_unsafe_characters_are_always_hashed() {
        let id = felix_proto::PolicyId {
            name: "a b".into(),
            namespace: String::new(),
            kind: "GlobalNetworkPolicy".into(),
        };
        let name = policy_chain_name(POLICY_INBOUND_PFX, &id);
        assert!(
            name.starts_with("cali-pi-_") && name.len() == MAX_CHAIN_NAME,
            "{name}"
        );
        assert!(name.bytes().all(quote::is_bare));
        let iface = endpoint_chain_name("cali-tw-", "x\n-A INPUT");
        assert!(iface.bytes().all(quote::is_bare), "{iface}");
        assert_ne!(iface, endpoint_chain_name("cali-tw-", "x\n-A INPUT2"));
    }

    #[test]
    fn ipset_names_are_cut_to_31() {
        let n = ipset_name(IpVersion::V4, "s:5y5I3VdRZfDU01O--xXAPx2AO5xQ6Vf6pbgP0");
        assert_eq!(n, "cali40s:5y5I3VdRZfDU01O--xXAPx2");
        assert_eq!(ipset_name(IpVersion::V6, "short"), "cali60short");
    }

    #[test]
    fn hashes_depend_on_position_and_chain() {
        let a = Rule::always(Action::Accept);
        let d = Rule::always(Action::Drop);
        let h1 = rule_hashes("cali-x", &[a.clone(), d.clone()]);
        let h2 = rule_hashes("cali-x", &[d.clone(), d.clone()]);
        let h3 = rule_hashes("cali-y", &[a.clone(), d.clone()]);
        assert_eq!(h1.len(), 2);
        assert!(h1.iter().all(|h| h.len() == HASH_LEN));
        // The second rule is the same but the first differs: its hash differs too.
        assert_ne!(h1[1], h2[1]);
        assert_ne!(h1[0], h3[0]);
        assert_eq!(h1, rule_hashes("cali-x", &[a, d]));
    }

    #[test]
    fn rules_render_in_iptables_restore_syntax() {
        let r = Rule::new(
            Match::new().protocol("tcp").dst_ports("80,443"),
            Action::SetMark(marks::ACCEPT),
        )
        .comment("say \"hi\"");
        assert_eq!(
            r.render_with_hash("cali-pi-x", "abc"),
            "-A cali-pi-x -m comment --comment \"cali:abc\" -m comment --comment \"say _hi_\" \
             --protocol tcp -m multiport --destination-ports 80,443 \
             --jump MARK --set-mark 0x10000/0x10000"
        );
    }
}
