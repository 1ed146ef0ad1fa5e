//! Python programs under the library that allocate and free through the driver API,
//! and the hand-off of one block between two waiters, shared by the waiting tests
//! (`jobs::waiting`: every hand-off goes through, in turn) and the waiting benchmark
//! (`benches/waiting.rs`: how long a hand-off takes, a wake against a look).

/// A process's threads: device 0's primary context current in each, `alloc(n)` and
/// `free(p)` through the driver API.
pub const THREADS_PRELUDE: &str = r#"
import ctypes, threading, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
MI = 1 << 20
def alloc(n):
    assert cuda.cuCtxSetCurrent(ctx) == 0
    p = ctypes.c_uint64()
    rc = cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n))
    return rc, p.value
def free(p):
    assert cuda.cuCtxSetCurrent(ctx) == 0
    assert cuda.cuMemFree_v2(ctypes.c_uint64(p)) == 0
"#;

/// Hand-offs of one block each way between two threads of a process.
pub const HANDOFFS: usize = 60;

/// Two threads hand 700 MiB of a 1 GiB budget back and forth: each holds it 10 ms
/// while the other waits for it in the library (it asks once the other has it), then
/// frees it. Prints who got it each time (`0 1 0 1 …`, the allocation's code beside
/// it) and, last, the seconds all the hand-offs took.
pub const THREADS_HANDOFF: &str = r#"
cv = threading.Condition()
got = []
def player(me):
    for _ in range(HALF):
        with cv:
            cv.wait_for(lambda: len(got) % 2 == me or any(not g.endswith(":0") for g in got))
            if any(not g.endswith(":0") for g in got):
                return
        rc, p = alloc(700 * MI)
        with cv:
            got.append(f"{me}:{rc}")
            cv.notify_all()
        if rc != 0:
            return
        time.sleep(0.01)
        free(p)
t0 = time.time()
ts = [threading.Thread(target=player, args=(me,)) for me in (0, 1)]
for t in ts: t.start()
for t in ts: t.join()
print(" ".join(got))
print(round(time.time() - t0, 3))
"#;

/// The same between two processes of a job: this one (`0`) and a member it starts
/// (`1`), which tell each other over pipes when they hold the block.
pub const MEMBERS_HANDOFF: &str = r#"
other = member(f"HALF = {HALF}\n" + """
for i in range(HALF):
    assert sys.stdin.readline().strip() == "go"
    rc, p = alloc(700 * MI)
    print(f"1:{rc}", flush=True)
    if rc != 0:
        sys.exit(1)
    time.sleep(0.01)
    free(p)
""")
got = []
t0 = time.time()
for i in range(HALF):
    if i > 0:
        got.append(other.stdout.readline().strip())
        if got[-1] != "1:0":
            break
    rc, p = alloc(700 * MI)
    got.append(f"0:{rc}")
    if rc != 0:
        break
    other.stdin.write("go\n"); other.stdin.flush()
    time.sleep(0.01)
    free(p)
else:
    got.append(other.stdout.readline().strip())
took = time.time() - t0
other.stdin.close()
other.wait()
print(" ".join(got))
print(round(took, 3))
"#;

/// Runs `script` (after [`THREADS_PRELUDE`]) in one process under the library, with a
/// 1 GiB budget and `patience` (`CUDABUDGET_ON_EXCEED`); its standard output.
pub fn python_threads(script: &str, patience: &str) -> String {
    let (ok, out, err) = super::python_under_library(
        &format!("{THREADS_PRELUDE}{script}"),
        &[
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_ON_EXCEED", patience),
            ("FAKE_NVML_PID_OFFSET", "100000"),
        ],
    );
    assert!(ok, "{out}\n{err}");
    out
}

/// Where device 0's queue of waiters keeps its next ticket in a job's ledger (never
/// taken back: how many waits have begun): the second word of the device's words
/// (`crates/spec/src/job_file.rs`'s layout).
pub const NEXT_TICKET_AT: u64 = cudabudget_spec::job_file::DEVICE_WORDS_AT as u64 + 8;

/// Runs `script` (after [`THREADS_PRELUDE`]) as a member of job `name`, in `dir`, with a
/// 1 GiB budget and `patience`; `CHILD` in the script is a program that runs the
/// prelude then `exec(sys.argv[1])`, for other members of the job started with
/// `member(code)` (a `subprocess.Popen` with pipes), and `until_waits_begun(n)` waits
/// until `n` waits for room have begun in the job (the ledger's queue ticket), a
/// handshake with a member or thread that asked for more than there is room for.
pub fn python_job(dir: &str, name: &str, script: &str, patience: &str) -> String {
    let members = r#"
import subprocess, sys
CHILD = "import sys\n" + PRELUDE + "\nexec(sys.argv[1])\n"
def member(code):
    return subprocess.Popen([sys.executable, "-c", CHILD, code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1)
def until_waits_begun(n):
    deadline = time.time() + 60
    while True:
        with open(LEDGER, "rb") as f:
            f.seek(NEXT_TICKET_AT)
            if int.from_bytes(f.read(8), "little") >= n:
                return
        assert time.time() < deadline, f"{n} waits never began"
        time.sleep(0.002)
"#;
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let ledger = format!("{dir}/cudabudget-{uid}/job-{name}");
    let script = format!(
        "PRELUDE = {THREADS_PRELUDE:?}\nLEDGER = {ledger:?}\nNEXT_TICKET_AT = {NEXT_TICKET_AT}\n\
         {THREADS_PRELUDE}{members}{script}"
    );
    let scope = format!("job:{name}");
    let (ok, out, err) = super::python_under_library(
        &script,
        &[
            ("CUDABUDGET_JOB_DIR", dir),
            ("CUDABUDGET_SCOPE", scope.as_str()),
            ("CUDABUDGET_LIMIT", "1Gi"),
            ("CUDABUDGET_ON_EXCEED", patience),
            ("FAKE_NVML_PID_OFFSET", "100000"),
        ],
    );
    assert!(ok, "{out}\n{err}");
    out
}

/// The hand-offs between two threads (`members`: false) or two members of job `name`
/// in `dir`, each waiting with `patience`: who got the block each time, with the
/// allocation's code (`["0:0", "1:0", …]`), and the seconds they took.
pub fn hand_offs(members: Option<(&str, &str)>, patience: &str) -> (Vec<String>, f64) {
    let half = format!("HALF = {}\n", HANDOFFS / 2);
    let out = match members {
        None => python_threads(&format!("{half}{THREADS_HANDOFF}"), patience),
        Some((dir, name)) => python_job(dir, name, &format!("{half}{MEMBERS_HANDOFF}"), patience),
    };
    let mut lines = out.lines();
    let got = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let took = lines.next().and_then(|l| l.trim().parse().ok());
    (
        got,
        took.unwrap_or_else(|| panic!("no time printed: {out}")),
    )
}
