//! The config manager: FelixConfiguration from the stream applied over the agent's flags, and
//! the static chains (`cali-INPUT`, `cali-FORWARD`, failsafes, NAT, …) those settings shape.
//!
//! Contract: `on_update` only keeps the latest `ConfigUpdate`; [`ConfigManager::apply`] takes it
//! (with Felix's precedence, see [`super::config`]) at the start of the next apply and says what
//! changed, so the driver can have the other managers follow (endpoints re-checked against new
//! workload prefixes, policies re-rendered for a new log prefix). A prefix that matches one of
//! the host's own interfaces is refused and the flag's value kept. The static chains are
//! re-rendered only when a setting they depend on (or the IPAM pools) changed.

use std::collections::BTreeMap;

use tracing::{info, warn};

use super::desired::Tables;
use super::interfaces::Interfaces;
use super::rules::static_chains;
use super::rules::{self, IpVersion};
use super::{LinuxOptions, MASQ_POOLS_SET, NETWORK_POOLS_SET, config};
use crate::message::Message;

pub(crate) struct ConfigManager {
    /// The options from flags and defaults alone.
    base: LinuxOptions,
    /// The options in force (flags and defaults, with datastore settings applied).
    opts: LinuxOptions,
    /// The last FelixConfiguration map from the server, not yet applied.
    pending: Option<BTreeMap<String, String>>,
    /// The FelixConfiguration settings last reported as not applied.
    not_applied: Option<String>,
    /// The static chains must be rendered again.
    statics_dirty: bool,
}

/// What applying a FelixConfiguration changed, for the other managers to follow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ConfigChanges {
    /// The workload interface prefixes in force changed: every endpoint must be checked again.
    pub prefixes: bool,
    /// The log prefix or flow logs changed: every policy and profile renders differently.
    pub render: bool,
    /// Flow logs changed: every endpoint chain renders differently too.
    pub endpoints: bool,
}

impl ConfigManager {
    pub(crate) fn new(opts: LinuxOptions) -> Self {
        Self {
            base: opts.clone(),
            opts,
            pending: None,
            not_applied: None,
            statics_dirty: true,
        }
    }

    /// The options in force.
    pub(crate) fn opts(&self) -> &LinuxOptions {
        &self.opts
    }

    pub(crate) fn on_update(&mut self, msg: &Message) {
        if let Message::Config(u) = msg {
            self.pending = Some(u.config.clone().into_iter().collect());
        }
    }

    /// The static chains depend on something that changed outside the settings (the pools).
    pub(crate) fn mark_statics_dirty(&mut self) {
        self.statics_dirty = true;
    }

    /// MASQUERADE gets `--random-fully` where supported, unless the operator says otherwise.
    pub(crate) fn masq_fully_random(&self, supported: Option<bool>) -> bool {
        self.opts.masq_fully_random.or(supported).unwrap_or(false)
    }

