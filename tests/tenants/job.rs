//! A job's ledger among tenants: another user's file, link or directory at the names a
//! job uses in a shared directory never takes CUDA or the budget away from the job's
//! user. Run as root (CI); skipped otherwise (see `util::tenants`).

use crate::util::tenants::{Tenants, User, as_user};
use crate::util::{Run, fake_dir, lib_path};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// `ops` of the fake client, run as `user` in job `train` (1 GiB) whose ledgers go in
/// `dir`; `more` adds variables.
fn member(
    t: &Tenants,
    user: &User,
    dir: &Path,
    ops: &[&str],
    more: &[(&str, &str)],
) -> std::process::Command {
    let (client, lib, fake, _) = shared(t);
    let mut args = vec!["gpa"];
    args.extend_from_slice(ops);
    let mut cmd = as_user(t, user, client, &args);
    cmd.env("LD_LIBRARY_PATH", fake)
        .env("LD_PRELOAD", lib)
        .env("CUDABUDGET_JOB_DIR", dir)
        .env("CUDABUDGET_SCOPE", "job:train")
        .env("CUDABUDGET_LIMIT", "1Gi")
        .env("FAKE_NVML_PID_OFFSET", "100000");
    for (k, v) in more {
        cmd.env(k, v);
    }
    cmd
}

/// The client, the library, the fake driver's directory and the CLI, copied where the
/// tenants can run them: once for the whole binary (the tests run in parallel).
fn shared(t: &Tenants) -> &'static (PathBuf, PathBuf, PathBuf, PathBuf) {
    static SHARED: std::sync::OnceLock<(PathBuf, PathBuf, PathBuf, PathBuf)> =
        std::sync::OnceLock::new();
    SHARED.get_or_init(|| {
        (
            t.share(Path::new(crate::util::client_bin("gpa"))),
            t.share(&lib_path()),
            t.share_dir(Path::new(fake_dir())),
            t.share(Path::new(env!("CARGO_BIN_EXE_cudabudget"))),
        )
    })
}

fn run(cmd: std::process::Command) -> Run {
    crate::util::run(cmd)
}

/// Gives what root planted to `user` (without following a link).
fn chown(path: &Path, user: &User) {
    std::os::unix::fs::lchown(path, Some(user.uid), Some(user.gid)).unwrap();
}

/// alice's job still runs under its budget: CUDA works, 700 MiB fit, 500 MiB more do
/// not (whichever budget holds: the job's or, with no place for its ledger, the
/// process's own).
fn assert_budgeted(run: &Run, what: &str) {
    assert_eq!(run.rc("init", 0), 0, "{what}: CUDA was taken away\n{run:?}");
    assert_eq!(run.rc("alloc", 0), 0, "{what}: {run:?}");
    assert_eq!(run.rc("alloc", 1), 2, "{what}: unbudgeted\n{run:?}");
}

#[test]
fn another_users_file_or_link_at_a_jobs_old_name_does_not_disable_the_job() {
    let Some(t) = Tenants::get() else { return };
    for (what, plant) in [("a file of mallory's", 0), ("a link to /etc/passwd", 1)] {
        let dir = t.sticky_dir(&format!("job-old-name-{plant}"));
        let name = dir.join(format!("cudabudget-{}-job-train", t.alice.uid));
        match plant {
            0 => {
                std::fs::write(&name, b"mallory was here").unwrap();
                std::fs::set_permissions(&name, std::fs::Permissions::from_mode(0o644)).unwrap();
            }
            _ => std::os::unix::fs::symlink("/etc/passwd", &name).unwrap(),
        }
        chown(&name, &t.mallory);
        // Not alice's $HOME/.cache, where another test's job `train` may be running (a
        // process joins its job's ledger wherever it exists).
        let home = dir.display().to_string();
        let run = run(member(
            t,
            &t.alice,
            &dir,
            &["alloc:700Mi", "alloc:500Mi"],
            &[("HOME", &home)],
        ));
        assert_budgeted(&run, what);
        let passwd = std::fs::read_to_string("/etc/passwd").unwrap();
        assert!(passwd.contains("root:"), "{what}: /etc/passwd was written");
    }
}

