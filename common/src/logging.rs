//! Logging set-up for both binaries: a level or tracing filter, plain or JSON lines on
//! stderr, colour only for a person at a terminal.
//!
//! Field values and messages often carry text from the datastore or the stream (object names,
//! interface names, kernel errors quoting them), and all of it is hostile: a name with a
//! newline would forge a log line, an escape sequence would drive the reader's terminal, a
//! bidirectional override would reorder what it shows. Both formats therefore escape every
//! control character (C0, DEL, C1), the bidirectional formatting characters and the Unicode
//! line and paragraph separators, whatever field or span they are in, so a call site cannot
//! forget to: plain lines through [`EscapedFields`] (`\n`, `\r`, `\t`, else `\u{1b}`), JSON lines
//! through [`EscapedJson`] (JSON's own `\uXXXX` escapes, so the value a reader decodes is the
//! original text). One event is always one line.

use std::fmt::{self, Write as _};

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::{self, FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::{FmtContext, MakeWriter};
use tracing_subscriber::registry::LookupSpan;

/// Log line format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Plain,
    /// One JSON object per line.
    Json,
}

/// Installs the global subscriber. `level` is a level or a filter directive; an invalid one
/// falls back to `fallback`.
pub fn init_logging(level: &str, format: LogFormat, fallback: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(fallback));
    // A log file or collector gets plain text: escape codes would corrupt it.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    // `init` also routes the `log` records of dependencies (rustls) through the subscriber.
    tracing_subscriber::util::SubscriberInitExt::init(subscriber(
        filter,
        format,
        ansi,
        std::io::stderr,
    ));
}

/// The subscriber [`init_logging`] installs, writing to `writer`.
fn subscriber<W>(
    filter: tracing_subscriber::EnvFilter,
    format: LogFormat,
    ansi: bool,
    writer: W,
) -> Box<dyn Subscriber + Send + Sync>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match format {
        LogFormat::Plain => Box::new(builder.with_ansi(ansi).fmt_fields(EscapedFields).finish()),
        LogFormat::Json => Box::new(
            builder
                .with_ansi(false)
                .fmt_fields(format::JsonFields::new())
                .event_format(EscapedJson(format::format().json()))
                .finish(),
        ),
    }
}

/// Whether `c` is escaped in a log line: control characters (C0, DEL, C1), the bidirectional
/// marks, embeddings, overrides and isolates, and the Unicode line and paragraph separators.
pub fn must_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

/// A `fmt::Write` that passes text on with [`must_escape`] characters written as `\n`, `\r`,
/// `\t` or `\u{…}`.
struct Escaping<'a>(&'a mut dyn fmt::Write);

impl fmt::Write for Escaping<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let mut rest = s;
        while let Some(i) = rest.find(must_escape) {
            self.0.write_str(&rest[..i])?;
            let c = rest[i..].chars().next().unwrap_or_default();
            match c {
                '\n' => self.0.write_str("\\n")?,
                '\r' => self.0.write_str("\\r")?,
                '\t' => self.0.write_str("\\t")?,
                c => write!(self.0, "\\u{{{:x}}}", c as u32)?,
            }
            rest = &rest[i + c.len_utf8()..];
        }
        self.0.write_str(rest)
    }
}

/// The plain format's field formatter: tracing's default layout (the message, then
/// `name=value` pairs separated by spaces; strings given as values are quoted) with every
/// value and the message escaped (see the module documentation). Used for events and for the
/// fields of spans alike.
#[derive(Clone, Copy, Debug, Default)]
pub struct EscapedFields;

impl<'writer> FormatFields<'writer> for EscapedFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'writer>, fields: R) -> fmt::Result {
        let mut visitor = EscapingVisitor {
            ansi: writer.has_ansi_escapes(),
            writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct EscapingVisitor<'w> {
    writer: Writer<'w>,
    ansi: bool,
    first: bool,
    result: fmt::Result,
}

