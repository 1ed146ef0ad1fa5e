//! Budget events: with `CUDABUDGET_EVENTS=<path>`, every refused allocation (`"outcome":
//! "denied"`) and, with `CUDABUDGET_ON_EXCEED=warn`, every allocation admitted past the
//! budget (`"outcome":"overrun"`) appends one JSON line to that file:
//!
//! ```json
//! {"time":"2026-12-01T09:30:00.123Z","pid":1234,"command":"python3","job":null,"device":0,"call":"cuMemAlloc","outcome":"denied","request_bytes":4294967296,"used_bytes":5368709120,"limit_bytes":8589934592}
//! ```
//!
//! The allocating thread never touches the file. An event is put, as a few numbers, in
//! a bounded lock-free queue (no allocation, no lock, no system call but one futex wake);
//! when the queue is full the event is dropped and counted. A writer thread of the
//! library's own, started at the first event, opens the file once and writes the lines:
//! - opened safely: its directory through [`Dir::open_trusted`] (every directory from
//!   `/` root's or ours, none writable by others unless sticky), the file through
//!   [`Dir::open_file`] with [`FileOpen::APPEND`] (no link followed, no FIFO or device
//!   waited on, a regular file of ours with one link that nobody else may write; created
//!   0600);
//! - whole lines or nothing: each line is one `write(2)` with `O_APPEND` (lines of many
//!   processes never interleave on a local filesystem); a short write (a full disk, a
//!   file-size limit) is cut back to where the file ended before it;
//! - a path that cannot be used (a FIFO, a link, a directory, another user's file at the
//!   name, a directory on the way that others may change, a missing directory) moves the
//!   events to the same file name in `events/` of the user's own records directory
//!   (`cudabudget-<uid>` in the runtime directory, or in `$XDG_RUNTIME_DIR` or `~/.cache`
//!   when that name is taken), with one line at `warn` that says why and where; only
//!   when that fails too are they not recorded (one line). The process runs on,
//!   budgeted, either way.
//!
//! At exit the queue is flushed for at most [`EXIT_FLUSH`].

use std::cell::UnsafeCell;
use std::ffi::CStr;
use std::fmt::{self, Write as _};
use std::fs::File;
use std::os::fd::IntoRawFd;
use std::path::Path;
use std::sync::atomic::{
    AtomicBool, AtomicI32, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering,
};
use std::time::Duration;

use cudabudget_spec::place::{Dir, FileOpen, PlaceError};

use crate::books::ledger::Denial;
use crate::config::{Config, LogLevel};

/// Events the queue holds (a power of two). An event is about 150 bytes.
const CAPACITY: usize = 1024;
/// How long `exit` waits for the writer to empty the queue.
pub const EXIT_FLUSH: Duration = Duration::from_millis(200);

/// Events queued and not yet written out (or given up on): what the exit waits for. An
/// empty queue is not enough: the writer may hold the last event it took, unwritten.
static UNWRITTEN: AtomicU64 = AtomicU64::new(0);

unsafe extern "C" {
    /// glibc: the program's name, as `ps` shows it (the last part of `argv[0]`).
    static program_invocation_short_name: *const libc::c_char;
}

/// The program's name as it was when the process was budgeted ([`remember_program_name`]):
/// programs that set their process title (Ray's workers) overwrite the `argv[0]` glibc's
/// name points into.
static PROGRAM: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Keeps the program's name for [`program_name`]: glibc's, unless it no longer agrees with
/// the kernel's (`/proc/self/comm`, at most 15 bytes), whose name is then kept. Called
/// once the process is budgeted, before any denial can be told.
pub fn remember_program_name() {
    let glibc = invocation_name();
    let comm = std::fs::read_to_string("/proc/self/comm")
        .map(|c| c.trim_end_matches('\n').to_string())
        .unwrap_or_default();
    let agrees = !glibc.is_empty() && glibc != "?" && glibc.starts_with(comm.as_str());
    let name = if agrees || comm.is_empty() {
        glibc.to_string()
    } else {
        comm
    };
    let _ = PROGRAM.set(name);
}

/// The program's name (`python3`), or `?`.
pub fn program_name() -> &'static str {
    match PROGRAM.get() {
        Some(name) => name,
        None => invocation_name(),
    }
}