#[test]
fn another_users_directory_at_the_users_own_name_moves_the_job_to_her_next_name_for_every_member() {
    // mallory holds `cudabudget-<alice's uid>` in the shared directory (a directory, or a
    // link to one of hers): alice's job lives under her next name there,
    // `cudabudget-<uid>.1`, still one budget for all of its processes whatever their
    // environment ($HOME unset in one of them), a line names what was in the way, and
    // root's `limit --job` finds the job.
    let Some(t) = Tenants::get() else { return };
    for link in [false, true] {
        let dir = t.sticky_dir(&format!("job-taken-{link}"));
        let taken = dir.join(format!("cudabudget-{}", t.alice.uid));
        if link {
            let hers = dir.join("mallorys");
            std::fs::create_dir(&hers).unwrap();
            chown(&hers, &t.mallory);
            std::os::unix::fs::symlink(&hers, &taken).unwrap();
        } else {
            std::fs::create_dir(&taken).unwrap();
            std::fs::set_permissions(&taken, std::fs::Permissions::from_mode(0o777)).unwrap();
        }
        chown(&taken, &t.mallory);
        let mut holder = member(t, &t.alice, &dir, &["alloc:700Mi", "sleep:30000"], &[]);
        holder
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut holder = holder.spawn().unwrap();
        crate::util::wait_for_line(&mut holder, "alloc");
        let mut homeless = member(t, &t.alice, &dir, &["alloc:500Mi", "alloc:300Mi"], &[]);
        homeless.env_remove("HOME").env_remove("XDG_RUNTIME_DIR");
        let other = run(homeless);
        let ledger = dir
            .join(format!("cudabudget-{}.1", t.alice.uid))
            .join("job-train");
        let ours = ledger.exists();
        let (_, _, _, cli) = shared(t);
        let uid = t.alice.uid.to_string();
        let seen = std::process::Command::new(cli)
            .args(["limit", "--job", "train", "--uid", &uid])
            .env("CUDABUDGET_JOB_DIR", &dir)
            .output()
            .unwrap();
        let _ = holder.kill();
        let out = holder.wait_with_output().unwrap();
        let holder_err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(other.rc("init", 0), 0, "link={link}: {other:?}");
        assert_eq!(
            other.rc("alloc", 0),
            2,
            "link={link}: not one job budget\n{other:?}"
        );
        assert_eq!(other.rc("alloc", 1), 0, "link={link}: {other:?}");
        let named = taken.display().to_string();
        assert!(
            holder_err.lines().filter(|l| l.contains(&named)).count() == 1,
            "link={link}: no line names {named}:\n{holder_err}"
        );
        assert!(
            ours,
            "link={link}: the job's ledger is not at {}",
            ledger.display()
        );
        let said = String::from_utf8_lossy(&seen.stdout);
        assert!(
            seen.status.success() && said.contains("700.00 MiB"),
            "link={link}: root's limit does not find the job: {said}{}",
            String::from_utf8_lossy(&seen.stderr)
        );
    }
}

#[test]
fn with_every_name_taken_a_jobs_process_gets_no_cuda_and_is_told_why() {
    // mallory holds every name alice's directory may have in the shared directory:
    // alone, each process would have the job's whole budget, so none runs (CUDA is
    // refused with one line naming what is in the way), whatever its $HOME says.
    let Some(t) = Tenants::get() else { return };
    let dir = t.sticky_dir("job-nowhere");
    for name in cudabudget_spec::place::user_dir_names(t.alice.uid) {
        let taken = dir.join(name);
        std::fs::create_dir(&taken).unwrap();
        chown(&taken, &t.mallory);
    }
    let home = t.home_of(&t.alice).display().to_string();
    let run = run(member(
        t,
        &t.alice,
        &dir,
        &["alloc:700Mi", "alloc:500Mi"],
        &[("HOME", &home)],
    ));
    assert_ne!(run.rc("init", 0), 0, "{run:?}");
    let named = dir
        .join(format!("cudabudget-{}", t.alice.uid))
        .display()
        .to_string();
    let lines: Vec<&str> = run.stderr.lines().filter(|l| l.contains(&named)).collect();
    assert_eq!(lines.len(), 1, "{}", run.stderr);
    assert!(lines[0].contains("CUDA is disabled"), "{}", lines[0]);
}

