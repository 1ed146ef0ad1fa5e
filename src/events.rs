//! Denial events: with `CUDABUDGET_EVENTS=<path>`, every refused allocation appends one
//! JSON line to that file:
//!
//! ```json
//! {"time":"2026-12-01T09:30:00.123Z","pid":1234,"command":"python3","job":null,"device":0,"call":"cuMemAlloc","request_bytes":4294967296,"used_bytes":5368709120,"limit_bytes":8589934592}
//! ```
//!
//! Each line is formatted on the stack and written with one `write(2)` to a descriptor
//! opened with `O_APPEND` for that line alone, so lines of many processes (and threads)
//! appending to one file on a local filesystem never interleave, and no descriptor of
//! ours is left for the program to trip over. Only refused allocations pay for this.

use std::ffi::{CStr, CString};
use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use crate::config::LogLevel;
use crate::ledger::Denial;

/// The variable that names the events file.
pub const EVENTS: &str = "CUDABUDGET_EVENTS";

static PATH: Once<Option<CString>> = Once::new();
static JOB: Once<Option<String>> = Once::new();
static WARNED: AtomicBool = AtomicBool::new(false);

/// A value worked out on first use that never makes a thread wait: threads that arrive
/// together each work it out and the first to publish wins. (A `OnceLock` caught
/// initialising by a `fork()` would make the child wait forever.) The value is leaked.
struct Once<T>(AtomicPtr<T>);

impl<T> Once<T> {
    const fn new() -> Self {
        Once(AtomicPtr::new(std::ptr::null_mut()))
    }

    fn get_or_init(&'static self, init: impl FnOnce() -> T) -> &'static T
    where
        T: Send + Sync,
    {
        let current = self.0.load(Ordering::Acquire);
        if !current.is_null() {
            // SAFETY: a pointer published below, from a leaked Box, never freed.
            return unsafe { &*current };
        }
        let fresh = Box::into_raw(Box::new(init()));
        match self.0.compare_exchange(
            std::ptr::null_mut(),
            fresh,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            // SAFETY: `fresh` is ours, leaked and now published.
            Ok(_) => unsafe { &*fresh },
            Err(winner) => {
                // SAFETY: `fresh` was never published: ours to free. `winner` is as above.
                unsafe {
                    drop(Box::from_raw(fresh));
                    &*winner
                }
            }
        }
    }
}

unsafe extern "C" {
    /// glibc: the program's name, as `ps` shows it (the last part of `argv[0]`).
    static program_invocation_short_name: *const libc::c_char;
}

/// The program's name (`python3`), or `?`.
pub fn program_name() -> &'static str {
    // SAFETY: glibc sets this pointer before any code runs and it points to a
    // NUL-terminated string inside argv[0], which lives as long as the process.
    let name = unsafe { program_invocation_short_name };
    if name.is_null() {
        return "?";
    }
    // SAFETY: as above.
    unsafe { CStr::from_ptr(name) }.to_str().unwrap_or("?")
}

/// The job this process belongs to (`CUDABUDGET_SCOPE=job:<name>`), read once.
pub fn job() -> Option<&'static str> {
    JOB.get_or_init(|| {
        let scope = std::env::var(crate::config::SCOPE).ok()?;
        let name = scope.trim().strip_prefix("job:")?.trim();
        (!name.is_empty()).then(|| name.to_string())
    })
    .as_deref()
}

fn path() -> Option<&'static CStr> {
    PATH.get_or_init(|| {
        let path = std::env::var_os(EVENTS).filter(|p| !p.is_empty())?;
        use std::os::unix::ffi::OsStrExt;
        CString::new(path.as_bytes()).ok()
    })
    .as_deref()
}

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

/// The event line of one denial, newline included; `None` if it does not fit.
fn line(
    buffer: &mut Buffer,
    time_ms: u64,
    pid: i32,
    call: &str,
    device: usize,
    denial: &Denial,
) -> Option<usize> {
    let job = job();
    let written = write!(
        buffer,
        "{{\"time\":\"{}\",\"pid\":{pid},\"command\":{},\"job\":",
        Rfc3339(time_ms),
        JsonString(program_name())
    )
    .and_then(|()| match job {
        Some(job) => write!(buffer, "{}", JsonString(job)),
        None => buffer.write_str("null"),
    })
    .and_then(|()| {
        write!(
            buffer,
            ",\"device\":{device},\"call\":{},\"request_bytes\":{},\"used_bytes\":{},\"limit_bytes\":{}",
            JsonString(call),
            denial.requested,
            denial.used,
            denial.budget
        )
    })
    .and_then(|()| match crate::books::job::joined() {
        // In a job: who holds the most of the device.
        Some(ledger) if device < crate::ledger::MAX_DEVICES => {
            buffer.write_str(",\"top_holders\":[")?;
            let holders = ledger.top_holders(device);
            for (k, (pid, used)) in holders.iter().filter(|h| h.0 != 0).enumerate() {
                if k > 0 {
                    buffer.write_str(",")?;
                }
                write!(buffer, "{{\"pid\":{pid},\"used_bytes\":{used}}}")?;
            }
            buffer.write_str("]")
        }
        _ => Ok(()),
    })
    .and_then(|()| writeln!(buffer, "}}"));
    (written.is_ok() && !buffer.overflow).then_some(buffer.len)
}

/// Appends the event of one denial, if `CUDABUDGET_EVENTS` asks for it.
pub fn denial(call: &str, device: usize, denial: &Denial) {
    let Some(path) = path() else {
        return;
    };
    let mut buffer = Buffer {
        buf: [0; 2048],
        len: 0,
        overflow: false,
    };
    // SAFETY: getpid touches no memory.
    let pid = unsafe { libc::getpid() };
    let Some(len) = line(&mut buffer, realtime_ms(), pid, call, device, denial) else {
        return;
    };
    // SAFETY: a NUL-terminated path; the descriptor is ours alone and closed below; the
    // write reads initialised bytes of the stack buffer.
    let written = unsafe {
        let fd = libc::open(
            path.as_ptr(),
            libc::O_WRONLY | libc::O_APPEND | libc::O_CREAT | libc::O_CLOEXEC | libc::O_NOCTTY,
            0o644,
        );
        if fd < 0 {
            false
        } else {
            let n = libc::write(fd, buffer.buf.as_ptr().cast(), len);
            libc::close(fd);
            n == len as isize
        }
    };
    if !written && !WARNED.swap(true, Ordering::Relaxed) {
        crate::report::line(
            LogLevel::Warn,
            format_args!(
                "cannot append denial events to {} ({}); events are not recorded",
                path.to_string_lossy(),
                std::io::Error::last_os_error()
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let len = line(&mut buffer, 0, 42, "cuMemAlloc", 1, &denial).unwrap();
        let text = std::str::from_utf8(&buffer.buf[..len]).unwrap();
        assert!(
            text.ends_with("}\n") && text.matches('\n').count() == 1,
            "{text}"
        );
        assert!(
            text.starts_with("{\"time\":\"1970-01-01T00:00:00.000Z\",\"pid\":42,\"command\":\"")
        );
        assert!(text.contains(
            ",\"device\":1,\"call\":\"cuMemAlloc\",\"request_bytes\":4294967296,\
             \"used_bytes\":5368709120,\"limit_bytes\":8589934592}"
        ));
    }
}