/// glibc's `program_invocation_short_name`, or `?`.
fn invocation_name() -> &'static str {
    // SAFETY: glibc sets this pointer before any code runs and it points to a
    // NUL-terminated string inside argv[0], which lives as long as the process.
    let name = unsafe { program_invocation_short_name };
    if name.is_null() {
        return "?";
    }
    // SAFETY: as above.
    unsafe { CStr::from_ptr(name) }.to_str().unwrap_or("?")
}

/// The job this process belongs to, from the configuration ([`crate::config::Config::job`]).
pub fn job() -> Option<&'static str> {
    crate::runtime::config()?.job()
}

/// What became of the allocation an event is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Refused: the call got `CUDA_ERROR_OUT_OF_MEMORY`.
    Denied,
    /// Admitted past the budget (`CUDABUDGET_ON_EXCEED=warn`).
    Overrun,
    /// Not an allocation: the budget changed while the process ran (`cudabudget limit`).
    BudgetChanged,
}

impl Outcome {
    fn name(self) -> &'static str {
        match self {
            Outcome::Denied => "denied",
            Outcome::Overrun => "overrun",
            Outcome::BudgetChanged => "budget_changed",
        }
    }
}

/// One event, as the queue holds it: what the line is made of.
#[derive(Clone, Copy)]
struct Event {
    time_ms: u64,
    pid: i32,
    call: [u8; 32],
    call_len: u8,
    device: usize,
    outcome: Outcome,
    /// The request, and what the device held and allowed before it.
    denial: Denial,
    /// In a job: who holds the most of the device, when it was refused.
    top_holders: Option<[(u32, u64); 5]>,
    /// A budget change: the budget before, and who changed it (uid, pid).
    change: Option<(u64, u32, u32)>,
}

impl Event {
    fn call(&self) -> &str {
        std::str::from_utf8(&self.call[..usize::from(self.call_len)]).unwrap_or("?")
    }
}

struct Slot {
    /// Dmitry Vyukov's bounded queue: `position` when free for the producer of that
    /// position, `position + 1` once it holds that position's event.
    sequence: AtomicUsize,
    event: UnsafeCell<std::mem::MaybeUninit<Event>>,
}

/// A bounded queue of many producers (the program's threads) and one consumer (the
/// writer thread), without a lock.
struct Queue {
    slots: [Slot; CAPACITY],
    /// The next position a producer claims.
    tail: AtomicUsize,
    /// The next position the writer takes (only the writer moves it).
    head: AtomicUsize,
}

// SAFETY: a slot's event is written only by the producer that claimed its position
// (the compare-exchange on `tail`) and read only by the one writer after the producer
// published it (release/acquire on `sequence`).
unsafe impl Sync for Queue {}

impl Queue {
    const fn new() -> Queue {
        let mut slots = [const {
            Slot {
                sequence: AtomicUsize::new(0),
                event: UnsafeCell::new(std::mem::MaybeUninit::uninit()),
            }
        }; CAPACITY];
        let mut i = 0;
        while i < CAPACITY {
            slots[i].sequence = AtomicUsize::new(i);
            i += 1;
        }
        Queue {
            slots,
            tail: AtomicUsize::new(0),
            head: AtomicUsize::new(0),
        }
    }

    /// False when the queue is full.
    fn push(&self, event: Event) -> bool {
        let mut position = self.tail.load(Ordering::Relaxed);
        loop {
            let slot = &self.slots[position % CAPACITY];
            let sequence = slot.sequence.load(Ordering::Acquire);
            let lag = sequence.wrapping_sub(position) as isize;
            if lag == 0 {
                match self.tail.compare_exchange_weak(
                    position,
                    position.wrapping_add(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        // SAFETY: this position is ours alone until published below.
                        unsafe { (*slot.event.get()).write(event) };
                        slot.sequence
                            .store(position.wrapping_add(1), Ordering::Release);
                        return true;
                    }
                    Err(now) => position = now,
                }
            } else if lag < 0 {
                return false;
            } else {
                position = self.tail.load(Ordering::Relaxed);
            }
        }
    }

