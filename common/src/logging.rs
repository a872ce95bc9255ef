//! Logging set-up for both binaries: a level or tracing filter, plain or JSON lines on
//! stderr, colour only for a person at a terminal.

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
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Plain => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
