//! The one place where text becomes `iptables-restore` input.
//!
//! `iptables-restore` reads a line at a time and splits it into arguments at spaces, tabs and
//! newlines; a `"` opens a quoted argument in which `\` escapes the next byte. A string from the
//! stream that reached a rule line unquoted could therefore add arguments (a space), end the
//! rule and start another (a newline), or swallow the closing quote (a trailing `\`). Every
//! string-valued argument of every rule, chain name included, goes through [`arg`]; comments go
//! through [`comment`] first, which keeps only the characters Felix keeps.
//!
//! Contract: for any input, [`arg`] yields exactly one argument on one line, and that argument
//! is the input itself whenever the input has no control character (a control character cannot
//! be carried on a restore line and becomes `_`). The stream's values are validated before they
//! get here (`validate`); this is the defence behind that.

use std::borrow::Cow;

/// Longest comment the kernel's `comment` match stores (Felix truncates to the same).
pub(crate) const MAX_COMMENT_LEN: usize = 256;

/// Bytes that never need quoting: the characters of our chain names, ipset names, CIDRs,
/// ports, marks and interface names.
pub(crate) fn is_bare(b: u8) -> bool {
    b.is_ascii_alphanumeric()
        || matches!(
            b,
            b'_' | b'@' | b'%' | b'+' | b'=' | b':' | b',' | b'.' | b'/' | b'-'
        )
}

/// `s` as one `iptables-restore` argument: as it is when every byte is safe, else quoted with
/// `\` and `"` escaped and control characters replaced by `_`.
pub(crate) fn arg(s: &str) -> Cow<'_, str> {
    if !s.is_empty() && s.bytes().all(is_bare) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' | '\\' => {
                out.push('\\');
                out.push(ch);
            }
            c if c.is_control() => out.push('_'),
            c => out.push(c),
        }
    }
    out.push('"');
    Cow::Owned(out)
}

/// A comment as Felix renders it: every character other than ASCII letters, digits and
/// `_ @%+=:,./-` becomes `_`, then the result is cut to [`MAX_COMMENT_LEN`] bytes. Lossy on
/// purpose: comments carry ids and descriptions, and this keeps `iptables-save` output
/// identical to Felix's for the same annotation.
pub(crate) fn comment(s: &str) -> String {
    let mut out: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || " _@%+=:,./-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    out.truncate(MAX_COMMENT_LEN.min(out.len()));
    out
}

/// `s` as a quoted `--comment` argument, sanitised by [`comment`] (so nothing in it needs
/// escaping).
pub(crate) fn comment_arg(s: &str) -> String {
    format!("\"{}\"", comment(s))
}

/// `iptables-restore`'s argument splitting for one line, as its parser does it: whitespace
/// separates, `"` opens and closes a quoted argument, and inside quotes `\` takes the next byte
/// literally. Used by the fake kernel and the tests to read restore input back as the real tool
/// would; an unterminated quote is an error, as it is for the tool.
#[cfg(test)]
pub(crate) fn split_restore_line(line: &str) -> Result<Vec<String>, String> {
    if line.contains('\n') {
        return Err(format!("more than one line: {line:?}"));
    }
    let mut args = Vec::new();
    let mut cur = Vec::<u8>::new();
    let (mut quoted, mut escaped, mut started) = (false, false, false);
    for &b in line.as_bytes() {
        if quoted {
            if escaped {
                cur.push(b);
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                quoted = false;
            } else {
                cur.push(b);
            }
            continue;
        }
        match b {
            b'"' => {
                quoted = true;
                started = true;
            }
            b' ' | b'\t' => {
                if started {
                    args.push(String::from_utf8_lossy(&std::mem::take(&mut cur)).into_owned());
                }
                started = false;
            }
            _ => {
                cur.push(b);
                started = true;
            }
        }
    }
    if quoted {
        return Err(format!("unterminated quote: {line:?}"));
    }
    if started {
        args.push(String::from_utf8_lossy(&cur).into_owned());
    }
    Ok(args)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn every_char() -> impl Iterator<Item = char> {
        // Every byte value as a character, plus multi-byte characters of each UTF-8 length.
        (0u32..=255).filter_map(char::from_u32).chain([
            '\u{a0}',
            '\u{2028}',
            '\u{feff}',
            '\u{1f600}',
        ])
    }

    #[test]
    fn every_byte_value_stays_one_argument() {
        for c in every_char() {
            for s in [
                c.to_string(),
                format!("a{c}b"),
                format!("{c}{c}"),
                format!("x{c}"),
                format!("-A INPUT{c}-j ACCEPT"),
            ] {
                let line = format!("-A cali-x {} --jump ACCEPT", arg(&s));
                let args = split_restore_line(&line).unwrap();
                assert_eq!(args.len(), 5, "{s:?} -> {line:?} -> {args:?}");
                let expected: String = s
                    .chars()
                    .map(|c| if c.is_control() { '_' } else { c })
                    .collect();
                assert_eq!(args[2], expected, "{s:?} -> {line:?}");
                assert_eq!(&args[3..], ["--jump", "ACCEPT"]);
            }
        }
    }

    #[test]
    fn safe_strings_are_not_quoted() {
        for s in [
            "cali-tw-cali12345",
            "cali40s:abc-_",
            "10.0.0.0/8",
            "fd00::/64",
            "80,443:450",
            "0x10000/0x10000",
            "eth0.100",
            "cali+",
        ] {
            assert_eq!(arg(s), s);
        }
        assert_eq!(arg(""), "\"\"");
        assert_eq!(arg("a b"), "\"a b\"");
        assert_eq!(arg("a\"b\\"), "\"a\\\"b\\\\\"");
    }

    #[test]
    fn comments_keep_only_felix_characters_and_fit_the_kernel() {
        assert_eq!(comment("gnp default.allow: web"), "gnp default.allow: web");
        assert_eq!(comment("say \"hi\"\\\n\0é"), "say _hi_____");
        for c in every_char() {
            let out = comment(&format!("k={c}"));
            assert!(
                out.bytes().all(|b| b.is_ascii_graphic() || b == b' '),
                "{c:?}: {out:?}"
            );
            let line = format!(
                "-A x -m comment --comment {} --jump DROP",
                comment_arg(&format!("k={c}"))
            );
            let args = split_restore_line(&line).unwrap();
            assert_eq!(args.len(), 8, "{c:?}: {line}");
            assert_eq!(args[5], out);
        }
        assert_eq!(comment(&"é".repeat(300)).len(), MAX_COMMENT_LEN);
    }
}
