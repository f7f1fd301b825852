//! Connecting queue pairs: the `connect` loop (requests, their repetition, the fall-back
//! from rdma_cm to sockets), the control loop (control connections, rdma_cm events, link
//! failures), and what both handshakes share: installing a link built on a peer's request,
//! settling simultaneous requests, announcing a link. The handshakes themselves are
//! `socket.rs` (over the TCP control connection) and `rdma_cm.rs`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use psnet_transport::{Event, NodeId, Transport, TransportError};
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch};

use super::{lock, random_u64, Current, Handshake, Inner, Phase};
use crate::control::{self, Control, OwnLink};
use crate::link::Link;
use crate::rdmacm::CmChannel;

mod rdma_cm;
mod socket;

pub(super) use rdma_cm::{listen_cm, CmState};

/// How often an unanswered queue-pair request is repeated.
const REQUEST_RESEND: Duration = Duration::from_millis(300);
/// With `PSNET_RDMA_CONNECT=auto`: how long an rdma_cm connection may take before the queue
/// pair is connected over the TCP control connection instead. rdma_cm's own retry of a lost
/// request comes after about 4 s.
const CM_FALLBACK: Duration = Duration::from_secs(6);

impl Inner {
    /// [`Transport::connect`]: connects the control connection, then the queue pair (rdma_cm
    /// or sockets, as configured), and waits until it is ready, the handshake fails, or the
    /// connect timeout passes.
    pub(super) async fn connect_peer(
        &self,
        peer: NodeId,
        addr: SocketAddr,
    ) -> Result<(), TransportError> {
        let inner = self;
        if inner.is_closed() {
            return Err(TransportError::Closed);
        }
        inner.tcp.connect(peer, addr).await?;
        let timeout = inner.config.tcp.connect_timeout.max(Duration::from_secs(1));
        let deadline = tokio::time::Instant::now() + timeout;
        let mut resend_at = tokio::time::Instant::now() + REQUEST_RESEND;
        let fallback_at = tokio::time::Instant::now() + CM_FALLBACK;
        let mut mine: Option<Arc<Link>> = None;
        loop {
            let notified = inner.links_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if inner.is_closed() {
                return Err(TransportError::Closed);
            }
            let mut start_cm = None;
            let mut abandon_cm = None;
            let request = {
                let mut links = lock(&inner.links);
                if let Some(c) = links.get_mut(&peer) {
                    if c.via_cm
                        && inner.cm_fallback
                        && c.phase == Phase::Requested
                        && tokio::time::Instant::now() >= fallback_at
                        && c.link.failure().is_none()
                    {
                        // Seen on Soft-RoCE after its interface went down and up: rdma_cm's
                        // messages are lost while queue pairs still work.
                        tracing::warn!(%peer, %addr, "rdma_cm did not connect within {CM_FALLBACK:?}; \
                            connecting the queue pair over the TCP control connection instead \
                            (PSNET_RDMA_CONNECT=rdma_cm never does)");
                        c.via_cm = false;
                        abandon_cm = Some(c.link.id);
                        resend_at = tokio::time::Instant::now();
                    }
                }
                match links.get(&peer) {
                    Some(c) if c.link.is_ready() => return Ok(()),
                    Some(c) => match c.link.failure() {
                        Some(reason) => {
                            return Err(TransportError::Handshake { peer, reason });
                        }
                        // Checked every REQUEST_RESEND: the peer may have refused for now
                        // (its own request crossed ours, or its control connection was not
                        // up yet); then ask again.
                        None if c.via_cm => {
                            let now = tokio::time::Instant::now();
                            if now >= resend_at {
                                resend_at = now + REQUEST_RESEND;
                                if c.phase == Phase::Requested && !inner.cm_pending(c.link.id) {
                                    start_cm = Some(c.link.clone());
                                }
                            }
                            None
                        }
                        // Our request may have gone out on a connection a simultaneous
                        // connect closed: repeat it now and then.
                        None if c.phase == Phase::Requested
                            && tokio::time::Instant::now() >= resend_at =>
                        {
                            resend_at = tokio::time::Instant::now() + REQUEST_RESEND;
                            Some(Control::Request {
                                nonce: c.link.nonce,
                                info: c.link.local_info(),
                            })
                        }
                        // Our reply or the peer's confirmation may have been lost the same way.
                        None if tokio::time::Instant::now() >= resend_at => {
                            resend_at = tokio::time::Instant::now() + REQUEST_RESEND;
                            c.answered.map(|(_, reply)| reply)
                        }
                        None => None,
                    },
                    None => {
                        // The link this call made failed and is gone already (an rdma_cm
                        // refusal is handled by the control loop): report it, do not retry.
                        if let Some(reason) = mine.as_ref().and_then(|l: &Arc<Link>| l.failure()) {
                            return Err(TransportError::Handshake { peer, reason });
                        }
                        if !inner.tcp.connected_peers().contains(&peer) {
                            return Err(TransportError::Handshake {
                                peer,
                                reason: "control connection closed during the RDMA handshake"
                                    .into(),
                            });
                        }
                        let link = inner
                            .new_link(peer, random_u64())
                            .map_err(|e| e.into_handshake(peer))?;
                        mine = Some(link.clone());
                        let info = link.local_info();
                        let nonce = link.nonce;
                        let via_cm = inner.config.handshake == Handshake::RdmaCm;
                        if via_cm {
                            start_cm = Some(link.clone());
                        }
                        links.insert(
                            peer,
                            Current {
                                link,
                                phase: Phase::Requested,
                                announced: false,
                                answered: None,
                                via_cm,
                            },
                        );
                        (!via_cm).then_some(Control::Request { nonce, info })
                    }
                }
            };
            if let Some(link) = abandon_cm {
                inner.drop_cm_of_link(link);
            }
            if let Some(link) = start_cm {
                if let Err(e) = inner.start_cm_connect(peer, addr, &link) {
                    inner.remove_link(peer, Some(link.id), &e.to_string());
                    return Err(e.into_handshake(peer));
                }
                continue;
            }
            if let Some(req) = request {
                if let Err(e) = inner.send_control(peer, req).await {
                    inner.remove_link(peer, None, "control connection lost");
                    return Err(e);
                }
                continue;
            }
            let wake = resend_at.min(deadline);
            if tokio::time::timeout_at(wake, notified).await.is_err()
                && tokio::time::Instant::now() >= deadline
            {
                return Err(TransportError::Handshake {
                    peer,
                    reason: format!("RDMA queue-pair handshake timed out after {timeout:?}"),
                });
            }
        }
    }

