//! A binary that asks the driver and NVML for itself runs without the library: the
//! library preloaded into it would budget it and show it budgets instead of devices.

/// Where a process started again by [`without_own_preload`] finds the `LD_PRELOAD` it had
/// (`doctor` reports it).
pub const PRELOAD_BEFORE: &str = "_CUDABUDGET_PRELOAD_BEFORE";

/// `status`, `limit`, `doctor`, `install` and the exporter ask the driver and NVML for
/// themselves: with the library preloaded into this process (an image that sets
/// `LD_PRELOAD` for everything) they would see budgets instead of devices, and be
/// budgeted themselves. Such a process starts itself again without it (the old value is
/// kept in [`PRELOAD_BEFORE`] for `doctor`).
pub fn without_own_preload() {
    use std::os::unix::process::CommandExt;
    let Some(preload) = std::env::var_os("LD_PRELOAD") else {
        return;
    };
    if std::env::var_os(PRELOAD_BEFORE).is_some() {
        return; // started again already
    }
    let text = preload.to_string_lossy().into_owned();
    let entries: Vec<&str> = text.split([':', ' ']).filter(|e| !e.is_empty()).collect();
    let kept: Vec<&str> = entries
        .iter()
        .copied()
        .filter(|e| {
            !std::path::Path::new(e)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libcudabudget"))
        })
        .collect();
    if kept.len() == entries.len() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let mut command = std::process::Command::new(exe);
    command
        .args(std::env::args_os().skip(1))
        .env(PRELOAD_BEFORE, &preload);
    if kept.is_empty() {
        command.env_remove("LD_PRELOAD");
    } else {
        command.env("LD_PRELOAD", kept.join(":"));
    }
    // Only returns if the exec failed: go on as we are.
    let _ = command.exec();
}