impl EscapingVisitor<'_> {
    /// Writes `name=` (or nothing for the message) and then `value`, escaped.
    fn field(&mut self, field: &Field, value: fmt::Arguments<'_>) {
        if self.result.is_err() {
            return;
        }
        let name = field.name();
        // `log` crate metadata already shown by the event formatter.
        if name.starts_with("log.") {
            return;
        }
        self.result = (|| {
            if !std::mem::take(&mut self.first) {
                self.writer.write_char(' ')?;
            }
            if name != "message" {
                let name = name.strip_prefix("r#").unwrap_or(name);
                if self.ansi {
                    write!(self.writer, "\x1b[3m{name}\x1b[0m\x1b[2m=\x1b[0m")?;
                } else {
                    write!(self.writer, "{name}=")?;
                }
            }
            Escaping(&mut self.writer).write_fmt(value)
        })();
    }
}

impl Visit for EscapingVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.field(field, format_args!("{value}"));
        } else {
            self.field(field, format_args!("{value:?}"));
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.field(field, format_args!("{value}"));
        let mut source = value.source();
        if source.is_none() || self.result.is_err() {
            return;
        }
        let name = field.name().strip_prefix("r#").unwrap_or(field.name());
        self.result = write!(self.writer, " {name}.sources=[");
        let mut first = true;
        while let Some(s) = source {
            if self.result.is_err() {
                return;
            }
            let sep = if std::mem::take(&mut first) { "" } else { ", " };
            self.result = self
                .writer
                .write_str(sep)
                .and_then(|()| Escaping(&mut self.writer).write_fmt(format_args!("{s}")));
            source = s.source();
        }
        if self.result.is_ok() {
            self.result = self.writer.write_char(']');
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.field(field, format_args!("{value:?}"));
    }
}

/// The JSON format's event formatter: tracing's JSON object, with every [`must_escape`]
/// character JSON does not escape itself (DEL, C1, the bidirectional and separator characters)
/// written as a `\uXXXX` escape. Those characters can only occur inside JSON strings, where
/// the escape decodes to the same character, so the object a reader parses is unchanged.
pub struct EscapedJson<F>(pub F);