    /// The writer's next event, if one was published. Only the writer thread calls it.
    fn pop(&self) -> Option<Event> {
        let position = self.head.load(Ordering::Relaxed);
        let slot = &self.slots[position % CAPACITY];
        if slot.sequence.load(Ordering::Acquire) != position.wrapping_add(1) {
            return None;
        }
        // SAFETY: published by its producer (acquire above); no producer touches it
        // until the sequence below frees it.
        let event = unsafe { (*slot.event.get()).assume_init() };
        slot.sequence
            .store(position.wrapping_add(CAPACITY), Ordering::Release);
        self.head.store(position.wrapping_add(1), Ordering::Release);
        Some(event)
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.head.load(Ordering::Acquire) == self.tail.load(Ordering::Acquire)
    }

    /// In the child of `fork()`: empty, whatever a thread that did not come along was
    /// doing. Stores only.
    fn reset(&self) {
        for (i, slot) in self.slots.iter().enumerate() {
            slot.sequence.store(i, Ordering::Relaxed);
        }
        self.tail.store(0, Ordering::Relaxed);
        self.head.store(0, Ordering::Release);
    }
}

static QUEUE: Queue = Queue::new();
/// Events dropped because the queue was full, not yet said.
static DROPPED: AtomicU64 = AtomicU64::new(0);
/// Bumped at each push; the writer sleeps on it.
static SIGNAL: AtomicU32 = AtomicU32::new(0);

const IDLE: u8 = 0;
const STARTING: u8 = 1;
const RUNNING: u8 = 2;
/// The file cannot be used, or the writer cannot run: no more events in this process.
const OFF: u8 = 3;
static WRITER: AtomicU8 = AtomicU8::new(IDLE);
/// The events file's descriptor while the writer holds it (for the fork child to close).
static FD: AtomicI32 = AtomicI32::new(-1);
/// The fork and exit handlers are registered (once, by the first writer).
static AT_FORK: AtomicBool = AtomicBool::new(false);

/// A line of at most 2 KiB on the stack; text that does not fit is dropped whole
/// (`overflow`), so no line is ever cut into invalid JSON.
struct Buffer {
    buf: [u8; 2048],
    len: usize,
    overflow: bool,
}

impl fmt::Write for Buffer {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if self.len + s.len() > self.buf.len() - 1 {
            self.overflow = true;
            return Err(fmt::Error);
        }
        self.buf[self.len..self.len + s.len()].copy_from_slice(s.as_bytes());
        self.len += s.len();
        Ok(())
    }
}

/// A JSON string literal of `text`, cut to 256 bytes.
struct JsonString<'a>(&'a str);
impl fmt::Display for JsonString<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut end = self.0.len().min(256);
        while !self.0.is_char_boundary(end) {
            end -= 1;
        }
        f.write_char('"')?;
        for c in self.0[..end].chars() {
            match c {
                '"' => f.write_str("\\\"")?,
                '\\' => f.write_str("\\\\")?,
                c if (c as u32) < 0x20 => write!(f, "\\u{:04x}", c as u32)?,
                c => f.write_char(c)?,
            }
        }
        f.write_char('"')
    }
}

/// Milliseconds since the Unix epoch as RFC 3339 UTC: `2026-12-01T09:30:00.123Z`.
struct Rfc3339(u64);
impl fmt::Display for Rfc3339 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (secs, millis) = (self.0 / 1000, self.0 % 1000);
        let (days, rest) = (secs / 86_400, secs % 86_400);
        // Howard Hinnant's days-to-civil, for days since 1970-01-01.
        let z = days as i64 + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        let year = yoe + era * 400 + i64::from(month <= 2);
        write!(
            f,
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
            rest / 3600,
            rest % 3600 / 60,
            rest % 60
        )
    }
}

