//! Calico-compatible ids (`libcalico-go/lib/hash`).
//!
//! These strings end up as IP set names, chain names and map keys shared with Felix-era
//! state, so they must match Calico's byte for byte.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use sha2::{Digest, Sha224, Sha256};

/// Marks an id whose suffix was replaced by a hash (Calico's `shortenedPrefix`).
const SHORTENED_MARKER: char = '_';

/// Calico's `hash.MakeUniqueID`: `prefix + ":" + base64url_nopad(SHA-224(prefix + ":" + content))`.
///
/// The hash part is always 38 characters.
pub fn make_unique_id(prefix: &str, content: &str) -> String {
    let digest = Sha224::new()
        .chain_update(prefix)
        .chain_update(":")
        .chain_update(content)
        .finalize();
    let mut id = String::with_capacity(prefix.len() + 1 + 38);
    id.push_str(prefix);
    id.push(':');
    URL_SAFE_NO_PAD.encode_string(digest, &mut id);
    id
}

/// Calico's `hash.GetLengthLimitedID`: `prefix + suffix` if that fits in `max_len` bytes,
/// otherwise `prefix + "_" + base64url_nopad(SHA-256(suffix))` cut to `max_len`.
///
/// An exact fit whose suffix starts with `_` is hashed too, so that it cannot collide with a
/// shortened id; an empty suffix counts as `"_"`.
///
/// Calico panics when `max_len` leaves no room for any hash characters, or (by slicing past
/// the end) more room than the 43-character hash; here the hash part is clamped to that range
/// instead, so the result may then be longer or shorter than `max_len`. Callers pass fixed
/// prefixes and limits, so neither case arises in practice.
pub fn length_limited_id(prefix: &str, suffix: &str, max_len: usize) -> String {
    let suffix = if suffix.is_empty() { "_" } else { suffix };
    let total = prefix.len() + suffix.len();
    let fits = total < max_len || (total == max_len && !suffix.starts_with(SHORTENED_MARKER));
    if fits {
        return format!("{prefix}{suffix}");
    }
    let hash = URL_SAFE_NO_PAD.encode(Sha256::digest(suffix));
    let keep = max_len.saturating_sub(prefix.len() + 1).min(hash.len());
    format!("{prefix}{SHORTENED_MARKER}{}", &hash[..keep])
}

/// The id of a named-port IP set (Felix's `IPSetData.UniqueID()` for named ports):
/// `MakeUniqueID("n", selector_uid + "," + protocol + "," + port_name)`.
///
/// `protocol` is `tcp`, `udp`, `sctp` or `any`; `selector_unique_id` is the `s:` id of the
/// selector in that rule direction (`all()`'s when there is none).
pub fn named_port_ipset_id(selector_unique_id: &str, protocol: &str, port_name: &str) -> String {
    make_unique_id("n", &format!("{selector_unique_id},{protocol},{port_name}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    const CALC_STATES: &str = include_str!("../../testdata/calc_states.json");

    #[test]
    fn unique_id_of_all() {
        assert_eq!(
            make_unique_id("s", "all()"),
            "s:5y5I3VdRZfDU01O--xXAPx2yxCQQqMf0M6IWug"
        );
    }

    #[test]
    fn unique_id_shape() {
        let id = make_unique_id("test", "content");
        assert!(id.starts_with("test:"));
        assert_eq!(id.len() - "test:".len(), 38);
        assert!(make_unique_id("", "content").starts_with(':'));
        assert_ne!(make_unique_id("p", "a"), make_unique_id("p", "b"));
        assert_ne!(make_unique_id("p1", "a"), make_unique_id("p2", "a"));
    }

    #[test]
    fn length_limited_id_matches_calico() {
        // Upstream unique_id_test.go cases.
        assert_eq!(length_limited_id("felix", "1234", 10), "felix1234");
        assert_eq!(length_limited_id("felix", "123456", 11), "felix123456");
        assert_eq!(length_limited_id("felix", "_2345", 10), "felix_kMQI");
        assert_eq!(
            length_limited_id("felix", "12345678910", 13),
            "felix_Y2QCZIS"
        );
        // Chain names (felix/iptables, max 28).
        assert_eq!(
            length_limited_id("cali-pi-", "gnp/pol-1", 28),
            "cali-pi-gnp/pol-1"
        );
        assert_eq!(
            length_limited_id("cali-pi-", "gnp/long-policy-name-that-gets-hashed", 28),
            "cali-pi-_PymyFHQQg3808jiz1OJ"
        );
    }

    #[test]
    fn length_limited_id_edges() {
        // An exact fit is kept unless it could be mistaken for a shortened id.
        assert_eq!(length_limited_id("ab", "cd", 4), "abcd");
        let shortened = length_limited_id("ab", "_d", 4);
        assert_eq!(shortened.len(), 4);
        assert!(shortened.starts_with("ab_"));
        // Empty suffix stands for "_".
        assert_eq!(length_limited_id("ab", "", 10), "ab_");
        assert_eq!(
            length_limited_id("ab", "", 3),
            length_limited_id("ab", "_", 3)
        );
        // Out-of-range limits clamp rather than panic.
        assert_eq!(length_limited_id("abc", "defgh", 3), "abc_");
        assert_eq!(
            length_limited_id("a", &"x".repeat(100), 90).len(),
            1 + 1 + 43
        );
        // Every shortened id is exactly max_len long in the normal range.
        for max in 10..40 {
            let id = length_limited_id("cali-fw-", &"y".repeat(60), max);
            assert_eq!(id.len(), max);
        }
    }

    #[test]
    fn named_port_ids_match_calc_states() {
        let states: Value = serde_json::from_str(CALC_STATES).expect("calc_states.json");
        let meta = states["ipset_meta"].as_object().expect("ipset_meta");
        let mut checked = 0;
        for (key, entry) in meta {
            if entry["type"] != "IP_AND_PORT" {
                continue;
            }
            let got = named_port_ipset_id(
                entry["selector_id"].as_str().unwrap(),
                entry["protocol"].as_str().unwrap(),
                entry["port_name"].as_str().unwrap(),
            );
            assert_eq!(got, entry["id"].as_str().unwrap(), "{key}");
            assert_eq!(
                make_unique_id("s", entry["canonical_selector"].as_str().unwrap()),
                entry["selector_id"].as_str().unwrap(),
                "{key}"
            );
            checked += 1;
        }
        assert!(checked > 0);
    }
}