    /// Makes `answer` (a link built on the peer's request with `nonce`) the peer's link and
    /// retires the one it replaces, in one lock hold: a `connect` racing with us never sees
    /// the peer without a link (it would start a request of its own). Unless a link that
    /// wins over the request is there (ours, requested with a larger nonce, or one already
    /// connected): then the new link is dropped and this returns false.
    fn install_answer(&self, peer: NodeId, nonce: u64, answer: Current) -> bool {
        let link = answer.link.clone();
        let old = {
            let mut links = lock(&self.links);
            if links.get(&peer).is_some_and(|c| beats_request(c, nonce)) {
                None
            } else {
                Some(links.insert(peer, answer))
            }
        };
        let Some(old) = old else {
            link.fail("superseded during the handshake");
            lock(&self.by_id).remove(&link.id);
            return false;
        };
        if let Some(old) = old {
            old.link.fail("replaced by a new queue pair");
            lock(&self.by_id).remove(&old.link.id);
            self.drop_cm_of_link(old.link.id);
        }
        true
    }

    fn announce(&self, peer: NodeId) {
        let addr = lock(&self.addrs)
            .get(&peer)
            .copied()
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        tracing::debug!(%peer, %addr, "RDMA link up");
        self.inbox.push_event(Event::PeerConnected { peer, addr });
    }
}

/// Whether the peer's link `c` wins over a request (with `nonce`) from the peer.
fn beats_request(c: &Current, nonce: u64) -> bool {
    let own = match c.phase {
        Phase::Requested => OwnLink::Requested(c.link.nonce),
        Phase::Connected => OwnLink::Connected,
    };
    !control::answers_request(own, nonce)
}

/// Handles the control connections' events, rdma_cm's events and link failures, in one task:
/// a peer's new control connection is seen before its rdma_cm request (which follows it).
pub(super) async fn control_loop(
    inner: Arc<Inner>,
    mut failures: mpsc::UnboundedReceiver<(NodeId, u32, String)>,
    cm_fd: Option<AsyncFd<Arc<CmChannel>>>,
    mut stop: watch::Receiver<bool>,
) {
    let cm_readable = || async {
        match &cm_fd {
            Some(fd) => fd.readable().await.ok(),
            None => std::future::pending().await,
        }
    };
    loop {
        tokio::select! {
            biased;
            event = inner.tcp.recv() => match event {
                Ok(Event::PeerConnected { peer, addr }) => {
                    lock(&inner.addrs).insert(peer, addr);
                    // A new control connection replaced the one a connected link belonged to
                    // (the peer disconnected and dialled again): that queue pair is gone too.
                    let stale = lock(&inner.links)
                        .get(&peer)
                        .filter(|c| c.phase == Phase::Connected)
                        .map(|c| c.link.id);
                    if let Some(id) = stale {
                        let reason = "the peer reconnected";
                        if inner.remove_link(peer, Some(id), reason) == Some(true) {
                            inner.inbox.push_event(Event::PeerLost { peer, reason: reason.into() });
                        }
                    }
                }
                Ok(Event::Message(m)) => match Control::decode(&m.meta) {
                    Some(msg) => inner.on_control(m.peer, msg).await,
                    None => {
                        tracing::warn!(peer = %m.peer, "malformed RDMA control message; closing");
                        inner.drop_control(m.peer);
                        if inner.remove_link(m.peer, None, "malformed control message") == Some(true) {
                            inner.inbox.push_event(Event::PeerLost {
                                peer: m.peer,
                                reason: "malformed RDMA control message".into(),
                            });
                        }
                    }
                },
                Ok(Event::PeerLost { peer, reason }) => {
                    // Marks the peer as having no control connection this loop has seen
                    // (see `on_cm_request`).
                    lock(&inner.addrs).remove(&peer);
                    if inner.remove_link(peer, None, &reason) == Some(true) {
                        inner.inbox.push_event(Event::PeerLost { peer, reason });
                    }
                }
                Err(_) => return,
            },
            Some(mut guard) = cm_readable() => {
                let channel = guard.get_inner().clone();
                guard.clear_ready();
                while let Some(event) = channel.next_event() {
                    match event {
                        Ok(event) => inner.on_cm_event(event),
                        Err(e) => {
                            tracing::error!(error = %e, "reading rdma_cm events failed");
                            break;
                        }
                    }
                }
            }
            Some((peer, id, reason)) = failures.recv() => {
                if inner.remove_link(peer, Some(id), &reason) == Some(true) {
                    inner.drop_control(peer);
                    inner.inbox.push_event(Event::PeerLost { peer, reason });
                }
            }
            _ = stop.changed() => return,
        }
    }
}
