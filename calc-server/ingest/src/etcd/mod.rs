//! Calico's etcd v3 layout: which keys the graph reads and what their values mean.
//!
//! - [`decode()`]: one key/value → a [`Decision`](crate::Decision) (policy names restored,
//!   metadata filled from the key) or a rejection naming the key.
//! - [`put`] and [`adopt_last_good`]: a key's value into the [`Mirror`], identified by the key
//!   and versioned by the value's bytes. One list covers the whole prefix, so the mirror's list
//!   group is `()`. [`put_many`]: the same for a page, its changed values decoded on several
//!   threads first.

pub mod decode;

use crate::mirror::Fingerprint;
use crate::{Batch, Decision};

pub use decode::{decode, kind_of_plural, parse_key};

/// Where Calico keeps the v3 resources.
pub const RESOURCE_PREFIX: &str = "/calico/resources/v3/projectcalico.org/";

/// What the graph was last given per etcd key.
pub type Mirror = crate::mirror::Mirror<Box<str>>;

/// A key's current value (from a list page or a watch event). A value's bytes are its version:
/// an unchanged value is not decoded again.
pub fn put(mirror: &mut Mirror, key: &str, value: &[u8], out: &mut Batch) {
    put_decided(mirror, key, value, Fingerprint::of(value), None, out);
}

/// Below this many values per thread, a page is decoded on the calling thread: threads cost
/// more than they save.
const PARALLEL_DECODE_MIN: usize = 512;

/// [`put`] for each key/value in order, with the values that changed fingerprinted and
/// decoded first on up to `threads` threads (a cold start's list pages are mostly decoding, and decoding one value
/// depends on nothing else). The mirror's bookkeeping stays sequential, in the given order,
/// so the result is the same as calling [`put`] for each. `on_put` is called after each put
/// with its index, for callers that look at what it added to `out`.
pub fn put_many(
    mirror: &mut Mirror,
    items: &[(&str, &[u8])],
    threads: usize,
    out: &mut Batch,
    mut on_put: impl FnMut(usize, &Batch),
) {
    let threads = threads.clamp(1, items.len().div_ceil(PARALLEL_DECODE_MIN).max(1));
    if threads == 1 {
        for (i, (key, value)) in items.iter().enumerate() {
            put(mirror, key, value, out);
            on_put(i, out);
        }
        return;
    }
    // Each thread fingerprints its values too: hashing every value is a pass over the page.
    let current: &Mirror = mirror;
    let decide = move |&(key, value): &(&str, &[u8])| {
        let version = Fingerprint::of(value);
        let changed = !matches!(parse_key(key), Ok(None)) && !current.is_current(key, version);
        (version, changed.then(|| decode(key, value)))
    };
    let per_thread = items.len().div_ceil(threads);
    let decided: Vec<(Fingerprint, Option<Decision>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = items
            .chunks(per_thread)
            .map(|chunk| scope.spawn(move || chunk.iter().map(decide).collect::<Vec<_>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| {
                h.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    });
    for (i, ((key, value), (version, pre))) in items.iter().zip(decided).enumerate() {
        put_decided(mirror, key, value, version, pre, out);
        on_put(i, out);
    }
}

/// [`put`] of a value whose fingerprint is `version`, its decision already made when `pre` is
/// given.
fn put_decided(
    mirror: &mut Mirror,
    key: &str,
    value: &[u8],
    version: Fingerprint,
    pre: Option<Decision>,
    out: &mut Batch,
) {
    // Other key families under the prefix (BGP, IPAM configuration, …) never
    // deliver anything: they are not tracked at all.
    if matches!(parse_key(key), Ok(None)) {
        return;
    }
    mirror.put(
        (),
        key,
        Some(version),
        || pre.unwrap_or_else(|| decode(key, value)),
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
