//! What the exporter serves on the command line's HTTP server ([`crate::http`]): the
//! figures at `/metrics`, gathered by one thread of their own, one gathering shared by
//! the scrapes that wait for it; a panic there is a 500, never the end of the server.

use std::sync::mpsc;

use hyper::body::Bytes;
use hyper::{Request, StatusCode};

use crate::http::{Answer, Peer, Site, TEXT, reply};
use crate::say;

/// Scrapes that may wait for a gathering at once; beyond, 503.
const WAITING_SCRAPES: usize = 256;

/// Asks the gathering thread for the exposition text.
pub type Gather = mpsc::SyncSender<tokio::sync::oneshot::Sender<Option<Vec<u8>>>>;

/// The exporter's pages.
pub struct Metrics {
    pub gather: Gather,
}

impl Site for Metrics {
    async fn answer(&self, request: Request<Bytes>, _peer: Peer) -> Answer {
        route(self, &request).await
    }
}

async fn route(site: &Metrics, request: &Request<Bytes>) -> Answer {
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

/// The gathering thread: one gathering at a time, its text handed to every scrape that
/// waited for it. A panic while gathering is a 500 for those scrapes, not the end.
/// `setup` runs on that thread and returns the maker of the text (which may hold what
/// cannot leave the thread, such as NVML's handle).
pub fn gatherer<F: Fn() -> Vec<u8>>(setup: impl FnOnce() -> F + Send + 'static) -> Gather {
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
