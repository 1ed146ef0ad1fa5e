//! For the tests of the node services' servers (the exporter, the webhook): the binary
//! that runs them ([`node_bin`]), clients from chosen loopback addresses (every address
//! of 127.0.0.0/8 reaches a server on 127.0.0.1, so 127.0.0.2 and 127.0.0.3 are two
//! clients of one machine, as the servers count clients), and a start that is bounded in
//! time.

use std::io::Read;
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::os::fd::FromRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The node services' binary, `cudabudget-node`, beside the `cudabudget` cargo built for
/// these tests (where `cudabudget webhook|exporter` find it too). Cargo builds another
/// workspace package's binary for this package's tests only when asked, so the first call
/// in each test binary asks: `cargo build -p cudabudget-node` (at once when it is up to
/// date, as after `.ci/run`'s `cargo build -p cudabudget-node`).
pub fn node_bin() -> &'static Path {
    static NODE: OnceLock<PathBuf> = OnceLock::new();
    NODE.get_or_init(|| {
        let profile_dir = super::cargo::profile_dir();
        let node = profile_dir.join("cudabudget-node");
        super::cargo::build(
            &profile_dir,
            &["-p", "cudabudget-node", "--bin", "cudabudget-node"],
            &node,
        );
        node
    })
}

/// A connection from `source` (any free port) to `to` (`ADDR:PORT`, IPv4).
pub fn connect_from(source: Ipv4Addr, to: &str) -> std::io::Result<TcpStream> {
    let to: SocketAddrV4 = to
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let sockaddr = |address: &SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: address.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*address.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    let length = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a new socket, owned by the TcpStream made of it below (or closed here on
    // failure); bind and connect read a local sockaddr_in of the length given.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let stream = TcpStream::from_raw_fd(fd);
        let here = sockaddr(&SocketAddrV4::new(source, 0));
        if libc::bind(fd, (&raw const here).cast(), length) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let there = sockaddr(&to);
        if libc::connect(fd, (&raw const there).cast(), length) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(stream)
    }
}

/// Whether the server still holds `stream` open: nothing to read yet, and no end.
pub fn still_open(stream: &TcpStream) -> bool {
    stream.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    let open = matches!(
        (&*stream).read(&mut byte),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
    );
    stream.set_nonblocking(false).unwrap();
    open
}

/// `count` idle connections from `source` to `to`, and how many of them the server holds
/// open once it has taken them all.
pub fn idle_connections(source: Ipv4Addr, to: &str, count: usize) -> (Vec<TcpStream>, usize) {
    let held: Vec<TcpStream> = (0..count)
        .map(|_| connect_from(source, to).unwrap())
        .collect();
    // A server takes connections in order: once it has closed this one (the client is
    // at its cap), it has taken or closed every one before.
    let mut last = connect_from(source, to).unwrap();
    last.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut answer = Vec::new();
    let _ = last.read_to_end(&mut answer);
    assert!(
        answer.is_empty(),
        "a connection over the client's cap was served: {}",
        String::from_utf8_lossy(&answer)
    );
    let open = held.iter().filter(|s| still_open(s)).count();
    (held, open)
}

/// The exit status and stderr of `command`, killed if still running after 10 s (a
/// failure bound only: a start that is refused ends at once).
pub fn run_briefly(command: &mut Command) -> (Option<i32>, String) {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if started.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut text = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut text)
        .unwrap();
    (status, text)
}