    /// Applies a FelixConfiguration map from the server, if one came: a change to the static
    /// chains' settings marks them for rendering; the rest is for the driver to pass on.
    pub(crate) fn apply(&mut self, ifaces: &Interfaces) -> ConfigChanges {
        let Some(ds) = self.pending.take() else {
            return ConfigChanges::default();
        };
        let (mut next, mut problems) = config::effective(&self.base, &self.base.pinned, &ds);
        // A prefix matching one of the host's own interfaces would hand it to workload
        // dispatch (its traffic dropped as "unknown workload"): refused, flag value kept.
        if next.statics.workload_prefixes != self.base.statics.workload_prefixes {
            let clash = next.statics.workload_prefixes.iter().find_map(|p| {
                ifaces
                    .host_interfaces_matching(p)
                    .into_iter()
                    .next()
                    .map(|(iface, why)| (p.clone(), iface, why))
            });
            if let Some((prefix, iface, why)) = clash {
                problems.push(format!(
                    "FelixConfiguration InterfacePrefix: {prefix:?} matches host interface {iface:?} ({why})"
                ));
                next.statics.workload_prefixes = self.base.statics.workload_prefixes.clone();
            }
        }
        for p in problems {
            warn!(problem = %p, "datastore setting ignored");
        }
        let (unused, by_flag, at_start) = config::not_applied(&self.base.pinned, &ds);
        let summary = format!(
            "not used by this agent: {}; pinned by a flag: {}; read at start only (use the flag): {}",
            list_or_none(&unused),
            list_or_none(&by_flag),
            list_or_none(&at_start)
        );
        // Once per change of what is not applied, not on every ConfigUpdate.
        if !(unused.is_empty() && by_flag.is_empty() && at_start.is_empty())
            && self.not_applied.as_deref() != Some(summary.as_str())
        {
            info!(settings = %summary, "FelixConfiguration settings not applied");
        }
        self.not_applied = Some(summary);
        let statics_changed = next.statics.workload_prefixes != self.opts.statics.workload_prefixes
            || next.statics.endpoint_to_host != self.opts.statics.endpoint_to_host
            || next.statics.failsafe_in != self.opts.statics.failsafe_in
            || next.statics.failsafe_out != self.opts.statics.failsafe_out
            || next.masq_fully_random != self.opts.masq_fully_random;
        let flow_logs_changed = next.render.flow_logs != self.opts.render.flow_logs;
        let render_changed =
            next.render.log_prefix != self.opts.render.log_prefix || flow_logs_changed;
        if statics_changed || render_changed {
            info!(
                endpoint_to_host = ?next.statics.endpoint_to_host,
                prefixes = ?next.statics.workload_prefixes,
                log_prefix = %next.render.log_prefix,
                flow_logs = next.render.flow_logs,
                "datastore settings applied"
            );
        }
        let prefixes_changed =
            next.statics.workload_prefixes != self.opts.statics.workload_prefixes;
        self.opts.statics = next.statics;
        self.opts.render = next.render;
        self.opts.masq_fully_random = next.masq_fully_random;
        if next.hit_counters != self.opts.hit_counters {
            info!(
                hit_counters = next.hit_counters,
                "FeatureGates PolicyHitCounters applied: rule hit counters are {}",
                if next.hit_counters {
                    "read"
                } else {
                    "not read"
                }
            );
            self.opts.hit_counters = next.hit_counters;
        }
        if statics_changed {
            self.statics_dirty = true;
        }
        ConfigChanges {
            prefixes: prefixes_changed,
            render: render_changed,
            endpoints: flow_logs_changed,
        }
    }

    /// Renders the static chains into every table if anything they depend on changed.
    /// `masquerading(v)`: family `v` has a natOutgoing pool (its MASQUERADE rule exists only
    /// then, as Felix renders it).
    pub(crate) fn apply_statics(
        &mut self,
        tables: &mut Tables,
        masquerading: impl Fn(IpVersion) -> bool,
        fully_random: bool,
    ) {
        if !self.statics_dirty {
            return;
        }
        for v in tables.versions().to_vec() {
            let (chains, hooks) = static_chains::filter(&self.opts.statics, v);
            let t = tables.table(v, "filter");
            chains.into_iter().for_each(|c| t.set_chain(c));
            t.set_hooks(hooks);
            let (chains, hooks) = static_chains::raw(&self.opts.statics, v);
            let t = tables.table(v, "raw");
            chains.into_iter().for_each(|c| t.set_chain(c));
            t.set_hooks(hooks);
            let (chains, hooks) = static_chains::mangle(&self.opts.statics, v);
            let t = tables.table(v, "mangle");
            chains.into_iter().for_each(|c| t.set_chain(c));
            t.set_hooks(hooks);
            let (chains, hooks) = static_chains::nat(
                &rules::ipset_name(v, MASQ_POOLS_SET),
                &rules::ipset_name(v, NETWORK_POOLS_SET),
                masquerading(v),
                fully_random,
            );
            let t = tables.table(v, "nat");
            chains.into_iter().for_each(|c| t.set_chain(c));
            t.set_hooks(hooks);
        }
        self.statics_dirty = false;
    }
}

/// `"a", "b"` or `none`. The names come from the datastore: quoted and escaped, so a control
/// character cannot forge log output.
fn list_or_none(items: &[&str]) -> String {
    if items.is_empty() {
        "none".into()
    } else {
        items
            .iter()
            .map(|i| format!("{i:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_named_in_logs_are_escaped() {
        assert_eq!(list_or_none(&[]), "none");
        assert_eq!(
            list_or_none(&["BPFEnabled", "X\u{1b}[2Jy"]),
            "\"BPFEnabled\", \"X\\u{1b}[2Jy\""
        );
    }
}
