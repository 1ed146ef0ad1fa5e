//! What the binaries tell their user and how they end: every message one line in one
//! style ([`say`]), a refusal with its exit status ([`Refusal`], [`usage`]), and the exit
//! statuses shells know. Every command's module uses these; none reaches into a `main.rs`.

/// Usage errors and refusals before anything ran, as clap reports its own (`cudabudget
/// run`'s are 125, so that they are not taken for the command's).
pub const EXIT_USAGE: u8 = 2;
/// The command exists but cannot be executed, as shells report it.
pub const EXIT_CANNOT_EXECUTE: u8 = 126;
/// The command does not exist, as shells report it.
pub const EXIT_NOT_FOUND: u8 = 127;

/// A refusal the user must act on: printed as one line, then the exit status.
pub struct Refusal {
    pub message: String,
    pub status: u8,
}

/// A refusal with the usage status (2): nothing was run.
pub fn usage(message: impl Into<String>) -> Refusal {
    Refusal {
        message: message.into(),
        status: EXIT_USAGE,
    }
}

/// Prints `cudabudget: <message>` to stderr, the one style of every message.
pub fn say(message: impl std::fmt::Display) {
    eprintln!("cudabudget: {message}");
}

/// Why a budget of 0 bytes is refused (`run --limit 0`, `limit … 0`): it would refuse
/// every allocation, which is never what a budget is set for, and HAMi's 0 means the
/// opposite, no budget (an operator used to it would stop a job meaning to free it).
pub const ZERO_BUDGET: &str =
    "a budget of 0 bytes would refuse every allocation (HAMi's 0 means no budget)";

/// A command's status when its output could not be written.
pub const EXIT_OUTPUT_FAILED: u8 = 1;

/// Writes `text` to stdout, at once. A write that fails (a full disk, a closed
/// descriptor) is a refusal naming the error ([`EXIT_OUTPUT_FAILED`]), never a panic
/// nor a success with the output lost. A reader that went away is no such failure: the
/// default SIGPIPE, which the commands keep, ends the process first, as it ends `cat`.
pub fn print(text: &str) -> Result<(), Refusal> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|error| Refusal {
            message: format!("cannot write the output: {error}"),
            status: EXIT_OUTPUT_FAILED,
        })
}

/// [`print`] of one line: `outln(format_args!(…))?` where `println!` would panic.
pub fn outln(line: std::fmt::Arguments<'_>) -> Result<(), Refusal> {
    print(&format!("{line}\n"))
}

/// clap's own messages, in this style: "cudabudget: unexpected argument …" with clap's
/// tip (the option that was probably meant) and usage below, then `status`; help and
/// the version as clap prints them.
pub fn clap_error(error: &clap::Error, status: u8) -> std::process::ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        error.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        let _ = error.print();
        return std::process::ExitCode::from(error.exit_code() as u8);
    }
    let text = error.render().to_string();
    let text = text.strip_prefix("error: ").unwrap_or(&text);
    eprint!("cudabudget: {text}");
    std::process::ExitCode::from(status)
}
