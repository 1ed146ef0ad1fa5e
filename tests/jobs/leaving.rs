//! Leaving: a member that exits, is killed (reaped or not), execs, or loses its context
//! gives its share back at once, and takes only its own; a stopped member holds nobody up.

use super::*;

#[test]
fn a_killed_holders_share_comes_back_at_once() {
    let dir = job_dir("kill");
    let e = envs(&dir, "job:k", "1Gi");
    let mut holder = spawn(&["alloc:800Mi", "sleep:30000"], &e);
    util::wait_for_line(&mut holder, "alloc");
    let before = client(&["alloc:800Mi"], &e);
    assert_eq!(
        before.rc("alloc", 0),
        2,
        "the holder still holds it\n{before:?}"
    );
    holder.kill().unwrap();
    holder.wait().unwrap();
    // Without a wait (CUDABUDGET_ON_EXCEED is `fail`): the share is back at the first ask.
    let after = client(&["alloc:800Mi"], &e);
    assert_eq!(after.rc("alloc", 0), 0, "{after:?}");
}

#[test]
fn a_process_that_exits_gives_its_share_back_at_once() {
    // A member that ends (exit, not killed) leaves the job: the next process sees the
    // whole budget free, before anything looks for dead members.
    let dir = job_dir("leave");
    let e = envs(&dir, "job:leave", "1Gi");
    let first = client(&["alloc:700Mi"], &e);
    assert_eq!(first.rc("alloc", 0), 0, "{first:?}");
    let next = client(&["info"], &e);
    assert_eq!(next.num("info", 0, "free"), GI, "{next:?}");
}

#[test]
fn a_member_that_exits_takes_only_its_own_share_out_of_the_job() {
    // One member holds 400 MiB; another allocates, frees, allocates again and exits.
    // The job's books then hold exactly the first member's 400 MiB.
    let dir = job_dir("ownshare");
    let e = envs(&dir, "job:own", "1Gi");
    let holder = Holder::start(&["alloc:400Mi"], &e);
    let other = client(&["alloc:100Mi", "free:0", "alloc:300Mi"], &e);
    assert_eq!(other.rc("alloc", 1), 0, "{other:?}");
    let view = client(&["info"], &e);
    holder.finish();
    assert_eq!(view.num("info", 0, "free"), GI - 400 * MI, "{view:?}");
}

#[test]
fn a_member_whose_memory_went_with_its_context_holds_nothing_in_the_job() {
    // A reset of the primary context frees everything allocated in it: the process's
    // share of the job goes back with it.
    let dir = job_dir("teardown");
    let e = envs(&dir, "job:teardown", "1Gi");
    let holder = Holder::start(&["alloc:700Mi", "ctxreset:0", "ctx:0"], &e);
    // Holder::start returned once the reset and the next context were done.
    let view = client(&["info"], &e);
    let holder = holder.finish();
    assert_eq!(holder.rc("ctxreset", 0), 0, "{holder:?}");
    assert_eq!(view.num("info", 0, "free"), GI, "{view:?}");
}

#[test]
fn a_forked_child_is_not_its_parents_member() {
    // The child of fork() does not share its parent's slot: when it exits, the
    // parent's share stays in the job's books.
    let dir = job_dir("fork");
    let out = python_job(
        &dir,
        "fork",
        r#"
import os
rc, p = alloc(700 * MI); assert rc == 0
pid = os.fork()
if pid == 0:
    sys.exit(0)
os.waitpid(pid, 0)
view = member("""
f = ctypes.c_size_t(); t = ctypes.c_size_t()
assert cuda.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)) == 0
print(f.value // MI, flush=True)
""")
print(view.stdout.readline().strip())
view.wait()
"#,
        "fail",
    );
    assert_eq!(out.trim(), "324", "{out}");
}

#[test]
fn a_killed_members_forked_child_does_not_keep_its_share_in_the_job() {
    // The child of fork() inherits its parent's descriptors, the ledger's among them; it
    // must not keep a killed parent alive to the job.
    let dir = job_dir("fork-kill");
    let out = python_job(
        &dir,
        "forkkill",
        r#"
import os, signal
holder = member("""
import os, time
rc, p = alloc(700 * MI); assert rc == 0
child = os.fork()
if child == 0:
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1); os.dup2(quiet, 2)
    time.sleep(30)
    os._exit(0)
print(child, flush=True)
time.sleep(30)
""")
child = int(holder.stdout.readline())
rc, p = alloc(700 * MI)
print("while it lives", rc)
os.kill(holder.pid, signal.SIGKILL)
holder.wait()
rc, p = alloc(700 * MI)
print("after it was killed", rc)
os.kill(child, signal.SIGKILL)
"#,
        "fail",
    );
    assert!(out.contains("while it lives 2"), "{out}");
    assert!(out.contains("after it was killed 0"), "{out}");
}

