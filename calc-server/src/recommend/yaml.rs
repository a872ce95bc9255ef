//! A small YAML writer for JSON values (the recommendation's `--output yaml`): block style,
//! one document per object separated by `---`, every string double-quoted in JSON's escaping
//! (JSON strings are YAML double-quoted scalars, so no value can be read back as anything
//! else: `"on"`, `"1"`, `"null"` stay strings), keys plain when they are plain words (and not
//! `on`, `no`, … which YAML 1.1 readers such as kubectl's take for booleans). [`answer`] writes
//! a `/recommend` answer: a header of `#` comments (the flows left out and why, at most 100,
//! and the notes), then the policies.

use serde_json::Value;

/// Left-out flows listed in the YAML header; `--output json` has them all.
const LEFT_OUT_LINES: usize = 100;

/// The documents, each started by `---`.
pub fn documents(values: &[Value]) -> String {
    let mut out = String::new();
    for v in values {
        out.push_str("---\n");
        block(v, 0, &mut out);
    }
    out
}

/// One value as a block (a mapping or a sequence; a scalar on its own line).
fn block(v: &Value, indent: usize, out: &mut String) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, val) in m {
                pad(indent, out);
                out.push_str(&key(k));
                out.push(':');
                after_key(val, indent, out);
            }
        }
        Value::Array(a) if !a.is_empty() => {
            for item in a {
                pad(indent, out);
                out.push('-');
                after_dash(item, indent, out);
            }
        }
        _ => {
            pad(indent, out);
            out.push_str(&scalar(v));
            out.push('\n');
        }
    }
}

fn nested(v: &Value) -> bool {
    match v {
        Value::Object(m) => !m.is_empty(),
        Value::Array(a) => !a.is_empty(),
        _ => false,
    }
}

fn after_key(val: &Value, indent: usize, out: &mut String) {
    if nested(val) {
        out.push('\n');
        block(val, indent + 2, out);
    } else {
        out.push(' ');
        out.push_str(&scalar(val));
        out.push('\n');
    }
}

fn after_dash(item: &Value, indent: usize, out: &mut String) {
    match item {
        Value::Object(m) if !m.is_empty() => {
            // The first entry on the dash's line, the rest under it.
            let mut inner = String::new();
            block(item, indent + 2, &mut inner);
            out.push(' ');
            out.push_str(&inner[indent + 2..]);
        }
        Value::Array(a) if !a.is_empty() => {
            out.push('\n');
            block(item, indent + 2, out);
        }
        _ => {
            out.push(' ');
            out.push_str(&scalar(item));
            out.push('\n');
        }
    }
}

fn pad(indent: usize, out: &mut String) {
    out.extend(std::iter::repeat_n(' ', indent));
}

/// A key: plain when it is made of letters, digits, `.`, `/`, `_` and `-` and starts with a
/// letter, and is no word a YAML 1.1 reader (kubectl's) takes for a boolean or null; else
/// double-quoted.
fn key(k: &str) -> String {
    const WORDS: [&str; 11] = [
        "y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf",
    ];
    let plain = k.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && !WORDS.contains(&k.to_ascii_lowercase().as_str())
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '/' | '_' | '-'));
    if plain {
        k.to_string()
    } else {
        Value::String(k.to_string()).to_string()
    }
}

fn scalar(v: &Value) -> String {
    match v {
        Value::Object(_) => "{}".into(),
        Value::Array(_) => "[]".into(),
        other => other.to_string(),
    }
}

