//! A reader that goes away (`cudabudget doctor | head -c1`) ends the command quietly, as
//! it ends `cat`: killed by SIGPIPE, or done, never a panic. Output that cannot be
//! written (a full disk) is a failure said in one line, never a panic nor a success.

use crate::util::cli::{cudabudget, output, stderr};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;

/// A pipe whose reading end is closed already: its writing end, for a child's stdout.
fn pipe_nobody_reads() -> Stdio {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a valid array of two descriptors for pipe2 to fill.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both descriptors were just made and are owned by nobody else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    Stdio::from(write)
}

#[test]
fn every_command_ends_quietly_when_its_reader_has_gone() {
    for args in [
        &["--version"][..],
        &["--help"],
        &["doctor"],
        &["doctor", "--json"],
        &["status"],
        &["status", "--json"],
        &["run", "--help"],
        &["limit", "--help"],
        &["install", "--help"],
    ] {
        let out = output(cudabudget(args).stdout(pipe_nobody_reads()));
        let said = stderr(&out);
        assert!(
            out.status.signal() == Some(libc::SIGPIPE) || out.status.code() == Some(0),
            "{args:?}: {:?}: {said}",
            out.status
        );
        assert!(said.is_empty(), "{args:?} said: {said}");
    }
}

#[test]
fn a_command_whose_output_cannot_be_written_fails_saying_so() {
    for args in [
        &["doctor"][..],
        &["doctor", "--json"],
        &["status"],
        &["status", "--json"],
    ] {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("/dev/full");
        let out = output(cudabudget(args).stdout(full));
        let said = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {said}");
        assert_eq!(
            said.trim_end(),
            "cudabudget: cannot write the output: No space left on device (os error 28)",
            "{args:?}"
        );
    }
}