fn realtime_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer; CLOCK_REALTIME is served by the vDSO.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// The event line, newline included; `None` if it does not fit.
fn line(buffer: &mut Buffer, event: &Event, job: Option<&str>) -> Option<usize> {
    let written = write!(
        buffer,
        "{{\"time\":\"{}\",\"pid\":{},\"command\":{},\"job\":",
        Rfc3339(event.time_ms),
        event.pid,
        JsonString(program_name())
    )
    .and_then(|()| match job {
        Some(job) => write!(buffer, "{}", JsonString(job)),
        None => buffer.write_str("null"),
    })
    .and_then(|()| {
        write!(
            buffer,
            ",\"device\":{},\"call\":{},\"outcome\":\"{}\",\"request_bytes\":{},\"used_bytes\":{},\"limit_bytes\":{}",
            event.device,
            JsonString(event.call()),
            event.outcome.name(),
            event.denial.requested,
            event.denial.used,
            event.denial.budget
        )
    })
    .and_then(|()| match event.change {
        Some((previous, uid, pid)) => write!(
            buffer,
            ",\"previous_limit_bytes\":{previous},\"changed_by\":{{\"uid\":{uid},\"pid\":{pid}}}"
        ),
        None => Ok(()),
    })
    .and_then(|()| match &event.top_holders {
        Some(holders) => {
            buffer.write_str(",\"top_holders\":[")?;
            for (k, (pid, used)) in holders.iter().filter(|h| h.0 != 0).enumerate() {
                if k > 0 {
                    buffer.write_str(",")?;
                }
                write!(buffer, "{{\"pid\":{pid},\"used_bytes\":{used}}}")?;
            }
            buffer.write_str("]")
        }
        None => Ok(()),
    })
    .and_then(|()| writeln!(buffer, "}}"));
    (written.is_ok() && !buffer.overflow).then_some(buffer.len)
}

/// Queues the event of one denial, if `CUDABUDGET_EVENTS` asks for it. Never waits:
/// atomics, and a futex wake (the first event of a process also starts the writer).
pub fn denial(config: &'static Config, call: &str, device: usize, denial: &Denial) {
    queue(config, Outcome::Denied, call, device, denial);
}

/// Queues the event of one allocation admitted past the budget
/// (`CUDABUDGET_ON_EXCEED=warn`), if `CUDABUDGET_EVENTS` asks for it; as [`denial`].
pub fn overrun(config: &'static Config, call: &str, device: usize, request: &Denial) {
    queue(config, Outcome::Overrun, call, device, request);
}

/// Queues the event of a change of the device's budget from `previous` to
/// `now.budget` by `by` (uid, pid), `now.used` in use then; as [`denial`].
pub fn budget_changed(
    config: &'static Config,
    device: usize,
    previous: u64,
    now: &Denial,
    by: (u32, u32),
) {
    queue_event(
        config,
        Outcome::BudgetChanged,
        "cudabudget limit",
        device,
        now,
        Some((previous, by.0, by.1)),
    );
}

fn queue(config: &'static Config, outcome: Outcome, call: &str, device: usize, denial: &Denial) {
    queue_event(config, outcome, call, device, denial, None);
}

fn queue_event(
    config: &'static Config,
    outcome: Outcome,
    call: &str,
    device: usize,
    denial: &Denial,
    change: Option<(u64, u32, u32)>,
) {
    let state = WRITER.load(Ordering::Acquire);
    if state == OFF || config.events.is_none() {
        return;
    }
    let mut name = [0u8; 32];
    let mut len = call.len().min(name.len());
    while !call.is_char_boundary(len) {
        len -= 1;
    }
    name[..len].copy_from_slice(&call.as_bytes()[..len]);
    let top_holders = match crate::books::job::joined() {
        Some(ledger) if change.is_none() && device < crate::books::ledger::MAX_DEVICES => {
            Some(ledger.top_holders(device))
        }
        _ => None,
    };
    let event = Event {
        time_ms: realtime_ms(),
        // SAFETY: getpid touches no memory.
        pid: unsafe { libc::getpid() },
        call: name,
        call_len: len as u8,
        device,
        outcome,
        denial: *denial,
        top_holders,
        change,
    };
    UNWRITTEN.fetch_add(1, Ordering::AcqRel);
    if !QUEUE.push(event) {
        UNWRITTEN.fetch_sub(1, Ordering::AcqRel);
        DROPPED.fetch_add(1, Ordering::Relaxed);
    }
    SIGNAL.fetch_add(1, Ordering::Release);
    if state == IDLE {
        start_writer(config);
    } else {
        futex_wake(&SIGNAL);
    }
}

