//! `cudabudget status`: the budgeted processes of this machine, per job, process and
//! device, with each GPU's physical total and use where NVML can say.

use std::collections::BTreeSet;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use cudabudget_cli_common::figures::{JobJson, StatusJson, collect};
use cudabudget_cli_common::gpu::Nvml;
use cudabudget_cli_common::records;
use cudabudget_cli_common::tell::{Refusal, print, usage};

pub const AFTER_HELP: &str = "Shows the processes that run under a budget and publish \
their figures (every budgeted process does, within 0.2 s), for this user, or for every \
user when run as root. Records live in /dev/shm/cudabudget-<uid>/ \
($CUDABUDGET_RUNTIME_DIR instead of /dev/shm when set; $XDG_RUNTIME_DIR or \
$HOME/.cache when another user holds that name). A record is shown only if the user \
whose directory holds it owns the process (or is root) and the process's start time \
matches; text from records is shown escaped (\\e, \\x.., \\u{..}).

--json prints one object:
  {\"processes\": [{\"pid\", \"uid\", \"job\", \"command\", \"namespace\", \"pod\",
   \"container\", \"devices\": [{\"index\", \"uuid\", \"used_bytes\", \"limit_bytes\",
   \"peak_bytes\", \"denials\", \"waits\", \"overruns\", \"physical_total_bytes\",
   \"physical_used_bytes\"}]}],
   \"jobs\": [{\"name\", \"uid\", \"user\", \"processes\", \"used_bytes\",
     \"devices\": [{\"index\", \"used_bytes\", \"limit_bytes\", \"over_budget\"}]}],
   \"gpus\": [{\"index\", \"uuid\", \"name\", \"total_bytes\", \"used_bytes\"}] or null,
   \"skipped\": [\"why a record file was passed over\"]}

Examples:
  cudabudget status
  cudabudget status --json
  cudabudget status --watch 2";

#[derive(Args)]
pub struct StatusArgs {
    /// Print one JSON object (with --watch: one per line, each refresh).
    #[arg(long)]
    json: bool,

    /// Refresh every SECONDS (default 1) until interrupted.
    #[arg(
        long,
        value_name = "SECONDS",
        num_args = 0..=1,
        default_missing_value = "1"
    )]
    watch: Option<f64>,
}

pub fn status(args: StatusArgs) -> Result<ExitCode, Refusal> {
    // A bad CUDABUDGET_RUNTIME_DIR is said, not passed over for the default places.
    records::runtime_dirs_as_set().map_err(usage)?;
    let interval = match args.watch {
        None => None,
        Some(seconds) if seconds.is_finite() && seconds >= 0.1 => {
            Some(Duration::from_secs_f64(seconds))
        }
        Some(seconds) => {
            return Err(usage(format!(
                "--watch {seconds}: the interval must be at least 0.1 seconds (e.g. --watch 2)"
            )));
        }
    };
    let nvml = Nvml::open().ok();
    let clear = interval.is_some() && !args.json && std::io::stdout().is_terminal();
    loop {
        let status = collect(nvml.as_ref());
        let mut text = if args.json {
            let mut line = terminal_safe_json(serde_json::to_string(&status).unwrap_or_default());
            line.push('\n');
            line
        } else {
            table(&status)
        };
        if clear {
            text.insert_str(0, "\x1b[H\x1b[2J");
        }
        // A reader that went away (`| head`) ends the process by SIGPIPE (main.rs).
        print(&text)?;
        match interval {
            Some(interval) => std::thread::sleep(interval),
            None => return Ok(ExitCode::SUCCESS),
        }
    }
}

/// Bytes as the budgets are written: "8.00 GiB".
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut unit = 0;
    let mut scale = 1024u64;
    while unit + 1 < UNITS.len() && n / scale >= 1024 {
        scale *= 1024;
        unit += 1;
    }
    format!("{:.2} {}", n as f64 / scale as f64, UNITS[unit])
}

/// A command as the table shows it: its program by file name (`--json` keeps the path),
/// so that the program and its first arguments fit the column. The record keeps no
/// argument boundaries: a program path with a space in it shows from its last `/`
/// before that space.
fn short_command(command: &str) -> &str {
    let program = command.split(' ').next().unwrap_or_default();
    match program.rfind('/') {
        Some(slash) if slash + 1 < program.len() => &command[slash + 1..],
        _ => command,
    }
}

