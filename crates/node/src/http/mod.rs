//! The node services' HTTP server, used by the exporter and the webhook: hyper (HTTP/1.1)
//! on a single-threaded tokio runtime, made to hold under abuse from anyone who can reach
//! the port. Each server brings only what it answers ([`Site`]); this module owns:
//!
//! - a request's head must arrive whole within the read timeout (slowloris), which is
//!   also how long an idle keep-alive connection is kept; it is at most
//!   [`MAX_HEADER_BYTES`] in at most [`MAX_HEADERS`] lines (431 beyond); a body is read
//!   only where the server takes one, within the same time and at most its `max_body`
//!   bytes (413 beyond);
//! - connections: at most `per_client` from one client (one IPv4 address, one IPv6 /64),
//!   at most `max_connections` in all, and beyond that a few more ([`Limits::reserve`])
//!   for clients that hold none, so that a flood from a few addresses leaves room for a
//!   probe or a scrape from another; a connection over a cap is closed at once;
//! - a connection that moves no byte for [`STALL`] while it waits on us, or lives longer
//!   than [`LIFETIME`], is dropped (a client that never reads its answer);
//! - TLS (rustls, [`crate::tls`]), its certificate read again when its files change
//!   where the server asks for it (the webhook's renewed Secret);
//! - `GET /healthz`, answered 200 before anything else (no authentication, no body);
//! - basic authentication (bcrypt): verified credentials are remembered, so that a
//!   scrape after the first costs no bcrypt; a client's checks run one at a time, behind
//!   its own only, and at most [`PASSWORD_CHECKS`] run at once, so that one client's
//!   wrong passwords never queue a correct one behind them;
//! - accept errors (out of descriptors) wait and retry; nothing on the way unwraps what
//!   a client sent.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;

use crate::tell::say;

mod owner;

/// The most bytes of a request's head (request line and headers).
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
/// The most header lines of a request.
pub const MAX_HEADERS: usize = 64;
/// A connection that moves no byte for this long while it waits on us is dropped.
pub const STALL: Duration = Duration::from_secs(30);
/// The longest a connection lives, however busy.
pub const LIFETIME: Duration = Duration::from_secs(600);
/// The health endpoint's path (the chart's probes use it).
pub const HEALTH: &str = "/healthz";
/// Password checks (bcrypt, deliberately slow) that may run at once.
pub const PASSWORD_CHECKS: usize = 2;
/// Descriptors kept for everything but connections (the listener, records, NVML, ...).
const SPARE_DESCRIPTORS: u64 = 64;
/// The most connections kept beyond the cap for clients that hold none.
const MAX_RESERVE: usize = 64;
/// The queue of connections not yet accepted.
const BACKLOG: i32 = 4096;
/// Verified (user, password) pairs remembered, so that a scrape costs no bcrypt.
const REMEMBERED: usize = 16;
/// Clients whose password checks are remembered as running, before finished ones are
/// forgotten.
const LANES: usize = 4096;
/// How often a renewable certificate's files are looked at.
const RELOAD_EVERY: Duration = Duration::from_secs(10);

/// What a server may cost its clients together and each client alone.
pub struct Limits {
    /// Connections served at once (lowered to fit the descriptor limit).
    pub max_connections: usize,
    /// Connections served at once from one client (an IPv4 address, an IPv6 /64).
    pub per_client: usize,
    /// How long a client has to send a request's head (and body); also how long an idle
    /// keep-alive connection is kept.
    pub read_timeout: Duration,
    /// The largest body read; 0: bodies are never read (an unread body closes the
    /// connection after the answer).
    pub max_body: usize,
}

impl Limits {
    /// Connections kept beyond `max_connections` for clients that hold none.
    fn reserve(&self) -> usize {
        (self.max_connections / 8).clamp(1, MAX_RESERVE)
    }
}

/// How connections are secured.
pub enum Tls {
    Plain,
    /// One configuration for the server's life.
    Fixed(Arc<rustls::ServerConfig>),
    /// A certificate read again when its files change.
    Renewable(Certificate),
}