#[cold]
fn start_writer(config: &'static Config) {
    // Before the state leaves IDLE: a fork between the two would leave the child
    // STARTING with no handler to set it back, and its events never written.
    if !AT_FORK.swap(true, Ordering::Relaxed) {
        // SAFETY: registers plain extern "C" functions: one that only stores and closes,
        // one that waits, boundedly, on atomics.
        unsafe {
            libc::pthread_atfork(None, None, Some(after_fork_child));
            libc::atexit(flush_at_exit);
        }
    }
    if WRITER
        .compare_exchange(IDLE, STARTING, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        futex_wake(&SIGNAL);
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("cudabudget-events".into())
        .stack_size(256 << 10)
        .spawn(move || {
            if std::panic::catch_unwind(|| writer(config)).is_err() {
                WRITER.store(OFF, Ordering::Release);
            }
        });
    if let Err(error) = spawned {
        WRITER.store(OFF, Ordering::Release);
        crate::sys::log::line(
            LogLevel::Warn,
            format_args!(
                "cannot start the thread that writes denial events ({error}); events are not recorded"
            ),
        );
    }
}

/// In the child of `fork()`: the writer did not come along. The child starts its own
/// at its first event, with an empty queue.
extern "C" fn after_fork_child() {
    let fd = FD.swap(-1, Ordering::Relaxed);
    if fd >= 0 {
        // SAFETY: the parent's writer descriptor, inherited; nothing in the child uses it.
        unsafe { libc::close(fd) };
    }
    QUEUE.reset();
    DROPPED.store(0, Ordering::Relaxed);
    UNWRITTEN.store(0, Ordering::Relaxed);
    if WRITER.load(Ordering::Relaxed) != OFF {
        WRITER.store(IDLE, Ordering::Release);
    }
}

/// At exit: the writer gets up to [`EXIT_FLUSH`] to write what is queued.
extern "C" fn flush_at_exit() {
    let start = std::time::Instant::now();
    while matches!(WRITER.load(Ordering::Acquire), STARTING | RUNNING)
        && UNWRITTEN.load(Ordering::Acquire) > 0
    {
        if start.elapsed() >= EXIT_FLUSH {
            return;
        }
        futex_wake(&SIGNAL);
        std::thread::sleep(Duration::from_micros(500));
    }
}

/// The events file, opened as the module says.
fn open(path: &Path) -> Result<File, String> {
    let path = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| format!("the current directory: {e}"))?
            .join(path)
    };
    let (Some(parent), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str()))
    else {
        return Err("not a file path".to_string());
    };
    let dir = Dir::open_trusted(parent).map_err(|e| e.to_string())?;
    let file = dir.path().join(name);
    // The line names the path already: what is wrong with the file itself is said
    // without it again (a line holds 512 bytes).
    dir.open_file(name, FileOpen::APPEND).map_err(|e| match e {
        PlaceError::Taken { what, .. } => format!("taken by {what}"),
        PlaceError::Untrusted { path, why } if path == file => why,
        PlaceError::Io { path, error } if path == file => error.to_string(),
        other => other.to_string(),
    })
}

fn writer(config: &Config) {
    let Some(named) = config.events.clone() else {
        WRITER.store(OFF, Ordering::Release);
        return;
    };
    let (file, path) = match open(&named) {
        Ok(file) => (file, named),
        Err(why) => match fallback(&named, &config.runtime_dirs) {
            Ok((file, moved)) => {
                crate::sys::log::line(
                    LogLevel::Warn,
                    format_args!(
                        "cannot append denial events to {} ({why}); they go to {} instead",
                        named.display(),
                        moved.display()
                    ),
                );
                (file, moved)
            }
            Err(_) => {
                WRITER.store(OFF, Ordering::Release);
                warn_unusable(&named, &why);
                return;
            }
        },
    };
    let fd = file.into_raw_fd();
    FD.store(fd, Ordering::Release);
    WRITER.store(RUNNING, Ordering::Release);
    let job = job();
    let mut said_failure = false;
    let mut last_drop_line = None::<std::time::Instant>;
    loop {
        let seen = SIGNAL.load(Ordering::Acquire);
        while let Some(event) = QUEUE.pop() {
            let mut buffer = Buffer {
                buf: [0; 2048],
                len: 0,
                overflow: false,
            };
            if let Some(len) = line(&mut buffer, &event, job)
                && let Err(why) = append_line(fd, &buffer.buf[..len])
                && !std::mem::replace(&mut said_failure, true)
            {
                warn_unusable(&path, &why);
            }
            // Written (or given up on): the exit need not wait for it.
            let _ = UNWRITTEN.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                Some(n.saturating_sub(1))
            });
        }
        let dropped = DROPPED.load(Ordering::Relaxed);
        if dropped > 0 && last_drop_line.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            DROPPED.fetch_sub(dropped, Ordering::Relaxed);
            last_drop_line = Some(std::time::Instant::now());
            crate::sys::log::line(
                LogLevel::Warn,
                format_args!(
                    "{dropped} denial events were not written to {}: they came faster than \
                     they could be written",
                    path.display()
                ),
            );
        }
        futex_wait(&SIGNAL, seen, Duration::from_secs(1));
    }
}

