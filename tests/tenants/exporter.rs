//! The exporter under abuse: what any local user (or anyone who reaches its port) can
//! send it must never stop it, freeze it, or make it hold the node's memory. Each test
//! ends with a scrape that must be answered. No test bounds how long anything takes:
//! where an answer must not wait for an abuser, the exporter is given an hour's read
//! timeout ([`PATIENT`]), so an answer that waited for one would not come within the
//! scrape's minute; only the tests of the read timeout itself set a short one.
//!
//! The clients are plain `TcpStream`s on 127.0.0.1; every loop is bounded.

use crate::util::cli::node;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `--read-timeout` for an exporter that must answer while abusers' connections stay
/// open: an hour (its most), far beyond any test's time.
const PATIENT: &[&str] = &["--read-timeout", "3600"];

/// How long a test waits for what must come (an answer, a close) before it fails: it
/// tells "never" from "late", and no busy machine makes a scrape take that long.
const LIVENESS: Duration = Duration::from_secs(60);

/// Idle connections the flood test opens (scaled down when this process cannot have
/// that many descriptors).
const IDLE_CONNECTIONS: usize = 5000;

/// An exporter on a free port of 127.0.0.1, stopped when dropped.
struct Exporter {
    child: Child,
    address: String,
}

impl Exporter {
    /// The exporter with `extra` options, under `limits` (resource, soft and hard limit:
    /// as a node's limits on a service would be).
    fn start(extra: &[&str], limits: &[(libc::__rlimit_resource_t, u64)]) -> Exporter {
        let mut args = vec!["exporter", "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        Exporter::launch(node(&args), limits)
    }

    /// The exporter that `command` starts, under `limits`.
    fn launch(mut command: Command, limits: &[(libc::__rlimit_resource_t, u64)]) -> Exporter {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let limits = limits.to_vec();
        // SAFETY: the closure only calls setrlimit, which is async-signal-safe.
        unsafe {
            command.pre_exec(move || {
                for &(resource, value) in &limits {
                    let limit = libc::rlimit {
                        rlim_cur: value,
                        rlim_max: value,
                    };
                    if libc::setrlimit(resource, &limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let mut child = command.spawn().expect("start the exporter");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let first = lines.next().and_then(Result::ok).unwrap_or_default();
        let address = first
            .strip_prefix("cudabudget: exporter listening on http://")
            .and_then(|rest| rest.strip_suffix("/metrics"))
            .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
            .to_string();
        // Whatever it says later goes to our stderr.
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                eprintln!("exporter: {line}");
            }
        });
        Exporter { child, address }
    }

    fn connect(&self) -> TcpStream {
        TcpStream::connect(&self.address).expect("connect to the exporter")
    }

    /// A scrape of /metrics, which must be answered (200, the exposition); returns how
    /// long it took (to print: no test bounds it).
    fn scrape(&self) -> Duration {
        let within = LIVENESS;
        let started = Instant::now();
        let result = (|| -> std::io::Result<String> {
            let mut stream = TcpStream::connect_timeout(&self.address.parse().unwrap(), within)?;
            stream.set_read_timeout(Some(within))?;
            stream.set_write_timeout(Some(within))?;
            stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: test\r\n\r\n")?;
            let mut response = String::new();
            stream.read_to_string(&mut response)?;
            Ok(response)
        })();
        let took = started.elapsed();
        let response = result.unwrap_or_else(|e| panic!("the scrape failed after {took:?}: {e}"));
        assert!(
            response.starts_with("HTTP/1.") && response.contains(" 200 OK\r\n"),
            "{response}"
        );
        assert!(response.contains("cudabudget_processes "), "{response}");
        took
    }

    /// Scrapes until one is answered ([`LIVENESS`] at most): for an exporter that turns
    /// connections away for a while (its descriptors all taken).
    fn scrape_eventually(&self) {
        let deadline = Instant::now() + LIVENESS;
        loop {
            let answered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.scrape();
            }));
            if answered.is_ok() {
                return;
            }
            assert!(Instant::now() < deadline, "no scrape was answered");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The exporter's resident memory (VmRSS), in bytes.
    fn resident(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("the exporter is alive");
        let line = status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .expect("a VmRSS line");
        let kib: u64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|n| n.parse().ok())
            .expect("VmRSS in kB");
        kib * 1024
    }

    fn assert_alive(&mut self) {
        assert!(
            self.child.try_wait().unwrap().is_none(),
            "the exporter has stopped"
        );
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads what the server sends on `stream` until it closes it or `within` passes;
/// `None` if it did neither in time.
fn answer_or_close(stream: &mut TcpStream, within: Duration) -> Option<String> {
    stream.set_read_timeout(Some(within)).unwrap();
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    let mut buffer = [0u8; 4096];
    while Instant::now() < deadline {
        match stream.read(&mut buffer) {
            Ok(0) => return Some(String::from_utf8_lossy(&got).into_owned()),
            Ok(n) => got.extend_from_slice(&buffer[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Some(String::from_utf8_lossy(&got).into_owned());
            }
            Err(_) => return None,
        }
    }
    None
}

/// This process's descriptor limit, raised to the hard one; returns the soft limit now.
fn raise_nofile() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
    }
    limit.rlim_cur
}

#[test]
fn a_get_with_a_huge_content_length_does_not_stop_the_exporter() {
    let mut exporter = Exporter::start(PATIENT, &[]);
    let mut stream = exporter.connect();
    stream
        .write_all(
            b"GET /metrics HTTP/1.1\r\nHost: test\r\nContent-Length: 18446744073709551615\r\n\r\n",
        )
        .unwrap();
    assert!(
        answer_or_close(&mut stream, LIVENESS).is_some(),
        "neither answered nor closed"
    );
    exporter.scrape();
    exporter.assert_alive();
}

#[test]
fn a_request_whose_body_never_comes_does_not_delay_another_scrape() {
    let mut exporter = Exporter::start(PATIENT, &[]);
    let mut stalled = Vec::new();
    for length in ["4096", "1", "18446744073709551615"] {
        let mut stream = exporter.connect();
        write!(
            stream,
            "GET /metrics HTTP/1.1\r\nHost: test\r\nContent-Length: {length}\r\n\r\n"
        )
        .unwrap();
        stalled.push(stream);
    }
    let mut chunked = exporter.connect();
    chunked
        .write_all(
            b"POST /metrics HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n1000\r\nab",
        )
        .unwrap();
    stalled.push(chunked);
    for _ in 0..3 {
        exporter.scrape();
    }
    exporter.assert_alive();
}

#[test]
fn a_scrape_is_answered_while_thousands_of_idle_connections_and_a_slowloris_are_open() {
    let nofile = raise_nofile();
    // Our end of each connection is one descriptor; keep some for the test itself.
    let idle = IDLE_CONNECTIONS.min(nofile.saturating_sub(200) as usize);
    if idle < IDLE_CONNECTIONS {
        eprintln!(
            "scaled down: {idle} idle connections instead of {IDLE_CONNECTIONS} (RLIMIT_NOFILE {nofile})"
        );
    }
    // Under a limit on its address space (as a service's unit may set), so that a thread
    // per connection cannot be had.
    // Every connection from this one address counts here: without a per-client cap,
    // the server's own cap and its memory are what hold.
    let mut exporter = Exporter::start(
        &[
            "--max-connections-per-client",
            "1000000",
            PATIENT[0],
            PATIENT[1],
        ],
        &[(libc::RLIMIT_AS, 1 << 30)],
    );
    let mut open = Vec::with_capacity(idle);
    let connecting = Instant::now();
    for i in 0..idle {
        let mut stream = exporter.connect();
        // Half a request line, or nothing at all.
        if i % 2 == 0 {
            let _ = stream.write_all(b"GET /metr");
        }
        open.push(stream);
    }
    eprintln!("{idle} connections opened in {:?}", connecting.elapsed());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let slowloris = {
        let mut stream = exporter.connect();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let _ = stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\n");
            for i in 0..200 {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                if stream
                    .write_all(format!("X-{i}: a\r\n").as_bytes())
                    .is_err()
                {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let took = exporter.scrape();
    eprintln!(
        "scrape with {idle} idle connections open: {took:?}; the exporter holds {} MiB",
        exporter.resident() >> 20
    );
    exporter.scrape();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    slowloris.join().unwrap();
    drop(open);
    exporter.scrape();
    exporter.assert_alive();
}

#[test]
fn a_request_with_300000_header_lines_is_refused_without_holding_memory() {
    let mut exporter = Exporter::start(PATIENT, &[]);
    let mut stream = exporter.connect();
    stream
        .set_write_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut request = b"GET /metrics HTTP/1.1\r\nHost: test\r\n".to_vec();
    let mut sent = 0;
    let mut refused = false;
    for i in 0..300_000 {
        request.extend_from_slice(format!("X-Header-{i}: some value of a header\r\n").as_bytes());
        if request.len() > 64 * 1024 || i == 299_999 {
            if i == 299_999 {
                request.extend_from_slice(b"\r\n");
            }
            if stream.write_all(&request).is_err() {
                refused = true; // closed by the exporter
                break;
            }
            sent += request.len();
            request.clear();
        }
    }
    let resident = exporter.resident();
    let answer = answer_or_close(&mut stream, LIVENESS);
    assert!(
        refused || answer.as_deref().is_some_and(|a| !a.contains(" 200 OK")),
        "sent {sent} bytes of headers; answer: {answer:?}"
    );
    assert!(
        resident < 64 << 20,
        "the exporter holds {} MiB",
        resident >> 20
    );
    exporter.scrape();
    assert!(exporter.resident() < 64 << 20);
    exporter.assert_alive();
}

#[test]
fn connections_beyond_the_cap_are_closed_at_once_and_scrapes_come_back() {
    // The held ones stay (an hour's read timeout): the one beyond the cap (accepted
    // after them, in the order they connected) is closed, not kept waiting for a place.
    let mut exporter = Exporter::start(&["--max-connections", "20", PATIENT[0], PATIENT[1]], &[]);
    let held: Vec<TcpStream> = (0..20).map(|_| exporter.connect()).collect();
    let mut extra = exporter.connect();
    let _ = extra.write_all(b"GET /metrics HTTP/1.0\r\n\r\n");
    let answer = answer_or_close(&mut extra, LIVENESS);
    assert!(
        answer.as_deref().is_some_and(|a| !a.contains("200 OK")),
        "a connection beyond the cap was not closed at once: {answer:?}"
    );
    drop(held);
    exporter.scrape_eventually();
    exporter.assert_alive();
}

#[test]
fn idle_connections_are_closed_once_the_read_timeout_passes_and_scrapes_come_back() {
    let mut exporter = Exporter::start(&["--max-connections", "20", "--read-timeout", "1"], &[]);
    let held: Vec<TcpStream> = (0..20).map(|_| exporter.connect()).collect();
    for mut stream in held {
        assert!(
            answer_or_close(&mut stream, LIVENESS).is_some(),
            "an idle connection was kept past the read timeout"
        );
    }
    exporter.scrape();
    exporter.assert_alive();
}

#[test]
fn a_slowloris_client_is_cut_off_after_the_read_timeout() {
    let mut exporter = Exporter::start(&["--read-timeout", "1"], &[]);
    let mut stream = exporter.connect();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\n")
        .unwrap();
    // A header line every 100 ms, until the exporter cuts it off (or a minute).
    let started = Instant::now();
    let mut cut = false;
    for i in 0.. {
        if started.elapsed() > LIVENESS {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        if stream
            .write_all(format!("X-{i}: a\r\n").as_bytes())
            .is_err()
        {
            cut = true;
            break;
        }
        stream.set_nonblocking(true).unwrap();
        let mut buffer = [0u8; 1024];
        let closed = match stream.read(&mut buffer) {
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
            Ok(_) => true, // an answer (408) or the end
        };
        stream.set_nonblocking(false).unwrap();
        if closed {
            cut = true;
            break;
        }
    }
    assert!(cut, "still connected after {:?}", started.elapsed());
    exporter.scrape();
    exporter.assert_alive();
}

#[test]
fn running_out_of_descriptors_does_not_stop_the_exporter() {
    // 128 descriptors: the exporter serves fewer connections than that and closes the
    // others at once, instead of failing to accept (or dying) for good.
    let mut exporter = Exporter::start(&["--read-timeout", "1"], &[(libc::RLIMIT_NOFILE, 128)]);
    let held: Vec<TcpStream> = (0..300).map(|_| exporter.connect()).collect();
    exporter.assert_alive();
    // Once the read timeout has closed the idle ones, scrapes are served again.
    exporter.scrape_eventually();
    drop(held);
    exporter.scrape();
    exporter.assert_alive();
}

/// `GET /metrics` (the body) on a connection whose socket belongs to `uid`: made with
/// that file-system uid, which the kernel records as the socket's owner.
fn scrape_as(address: &str, uid: u32) -> String {
    // SAFETY: setfsuid changes this thread's file-system uid only; it is set back
    // before anything else runs on the thread.
    let stream = unsafe {
        libc::setfsuid(uid);
        let stream = TcpStream::connect(address);
        libc::setfsuid(0);
        stream
    };
    let mut stream = stream.expect("connect to the exporter");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: test\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(
        head.starts_with("HTTP/1.") && head[8..].starts_with(" 200"),
        "{head}"
    );
    body.to_string()
}

#[test]
fn on_a_loopback_listener_without_passwords_a_local_user_sees_only_their_own_series() {
    use super::records::{budgeted, kit};
    use crate::util::tenants::{Tenants, as_user};
    let Some(t) = Tenants::get() else {
        return;
    };
    let kit = kit(t);
    let pod = |user: &str| format!("{user}-pod-{}", std::process::id());
    let (alice_pod, mallory_pod) = (pod("alice"), pod("mallory"));
    let _alice = budgeted(
        t,
        &kit,
        &t.alice,
        &[("POD_NAME", &alice_pod)],
        Stdio::null(),
    );
    let _mallory = budgeted(
        t,
        &kit,
        &t.mallory,
        &[("POD_NAME", &mallory_pod)],
        Stdio::null(),
    );
    // Where the tenants' processes publish.
    let probe = as_user(t, &t.alice, Path::new("true"), &[]);
    let runtime = probe
        .get_envs()
        .find(|(name, _)| *name == "CUDABUDGET_RUNTIME_DIR")
        .and_then(|(_, value)| value)
        .expect("the tenants' runtime directory")
        .to_os_string();
    let mut command = node(&["exporter", "--listen", "127.0.0.1:0"]);
    command.env("CUDABUDGET_RUNTIME_DIR", &runtime);
    let exporter = Exporter::launch(command, &[]);
    // Root sees both, once both have published.
    let started = Instant::now();
    loop {
        let body = scrape_as(&exporter.address, 0);
        if body.contains(&alice_pod) && body.contains(&mallory_pod) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the tenants' processes are not exported: {body}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for (user, own, other) in [
        (&t.alice, &alice_pod, &mallory_pod),
        (&t.mallory, &mallory_pod, &alice_pod),
    ] {
        let body = scrape_as(&exporter.address, user.uid);
        assert!(body.contains(own.as_str()), "{}: {body}", user.name);
        assert!(!body.contains(other.as_str()), "{}: {body}", user.name);
        let uid = format!("budget_uid=\"{}\"", user.uid);
        for line in body.lines().filter(|l| l.contains("budget_uid=")) {
            assert!(line.contains(&uid), "{}: {line}", user.name);
        }
    }
}
