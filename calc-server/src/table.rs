//! Column-aligned text tables, as the admin commands (`status`, `policies`) print them: each
//! column as wide as its widest cell, numbers right-aligned, two spaces between columns and no
//! trailing spaces; and the one rendering of a policy's per-rule hits that `status --policy`
//! and `explain --policy` share. Imports none of ours.

/// `header` and `rows` as a table; `right[i]` right-aligns column `i`.
pub(crate) fn table(header: &[&str], rows: &[Vec<String>], right: &[bool]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, cell) in cells.iter().enumerate() {
            let pad = widths[i].saturating_sub(cell.chars().count());
            let last = i + 1 == cells.len();
            if i > 0 {
                out.push_str("  ");
            }
            if right[i] {
                out.push_str(&" ".repeat(pad));
                out.push_str(cell);
            } else {
                out.push_str(cell);
                if !last {
                    out.push_str(&" ".repeat(pad));
                }
            }
        }
        out.push('\n');
        out
    };
    let mut out = line(header.to_vec());
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

/// The columns of [`rule_hits`], in order, and whether each aligns right.
const RULE_COLUMNS: [(&str, bool); 8] = [
    ("DIRECTION", false),
    ("RULE", true),
    ("ACTION", false),
    ("PACKETS", true),
    ("BYTES", true),
    ("LAST-HIT", false),
    ("NODES", false),
    ("TEXT", false),
];

/// A policy's rules with their hits (`rules` of a `/status/policies/NAME` answer), after a blank
/// line: one line each, ingress then egress (the server's order), with the rule's direction and
/// index, action, packets, bytes, last hit (`never`), with `nodes` the nodes where it matched
/// (`-`: none), and the rule's text when the rules carry one (`text`, which `explain` adds).
/// Rules without counters (a staged policy, which is not in the dataplane; or rules listed
/// offline) show no counter columns, and a staged policy says why; an answer without `rules`
/// (an older server) adds nothing.
pub(crate) fn rule_hits(status: &serde_json::Value, nodes: bool) -> String {
    let Some(rules) = status["rules"].as_array() else {
        return String::new();
    };
    let staged = status["phase"] == "Staged";
    let note = if staged {
        "\nstaged: not in the dataplane, no counters\n"
    } else {
        ""
    };
    if rules.is_empty() {
        return format!("{note}\nno rules\n");
    }
    let texts = rules.iter().any(|r| r.get("text").is_some());
    if staged && !texts {
        return note.into();
    }
    let counters = !staged && rules.iter().any(|r| r.get("packets").is_some());
    let shown: Vec<usize> = (0..RULE_COLUMNS.len())
        .filter(|&c| match c {
            3..=5 => counters,
            6 => counters && nodes,
            7 => texts,
            _ => true,
        })
        .collect();
    let rows: Vec<Vec<String>> = rules
        .iter()
        .map(|rule| {
            let text = |k: &str| rule[k].as_str().unwrap_or_default().to_string();
            let num = |k: &str| rule[k].as_u64().map_or("-".into(), |n| n.to_string());
            let cell = |c: usize| match c {
                0 => text("direction"),
                1 => rule["index"].as_u64().unwrap_or_default().to_string(),
                2 => text("action"),
                3 => num("packets"),
                4 => num("bytes"),
                5 => rule["last_hit"].as_str().unwrap_or("never").to_string(),
                6 => {
                    let names: Vec<&str> = rule["nodes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(serde_json::Value::as_str)
                        .collect();
                    if names.is_empty() {
                        "-".into()
                    } else {
                        names.join(",")
                    }
                }
                _ => text("text"),
            };
            shown.iter().map(|&c| cell(c)).collect()
        })
        .collect();
    let header: Vec<&str> = shown.iter().map(|&c| RULE_COLUMNS[c].0).collect();
    let right: Vec<bool> = shown.iter().map(|&c| RULE_COLUMNS[c].1).collect();
    format!("{note}\n{}", table(&header, &rows, &right))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_pad_to_their_column_and_numbers_align_right() {
        let rows = vec![
            vec!["a".to_string(), "1".to_string(), "x".to_string()],
            vec!["long".to_string(), "100".to_string(), "y".to_string()],
        ];
        assert_eq!(
            table(&["NAME", "N", "END"], &rows, &[false, true, false]),
            "NAME    N  END\na       1  x\nlong  100  y\n"
        );
    }
}
