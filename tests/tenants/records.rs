//! Records among tenants: what another user can plant in
//! the shared runtime directory neither hides a user's processes from `status` nor
//! passes for them, and two users' jobs of one name stay two. Run as root (CI); skipped
//! otherwise (see `util/tenants.rs`).

use crate::util::tenants::{Tenants, User, as_user};
use cudabudget_spec::record;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const GI: u64 = 1 << 30;

/// What a tenant needs to run a budgeted client and the CLI.
pub(crate) struct Kit {
    pub client: PathBuf,
    pub cli: PathBuf,
    pub library: PathBuf,
    pub fake: PathBuf,
}

pub(crate) fn kit(t: &Tenants) -> Kit {
    // `Tenants::share` copies through one temporary name: one test at a time.
    static SHARING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = SHARING.lock().unwrap_or_else(|e| e.into_inner());
    Kit {
        client: t.share(Path::new(crate::util::client_bin("gpa"))),
        cli: t.share(Path::new(crate::util::cli::BIN)),
        library: t.share(&crate::util::cli::fresh_library()),
        fake: t.share_dir(Path::new(crate::util::fake_dir())),
    }
}

/// A budgeted client of `user` that allocates 1 MiB and sleeps, killed when dropped.
pub(crate) struct Client(pub Child);

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn budgeted(
    t: &Tenants,
    kit: &Kit,
    user: &User,
    envs: &[(&str, &str)],
    stderr: Stdio,
) -> Client {
    let mut command = as_user(t, user, &kit.client, &["gpa", "alloc:1Mi", "sleep:20000"]);
    command
        .env("LD_PRELOAD", &kit.library)
        .env("LD_LIBRARY_PATH", &kit.fake)
        .env("CUDABUDGET_LIMIT", "1Gi")
        .envs(envs.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr);
    Client(command.spawn().expect("start the client"))
}

