//! The masquerade manager: IPAM pools, as Felix's masquerade manager keeps them.
//!
//! Contract: `on_update` checks and records pools; [`MasqManager::apply`] fills the agent's two
//! pool sets (`masq-ipam-pools`: the natOutgoing pools; `network-ip-pools`: the pools workloads
//! and tunnels use) and says when the pools changed, so the NAT static chains are rendered
//! again ([`MasqManager::masquerading`] says whether a family's MASQUERADE rule exists).

use std::collections::BTreeMap;

use felix_proto::IpamPool;

use super::desired::{SetKind, Sets};
use super::refusals::Refusals;
use super::rules::IpVersion;
use super::validate;
use super::{MASQ_POOLS_SET, NETWORK_POOLS_SET};
use crate::message::{IpamPoolId, Message};

pub(crate) struct MasqManager {
    pools: BTreeMap<IpamPoolId, IpamPool>,
    dirty: bool,
}

impl Default for MasqManager {
    fn default() -> Self {
        // The pool sets exist (empty) from the first apply on: the NAT chains name them.
        Self {
            pools: BTreeMap::new(),
            dirty: true,
        }
    }
}

impl MasqManager {
    pub(crate) fn on_update(&mut self, msg: &Message, refusals: &mut Refusals) {
        match msg {
            Message::IpamPoolUpdate { id, pool } => {
                let what = format!("IPAM pool {id:?}");
                if let Err(e) = validate::ipam_pool(id.as_str(), pool) {
                    return refusals.reject(what, e.to_string());
                }
                refusals.accept(&what);
                self.pools.insert(id.clone(), pool.clone());
                self.dirty = true;
            }
            Message::IpamPoolRemove { id } if self.pools.contains_key(id) => {
                self.pools.remove(id);
                self.dirty = true;
            }
            _ => {}
        }
    }

    /// Fills the pool sets if the pools changed; returns whether they did (the NAT chains
    /// follow).
    pub(crate) fn apply(&mut self, sets: &mut Sets) -> bool {
        if !self.dirty {
            return false;
        }
        // A pool only LoadBalancer addresses come from is outside the network: traffic to it
        // from a natOutgoing pool is masqueraded.
        let network: Vec<String> = self
            .pools
            .values()
            .filter(|p| {
                p.allowed_uses.is_empty() || p.allowed_uses.iter().any(|u| u != "LoadBalancer")
            })
            .map(|p| p.cidr.clone())
            .collect();
        let masq: Vec<String> = self
            .pools
            .values()
            .filter(|p| p.masquerade)
            .map(|p| p.cidr.clone())
            .collect();
        // Our own sets: their members are trusted.
        sets.replace(NETWORK_POOLS_SET, SetKind::Net, &network);
        sets.replace(MASQ_POOLS_SET, SetKind::Net, &masq);
        self.dirty = false;
        true
    }

    /// Whether family `v` has a natOutgoing pool.
    pub(crate) fn masquerading(&self, v: IpVersion) -> bool {
        self.pools
            .values()
            .any(|p| p.masquerade && v.matches(&p.cidr))
    }
}