#[test]
fn a_killed_member_not_yet_reaped_gives_its_share_back() {
    // A zombie runs nothing and holds nothing: its share comes back before its parent
    // reaps it (this test reaps it only at the end).
    let dir = job_dir("zombie");
    let e = envs(&dir, "job:z", "1Gi");
    let mut holder = spawn(&["alloc:800Mi", "sleep:30000"], &e);
    // SAFETY: a plain signal to our own child, which is not reaped (it stays a zombie).
    unsafe { libc::kill(holder.id() as i32, libc::SIGKILL) };
    until_state(holder.id(), 'Z');
    let after = client(&["alloc:800Mi"], &e);
    holder.wait().unwrap();
    assert_eq!(
        after.rc("alloc", 0),
        0,
        "the zombie's share stayed\n{after:?}"
    );
}

/// Waits until the process `pid` is in `state` (`/proc/<pid>/stat`'s third field: `Z`
/// for a zombie), 60 s at most.
fn until_state(pid: u32, state: char) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The name in parentheses may hold spaces: the state follows its last `)`.
        let now = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next());
        if now == Some(state) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{pid} never in state {state}: {stat}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_member_that_execs_another_program_gives_its_share_back() {
    // After exec the process is another program: what the old image held is gone with
    // its address space, whether or not the new one uses CUDA.
    let dir = job_dir("exec");
    let mut member = python_member(
        &dir,
        "exec",
        r#"
import os
rc, p = alloc(800 * MI); assert rc == 0
print("held", flush=True)
os.execv("/bin/sleep", ["sleep", "30"])
"#,
        "fail",
    );
    assert_eq!(read_line(&mut member).trim(), "held");
    until_exec(member.id(), "/bin/sleep");
    let e = envs(&dir, "job:exec", "1Gi");
    let after = client(&["alloc:800Mi"], &e);
    member.kill().unwrap();
    member.wait().unwrap();
    assert_eq!(
        after.rc("alloc", 0),
        0,
        "the old image's share stayed\n{after:?}"
    );
}