/// `cudabudget status ARGS` as `user` (`None`: root, this process's user).
fn status_as(t: &Tenants, kit: &Kit, user: Option<&User>, runtime: &Path, args: &[&str]) -> String {
    let mut command = match user {
        Some(user) => as_user(t, user, &kit.cli, args),
        None => crate::util::cli::cli_at(&kit.cli, args),
    };
    command.env("CUDABUDGET_RUNTIME_DIR", runtime);
    let out = crate::util::cli::output(&mut command);
    assert!(out.status.success(), "{}", crate::util::cli::stderr(&out));
    crate::util::cli::stdout(&out)
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

fn entries_of(status: &serde_json::Value, pid: u32) -> Vec<serde_json::Value> {
    status["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["pid"].as_u64() == Some(u64::from(pid)))
        .cloned()
        .collect()
}

/// Waits (10 s at most) until `look` finds what it wants in a fresh status.
fn wait_until<T>(mut look: impl FnMut() -> (Option<T>, String)) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (found, last) = look();
        if let Some(found) = found {
            return found;
        }
        assert!(Instant::now() < deadline, "never came; last status: {last}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn another_users_directory_file_or_link_at_alices_name_does_not_hide_her_processes() {
    let Some(t) = Tenants::get() else { return };
    let kit = kit(t);
    let name = cudabudget_spec::place::user_dir_name(t.alice.uid);
    for (kind, program, args) in [
        ("directory", "/bin/mkdir", vec!["-m", "0755"]),
        ("file", "/usr/bin/touch", vec![]),
        ("symbolic link", "/bin/ln", vec!["-s", "/etc/passwd"]),
    ] {
        let runtime = t.sticky_dir(&format!("rec-taken-{}", kind.replace(' ', "-")));
        let planted = runtime.join(&name);
        let mut args: Vec<&str> = args;
        let planted_arg = planted.to_str().unwrap();
        args.push(planted_arg);
        let out = crate::util::cli::output(&mut as_user(t, &t.mallory, Path::new(program), &args));
        assert!(out.status.success(), "{}", crate::util::cli::stderr(&out));

        // Alice's directory takes its next name in the same runtime directory, where
        // root's status and the exporter read it too, whatever her environment.
        let next = runtime.join(format!("{name}.1"));
        let log = t
            .shared
            .join(format!("alice-{}.log", kind.replace(' ', "-")));
        let envs = vec![
            ("CUDABUDGET_RUNTIME_DIR", runtime.to_str().unwrap()),
            ("CUDABUDGET_LOG", "info"),
        ];
        let client = budgeted(
            t,
            &kit,
            &t.alice,
            &envs,
            Stdio::from(std::fs::File::create(&log).unwrap()),
        );
        let pid = client.0.id();
        wait_until(|| {
            let mut command = as_user(t, &t.alice, &kit.cli, &["status", "--json"]);
            command.envs(envs.iter().copied());
            let text = crate::util::cli::stdout(&crate::util::cli::output(&mut command));
            let found = entries_of(&json(&text), pid).into_iter().next();
            (found, text)
        });
        // Root's status says what is in the way instead of passing over it silently,
        // and finds her record under her next name.
        let root = json(&status_as(t, &kit, None, &runtime, &["status", "--json"]));
        if kind == "directory" {
            assert!(root["skipped"].to_string().contains(planted_arg), "{root}");
        }
        let entries = entries_of(&root, pid);
        assert_eq!(entries.len(), 1, "the {kind}: {root}");
        assert_eq!(entries[0]["uid"], t.alice.uid, "{root}");
        drop(client);
        let said = std::fs::read_to_string(&log).unwrap();
        assert!(
            said.contains(&format!("{} is taken by a {kind}", planted.display()))
                && said.contains(&next.display().to_string()),
            "the {kind}: alice is told where her record went and what was in the way:\n{said}"
        );
    }
}

#[test]
fn doctor_names_mallorys_directory_at_alices_name_in_the_runtime_dir_check() {
    let Some(t) = Tenants::get() else { return };
    let kit = kit(t);
    let name = cudabudget_spec::place::user_dir_name(t.alice.uid);
    let runtime = t.sticky_dir("rec-doctor");
    let planted = runtime.join(&name);
    let out = crate::util::cli::output(&mut as_user(
        t,
        &t.mallory,
        Path::new("/bin/mkdir"),
        &["-m", "0755", planted.to_str().unwrap()],
    ));
    assert!(out.status.success(), "{}", crate::util::cli::stderr(&out));
    let mut command = as_user(t, &t.alice, &kit.cli, &["doctor", "--json"]);
    command
        .env("LD_LIBRARY_PATH", &kit.fake)
        .env("CUDABUDGET_LIB", &kit.library)
        .env("CUDABUDGET_LIMIT", "1Gi")
        .env("CUDABUDGET_RUNTIME_DIR", &runtime);
    let out = crate::util::cli::output(&mut command);
    let report = json(&crate::util::cli::stdout(&out));
    let check = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "runtime-dir")
        .cloned()
        .unwrap();
    assert_eq!(check["status"], "warn", "{check:#}");
    let summary = check["summary"].as_str().unwrap();
    let own = runtime.join(format!("{name}.1"));
    assert!(
        summary.contains(&format!(
            "{} is taken by a directory of uid {}",
            planted.display(),
            t.mallory.uid
        )) && summary.contains(&format!("records go to {} instead", own.display())),
        "{summary}"
    );
    // Root's status and the exporter read every name of hers there: the check says so.
    assert!(summary.contains("look there too"), "{summary}");
    assert_eq!(check["details"]["dir"], own.to_str().unwrap(), "{check:#}");
}

/// `pid`'s start time and PID namespace, from /proc.
fn identity(pid: u32) -> (u64, u64) {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).unwrap();
    let link = std::fs::read_link(format!("/proc/{pid}/ns/pid")).unwrap();
    (
        record::start_time_from_stat(&stat).unwrap(),
        record::namespace_inode(&link.to_string_lossy()).unwrap(),
    )
}

/// `user`'s records directory in `runtime`, as that user would make it (0700).
fn records_dir_of(runtime: &Path, user: &User) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = runtime.join(cudabudget_spec::place::user_dir_name(user.uid));
    let _ = std::fs::create_dir(&dir);
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&dir, Some(user.uid), Some(user.gid)).unwrap();
    dir
}

