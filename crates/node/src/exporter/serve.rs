//! What the exporter serves on the node services' HTTP server ([`crate::http`]): the
//! figures at `/metrics`, gathered by one thread of their own, one gathering shared by
//! the scrapes that wait for it; a panic there is a 500, never the end of the server.
//!
//! On a loopback listener that asks no password, the local user who connects is known
//! (the owner of the client's socket) and sees only the series of their own budgets,
//! unless they are root or the exporter's own user: every user's jobs, pods and
//! namespaces are not every local user's business. Any other listener serves everything
//! to whoever it lets in.

use std::sync::mpsc;

use hyper::body::Bytes;
use hyper::{Request, StatusCode};

use crate::http::{Answer, Peer, Site, TEXT, reply};
use crate::tell::say;

/// Scrapes that may wait for a gathering at once; beyond, 503.
const WAITING_SCRAPES: usize = 256;

/// Who a scrape is for: `None` sees every series, `Some(uid)` that user's only.
pub type Viewer = Option<u32>;

/// One scrape waiting for the exposition text.
type Ask = (Viewer, tokio::sync::oneshot::Sender<Option<Vec<u8>>>);

/// Asks the gathering thread for the exposition text.
pub type Gather = mpsc::SyncSender<Ask>;

/// The exporter's pages.
pub struct Metrics {
    pub gather: Gather,
    /// Scrapes see only their local user's series (a loopback listener, no password).
    pub per_user: bool,
    /// The exporter's own effective uid, which sees every series as root does.
    pub own_uid: u32,
}

impl Metrics {
    /// Who `peer` is, or `None` when it cannot be told (and sees nothing).
    fn viewer(&self, peer: &Peer) -> Option<Viewer> {
        if !self.per_user {
            return Some(None);
        }
        let uid = peer.owner()?;
        Some((uid != 0 && uid != self.own_uid).then_some(uid))
    }
}

impl Site for Metrics {
    async fn answer(&self, request: Request<Bytes>, peer: Peer) -> Answer {
        match request.uri().path() {
            "/metrics" => {
                let Some(viewer) = self.viewer(&peer) else {
                    return reply(
                        StatusCode::FORBIDDEN,
                        TEXT,
                        "cannot tell which local user connected\n",
                    );
                };
                let (tell, told) = tokio::sync::oneshot::channel();
                if self.gather.try_send((viewer, tell)).is_err() {
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
}

/// The gathering thread: one gathering at a time, its text for each viewer handed to
/// every scrape that waited for it. A panic while gathering is a 500 for those scrapes,
/// not the end. `setup` runs on that thread and returns the maker of the texts, one per
/// viewer asked for (it may hold what cannot leave the thread, such as NVML's handle).
pub fn gatherer<F: Fn(&[Viewer]) -> Vec<Vec<u8>>>(
    setup: impl FnOnce() -> F + Send + 'static,
) -> Gather {
    let (tell, asks) = mpsc::sync_channel::<Ask>(WAITING_SCRAPES);
    std::thread::spawn(move || {
        let make = setup();
        while let Ok(first) = asks.recv() {
            let mut waiting = vec![first];
            waiting.extend(asks.try_iter());
            let mut viewers: Vec<Viewer> = waiting.iter().map(|(viewer, _)| *viewer).collect();
            viewers.sort_unstable();
            viewers.dedup();
            let bodies =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| make(&viewers))).ok();
            if bodies.is_none() {
                say("exporter: gathering the figures failed (a bug: please report it)");
            }
            for (viewer, waiter) in waiting {
                let body = bodies.as_ref().and_then(|bodies| {
                    let at = viewers.binary_search(&viewer).ok()?;
                    bodies.get(at).cloned()
                });
                let _ = waiter.send(body);
            }
        }
    });
    tell
}
