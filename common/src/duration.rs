//! Durations on the command line: `500ms`, `5s`, `1.5s`, `2m`, `1h`; a bare number is seconds.

use std::time::{Duration, TryFromFloatSecsError};

/// Why a flag value is not a duration; clap shows it after the flag's name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("{0:?} is not a duration (e.g. 200ms, 5s, 1m)")]
    NotADuration(String),
    #[error("unknown unit {unit:?} in {text:?} (use ms, s, m or h)")]
    UnknownUnit { unit: String, text: String },
    #[error("{text:?}: {error}")]
    OutOfRange {
        text: String,
        error: TryFromFloatSecsError,
    },
}

/// Parses a duration flag value (a clap `value_parser`).
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| DurationError::NotADuration(text.to_owned()))?;
    let scale = match unit.trim() {
        "ms" => 0.001,
        "" | "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        other => {
            return Err(DurationError::UnknownUnit {
                unit: other.to_owned(),
                text: text.to_owned(),
            });
        }
    };
    Duration::try_from_secs_f64(value * scale).map_err(|error| DurationError::OutOfRange {
        text: text.to_owned(),
        error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_bare_seconds() {
        let ms = Duration::from_millis;
        assert_eq!(parse_duration("500ms"), Ok(ms(500)));
        assert_eq!(parse_duration(" 1.5s "), Ok(ms(1500)));
        assert_eq!(parse_duration("2m"), Ok(ms(120_000)));
        assert_eq!(parse_duration("1h"), Ok(ms(3_600_000)));
        assert_eq!(parse_duration("10"), Ok(ms(10_000)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
    }

    #[test]
    fn mistakes_are_named() {
        assert_eq!(
            parse_duration("fast").unwrap_err().to_string(),
            "\"fast\" is not a duration (e.g. 200ms, 5s, 1m)"
        );
        assert_eq!(
            parse_duration("5d").unwrap_err().to_string(),
            "unknown unit \"d\" in \"5d\" (use ms, s, m or h)"
        );
        assert!(parse_duration("").is_err());
        assert!(matches!(
            parse_duration("99999999999999999999999h"),
            Err(DurationError::OutOfRange { .. })
        ));
    }
}