/// Where the events go when `named` cannot be used: its file name in `events/` of our
/// records directory (our private directory in the first of the runtime `roots` that
/// gives one, as the records find it), made 0700 if missing.
fn fallback(
    named: &Path,
    roots: &[std::path::PathBuf],
) -> Result<(File, std::path::PathBuf), String> {
    let name = named
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| "not a file path".to_string())?;
    let (dir, _) = crate::tell::publish::records_dir(roots);
    let dir = dir
        .ok_or_else(|| "no place of the user's own".to_string())?
        .private("events", 0o700)
        .map_err(|e| e.to_string())?;
    let file = dir
        .open_file(name, FileOpen::APPEND)
        .map_err(|e| e.to_string())?;
    Ok((file, dir.path().join(name)))
}

fn warn_unusable(path: &Path, why: &str) {
    crate::sys::log::line(
        LogLevel::Warn,
        format_args!(
            "cannot append denial events to {} ({why}); events are not recorded",
            path.display()
        ),
    );
}

/// One line with one `write(2)` to an `O_APPEND` descriptor. A short write is cut back
/// to where the file ended before it, when no one appended after it since, so that a
/// full disk or a file-size limit leaves no half line.
fn append_line(fd: i32, line: &[u8]) -> Result<(), String> {
    loop {
        // SAFETY: writes initialised bytes of `line` to our descriptor.
        let n = unsafe { libc::write(fd, line.as_ptr().cast(), line.len()) };
        if n == line.len() as isize {
            return Ok(());
        }
        if n < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error.to_string());
        }
        // With O_APPEND the offset is now the end of what this write appended.
        // SAFETY: plain calls on our descriptor; `st` is a valid out-pointer.
        unsafe {
            let end = libc::lseek(fd, 0, libc::SEEK_CUR);
            let mut st: libc::stat = std::mem::zeroed();
            if end >= n as libc::off_t && libc::fstat(fd, &mut st) == 0 && st.st_size == end {
                libc::ftruncate(fd, end - n as libc::off_t);
            }
        }
        return Err(format!(
            "only {n} of {} bytes could be written: a full disk or a file-size limit; \
             the part written was taken back",
            line.len()
        ));
    }
}

fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a private futex wait on a word of this process, with a timeout.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            seen,
            &ts as *const libc::timespec,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: a private futex wake on a word of this process.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            1,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(n: u64) -> Event {
        Event {
            time_ms: n,
            pid: 1,
            call: [0; 32],
            call_len: 0,
            device: 0,
            outcome: Outcome::Denied,
            denial: Denial {
                requested: n,
                used: 0,
                budget: 0,
            },
            top_holders: None,
            change: None,
        }
    }

    #[test]
    fn a_full_queue_refuses_at_once_and_gives_events_back_in_order() {
        let queue = Box::new(Queue::new());
        for round in 0..3u64 {
            for n in 0..CAPACITY as u64 {
                assert!(queue.push(event(round * 10_000 + n)));
            }
            assert!(!queue.push(event(1)), "full: dropped, not waited for");
            for n in 0..CAPACITY as u64 {
                assert_eq!(queue.pop().map(|e| e.time_ms), Some(round * 10_000 + n));
            }
            assert!(queue.pop().is_none() && queue.is_empty());
        }
        queue.push(event(7));
        queue.reset();
        assert!(queue.pop().is_none() && queue.is_empty());
        assert!(queue.push(event(8)));
        assert_eq!(queue.pop().map(|e| e.time_ms), Some(8));
    }

    #[test]
    fn racing_producers_lose_nothing_the_queue_has_room_for() {
        let queue: &'static Queue = Box::leak(Box::new(Queue::new()));
        let producers: Vec<_> = (0..4u64)
            .map(|t| {
                std::thread::spawn(move || {
                    let mut pushed = 0;
                    for n in 0..2000u64 {
                        while !queue.push(event(t << 32 | n)) {
                            std::thread::yield_now();
                        }
                        pushed += 1;
                    }
                    pushed
                })
            })
            .collect();
        let mut next = [0u64; 4];
        let mut got = 0;
        while got < 8000 {
            match queue.pop() {
                Some(e) => {
                    let (t, n) = ((e.time_ms >> 32) as usize, e.time_ms & 0xffff_ffff);
                    assert_eq!(n, next[t], "each producer's events in its order");
                    next[t] += 1;
                    got += 1;
                }
                None => std::thread::yield_now(),
            }
        }
        let pushed: u64 = producers.into_iter().map(|p| p.join().unwrap()).sum();
        assert_eq!(pushed, 8000);
        assert!(queue.is_empty());
    }

    #[test]
    fn times_are_written_in_rfc_3339_utc() {
        assert_eq!(Rfc3339(0).to_string(), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            Rfc3339(951_782_400_000).to_string(),
            "2000-02-29T00:00:00.000Z"
        );
        assert_eq!(
            Rfc3339(1_796_089_111_984).to_string(),
            "2026-12-01T01:38:31.984Z"
        );
    }

    #[test]
    fn strings_are_escaped_and_cut_at_a_character_boundary() {
        assert_eq!(JsonString("a\"b\\c\n").to_string(), r#""a\"b\\c\u000a""#);
        let long = "é".repeat(200);
        assert_eq!(
            JsonString(&long).to_string(),
            format!("\"{}\"", "é".repeat(128))
        );
    }

    #[test]
    fn an_event_is_one_line_of_json() {
        let mut buffer = Buffer {
            buf: [0; 2048],
            len: 0,
            overflow: false,
        };
        let denial = Denial {
            requested: 4 << 30,
            used: 5 << 30,
            budget: 8 << 30,
        };
        let mut call = [0u8; 32];
        call[..10].copy_from_slice(b"cuMemAlloc");
        let event = Event {
            time_ms: 0,
            pid: 42,
            call,
            call_len: 10,
            device: 1,
            outcome: Outcome::Denied,
            denial,
            top_holders: None,
            change: None,
        };
        let len = line(&mut buffer, &event, None).unwrap();
        let text = std::str::from_utf8(&buffer.buf[..len]).unwrap();
        assert!(
            text.ends_with("}\n") && text.matches('\n').count() == 1,
            "{text}"
        );
        assert!(
            text.starts_with("{\"time\":\"1970-01-01T00:00:00.000Z\",\"pid\":42,\"command\":\"")
        );
        assert!(text.contains(
            ",\"device\":1,\"call\":\"cuMemAlloc\",\"outcome\":\"denied\",\
             \"request_bytes\":4294967296,\"used_bytes\":5368709120,\"limit_bytes\":8589934592}"
        ));
        let overrun = Event {
            outcome: Outcome::Overrun,
            ..event
        };
        (buffer.len, buffer.overflow) = (0, false);
        let len = line(&mut buffer, &overrun, Some("train")).unwrap();
        let text = std::str::from_utf8(&buffer.buf[..len]).unwrap();
        assert!(
            text.contains(
                "\"job\":\"train\",\"device\":1,\"call\":\"cuMemAlloc\",\"outcome\":\"overrun\","
            ),
            "{text}"
        );
        let change = Event {
            outcome: Outcome::BudgetChanged,
            change: Some((8 << 30, 1000, 77)),
            ..event
        };
        (buffer.len, buffer.overflow) = (0, false);
        let len = line(&mut buffer, &change, None).unwrap();
        let text = std::str::from_utf8(&buffer.buf[..len]).unwrap();
        assert!(
            text.contains(
                "\"outcome\":\"budget_changed\",\"request_bytes\":4294967296,\"used_bytes\":5368709120,\
                 \"limit_bytes\":8589934592,\"previous_limit_bytes\":8589934592,\
                 \"changed_by\":{\"uid\":1000,\"pid\":77}}"
            ),
            "{text}"
        );
    }
}
