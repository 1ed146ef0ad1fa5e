//! The exporter's HTTP server: hyper (HTTP/1.1) on a single-threaded tokio runtime, made
//! to hold under abuse from anyone who can reach the port:
//!
//! - a request's head must arrive whole within the read timeout (slowloris), which is
//!   also how long an idle keep-alive connection is kept; it is at most
//!   [`MAX_HEADER_BYTES`] in at most [`MAX_HEADERS`] lines (431 beyond);
//! - a body is never read (an unread body closes the connection after the answer);
//! - at most `max_connections` connections: beyond, a new one is closed at once;
//! - a connection that moves no byte for [`STALL`] while it waits on us, or lives
//!   longer than [`LIFETIME`], is dropped (a client that never reads its answer);
//! - the figures are gathered by one thread of their own, one gathering shared by the
//!   scrapes that wait for it; a panic there is a 500, never the end of the server;
//! - accept errors (out of descriptors) wait and retry; nothing on the way unwraps
//!   what a client sent.
//!
//! TLS (rustls, ring) and basic authentication (bcrypt) as the web configuration says.

use std::collections::HashSet;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;

use super::web_config::WebConfig;
use crate::say;

/// The most bytes of a request's head (request line and headers).
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
/// The most header lines of a request.
pub const MAX_HEADERS: usize = 64;
/// A connection that moves no byte for this long while it waits on us is dropped.
pub const STALL: Duration = Duration::from_secs(30);
/// The longest a connection lives, however busy.
pub const LIFETIME: Duration = Duration::from_secs(600);
/// Descriptors kept for everything but connections (the listener, records, NVML, ...).
const SPARE_DESCRIPTORS: u64 = 64;
/// The queue of connections not yet accepted.
const BACKLOG: i32 = 4096;
/// Scrapes that may wait for a gathering at once; beyond, 503.
const WAITING_SCRAPES: usize = 256;
/// Password checks (bcrypt, deliberately slow) that may run at once.
const PASSWORD_CHECKS: usize = 2;
/// Verified (user, password) pairs remembered, so that a scrape costs no bcrypt.
const REMEMBERED: usize = 16;

/// The limits an operator may set.
pub struct Limits {
    pub max_connections: usize,
    pub read_timeout: Duration,
}

/// What answers a request.
struct Site {
    users: std::collections::BTreeMap<String, String>,
    headers: Vec<(header::HeaderName, HeaderValue)>,
    /// Asks the gathering thread for the exposition text.
    gather: mpsc::SyncSender<tokio::sync::oneshot::Sender<Option<Vec<u8>>>>,
    /// Verified credentials (user, password).
    remembered: Mutex<HashSet<(String, Vec<u8>)>>,
    checks: tokio::sync::Semaphore,
    /// The hash checked for an unknown user, so that it takes as long as a known one.
    decoy: String,
}

/// This process's descriptor limit, the soft one raised to the hard one; returns the
/// soft limit in force.
pub fn raise_descriptor_limit() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit with a pointer to a local rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return 1024;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit = raised;
            }
        }
    }
    limit.rlim_cur
}

/// The connection cap that fits under the descriptor limit.
pub fn connection_cap(asked: usize, descriptors: u64) -> usize {
    let fits = descriptors.saturating_sub(SPARE_DESCRIPTORS).max(1);
    asked
        .min(usize::try_from(fits).unwrap_or(usize::MAX))
        .max(1)
}

/// Serves until the process ends; `gather` asks the gathering thread ([`gatherer`]) for
/// the exposition text.
pub fn serve(
    listener: std::net::TcpListener,
    config: WebConfig,
    limits: Limits,
    gather: mpsc::SyncSender<tokio::sync::oneshot::Sender<Option<Vec<u8>>>>,
) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(PASSWORD_CHECKS)
        .build()
        .map_err(|e| format!("cannot start the server's runtime ({e})"))?;
    // As costly as the users' own hashes, so that an unknown name takes as long.
    let decoy = match config.users.values().next() {
        None => String::new(),
        Some(hash) => {
            let cost = hash
                .parse::<bcrypt::HashParts>()
                .map_or(bcrypt::DEFAULT_COST, |h| h.get_cost());
            bcrypt::hash("decoy", cost).unwrap_or_default()
        }
    };
    let site = Arc::new(Site {
        users: config.users,
        headers: config.headers,
        gather,
        remembered: Mutex::new(HashSet::new()),
        checks: tokio::sync::Semaphore::new(PASSWORD_CHECKS),
        decoy,
    });
    let tls = config.tls.map(TlsAcceptor::from);
    widen_backlog(&listener);
    runtime.block_on(async move {
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("cannot use the listening socket ({e})"))?;
        let listener = tokio::net::TcpListener::from_std(listener)
            .map_err(|e| format!("cannot use the listening socket ({e})"))?;
        accept(listener, site, tls, limits).await;
        Ok(())
    })
}