/// A server: where it listens, what it costs at most, and who may ask.
pub struct Server {
    /// Names the server in its log lines ("exporter", "webhook").
    pub name: &'static str,
    pub listener: std::net::TcpListener,
    pub tls: Tls,
    pub limits: Limits,
    /// Basic authentication: user name → bcrypt hash (none: no authentication).
    pub users: BTreeMap<String, String>,
    /// Headers added to every response.
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

/// The two ends of a request's connection.
#[derive(Clone, Copy, Debug)]
pub struct Peer {
    /// The client's address and port.
    pub remote: SocketAddr,
    /// The address and port it reached.
    pub local: SocketAddr,
}

impl Peer {
    /// The uid that owns the client's socket, for a client on this machine (in this
    /// network namespace); `None` when it cannot be told (the client has gone, or is
    /// elsewhere).
    pub fn owner(&self) -> Option<u32> {
        owner::of(self.remote, self.local)
    }
}

pub type Answer = Response<Full<Bytes>>;

/// What a server answers, once a request has passed the limits, the health endpoint and
/// authentication; its body is read already (empty where the server reads none).
pub trait Site: Send + Sync + 'static {
    fn answer(&self, request: Request<Bytes>, peer: Peer) -> impl Future<Output = Answer> + Send;
}

pub const TEXT: &str = "text/plain; charset=utf-8";

pub fn reply(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Answer {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// Serves until the process ends; returns only when the server cannot start.
pub fn serve<S: Site>(server: Server, site: S) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(PASSWORD_CHECKS)
        .build()
        .map_err(|e| format!("cannot start the server's runtime ({e})"))?;
    let Server {
        name,
        listener,
        tls,
        mut limits,
        users,
        headers,
    } = server;
    let descriptors = raise_descriptor_limit();
    let asked = limits.max_connections;
    limits.max_connections = connection_cap(asked, descriptors);
    if limits.max_connections < asked {
        say(format!(
            "{name}: at most {} connections (the descriptor limit is {descriptors})",
            limits.max_connections
        ));
    }
    limits.per_client = limits.per_client.clamp(1, limits.max_connections);
    let shared = Arc::new(Shared {
        site,
        auth: (!users.is_empty()).then(|| Auth::new(users)),
        headers,
        clients: Mutex::new(Clients::default()),
        limits,
    });
    widen_backlog(&listener);
    runtime.block_on(async move {
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("cannot use the listening socket ({e})"))?;
        let listener = tokio::net::TcpListener::from_std(listener)
            .map_err(|e| format!("cannot use the listening socket ({e})"))?;
        accept(name, listener, shared, tls).await;
        Ok(())
    })
}

/// This process's descriptor limit, the soft one raised to the hard one; returns the
/// soft limit in force.
fn raise_descriptor_limit() -> u64 {
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

/// The connection cap that fits, with its reserve, under the descriptor limit.
fn connection_cap(asked: usize, descriptors: u64) -> usize {
    let fits = descriptors
        .saturating_sub(SPARE_DESCRIPTORS + MAX_RESERVE as u64)
        .max(1);
    asked
        .min(usize::try_from(fits).unwrap_or(usize::MAX))
        .max(1)
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

/// What every connection of a server shares.
struct Shared<S> {
    site: S,
    auth: Option<Auth>,
    headers: Vec<(HeaderName, HeaderValue)>,
    clients: Mutex<Clients>,
    limits: Limits,
}

/// The connections open, in all and per client.
#[derive(Default)]
struct Clients {
    total: usize,
    each: HashMap<IpAddr, usize>,
}

/// Who a client is, for its caps: an IPv4 address (an IPv4-mapped IPv6 address as
/// IPv4), or an IPv6 /64 (what one host is usually given).
fn client_of(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mut segments = v6.segments();
                segments[4..].fill(0);
                IpAddr::V6(segments.into())
            }
        },
    }
}

/// One connection's place, given back when dropped.
struct Slot<S> {
    shared: Arc<Shared<S>>,
    client: IpAddr,
}

