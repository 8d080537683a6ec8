//! Progress bars for work someone waits on or watches (indexing a tar, copying an object
//! to the node), on stderr, drawn only where that is a terminal.

/// A bar of `total` bytes labelled `label`.
pub fn bar(label: String, total: u64) -> indicatif::ProgressBar {
    let b = indicatif::ProgressBar::with_draw_target(
        Some(total),
        indicatif::ProgressDrawTarget::stderr(),
    );
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "{prefix} {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    b.set_prefix(label);
    b
}
