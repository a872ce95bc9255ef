//! Column-aligned text tables, as the admin commands (`status`, `policies`) print them: each
//! column as wide as its widest cell, numbers right-aligned, two spaces between columns and no
//! trailing spaces. Imports none of ours.

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