impl<S> Slot<S> {
    /// A place for a new connection of `client`, if its cap and the server's leave one:
    /// a client under its own cap gets one while the server is under its cap, and one of
    /// the reserve while it holds none.
    fn take(shared: &Arc<Shared<S>>, client: IpAddr) -> Option<Slot<S>> {
        let limits = &shared.limits;
        let mut clients = shared.clients.lock().ok()?;
        let held = clients.each.get(&client).copied().unwrap_or(0);
        let room = clients.total < limits.max_connections
            || (held == 0 && clients.total < limits.max_connections + limits.reserve());
        if held >= limits.per_client || !room {
            return None;
        }
        clients.total += 1;
        *clients.each.entry(client).or_insert(0) += 1;
        Some(Slot {
            shared: shared.clone(),
            client,
        })
    }
}

impl<S> Drop for Slot<S> {
    fn drop(&mut self) {
        if let Ok(mut clients) = self.shared.clients.lock() {
            clients.total = clients.total.saturating_sub(1);
            if let Some(held) = clients.each.get_mut(&self.client) {
                *held -= 1;
                if *held == 0 {
                    clients.each.remove(&self.client);
                }
            }
        }
    }
}

async fn accept<S: Site>(
    name: &'static str,
    listener: tokio::net::TcpListener,
    shared: Arc<Shared<S>>,
    tls: Tls,
) {
    let (acceptor, mut certificate) = match tls {
        Tls::Plain => (None, None),
        Tls::Fixed(config) => (Some(Arc::new(RwLock::new(TlsAcceptor::from(config)))), None),
        Tls::Renewable(certificate) => (Some(certificate.acceptor.clone()), Some(certificate)),
    };
    let mut reload =
        tokio::time::interval_at(tokio::time::Instant::now() + RELOAD_EVERY, RELOAD_EVERY);
    let mut said_full = None::<Instant>;
    loop {
        let (stream, remote) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors or memory, or a connection reset before it was
                    // taken: wait a little (the backlog keeps the others) and go on.
                    if said_full.is_none_or(|at| at.elapsed() > Duration::from_secs(60)) {
                        say(format!("{name}: cannot accept a connection ({e})"));
                        said_full = Some(Instant::now());
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            _ = reload.tick(), if certificate.is_some() => {
                if let Some(certificate) = &mut certificate {
                    certificate.refresh(name);
                }
                continue;
            }
        };
        let Some(slot) = Slot::take(&shared, client_of(remote.ip())) else {
            // Over a cap: closed at once.
            drop(stream);
            continue;
        };
        let Ok(local) = stream.local_addr() else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let acceptor = match &acceptor {
            None => None,
            Some(acceptor) => match acceptor.read() {
                Ok(acceptor) => Some(acceptor.clone()),
                Err(_) => continue,
            },
        };
        tokio::spawn(connection(stream, Peer { remote, local }, slot, acceptor));
    }
}

async fn connection<S: Site>(
    stream: TcpStream,
    peer: Peer,
    slot: Slot<S>,
    acceptor: Option<TlsAcceptor>,
) {
    let started = Instant::now();
    let progress = Arc::new(AtomicU64::new(0));
    let shared = slot.shared.clone();
    let Some(acceptor) = acceptor else {
        let io = Watched::new(stream, started, progress.clone());
        return http(io, shared, peer, started, progress).await;
    };
    // Plain HTTP on the TLS port is answered with a 400 there.
    let read_timeout = shared.limits.read_timeout;
    let Some(stream) = crate::tls::accept(&acceptor, stream, read_timeout).await else {
        return;
    };
    let io = Watched::new(stream, started, progress.clone());
    http(io, shared, peer, started, progress).await;
}

