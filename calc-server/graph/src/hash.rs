//! Calico-compatible ids (`libcalico-go/lib/hash`).
//!
//! The functions live in the `calico-names` crate, which the agent shares, so that the ids the
//! graph computes and the names the agent derives from them come from one implementation. They
//! are re-exported here so the graph's callers keep their paths.

pub use calico_names::hash::{length_limited_id, make_unique_id, named_port_ipset_id};

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    const CALC_STATES: &str = include_str!("../../../testdata/calc_states.json");

    #[test]
    fn selector_ids_match_calc_states() {
        let states: Value = serde_json::from_str(CALC_STATES).expect("calc_states.json");
        let meta = states["ipset_meta"].as_object().expect("ipset_meta");
        let mut checked = 0;
        for (key, entry) in meta {
            if entry["type"] != "NET" {
                continue;
            }
            let canonical = entry["canonical"].as_str().unwrap();
            assert_eq!(
                make_unique_id("s", canonical),
                entry["id"].as_str().unwrap(),
                "{key}"
            );
            // The key is the selector as written; it must parse to that canonical form.
            let parsed = crate::selector::parse(key).expect(key);
            assert_eq!(parsed.canonical(), canonical, "{key}");
            assert_eq!(parsed.unique_id(), entry["id"].as_str().unwrap(), "{key}");
            checked += 1;
        }
        assert!(checked > 0);
    }
}
