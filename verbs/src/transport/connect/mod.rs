//! Drivers of connection set-up: the `connect` loop, the control loop (control connections,
//! rdma_cm events, link failures), and what both handshakes share: acting on an installed
//! answer, announcing a link. Every decision (requests and their repetition, the fall-back
//! from rdma_cm to sockets, crossing requests, timeouts) is [`crate::proto::handshake`]'s;
//! these create queue pairs, move the messages and feed the results back. The handshakes'
//! drivers are `socket.rs` (over the TCP control connection) and `rdma_cm.rs`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use psnet_fallback_tcp::PeerSession;
use psnet_transport::session::{Opener, Role, Sealer, Session};
use psnet_transport::{Event, NodeId, Transport, TransportError};
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch};

use super::{lock, random_u64, Handshake, Inner};
use crate::control::Control;
use crate::error::VerbsError;
use crate::link::Link;
use crate::proto::handshake::connect::{Connect, Poll, Step};
use crate::proto::handshake::{LinkHandle, REPLACED, SUPERSEDED};
use crate::qp::QpInfo;
use crate::rdmacm::CmChannel;

mod rdma_cm;
mod socket;

/// The name both ends give a queue pair's keys: the requesting side's link nonce, then the
/// answering side's (each drawn afresh for every link, so no two links share keys).
fn link_channel(requester: u64, answerer: u64) -> String {
    format!("rdma queue pair {requester:016x} {answerer:016x}")
}

impl Inner {
    /// The keys that tag the messages of a queue pair to `peer` named `name`, this side
    /// being `role` (the requesting side the dialler): derived from the session of the control
    /// connection to `peer` where the job has a secret, none where it has not.
    fn link_tags(
        &self,
        peer: NodeId,
        role: Role,
        name: &str,
    ) -> Result<Option<(Sealer, Opener)>, VerbsError> {
        match self.tcp.session_with(peer) {
            PeerSession::Open => Ok(None),
            PeerSession::Keyed(base, _) => Ok(Some(Session::channel(&base, role, name))),
            PeerSession::NotConnected => Err(VerbsError::Protocol(format!(
                "no control connection to {peer} to derive the queue pair's keys from"
            ))),
        }
    }
}

pub(super) use rdma_cm::{listen_cm, CmState};

/// The handshakes read the driver's links through this.
impl LinkHandle for Arc<Link> {
    fn id(&self) -> u32 {
        self.id
    }

    fn nonce(&self) -> u64 {
        self.nonce
    }

    fn local_info(&self) -> QpInfo {
        Link::local_info(self)
    }

    fn is_ready(&self) -> bool {
        Link::is_ready(self)
    }

    fn failure(&self) -> Option<String> {
        Link::failure(self)
    }
}

impl Inner {
    /// [`Transport::connect`]: connects the control connection, then the queue pair (rdma_cm
    /// or sockets, as configured), and waits until it is ready, the handshake fails, or the
    /// connect timeout passes. The decisions are [`Connect`]'s; this moves the messages.
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
        let now = || tokio::time::Instant::now().into_std();
        let mut connect = Connect::new(
            peer,
            addr,
            now(),
            timeout,
            inner.config.handshake == Handshake::RdmaCm,
            inner.cm_fallback,
        );
        loop {
            let notified = inner.links_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if inner.is_closed() {
                return Err(TransportError::Closed);
            }
            let step = {
                let mut links = lock(&inner.links);
                let polled = connect.poll(
                    &mut links,
                    now(),
                    |link| inner.cm_pending(link),
                    || inner.tcp.connected_peers().contains(&peer),
                );
                match polled {
                    Poll::Step(step) => step,
                    // Built under the lock: a request from the peer crossing this one must
                    // find it.
                    Poll::NewLink => {
                        let link = inner
                            .new_link(peer, random_u64())
                            .map_err(|e| e.into_handshake(peer))?;
                        connect.handle_new_link(&mut links, link)
                    }
                }
            };
            match step {
                Step::Done => return Ok(()),
                Step::Fail(reason) => return Err(TransportError::Handshake { peer, reason }),
                Step::StartCm(link) => {
                    if let Err(e) = inner.start_cm_connect(peer, addr, &link) {
                        inner.remove_link(peer, Some(link.id), &e.to_string());
                        return Err(e.into_handshake(peer));
                    }
                }
                Step::Send { msg, abandon_cm } => {
                    if let Some(link) = abandon_cm {
                        inner.drop_cm_of_link(link);
                    }
                    if let Err(e) = inner.send_control(peer, msg).await {
                        inner.remove_link(peer, None, "control connection lost");
                        return Err(e);
                    }
                }
                Step::Wait(until) => {
                    let until = tokio::time::Instant::from_std(until);
                    if tokio::time::timeout_at(until, notified).await.is_err() {
                        if let Some(reason) = connect.handle_timeout(now()) {
                            return Err(TransportError::Handshake { peer, reason });
                        }
                    }
                }
            }
        }
    }

    /// Acts on [`Links::install_answer`]'s verdict on a link built on a peer's request:
    /// retires the link it replaced, or drops it if it was superseded. Returns whether it is
    /// the peer's link now.
    ///
    /// [`Links::install_answer`]: crate::proto::handshake::Links::install_answer
    fn settle_answer(&self, installed: Result<Option<Arc<Link>>, Arc<Link>>) -> bool {
        match installed {
            Err(link) => {
                link.fail(SUPERSEDED);
                lock(&self.by_id).remove(&link.id);
                false
            }
            Ok(retired) => {
                if let Some(old) = retired {
                    old.fail(REPLACED);
                    lock(&self.by_id).remove(&old.id);
                    self.drop_cm_of_link(old.id);
                }
                true
            }
        }
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
                    let stale = lock(&inner.links).handle_control_connected(peer);
                    if let Some((id, reason)) = stale {
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
            Some((peer, id, reason)) = failures.recv() => inner.forget_link(peer, id, reason),
            _ = stop.changed() => return,
        }
    }
}
