//! The device's asynchronous events (port down, queue-pair errors, first message on a
//! queue pair) turned into per-peer failures, and the task that reads them.

use std::sync::Arc;

use tokio::io::unix::AsyncFd;
use tokio::sync::watch;

use super::{lock, Inner};
use crate::events;
use crate::link::Link;
use crate::sys;

impl Inner {
    fn on_device_event(&self, event: &events::AsyncEvent) {
        let dev = &self.dev;
        let fail = |link: &Arc<Link>, reason: &str| {
            tracing::warn!(peer = %link.peer, device = %dev.name, %reason, "RDMA link failed");
            let _ = self.fail_tx.send((link.peer, link.id, reason.to_string()));
        };
        match events::decide(&dev.name, dev.port, event) {
            events::Action::FailQueuePair { qp_num, reason } => {
                let links: Vec<Arc<Link>> = lock(&self.by_id).values().cloned().collect();
                match links.iter().find(|l| l.qp_number() == qp_num) {
                    Some(link) => fail(link, &reason),
                    None => tracing::debug!(qp_num, %reason, "event for a queue pair already gone"),
                }
            }
            events::Action::Established { qp_num } => self.on_established(qp_num),
            events::Action::FailAll(reason) => {
                tracing::error!(device = %dev.name, %reason, "RDMA device event: failing every link");
                let links: Vec<Arc<Link>> = lock(&self.by_id).values().cloned().collect();
                for link in &links {
                    fail(link, &reason);
                }
            }
            events::Action::Log {
                warn: true,
                message,
            } => tracing::warn!("{message}"),
            events::Action::Log {
                warn: false,
                message,
            } => tracing::info!("{message}"),
        }
    }
}

/// Turns the device's asynchronous events into per-peer failures (see [`events::decide`]).
pub(super) async fn device_event_loop(
    inner: Arc<Inner>,
    fd: AsyncFd<sys::verbs::AsyncEventFd>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            ready = fd.readable() => {
                let Ok(mut guard) = ready else { return };
                while let Some(event) = sys::verbs::next_async_event(&inner.dev.ctx) {
                    inner.on_device_event(&event);
                }
                guard.clear_ready();
            }
            _ = stop.changed() => return,
        }
    }
}