/// Serves HTTP/1.1 on `io` until the client or a limit closes it.
async fn http<T, S: Site>(
    io: Watched<T>,
    shared: Arc<Shared<S>>,
    peer: Peer,
    started: Instant,
    progress: Arc<AtomicU64>,
) where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let read_timeout = shared.limits.read_timeout;
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(read_timeout)
        .max_buf_size(MAX_HEADER_BYTES)
        .max_headers(MAX_HEADERS)
        .keep_alive(true)
        .half_close(false);
    let service = hyper::service::service_fn(move |request| answer(shared.clone(), request, peer));
    let connection = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    // hyper's header timeout covers reading; this covers the rest (an answer nobody
    // reads). The stall limit stays above the read timeout, which closes idle
    // keep-alive connections itself.
    let stall = STALL.max(read_timeout + Duration::from_secs(1));
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

/// The answer to one request, with the server's headers.
async fn answer<S: Site>(
    shared: Arc<Shared<S>>,
    request: Request<Incoming>,
    peer: Peer,
) -> Result<Answer, Infallible> {
    let mut response = respond(&shared, request, peer).await;
    for (name, value) in &shared.headers {
        response.headers_mut().insert(name.clone(), value.clone());
    }
    Ok(response)
}

async fn respond<S: Site>(shared: &Shared<S>, request: Request<Incoming>, peer: Peer) -> Answer {
    if request.method() == Method::GET && request.uri().path() == HEALTH {
        return reply(StatusCode::OK, TEXT, "ok\n");
    }
    if let Some(auth) = &shared.auth
        && !auth
            .allows(request.headers(), client_of(peer.remote.ip()))
            .await
    {
        let mut response = reply(StatusCode::UNAUTHORIZED, TEXT, "Unauthorized\n");
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Basic"));
        return response;
    }
    let (parts, body) = request.into_parts();
    let max_body = shared.limits.max_body;
    let body = if max_body == 0 {
        Bytes::new()
    } else {
        let body = Limited::new(body, max_body);
        match tokio::time::timeout(shared.limits.read_timeout, body.collect()).await {
            Ok(Ok(body)) => body.to_bytes(),
            Ok(Err(_)) => {
                return reply(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    TEXT,
                    format!("the body is larger than {max_body} bytes or was cut\n"),
                );
            }
            Err(_) => {
                return reply(
                    StatusCode::REQUEST_TIMEOUT,
                    TEXT,
                    "the body did not arrive in time\n",
                );
            }
        }
    };
    shared
        .site
        .answer(Request::from_parts(parts, body), peer)
        .await
}

/// Basic authentication against bcrypt hashes.
struct Auth {
    users: BTreeMap<String, String>,
    /// The hash checked for an unknown user, so that it takes as long as a known one.
    decoy: String,
    /// Verified credentials (user, password).
    remembered: Mutex<HashSet<(String, Vec<u8>)>>,
    /// Each client's turn to have a password checked: one check at a time per client.
    lanes: Mutex<HashMap<IpAddr, Arc<tokio::sync::Mutex<()>>>>,
    /// Checks running at once, all clients together.
    checks: Arc<tokio::sync::Semaphore>,
}

impl Auth {
    fn new(users: BTreeMap<String, String>) -> Auth {
        // As costly as the users' own hashes, so that an unknown name takes as long.
        let decoy = match users.values().next() {
            None => String::new(),
            Some(hash) => {
                let cost = hash
                    .parse::<bcrypt::HashParts>()
                    .map_or(bcrypt::DEFAULT_COST, |h| h.get_cost());
                bcrypt::hash("decoy", cost).unwrap_or_default()
            }
        };
        Auth {
            users,
            decoy,
            remembered: Mutex::new(HashSet::new()),
            lanes: Mutex::new(HashMap::new()),
            checks: Arc::new(tokio::sync::Semaphore::new(PASSWORD_CHECKS)),
        }
    }