impl<S, N, F> FormatEvent<S, N> for EscapedJson<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'w> FormatFields<'w> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut line = String::new();
        self.0.format_event(ctx, Writer::new(&mut line), event)?;
        let body = line.strip_suffix('\n').unwrap_or(&line);
        let mut rest = body;
        while let Some(i) = rest.find(must_escape) {
            writer.write_str(&rest[..i])?;
            let c = rest[i..].chars().next().unwrap_or_default();
            // Every character escaped here is in the Basic Multilingual Plane.
            write!(writer, "\\u{:04x}", c as u32)?;
            rest = &rest[i + c.len_utf8()..];
        }
        writer.write_str(rest)?;
        if body.len() < line.len() {
            writer.write_char('\n')?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use parking_lot::Mutex;

    /// Collects what the subscriber writes.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Buffer {
        type Writer = Buffer;
        fn make_writer(&'a self) -> Buffer {
            self.clone()
        }
    }

    #[derive(Debug)]
    struct Refused(String, Option<Box<Refused>>);

    impl fmt::Display for Refused {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(&self.0)
        }
    }

    impl std::error::Error for Refused {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    /// A forged line as an attacker would write it into an object name.
    const FORGED: &str = "web\n2026-01-01T00:00:00Z  INFO policy allowed everything";

    /// What `log` writes through a subscriber of `format` (ansi as asked).
    fn logged(format: LogFormat, ansi: bool, log: impl FnOnce()) -> String {
        let buf = Buffer::default();
        let sub = subscriber(
            tracing_subscriber::EnvFilter::new("info"),
            format,
            ansi,
            buf.clone(),
        );
        tracing::subscriber::with_default(sub, log);
        String::from_utf8(buf.0.lock().clone()).expect("utf-8")
    }

    /// Every kind of field that can carry hostile text: a Display value, a Debug value, a
    /// plain `&str`, an error with a source, the message's arguments and a span's field.
    fn hostile_event() {
        let span = tracing::info_span!("agent", node = %format!("n\r\x1b]0;pwned\x07{FORGED}"));
        let _in = span.enter();
        let err = Refused(
            "bad\nline".into(),
            Some(Box::new(Refused("cause\u{9b}31m".into(), None))),
        );
        tracing::warn!(
            policy = %FORGED,
            key = ?FORGED,
            iface = "eth0\u{202e}1lac",
            error = &err as &(dyn std::error::Error + 'static),
            "refused {}",
            format!("x\u{1b}[2Jy\u{2028}z\u{7f}\u{9b}")
        );
    }

    #[test]
    fn plain_lines_escape_every_control_character_in_fields_messages_and_spans() {
        for ansi in [false, true] {
            let out = logged(LogFormat::Plain, ansi, hostile_event);
            assert_eq!(out.lines().count(), 1, "{out}");
            assert!(out.ends_with('\n'));
            let line = out.trim_end_matches('\n');
            // Only the formatter's own colour codes may remain.
            let stripped = line
                .replace("\x1b[3m", "")
                .replace("\x1b[2m", "")
                .replace("\x1b[0m", "")
                .replace("\x1b[33m", "")
                .replace("\x1b[1m", "");
            assert!(
                !stripped.chars().any(must_escape),
                "a raw control character in {line:?}"
            );
            assert!(
                stripped.contains("policy=web\\n2026-01-01T00:00:00Z  INFO policy allowed"),
                "{line:?}"
            );
            assert!(
                stripped.contains("refused x\\u{1b}[2Jy\\u{2028}z\\u{7f}\\u{9b} "),
                "{line:?}"
            );
            assert!(stripped.contains("iface=\"eth0\\u{202e}1lac\""), "{line:?}");
            assert!(
                stripped.contains("node=n\\r\\u{1b}]0;pwned\\u{7}web\\n2026"),
                "{line:?}"
            );
            assert!(
                stripped.contains("error=bad\\nline error.sources=[cause\\u{9b}31m]"),
                "{line:?}"
            );
        }
    }

    #[test]
    fn json_lines_escape_every_control_character_and_decode_to_the_original() {
        let out = logged(LogFormat::Json, false, hostile_event);
        assert_eq!(out.lines().count(), 1, "{out}");
        let line = out.trim_end_matches('\n');
        assert!(
            !line.chars().any(must_escape),
            "a raw control character in {line:?}"
        );
        let v: serde_json::Value = serde_json::from_str(line).expect("one JSON object");
        assert_eq!(v["fields"]["policy"], FORGED);
        assert_eq!(
            v["fields"]["message"],
            "refused x\u{1b}[2Jy\u{2028}z\u{7f}\u{9b}"
        );
        assert_eq!(v["fields"]["iface"], "eth0\u{202e}1lac");
        assert!(
            v["span"]["node"]
                .as_str()
                .is_some_and(|n| n.starts_with("n\r\u{1b}]0;pwned\u{7}web\n")),
            "{v}"
        );
        assert!(
            line.contains("\\u202e") && line.contains("\\u007f") && line.contains("\\u009b"),
            "{line}"
        );
    }

    #[test]
    fn ordinary_lines_are_unchanged() {
        let out = logged(
            LogFormat::Plain,
            false,
            || tracing::info!(node = %"node-a", count = 3, name = "web", "synced {} objects", 12),
        );
        assert!(
            out.trim_end()
                .ends_with("synced 12 objects node=node-a count=3 name=\"web\""),
            "{out}"
        );
        let out = logged(
            LogFormat::Json,
            false,
            || tracing::info!(node = %"node-a", "café ✓"),
        );
        let v: serde_json::Value = serde_json::from_str(out.trim_end()).unwrap();
        assert_eq!(v["fields"]["message"], "café ✓");
        assert!(out.contains("café ✓"), "{out}");
    }
}