/// A longer queue of connections waiting to be accepted than std's 128 (the kernel caps
/// it at net.core.somaxconn): a burst of connections waits there instead of its SYNs
/// being dropped and retried a second later. Listening again only changes the backlog.
fn widen_backlog(listener: &std::net::TcpListener) {
    use std::os::fd::AsRawFd;
    // SAFETY: listen on a descriptor we own, already listening; a failure leaves the
    // backlog as it was.
    unsafe {
        libc::listen(listener.as_raw_fd(), BACKLOG);
    }
}

async fn accept(
    listener: tokio::net::TcpListener,
    site: Arc<Site>,
    tls: Option<TlsAcceptor>,
    limits: Limits,
) {
    let open = Arc::new(AtomicUsize::new(0));
    let limits = Arc::new(limits);
    let mut said_full = None::<Instant>;
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors or memory, or a connection reset before it was
                // taken: wait a little (the backlog keeps the others) and go on.
                if said_full.is_none_or(|at| at.elapsed() > Duration::from_secs(60)) {
                    say(format!("exporter: cannot accept a connection ({e})"));
                    said_full = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let Some(slot) = Slot::take(&open, limits.max_connections) else {
            // Over the cap: closed at once.
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(connection(
            stream,
            slot,
            site.clone(),
            tls.clone(),
            limits.clone(),
        ));
    }
}

/// One of the `max_connections` places, given back when dropped.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(open: &Arc<AtomicUsize>, max: usize) -> Option<Slot> {
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()
        .map(|_| Slot(open.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

async fn connection(
    stream: TcpStream,
    _slot: Slot,
    site: Arc<Site>,
    tls: Option<TlsAcceptor>,
    limits: Arc<Limits>,
) {
    let started = Instant::now();
    let progress = Arc::new(AtomicU64::new(0));
    let Some(acceptor) = tls else {
        return http(
            Watched::new(stream, started, progress.clone()),
            site,
            &limits,
            started,
            progress,
        )
        .await;
    };
    // Plain HTTP on the TLS port is answered with a 400 there.
    let Some(stream) = crate::tls::accept(&acceptor, stream, limits.read_timeout).await else {
        return;
    };
    http(
        Watched::new(stream, started, progress.clone()),
        site,
        &limits,
        started,
        progress,
    )
    .await;
}

/// Serves HTTP/1.1 on `io` until the client or a limit closes it.
async fn http<T>(
    io: Watched<T>,
    site: Arc<Site>,
    limits: &Limits,
    started: Instant,
    progress: Arc<AtomicU64>,
) where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.read_timeout)
        .max_buf_size(MAX_HEADER_BYTES)
        .max_headers(MAX_HEADERS)
        .keep_alive(true)
        .half_close(false);
    let service = hyper::service::service_fn(move |request| answer(site.clone(), request));
    let connection = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    // hyper's header timeout covers reading; this covers the rest (an answer nobody
    // reads). The stall limit stays above the read timeout, which closes idle
    // keep-alive connections itself.
    let stall = STALL.max(limits.read_timeout + Duration::from_secs(1));
    let check = stall / 4;
    loop {
        tokio::select! {
            _ = &mut connection => return,
            _ = tokio::time::sleep(check) => {
                let last = Duration::from_millis(progress.load(Ordering::Relaxed));
                let now = started.elapsed();
                if now.saturating_sub(last) > stall || now > LIFETIME {
                    return;
                }
            }
        }
    }
}

/// An I/O object that notes when it last moved a byte (milliseconds since `started`).
struct Watched<T> {
    inner: T,
    started: Instant,
    progress: Arc<AtomicU64>,
}

impl<T> Watched<T> {
    fn new(inner: T, started: Instant, progress: Arc<AtomicU64>) -> Watched<T> {
        Watched {
            inner,
            started,
            progress,
        }
    }

    fn moved(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.progress.store(ms, Ordering::Relaxed);
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(poll, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.moved();
        }
        poll
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(poll, Poll::Ready(Ok(n)) if n > 0) {
            self.moved();
        }
        poll
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(poll, Poll::Ready(Ok(n)) if n > 0) {
            self.moved();
        }
        poll
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

type Answer = Response<Full<Bytes>>;

fn reply(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Answer {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

const TEXT: &str = "text/plain; charset=utf-8";

/// The answer to one request; its body, if any, is never read.
async fn answer(site: Arc<Site>, request: Request<Incoming>) -> Result<Answer, Infallible> {
    let mut response = if authorized(&site, &request).await {
        route(&site, &request).await
    } else {
        let mut response = reply(StatusCode::UNAUTHORIZED, TEXT, "Unauthorized\n");
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Basic"));
        response
    };
    for (name, value) in &site.headers {
        response.headers_mut().insert(name.clone(), value.clone());
    }
    Ok(response)
}

async fn route(site: &Site, request: &Request<Incoming>) -> Answer {
    match request.uri().path() {
        "/metrics" => {
            let (tell, told) = tokio::sync::oneshot::channel();
            if site.gather.try_send(tell).is_err() {
                return reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    TEXT,
                    "too many scrapes at once\n",
                );
            }
            match told.await {
                Ok(Some(body)) => reply(
                    StatusCode::OK,
                    "text/plain; version=0.0.4; charset=utf-8",
                    body,
                ),
                _ => reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    TEXT,
                    "the figures could not be gathered (see the exporter's log)\n",
                ),
            }
        }
        "/" => reply(
            StatusCode::OK,
            "text/html; charset=utf-8",
            &b"<html><body><a href=\"/metrics\">cudabudget metrics</a></body></html>\n"[..],
        ),
        _ => reply(
            StatusCode::NOT_FOUND,
            TEXT,
            &b"not found; the metrics are at /metrics\n"[..],
        ),
    }
}

/// Whether the request may be answered: always without users, else with the
/// credentials of one of them (basic authentication).
async fn authorized(site: &Site, request: &Request<Incoming>) -> bool {
    if site.users.is_empty() {
        return true;
    }
    let Some((user, password)) = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| basic_credentials(v.as_bytes()))
    else {
        return false;
    };
    let key = (user, password);
    if site
        .remembered
        .lock()
        .is_ok_and(|remembered| remembered.contains(&key))
    {
        return true;
    }
    let Ok(_permit) = site.checks.acquire().await else {
        return false;
    };
    let (hash, known) = match site.users.get(&key.0) {
        Some(hash) => (hash.clone(), true),
        None => (site.decoy.clone(), false),
    };
    let password = key.1.clone();
    let verified =
        tokio::task::spawn_blocking(move || bcrypt::verify(&password, &hash).unwrap_or(false))
            .await
            .unwrap_or(false);
    let ok = verified && known;
    if ok && let Ok(mut remembered) = site.remembered.lock() {
        if remembered.len() >= REMEMBERED {
            remembered.clear();
        }
        remembered.insert(key);
    }
    ok
}

/// (user, password) of `Basic <base64 of user:password>`.
fn basic_credentials(value: &[u8]) -> Option<(String, Vec<u8>)> {
    let value = std::str::from_utf8(value).ok()?.trim();
    let (scheme, encoded) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64(encoded.trim())?;
    let colon = decoded.iter().position(|&b| b == b':')?;
    let user = String::from_utf8(decoded[..colon].to_vec()).ok()?;
    Some((user, decoded[colon + 1..].to_vec()))
}

/// Standard base64 (padding optional); `None` for anything else.
fn base64(text: &str) -> Option<Vec<u8>> {
    let text = text.trim_end_matches('=');
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let mut bits = 0u32;
    let mut count = 0;
    for c in text.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        bits = (bits << 6) | u32::from(v);
        count += 6;
        if count >= 8 {
            count -= 8;
            out.push((bits >> count) as u8);
            bits &= (1 << count) - 1;
        }
    }
    (count < 6).then_some(out)
}

/// The gathering thread: one gathering at a time, its text handed to every scrape that
/// waited for it. A panic while gathering is a 500 for those scrapes, not the end.
/// `setup` runs on that thread and returns the maker of the text (which may hold what
/// cannot leave the thread, such as NVML's handle).
pub fn gatherer<F: Fn() -> Vec<u8>>(
    setup: impl FnOnce() -> F + Send + 'static,
) -> mpsc::SyncSender<tokio::sync::oneshot::Sender<Option<Vec<u8>>>> {
    let (tell, asks) =
        mpsc::sync_channel::<tokio::sync::oneshot::Sender<Option<Vec<u8>>>>(WAITING_SCRAPES);
    std::thread::spawn(move || {
        let make = setup();
        while let Ok(first) = asks.recv() {
            let mut waiting = vec![first];
            waiting.extend(asks.try_iter());
            let body = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&make)).ok();
            if body.is_none() {
                say("exporter: gathering the figures failed (a bug: please report it)");
            }
            for waiter in waiting {
                let _ = waiter.send(body.clone());
            }
        }
    });
    tell
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_credentials_are_decoded() {
        // "prometheus:secret"
        assert_eq!(
            basic_credentials(b"Basic cHJvbWV0aGV1czpzZWNyZXQ="),
            Some(("prometheus".into(), b"secret".to_vec()))
        );
        assert_eq!(basic_credentials(b"Bearer abc"), None);
        assert_eq!(basic_credentials(b"Basic !!!"), None);
        assert_eq!(base64("YQ"), Some(b"a".to_vec()));
        assert_eq!(base64("Y"), None);
    }

    #[test]
    fn the_connection_cap_fits_under_the_descriptor_limit() {
        assert_eq!(connection_cap(8192, 20000), 8192);
        assert_eq!(connection_cap(8192, 1024), 960);
        assert_eq!(connection_cap(8192, 10), 1);
    }
}
