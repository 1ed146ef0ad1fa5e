//! The log line: every line starts with `cudabudget:` and goes to stderr with one
//! `write(2)` from a buffer on the stack: no allocation, no lock, nothing that could
//! re-enter the library. Lines below the user's level (`CUDABUDGET_LOG`) are not made.

use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicU8, Ordering};

use crate::config::{ConfigError, LogLevel};

static LEVEL: AtomicU8 = AtomicU8::new(LogLevel::Warn as u8);

pub fn set_level(level: LogLevel) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

pub fn enabled(level: LogLevel) -> bool {
    level != LogLevel::Off && level as u8 <= LEVEL.load(Ordering::Relaxed)
}

/// A line of at most 512 bytes, longer text cut.
struct Line {
    buf: [u8; 512],
    len: usize,
}

impl fmt::Write for Line {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let n = s.len().min(self.buf.len() - 1 - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

pub fn emit(args: fmt::Arguments<'_>) {
    let mut line = Line {
        buf: [0; 512],
        len: 0,
    };
    let _ = line.write_str("cudabudget: ");
    let _ = line.write_fmt(args);
    line.buf[line.len] = b'\n';
    // SAFETY: writes initialised bytes of a stack buffer to fd 2.
    unsafe {
        libc::write(2, line.buf.as_ptr().cast(), line.len + 1);
    }
}

/// One line at `level`, if the user asked for that much.
pub fn line(level: LogLevel, args: fmt::Arguments<'_>) {
    if enabled(level) {
        emit(args);
    }
}

/// The malformed-configuration line: always shown, whatever the log level (the log level
/// may itself be what is malformed).
pub fn config_error(error: &ConfigError) {
    // ConfigError's Display already starts with "cudabudget: ".
    let mut line = Line {
        buf: [0; 512],
        len: 0,
    };
    let _ = write!(line, "{error}");
    line.buf[line.len] = b'\n';
    // SAFETY: as in `emit`.
    unsafe {
        libc::write(2, line.buf.as_ptr().cast(), line.len + 1);
    }
}
