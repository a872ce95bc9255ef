//! Name rules both binaries enforce, and how a refused value is shown.
//!
//! calc-server applies these to FelixConfiguration on ingest; the agent applies them again to
//! what the stream carries, because it cannot trust the server. One implementation keeps the two
//! verdicts identical. A refusal is a [`NameError`] holding the value and the rule it breaks;
//! it shows the value bounded and escaped ([`shown`]) when a log line displays it.

/// A value as shown in an error: quoted and escaped, cut to 80 characters (a hostile value can
/// be megabytes long).
pub fn shown(s: &str) -> String {
    let mut out = format!("{s:?}");
    if out.len() > 80 {
        let mut cut = 77;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push_str("...");
    }
    out
}

/// A refused name: the value (shown with [`shown`]) and the rule it breaks.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error(
        "{} is longer than 27 characters (the kernel's LOG prefix limit, less \": \")",
        shown(.0)
    )]
    LogPrefixTooLong(String),
    #[error(
        "{} may only contain letters, digits and '%', ':', ' ', '/', '_', '-'",
        shown(.0)
    )]
    LogPrefixCharacters(String),
    #[error(
        "{} is not an interface name prefix (1 to 14 of [A-Za-z0-9_.-])",
        shown(.0)
    )]
    NotAnInterfacePrefix(String),
    #[error("{} would match the loopback interface", shown(.0))]
    MatchesLoopback(String),
}

/// Felix's `LogPrefix` rule, shared with the agent: Calico's character set `[A-Za-z0-9%: /_-]`
/// and at most 27 characters (the kernel's LOG prefix limit, less the `": "` appended).
pub fn log_prefix(p: &str) -> Result<(), NameError> {
    if p.len() > 27 {
        Err(NameError::LogPrefixTooLong(p.to_owned()))
    } else if !p
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"%: /_-".contains(&b))
    {
        Err(NameError::LogPrefixCharacters(p.to_owned()))
    } else {
        Ok(())
    }
}

/// A workload interface prefix, shared with the agent: 1 to 14 interface name characters, and
/// never one the loopback interface matches (`l`, `lo`): the prefixes decide which interfaces
/// the agent takes over.
pub fn interface_prefix(p: &str) -> Result<(), NameError> {
    if p.len() > 14 || !is_interface_name(p) {
        Err(NameError::NotAnInterfacePrefix(p.to_owned()))
    } else if "lo".starts_with(p) {
        Err(NameError::MatchesLoopback(p.to_owned()))
    } else {
        Ok(())
    }
}

/// Calico's interface name rule: 1 to 15 of `[A-Za-z0-9_.-]` (the kernel's `IFNAMSIZ` less the
/// terminating NUL).
pub fn is_interface_name(s: &str) -> bool {
    (1..=15).contains(&s.len())
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'.' || c == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_quotes_escapes_and_cuts() {
        assert_eq!(shown("eth0"), "\"eth0\"");
        assert_eq!(shown("a\nb"), "\"a\\nb\"");
        let long = shown(&"é".repeat(100));
        assert!(long.len() <= 80, "{long}");
        assert!(long.ends_with("..."));
    }

    #[test]
    fn log_prefixes_follow_felix() {
        assert!(log_prefix("calico-packet").is_ok());
        assert!(log_prefix("").is_ok());
        assert!(log_prefix("%t: drop/x_y").is_ok());
        assert!(log_prefix(&"x".repeat(27)).is_ok());
        assert!(log_prefix(&"x".repeat(28)).is_err());
        let err = log_prefix("bad\"quote").unwrap_err().to_string();
        assert!(err.contains("\"bad\\\"quote\""), "{err}");
        assert_eq!(
            log_prefix(&"x".repeat(28)).unwrap_err().to_string(),
            format!(
                "\"{}\" is longer than 27 characters (the kernel's LOG prefix limit, less \": \")",
                "x".repeat(28)
            )
        );
    }

    #[test]
    fn interface_prefixes_never_match_loopback() {
        assert!(interface_prefix("cali").is_ok());
        assert!(interface_prefix("tap.x_y-1").is_ok());
        for bad in ["", "l", "lo", "cali+", "a b", &"c".repeat(15)] {
            assert!(interface_prefix(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            interface_prefix("lo").unwrap_err().to_string(),
            "\"lo\" would match the loopback interface"
        );
        assert!(
            interface_prefix("lo0").is_ok(),
            "only prefixes of \"lo\" match it"
        );
    }

    #[test]
    fn interface_names_fit_the_kernel() {
        assert!(is_interface_name("cali1234567890a"));
        assert!(!is_interface_name("cali1234567890ab"));
        assert!(!is_interface_name(""));
        assert!(!is_interface_name("eth0:1"));
    }
}