/// Text for a `#` comment line (or any line of output): control characters (a newline would
/// end the comment) shown as `?`.
pub fn comment(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// A flow of an answer as `source -> dest protocol[/port]`, not yet passed through
/// [`comment`].
pub fn flow_line(f: &Value) -> String {
    let port = f["port"].as_i64().unwrap_or(0);
    format!(
        "{} -> {} {}{}",
        f["source"].as_str().unwrap_or_default(),
        f["dest"].as_str().unwrap_or_default(),
        f["protocol"].as_str().unwrap_or_default(),
        if port > 0 {
            format!("/{port}")
        } else {
            String::new()
        },
    )
}

/// A `/recommend` answer as YAML: a header of comments (what was left out and why, notes),
/// then one document per policy.
pub fn answer(answer: &Value) -> String {
    let mut out = String::new();
    let policies: Vec<Value> = answer["policies"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| p["object"].clone())
        .collect();
    out.push_str(&format!(
        "# calc-server recommend: {} staged {} for namespace {}, from its flows.\n",
        policies.len(),
        if policies.len() == 1 {
            "policy"
        } else {
            "policies"
        },
        comment(answer["namespace"].as_str().unwrap_or_default())
    ));
    let left: Vec<&Value> = answer["left_out"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    if !left.is_empty() {
        out.push_str(&format!("# Left out ({} flows):\n", left.len()));
        if left.len() > LEFT_OUT_LINES {
            out.push_str(&format!(
                "#   (the first {LEFT_OUT_LINES}; --output json lists every one)\n"
            ));
        }
        for l in left.into_iter().take(LEFT_OUT_LINES) {
            let f = &l["flow"];
            out.push_str(&comment(&format!(
                "#   {} ({}, {}): {}",
                flow_line(f),
                f["reporter"].as_str().unwrap_or_default(),
                f["action"].as_str().unwrap_or_default(),
                l["why"].as_str().unwrap_or_default(),
            )));
            out.push('\n');
        }
    }
    for n in answer["notes"].as_array().into_iter().flatten() {
        out.push_str(&comment(&format!(
            "# Note: {}",
            n.as_str().unwrap_or_default()
        )));
        out.push('\n');
    }
    out.push_str(&documents(&policies));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn block_style_reads_back_as_the_same_value() {
        let v = json!({
            "apiVersion": "projectcalico.org/v3",
            "kind": "StagedNetworkPolicy",
            "metadata": {"name": "x", "annotations": {"a/b": "on", "weird key": "1\n2"}},
            "spec": {
                "types": ["Ingress", "Egress"],
                "ingress": [{"action": "Allow", "destination": {"ports": [80, "http"]},
                             "metadata": {"annotations": {}}}],
                "egress": [],
                "nested": [[1, 2], []],
                "n": null, "t": true, "f": 1.5
            }
        });
        let text = documents(&[v.clone(), json!({"k": "v"})]);
        assert!(
            text.starts_with("---\napiVersion: \"projectcalico.org/v3\"\n"),
            "{text}"
        );
        assert!(text.contains("  - action: \"Allow\"\n"), "{text}");
        assert!(text.contains("\"weird key\": \"1\\n2\""), "{text}");
        // A YAML reader gets the values back (the same parser the manifest reader uses).
        let docs: Vec<&str> = text.split("---\n").filter(|d| !d.is_empty()).collect();
        assert_eq!(docs.len(), 2);
        assert_eq!(read(docs[0]), v);
        assert_eq!(read(docs[1]), json!({"k": "v"}));
    }

    #[test]
    fn keys_a_yaml_1_1_reader_would_misread_are_quoted() {
        let text = documents(&[json!({"on": 1, "No": 2, "only": 3, "y": 4})]);
        assert_eq!(text, "---\n\"No\": 2\n\"on\": 1\nonly: 3\n\"y\": 4\n");
    }

    #[test]
    fn the_header_lists_at_most_a_hundred_left_out_flows() {
        let left: Vec<Value> = (0..150)
            .map(|i| {
                json!({"why": "w", "flow": {"source": format!("a/{i}"), "dest": "b/c",
                        "protocol": "tcp", "port": 1, "reporter": "src", "action": "Allow"}})
            })
            .collect();
        let text = answer(&json!({"namespace": "a", "policies": [], "left_out": left}));
        assert!(
            text.contains(
                "# Left out (150 flows):\n#   (the first 100; --output json lists every one)\n"
            ),
            "{text}"
        );
        assert_eq!(text.matches("-> b/c").count(), 100);
        assert!(text.contains("a/99 ->") && !text.contains("a/100 ->"));
    }

    fn read(doc: &str) -> Value {
        serde_saphyr::from_str(doc).unwrap()
    }
}
