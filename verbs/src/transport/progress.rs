//! Completion polling: draining the completion queue every queue pair shares into the
//! links, pumping them, and the poller task that spins briefly and then sleeps on the
//! completion channel.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::sync::watch;

use super::{lock, Inner};
use crate::link::{self, Link};
use crate::sys;

/// Polls of an empty completion queue before sleeping on the completion channel, at least
/// (the time budget `spin_us` usually allows more).
const SPIN_POLLS: u32 = 64;

impl Inner {
    /// Handles every completion waiting in the queue; returns how many there were. Waits for
    /// a concurrent poll to finish, so that nothing queued before the call is left behind.
    pub(super) fn drain_completions(&self) -> usize {
        let _polling = lock(&self.poll_gate);
        self.drain_polled()
    }

    /// As [`Inner::drain_completions`], unless someone else is polling right now.
    pub(super) fn try_drain_completions(&self) -> usize {
        match self.poll_gate.try_lock() {
            Ok(_polling) => self.drain_polled(),
            Err(_) => 0,
        }
    }

    fn drain_polled(&self) -> usize {
        let mut touched: Vec<Arc<Link>> = Vec::new();
        let handled = sys::verbs::poll(&self.dev.cq, |wc| {
            let (link_id, kind, index) = link::split_wr_id(wc.wr_id());
            let Some(kind) = kind else { return };
            let link = match touched.iter().find(|l| l.id == link_id) {
                Some(l) => l.clone(),
                None => match lock(&self.by_id).get(&link_id) {
                    Some(l) => {
                        touched.push(l.clone());
                        l.clone()
                    }
                    // A completion of a link already torn down.
                    None => return,
                },
            };
            let full = self.inbox.full();
            let completion = link::Completion { kind, index, wc };
            if let Err(e) = link.on_completion(completion, full) {
                self.fail_link(&link, e.to_string());
            }
        });
        for link in touched {
            self.pump(&link);
        }
        handled
    }

    fn pump(&self, link: &Arc<Link>) {
        let progress = link.pump(self.inbox.full());
        for m in progress.delivered {
            self.inbox.push_message(m);
        }
        if let Some(e) = progress.failure {
            self.fail_link(link, e.to_string());
        }
    }

    fn pump_all(&self) {
        let links: Vec<Arc<Link>> = lock(&self.by_id).values().cloned().collect();
        for link in links {
            self.pump(&link);
        }
    }
}

pub(super) async fn poll_loop(
    inner: Arc<Inner>,
    fd: AsyncFd<Arc<sideway::ibverbs::completion::CompletionChannel>>,
    mut stop: watch::Receiver<bool>,
) {
    let spin = Duration::from_micros(inner.config.spin_us);
    let mut idle = 0u32;
    let mut last_work = Instant::now();
    loop {
        if *stop.borrow() {
            return;
        }
        if inner.drain_completions() > 0 {
            idle = 0;
            last_work = Instant::now();
            tokio::task::yield_now().await;
            continue;
        }
        // Keep polling a while after the last completion: an answer to what was just sent
        // usually comes within a round trip, and sleeping on the channel costs wake-ups.
        if idle < SPIN_POLLS || last_work.elapsed() < spin {
            idle += 1;
            tokio::task::yield_now().await;
            continue;
        }
        if let Err(e) = sys::verbs::req_notify(&inner.dev.cq) {
            tracing::error!(error = %e, "cannot arm the completion queue");
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        }
        // A completion that arrived before arming raises no event: look once more.
        if inner.drain_completions() > 0 {
            idle = 0;
            continue;
        }
        tokio::select! {
            ready = fd.readable() => {
                if let Ok(mut guard) = ready {
                    sys::verbs::drain_cq_events(fd.get_ref());
                    guard.clear_ready();
                }
            }
            _ = inner.drained.notified() => inner.pump_all(),
            _ = stop.changed() => return,
        }
        idle = 0;
    }
}