#[test]
fn another_users_file_beside_hamis_shared_cache_moves_the_ledger_to_a_private_place() {
    // HAMi's processes name a cache file in a shared directory; mallory planted a file
    // where our ledger beside it would go. alice's processes share one budget in her own
    // directory instead, and a line names the planted file.
    let Some(t) = Tenants::get() else { return };
    let shared = t.sticky_dir("job-hami");
    let cache = shared.join("vgpu.cache");
    let planted = shared.join("vgpu.cache.cudabudget");
    std::fs::write(&planted, b"mallory was here").unwrap();
    chown(&planted, &t.mallory);
    let roots = t.sticky_dir("job-hami-roots");
    let hami = |ops: &[&str]| {
        let mut cmd = member(t, &t.alice, &roots, ops, &[]);
        cmd.env_remove("CUDABUDGET_SCOPE")
            .env_remove("CUDABUDGET_LIMIT")
            .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
            .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", &cache);
        cmd
    };
    // The holder holds its 700 MiB until the test makes the file it waits for.
    let release = roots.join("release");
    let wait = format!("waitfile:{}", release.display());
    let mut holder = hami(&["alloc:700Mi", &wait]);
    holder
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut holder = holder.spawn().unwrap();
    crate::util::wait_for_line(&mut holder, "alloc");
    let other = run(hami(&["alloc:500Mi", "alloc:300Mi"]));
    std::fs::write(&release, b"").unwrap();
    let out = holder.wait_with_output().unwrap();
    let holder_err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(other.rc("init", 0), 0, "{other:?}");
    assert_eq!(other.rc("alloc", 0), 2, "not one budget: {other:?}");
    assert_eq!(other.rc("alloc", 1), 0, "{other:?}");
    let named = planted.display().to_string();
    assert_eq!(
        holder_err.lines().filter(|l| l.contains(&named)).count(),
        1,
        "{holder_err}"
    );
    assert_eq!(std::fs::read(&planted).unwrap(), b"mallory was here");
}

#[test]
fn doctor_names_another_users_directory_in_the_way_of_the_jobs_ledger() {
    let Some(t) = Tenants::get() else { return };
    let dir = t.sticky_dir("job-doctor");
    let taken = dir.join(format!("cudabudget-{}", t.alice.uid));
    std::fs::create_dir(&taken).unwrap();
    chown(&taken, &t.mallory);
    let (_, _, fake, cli) = shared(t);
    let nowhere = t.shared.join("no-such-home");
    let mut cmd = as_user(t, &t.alice, cli, &["doctor", "--json"]);
    cmd.env("LD_LIBRARY_PATH", fake)
        .env("CUDABUDGET_JOB_DIR", &dir)
        .env("CUDABUDGET_SCOPE", "job:train")
        .env("CUDABUDGET_LIMIT", "1Gi")
        .env("HOME", &nowhere);
    let out = crate::util::cli::output(&mut cmd);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("{e}: {}", String::from_utf8_lossy(&out.stderr));
    });
    let check = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "job-ledger")
        .cloned()
        .unwrap();
    assert_eq!(check["status"], "warn", "{check:#}");
    let summary = check["summary"].as_str().unwrap();
    assert!(summary.contains(&taken.display().to_string()), "{summary}");
    assert!(summary.contains("uid"), "{summary}");
}
