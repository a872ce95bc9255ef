//! Calico's etcd v3 layout: which keys the graph reads and what their values mean.
//!
//! - [`decode()`]: one key/value → a [`Decision`](crate::Decision) (policy names restored,
//!   metadata filled from the key) or a rejection naming the key.
//! - [`put`] and [`adopt_last_good`]: a key's value into the [`Mirror`], identified by the key
//!   and versioned by the value's bytes. One list covers the whole prefix, so the mirror's list
//!   group is `()`.

pub mod decode;

use crate::Batch;
use crate::mirror::Fingerprint;

pub use decode::{decode, kind_of_plural, parse_key};

/// Where Calico keeps the v3 resources.
pub const RESOURCE_PREFIX: &str = "/calico/resources/v3/projectcalico.org/";

/// What the graph was last given per etcd key.
pub type Mirror = crate::mirror::Mirror<Box<str>>;

/// A key's current value (from a list page or a watch event). A value's bytes are its version:
/// an unchanged value is not decoded again.
pub fn put(mirror: &mut Mirror, key: &str, value: &[u8], out: &mut Batch) {
    // Other key families under the prefix (BGP, IPAM configuration, …) never
    // deliver anything: they are not tracked at all.
    if matches!(parse_key(key), Ok(None)) {
        return;
    }
    mirror.put(
        (),
        key,
        Some(Fingerprint::of(value)),
        || decode(key, value),
        out,
    );
}

/// `value` is an earlier version of `key` (from etcd's history) to keep in force while the
/// key's current value stays rejected; see [`Mirror::adopt_last_good`]. True if adopted.
pub fn adopt_last_good(mirror: &mut Mirror, key: &str, value: &[u8], out: &mut Batch) -> bool {
    mirror.adopt_last_good(key, || decode(key, value), out)
}

#[cfg(test)]
mod tests;