fn table(status: &StatusJson) -> String {
    let mut rows: Vec<[String; 9]> = vec![[
        "JOB".into(),
        "PID".into(),
        "DEVICE".into(),
        "USED".into(),
        "PEAK".into(),
        "BUDGET".into(),
        "DENIALS".into(),
        "WAITS".into(),
        "COMMAND".into(),
    ]];
    for p in &status.processes {
        let job = p.job.as_deref().map_or_else(|| "-".into(), escape);
        let mut command = escape(short_command(&p.command));
        if let Some(pod) = &p.pod {
            let namespace = p.namespace.as_deref().map_or_else(|| "-".into(), escape);
            command = format!("[{namespace}/{}] {command}", escape(pod));
        }
        let command: String = if command.chars().count() > 60 {
            command.chars().take(59).chain(['…']).collect()
        } else {
            command
        };
        if p.devices.is_empty() {
            rows.push([
                job,
                p.pid.to_string(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                command,
            ]);
            continue;
        }
        for d in &p.devices {
            rows.push([
                job.clone(),
                p.pid.to_string(),
                d.index.to_string(),
                bytes(d.used_bytes),
                bytes(d.peak_bytes),
                if p.job.is_none() && d.used_bytes > d.limit_bytes {
                    format!("{} (over budget)", bytes(d.limit_bytes))
                } else {
                    bytes(d.limit_bytes)
                },
                d.denials.to_string(),
                d.waits.to_string(),
                command.clone(),
            ]);
        }
    }
    // Jobs of more than one process get a total line; the user is named when the table
    // holds more than one user's processes.
    let users: BTreeSet<u32> = status.processes.iter().map(|p| p.uid).collect();
    let mut widths = [0usize; 9];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut text = String::new();
    if status.processes.is_empty() {
        text.push_str("no budgeted processes\n");
    } else {
        for row in &rows {
            let mut line = String::new();
            for (i, (cell, w)) in row.iter().zip(widths).enumerate() {
                if i + 1 == row.len() {
                    line.push_str(cell);
                } else if (1..8).contains(&i) {
                    line.push_str(&format!("{cell:>w$}  "));
                } else {
                    line.push_str(&format!("{cell:<w$}  "));
                }
            }
            text.push_str(line.trim_end());
            text.push('\n');
        }
        let over = |j: &&JobJson| j.devices.iter().any(|d| d.over_budget);
        for job in status.jobs.iter().filter(|j| j.processes > 1 || over(j)) {
            let whose = if users.len() > 1 {
                match &job.user {
                    Some(user) => format!(" ({})", escape(user)),
                    None => format!(" (uid {})", job.uid),
                }
            } else {
                String::new()
            };
            let over: String = job
                .devices
                .iter()
                .filter(|d| d.over_budget)
                .map(|d| {
                    format!(
                        ", over its budget of {} on device {}",
                        bytes(d.limit_bytes),
                        d.index
                    )
                })
                .collect();
            text.push_str(&format!(
                "job {}{whose}: {} processes, {} in use{over}\n",
                escape(&job.name),
                job.processes,
                bytes(job.used_bytes)
            ));
        }
    }
    match &status.gpus {
        None => text.push_str("GPUs: NVML is not available here (no physical figures)\n"),
        Some(gpus) => {
            for g in gpus {
                let name = g
                    .name
                    .as_deref()
                    .map(|n| format!(" {}", escape(n)))
                    .unwrap_or_default();
                let over = if g.overcommitted {
                    format!(
                        "; OVER-COMMITTED: budgets add up to {}, {} more than it has",
                        bytes(g.budgets_bytes),
                        bytes(g.budgets_bytes - g.total_bytes)
                    )
                } else {
                    String::new()
                };
                text.push_str(&format!(
                    "GPU {}{name} {}: {} of {} in use{over}\n",
                    g.index,
                    g.uuid.as_deref().map_or_else(|| "(no UUID)".into(), escape),
                    bytes(g.used_bytes),
                    bytes(g.total_bytes)
                ));
            }
        }
    }
    text
}

/// Characters that must not reach a terminal as they are: C0 controls, DEL and C1
/// controls (escape sequences; U+009B is a CSI on its own), and the invisible marks
/// that reorder text (bidi overrides, embeddings, isolates, marks).
fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
        )
}

/// `text` fit for a terminal: every unsafe character written out (`\e`, `\a`, `\t`,
/// `\n`, `\r`, `\x7f`, `\u{202e}`...), everything else as it is.
pub fn escape(text: &str) -> String {
    if !text.chars().any(is_unsafe) {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\x1b' => out.push_str("\\e"),
            '\x07' => out.push_str("\\a"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x80 && is_unsafe(c) => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c if is_unsafe(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// JSON as serde writes it (C0 controls escaped) with DEL, C1 controls and the bidi
/// marks escaped too (`\u007f`, `\u009b`, `\u202e`): the same values, and nothing a
/// terminal acts on. They can only be inside strings: JSON's own syntax is ASCII.
fn terminal_safe_json(json: String) -> String {
    if !json.chars().any(is_unsafe) {
        return json;
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if is_unsafe(c) {
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_names_a_program_by_its_file_name_and_keeps_its_arguments() {
        for (command, shown) in [
            (
                "/usr/bin/python3 train.py --lr 1e-3",
                "python3 train.py --lr 1e-3",
            ),
            ("/opt/tool", "tool"),
            ("python3 -c print(1)", "python3 -c print(1)"),
            // No name after the last slash: shown whole.
            ("/opt/tool/ --flag", "/opt/tool/ --flag"),
            ("/", "/"),
            ("", ""),
        ] {
            assert_eq!(short_command(command), shown, "{command:?}");
        }
    }

    #[test]
    fn text_is_escaped_for_a_terminal_and_json_keeps_its_values() {
        let text = "\x1b]0;pwned\x07 a\tb \u{7f}\u{9b}31m \u{202e}txt.exe é";
        assert_eq!(
            escape(text),
            "\\e]0;pwned\\a a\\tb \\x7f\\u{9b}31m \\u{202e}txt.exe é"
        );
        assert_eq!(escape("plain"), "plain");
        let json = terminal_safe_json(serde_json::to_string(&[text]).unwrap());
        assert!(!json.chars().any(is_unsafe), "{json}");
        let back: Vec<String> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, [text]);
    }
}