#[test]
fn a_record_in_mallorys_directory_claiming_alices_process_is_not_shown_as_hers() {
    use std::os::unix::fs::PermissionsExt;
    let Some(t) = Tenants::get() else { return };
    let kit = kit(t);
    let runtime = t.sticky_dir("rec-forged");
    let client = budgeted(
        t,
        &kit,
        &t.alice,
        &[("CUDABUDGET_RUNTIME_DIR", runtime.to_str().unwrap())],
        Stdio::null(),
    );
    let pid = client.0.id();
    // Her record is first written when the library starts, before her allocation: wait
    // for the one that shows her device, so what is compared below is hers.
    wait_until(|| {
        let text = status_as(t, &kit, None, &runtime, &["status", "--json"]);
        let shown = entries_of(&json(&text), pid)
            .into_iter()
            .find(|entry| entry["devices"][0]["used_bytes"].as_u64() > Some(0));
        (shown, text)
    });
    // What mallory can write into her own directory: alice's pid and start time, with
    // figures of her choosing.
    let (start_time, namespace) = identity(pid);
    let forged = record::Record {
        pid,
        start_time,
        pid_namespace: namespace,
        updated_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64,
        job: Some("train".into()),
        command: "forged".into(),
        pod: Some("trainer-0".into()),
        namespace: Some("ml".into()),
        devices: vec![record::DeviceFigures {
            ordinal: 0,
            budget: 16 * GI,
            used: 8 * GI,
            peak: 8 * GI,
            denials: 4242,
            ..Default::default()
        }],
        ..Default::default()
    };
    let mut bytes = [0u8; record::SIZE];
    forged.encode(&mut bytes);
    let dir = records_dir_of(&runtime, &t.mallory);
    let file = dir.join(record::file_name(pid, namespace));
    std::fs::write(&file, bytes).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&file, Some(t.mallory.uid), Some(t.mallory.gid)).unwrap();

    let status = json(&status_as(t, &kit, None, &runtime, &["status", "--json"]));
    let entries = entries_of(&status, pid);
    assert_eq!(entries.len(), 1, "{status}");
    assert_eq!(entries[0]["devices"][0]["denials"], 0, "{status}");
    assert_ne!(entries[0]["command"], "forged", "{status}");
    assert!(
        status["skipped"]
            .to_string()
            .contains(&file.display().to_string()),
        "the forgery is named: {status}"
    );
    drop(client);
}

#[test]
fn two_users_jobs_with_one_name_stay_two_jobs() {
    let Some(t) = Tenants::get() else { return };
    let kit = kit(t);
    let runtime = t.sticky_dir("rec-jobs");
    let jobs = t.sticky_dir("rec-jobs-ledgers");
    let envs = [
        ("CUDABUDGET_RUNTIME_DIR", runtime.to_str().unwrap()),
        ("CUDABUDGET_JOB_DIR", jobs.to_str().unwrap()),
        ("CUDABUDGET_SCOPE", "job:train"),
    ];
    let clients: Vec<Client> = [&t.alice, &t.alice, &t.mallory, &t.mallory]
        .into_iter()
        .map(|user| budgeted(t, &kit, user, &envs, Stdio::null()))
        .collect();
    let status = wait_until(|| {
        let text = status_as(t, &kit, None, &runtime, &["status", "--json"]);
        let status = json(&text);
        let all = clients
            .iter()
            .all(|c| !entries_of(&status, c.0.id()).is_empty());
        (all.then_some(status), text)
    });
    let trains: Vec<&serde_json::Value> = status["jobs"]
        .as_array()
        .expect("a jobs list")
        .iter()
        .filter(|j| j["name"] == "train")
        .collect();
    assert_eq!(trains.len(), 2, "{status}");
    for user in [&t.alice, &t.mallory] {
        let job = trains
            .iter()
            .find(|j| j["uid"] == user.uid)
            .unwrap_or_else(|| panic!("no job train of {}: {status}", user.name));
        assert_eq!(job["processes"], 2, "{status}");
    }
    let table = status_as(t, &kit, None, &runtime, &["status"]);
    let lines: Vec<&str> = table
        .lines()
        .filter(|l| l.starts_with("job train"))
        .collect();
    assert_eq!(lines.len(), 2, "{table}");
    for user in ["cbalice", "cbmallory"] {
        assert!(
            lines
                .iter()
                .any(|l| l.contains(user) && l.contains("2 processes")),
            "{table}"
        );
    }
    drop(clients);
}
