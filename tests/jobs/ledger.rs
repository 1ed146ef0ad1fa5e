//! The ledger itself: a damaged, foreign or others-writable ledger refuses CUDA (or is
//! passed over) with one line, a truncated one or a stray write never admits past the
//! budget, and `doctor` names a damaged one.

use super::*;

#[test]
fn a_damaged_or_foreign_ledger_refuses_cuda_with_one_line() {
    let dir = job_dir("corrupt");
    let e = envs(&dir, "job:bad", "1Gi");
    let private = format!("{dir}/cudabudget-{}", unsafe_uid());
    std::fs::create_dir_all(&private).unwrap();
    set_mode(&private, 0o700);
    let path = format!("{private}/job-bad");
    for (what, bytes) in [
        ("truncated", vec![0u8; 100]),
        ("foreign", vec![0x41u8; 1 << 20]),
        ("empty", Vec::new()),
    ] {
        std::fs::write(&path, &bytes).unwrap();
        set_mode(&path, 0o600);
        let run = client(&["info"], &e);
        assert_eq!(run.rc("init", 0), 800, "{what}: {run:?}");
        let lines: Vec<&str> = run
            .stderr
            .lines()
            .filter(|l| l.contains("job ledger"))
            .collect();
        assert_eq!(lines.len(), 1, "{what}: {}", run.stderr);
        assert!(lines[0].contains(&path), "{what}: {}", lines[0]);
        assert_eq!(
            std::fs::read(&path).unwrap(),
            bytes,
            "{what}: the ledger was made again"
        );
    }
    // A ledger of a valid size whose header is damaged.
    let good = job_dir("corrupt-good");
    let member = Member::start(&envs(&good, "job:bad", "1Gi"));
    let good_path = ledger_file(&good, "bad");
    let mut bytes = std::fs::read(&good_path).unwrap();
    drop(member);
    bytes[8] ^= 0xff; // the version
    std::fs::write(&path, &bytes).unwrap();
    set_mode(&path, 0o600);
    let run = client(&["info"], &e);
    assert_eq!(run.rc("init", 0), 800, "{run:?}");
    assert!(run.stderr.contains("layout version"), "{}", run.stderr);
}

#[test]
fn a_ledger_others_may_write_or_another_user_owns_refuses_cuda_with_one_line() {
    // Not a ledger to trust, and no other place every member would find: the process
    // gets no CUDA (alone, it would have the job's whole budget) and says which file is
    // in the way.
    let dir = job_dir("perm");
    let e = envs(&dir, "job:p", "1Gi");
    let _member = Member::start(&e);
    let path = ledger_file(&dir, "p");
    set_mode(&path, 0o666);
    let run1 = client(&["alloc:700Mi", "alloc:500Mi"], &e);
    assert_eq!(run1.rc("init", 0), 800, "{run1:?}");
    let named: Vec<&str> = run1.stderr.lines().filter(|l| l.contains(&path)).collect();
    assert_eq!(named.len(), 1, "{}", run1.stderr);
    assert!(named[0].contains("others may write"), "{}", named[0]);
    assert!(named[0].contains("CUDA is disabled"), "{}", named[0]);
    set_mode(&path, 0o600);
    // Another owner: possible to arrange only as root.
    if unsafe_uid() == 0 {
        let c = std::ffi::CString::new(path.clone()).unwrap();
        // SAFETY: a valid path; 65534 is nobody.
        assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
        let run2 = client(&["alloc:700Mi", "alloc:500Mi"], &e);
        assert_eq!(run2.rc("init", 0), 800, "{run2:?}");
        assert!(run2.stderr.contains("uid 65534"), "{}", run2.stderr);
    }
}

#[test]
fn a_ledger_truncated_under_its_members_neither_kills_them_nor_is_made_anew() {
    // The file is cut to 0 bytes while a member holds 700 MiB of the job's 1 GiB: the
    // member goes on (no SIGBUS), frees what it holds, and is refused anything new with
    // a line naming the file; a process that comes after does not make a fresh ledger
    // next to the live member (which would give each of them the whole budget).
    let dir = job_dir("truncate");
    let e = envs(&dir, "job:t", "1Gi");
    let member = spawn(
        &[
            "alloc:700Mi",
            "sleep:800",
            "free:0",
            "alloc:100Mi",
            "sleep:800",
        ],
        &e,
    );
    settle();
    let path = ledger_file(&dir, "t");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(0)
        .unwrap();
    let next = client(&["alloc:500Mi"], &e);
    let member = finish(member);
    assert!(member.status.success(), "the member died: {member:?}");
    assert_eq!(member.rc("free", 0), 0, "{member:?}");
    assert_eq!(
        member.rc("alloc", 1),
        2,
        "admitted from a damaged ledger: {member:?}"
    );
    assert!(
        member.stderr.contains(&path) && member.stderr.contains("damaged"),
        "{}",
        member.stderr
    );
    assert!(
        !next.lines.iter().any(|l| l.starts_with("alloc rc=0")),
        "a fresh ledger beside a live member: {next:?}"
    );
    assert!(next.stderr.contains(&path), "{}", next.stderr);
}

#[test]
fn a_stray_write_of_where_the_jobs_total_was_kept_neither_denies_nor_admits_past_the_budget() {
    // Any process of the user can write the ledger. Layout 1 kept the job's total at
    // byte 56 and trusted it: all ones denied every member for good, zero admitted past
    // the budget. What the job holds is the sum of its members' own shares.
    let dir = job_dir("total");
    let e = envs(&dir, "job:tot", "1Gi");
    let holder = spawn(&["alloc:700Mi", "sleep:2000"], &e);
    settle();
    let path = ledger_file(&dir, "tot");
    write_at(&path, 56, &u64::MAX.to_le_bytes());
    let small = client(&["alloc:100Mi"], &e);
    write_at(&path, 56, &0u64.to_le_bytes());
    let large = client(&["alloc:500Mi"], &e);
    finish(holder);
    assert_eq!(small.rc("alloc", 0), 0, "denied for good: {small:?}");
    assert_eq!(
        large.rc("alloc", 0),
        2,
        "admitted past the budget: {large:?}"
    );
}

#[test]
fn doctor_names_a_damaged_job_ledger() {
    let dir = job_dir("doctor");
    let e = envs(&dir, "job:doc", "1Gi");
    let _member = Member::start(&e);
    let path = ledger_file(&dir, "doc");
    let doctor = |envs: &[(&str, &str)]| -> serde_json::Value {
        let mut cmd = crate::util::cli::cudabudget(&["doctor", "--json"]);
        cmd.envs(envs.iter().copied());
        let out = crate::util::cli::output(&mut cmd);
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        report["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "job-ledger")
            .cloned()
            .unwrap()
    };
    let whole = doctor(&e);
    assert_eq!(whole["status"], "ok", "{whole:#}");
    write_at(&path, 0, b"garbage!");
    let damaged = doctor(&e);
    assert_eq!(damaged["status"], "fail", "{damaged:#}");
    assert!(
        damaged["summary"].as_str().unwrap().contains(&path),
        "{damaged:#}"
    );
}
