//! Showing strings that came from the datastore or a peer in logs and error messages.
//!
//! Such a string may hold a newline (which forges a separate line in a plain-text log),
//! terminal escapes, or megabytes (a 50 MB label value echoed as one log line). [`Untrusted`]
//! displays it with control characters escaped and at most [`MAX_SHOWN`] characters, saying how
//! much was left out. [`clip`] bounds a message that was already built.

use std::fmt::{self, Write};

/// Characters shown of one untrusted string.
pub const MAX_SHOWN: usize = 256;

/// Displays a string with control characters escaped (`\n`, `\u{1b}`) and cut after
/// [`MAX_SHOWN`] characters.
#[derive(Clone, Copy)]
pub struct Untrusted<'a>(pub &'a str);

impl fmt::Display for Untrusted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_escaped(f, self.0, MAX_SHOWN)
    }
}

impl fmt::Debug for Untrusted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_char('"')?;
        write_escaped(f, self.0, MAX_SHOWN)?;
        f.write_char('"')
    }
}

fn write_escaped(f: &mut impl Write, s: &str, max: usize) -> fmt::Result {
    for (shown, (i, c)) in s.char_indices().enumerate() {
        if shown == max {
            return write!(f, "…[{} more bytes]", s.len() - i);
        }
        match c {
            '\n' => f.write_str("\\n")?,
            '\r' => f.write_str("\\r")?,
            '\t' => f.write_str("\\t")?,
            // Bidirectional overrides reorder what a terminal shows; escape them with the rest.
            c if c.is_control() || ('\u{202a}'..='\u{202e}').contains(&c) => {
                write!(f, "\\u{{{:x}}}", c as u32)?
            }
            c => f.write_char(c)?,
        }
    }
    Ok(())
}

/// A message bounded for logs: control characters escaped, at most `max` characters kept.
/// Returns the input unchanged (no copy) when it is already safe.
pub fn clip(s: String, max: usize) -> String {
    let safe = s.len() <= max
        && !s
            .chars()
            .any(|c| c.is_control() || ('\u{202a}'..='\u{202e}').contains(&c));
    if safe {
        return s;
    }
    let mut out = String::with_capacity(max.min(s.len()) + 32);
    let _ = write_escaped(&mut out, &s, max);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newline_cannot_start_a_forged_log_line() {
        let name = "web\n2026-11-24T00:00:00Z  INFO policy allowed everything";
        let shown = Untrusted(name).to_string();
        assert!(!shown.contains('\n'), "{shown}");
        assert!(shown.starts_with("web\\n2026"), "{shown}");
        assert_eq!(
            format!("{:?}", Untrusted("a\u{1b}[31mb")),
            "\"a\\u{1b}[31mb\""
        );
    }

    #[test]
    fn long_values_are_cut_and_say_how_much_was_left_out() {
        let big = "x".repeat(50 * 1024 * 1024);
        let shown = Untrusted(&big).to_string();
        assert!(shown.len() < 300, "{}", shown.len());
        assert!(shown.ends_with(&format!("…[{} more bytes]", big.len() - MAX_SHOWN)));
        assert_eq!(Untrusted("short").to_string(), "short");
    }

    #[test]
    fn clip_keeps_safe_messages_and_bounds_the_rest() {
        assert_eq!(clip("fine message".into(), 100), "fine message");
        let clipped = clip(format!("bad {}", "é".repeat(1000)), 10);
        assert!(clipped.starts_with("bad éééééé…[") && clipped.ends_with(" more bytes]"));
        assert_eq!(clip("a\nb".into(), 100), "a\\nb");
    }
}