/// Waits until the process `pid` runs `program` (its exec done), 60 s at most.
fn until_exec(pid: u32, program: &str) {
    let program = std::fs::canonicalize(program).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::read_link(format!("/proc/{pid}/exe")).ok() != Some(program.clone()) {
        assert!(
            Instant::now() < deadline,
            "{pid} never ran {}",
            program.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_member_that_execs_into_another_member_starts_with_nothing_held() {
    // The new image joins the job with the same pid and start time as the old one: it
    // is a new member, and the old image's 800 MiB are not charged to it or the job.
    let dir = job_dir("reexec");
    let mut member = python_member(
        &dir,
        "reexec",
        r#"
import os, sys
if len(sys.argv) < 2:
    rc, p = alloc(800 * MI); assert rc == 0
    os.execv(sys.executable, [sys.executable, "-c", PRELUDE_AGAIN, "again"])
"#
        .replace(
            "PRELUDE_AGAIN",
            &format!(
                "{:?}",
                format!("{THREADS_PRELUDE}\nrc, p = alloc(800 * MI)\nprint(rc, flush=True)\n")
            ),
        )
        .as_str(),
        "fail",
    );
    let line = read_line(&mut member);
    let out = member.wait_with_output().unwrap();
    assert_eq!(
        line.trim(),
        "0",
        "the new image was charged the old one's share\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_stopped_member_never_holds_up_the_others_frees_or_allocations() {
    // A member allocating and freeing in a loop is stopped (SIGSTOP) a hundred times,
    // at whatever point of its calls the signal finds it; each time, another member
    // allocates and frees: neither waits on the stopped one beyond the bound.
    let dir = job_dir("stopped");
    let mut busy = python_member(
        &dir,
        "stopped",
        r#"
print("busy", flush=True)
while True:
    rc, p = alloc(MI)
    if rc == 0:
        free(p)
"#,
        "fail",
    );
    assert_eq!(read_line(&mut busy).trim(), "busy");
    let pid = busy.id();
    let other = python_member(
        &dir,
        "stopped",
        &format!(
            r#"{WATCHDOG}
busy = {pid}
worst = 0.0
for i in range(100):
    os.kill(busy, signal.SIGSTOP)
    time.sleep(0.002)
    (rc, p), took = timed(alloc, 100 * MI)
    assert rc == 0, rc
    _, took2 = timed(free, p)
    worst = max(worst, took, took2)
    os.kill(busy, signal.SIGCONT)
print("worst", worst, flush=True)
"#
        ),
        "fail",
    );
    let out = other.wait_with_output().unwrap();
    let _ = busy.kill();
    let _ = busy.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    let worst: f64 = text
        .split_whitespace()
        .nth(1)
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("{text}\n{}", String::from_utf8_lossy(&out.stderr)));
    assert!(
        worst < 0.5,
        "an allocation or free waited {worst} s: {text}"
    );
}

#[test]
fn a_lock_word_naming_a_live_member_that_is_not_admitting_holds_nobody_up() {
    // A member killed while it held a device's lock, its slot then reused by a new live
    // member (or a crafted lock=1 on slot 0, which a live member then took): the lock
    // names a live process that is not admitting. Others allocate and free; they do not
    // spin on it (a minute is far beyond any wait the lock allows).
    let dir = job_dir("stale-lock");
    let e = envs(&dir, "job:sl", "1Gi");
    // The idle member lives until the test makes the file it waits for: all along.
    let release = format!("{dir}/release");
    let mut idle = spawn(&["alloc:1Mi", &format!("waitfile:{release}")], &e);
    util::wait_for_line(&mut idle, "alloc");
    let path = ledger_file(&dir, "sl");
    // Slot 0 + 1 (its first generation): the idle member's slot.
    write_at(&path, lock_offset(&path), &1u64.to_le_bytes());
    let mut cmd = command(&["alloc:100Mi", "free:0", "alloc:100Mi"], &e);
    let t = Instant::now();
    let mut child = cmd.spawn().unwrap();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if t.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let took = t.elapsed();
    // It went through while the lock's owner lived (it waits 30 s at most for its file):
    // not by outwaiting it.
    let owner_lived = idle.try_wait().unwrap().is_none();
    // The idle member's own exit gives its share back without waiting on the lock.
    std::fs::write(&release, b"").unwrap();
    let mut idle = idle;
    let idle_exited = (0..6000).any(|_| {
        std::thread::sleep(Duration::from_millis(10));
        idle.try_wait().unwrap().is_some()
    });
    if !idle_exited {
        let _ = idle.kill();
    }
    let _ = idle.wait();
    assert!(status.is_some(), "the member spun on the lock for {took:?}");
    assert!(
        owner_lived,
        "the member went through only once the lock's owner ended"
    );
    assert!(idle_exited, "the idle member spun on the lock at its exit");
    let run = finish(child);
    assert_eq!(run.rc("alloc", 0), 0, "{run:?}");
    assert_eq!(run.rc("alloc", 1), 0, "{run:?}");
}

#[test]
fn a_member_whose_name_is_not_utf8_keeps_its_share_counted() {
    // A program's name in /proc/<pid>/stat is 15 bytes of its file name, cut wherever
    // they end: here inside a character. The member is alive and its share counts.
    let dir = job_dir("name-not-utf8");
    let e = envs(&dir, "job:n", "1Gi");
    let program = std::path::Path::new(&dir).join("a训练脚本模型");
    std::fs::copy(crate::util::client_bin("gpa"), &program).unwrap();
    let mut holder = crate::util::fixture_command(
        program.to_str().unwrap(),
        &e,
        Some(&crate::util::lib_path()),
    );
    holder
        .args(["gpa", "alloc:800Mi", "sleep:30000"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut holder = holder.spawn().unwrap();
    util::wait_for_line(&mut holder, "alloc");
    let stat = std::fs::read(format!("/proc/{}/stat", holder.id())).unwrap();
    assert!(
        std::str::from_utf8(&stat).is_err(),
        "the name is UTF-8 after all"
    );
    // Twice, a second apart: each denial looks for dead members first.
    let first = client(&["alloc:800Mi"], &e);
    std::thread::sleep(Duration::from_millis(1100));
    let second = client(&["alloc:800Mi"], &e);
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert_ne!(
        first.rc("alloc", 0),
        0,
        "admitted past the job's budget\n{first:?}"
    );
    assert_ne!(
        second.rc("alloc", 0),
        0,
        "admitted past the job's budget\n{second:?}"
    );
}

#[test]
fn the_jobs_ledger_is_removed_when_its_last_member_exits_and_kept_while_one_remains() {
    let dir = job_dir("removed");
    let e = envs(&dir, "job:gone", "1Gi");
    let ledger = std::path::Path::new(&dir)
        .join(format!("cudabudget-{}", unsafe_uid()))
        .join("job-gone");
    let holder = Holder::start(&["alloc:100Mi"], &e);
    assert!(ledger.exists(), "made by the first member");
    let other = client(&["alloc:100Mi"], &e);
    assert_eq!(other.rc("alloc", 0), 0, "{other:?}");
    assert!(ledger.exists(), "a member remains");
    let holder = holder.finish();
    assert_eq!(holder.rc("alloc", 0), 0, "{holder:?}");
    assert!(!ledger.exists(), "the last member removed it");
    // The job's next process starts a fresh ledger with the whole budget.
    let next = client(&["info"], &e);
    assert_eq!(next.num("info", 0, "free"), GI, "{next:?}");
}