    /// Whether `headers` carry the credentials of one of the users. A check waits for
    /// the client's own earlier checks, then for one of the [`PASSWORD_CHECKS`]; each
    /// runs to its end even when its client leaves, holding its places till then.
    async fn allows(&self, headers: &hyper::HeaderMap, client: IpAddr) -> bool {
        let Some((user, password)) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| basic_credentials(v.as_bytes()))
        else {
            return false;
        };
        let key = (user, password);
        if self
            .remembered
            .lock()
            .is_ok_and(|remembered| remembered.contains(&key))
        {
            return true;
        }
        let Some(lane) = self.lane(client) else {
            return false;
        };
        let turn = lane.clone().lock_owned().await;
        let Ok(permit) = self.checks.clone().acquire_owned().await else {
            return false;
        };
        let (hash, known) = match self.users.get(&key.0) {
            Some(hash) => (hash.clone(), true),
            None => (self.decoy.clone(), false),
        };
        let password = key.1.clone();
        let verified = tokio::task::spawn_blocking(move || {
            let verified = bcrypt::verify(&password, &hash).unwrap_or(false);
            drop((turn, permit));
            verified
        })
        .await
        .unwrap_or(false);
        drop(lane);
        let ok = verified && known;
        if ok && let Ok(mut remembered) = self.remembered.lock() {
            if remembered.len() >= REMEMBERED {
                remembered.clear();
            }
            remembered.insert(key);
        }
        ok
    }

    /// `client`'s lane, made if it has none; lanes nobody holds are forgotten once there
    /// are many.
    fn lane(&self, client: IpAddr) -> Option<Arc<tokio::sync::Mutex<()>>> {
        let mut lanes = self.lanes.lock().ok()?;
        if lanes.len() >= LANES {
            lanes.retain(|_, lane| Arc::strong_count(lane) > 1);
        }
        Some(lanes.entry(client).or_default().clone())
    }
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
    use base64::Engine;
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    const STANDARD_ANY_PADDING: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
    );
    STANDARD_ANY_PADDING.decode(text).ok()
}

/// A serving certificate read again when its files change (a renewed Secret), without a
/// restart.
pub struct Certificate {
    cert: PathBuf,
    key: PathBuf,
    seen: (Option<SystemTime>, Option<SystemTime>),
    acceptor: Arc<RwLock<TlsAcceptor>>,
}

impl Certificate {
    /// The certificate of `--tls-cert` and the key of `--tls-key`.
    pub fn load(cert: PathBuf, key: PathBuf) -> Result<Certificate, String> {
        let seen = (modified(&cert), modified(&key));
        let config = crate::tls::plain_server_config(("--tls-cert", &cert), ("--tls-key", &key))?;
        Ok(Certificate {
            cert,
            key,
            seen,
            acceptor: Arc::new(RwLock::new(TlsAcceptor::from(config))),
        })
    }

    /// Reads the files again if they changed; a renewal that cannot be read keeps the
    /// certificate in use (and says so).
    fn refresh(&mut self, name: &str) {
        let now = (modified(&self.cert), modified(&self.key));
        if now == self.seen {
            return;
        }
        self.seen = now;
        match crate::tls::plain_server_config(("--tls-cert", &self.cert), ("--tls-key", &self.key))
        {
            Ok(config) => {
                if let Ok(mut acceptor) = self.acceptor.write() {
                    *acceptor = TlsAcceptor::from(config);
                }
                say(format!("{name}: serving the renewed certificate"));
            }
            Err(e) => say(format!("{name}: keeping the certificate in use: {e}")),
        }
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
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
        assert_eq!(base64("YQ=="), Some(b"a".to_vec()));
        assert_eq!(base64("Y"), None);
    }

    #[test]
    fn the_connection_cap_fits_under_the_descriptor_limit() {
        assert_eq!(connection_cap(8192, 20000), 8192);
        assert_eq!(connection_cap(8192, 1024), 896);
        assert_eq!(connection_cap(8192, 10), 1);
    }

    #[test]
    fn a_client_is_an_ipv4_address_or_an_ipv6_slash_64() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(client_of(ip("10.1.2.3")), ip("10.1.2.3"));
        assert_eq!(client_of(ip("::ffff:10.1.2.3")), ip("10.1.2.3"));
        assert_eq!(
            client_of(ip("2001:db8:1:2:aa:bb:cc:dd")),
            ip("2001:db8:1:2::")
        );
        assert_eq!(
            client_of(ip("2001:db8:1:2::ff")),
            client_of(ip("2001:db8:1:2::1"))
        );
    }
}
