//! The log: `tracing` to stderr, filtered by `ARCHFS_LOG`. The mount's processes and the
//! in-process reader both start it, so it sits below the mount side.

/// `to_file`: stderr is about to go to a --log file, so no colour codes. Also what the
/// in-process reader logs with (warnings, or what `ARCHFS_LOG` asks for).
pub fn init(debug: bool, to_file: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("ARCHFS_LOG").unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(if debug { "debug" } else { "warn" })
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(!to_file && std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}
