//! `PS_RESEND`'s driver. Every node loop sends and receives through a [`Link`].
//!
//! Without `PS_RESEND`, a link is exactly [`wire::send`] and [`wire::recv`]. With it, messages
//! between registered nodes carry an [`Envelope`] and go through the I/O-free
//! [`Resender`](crate::proto::resend::Resender):
//!
//! - [`Link::send`] copies the message into the peer's window (waiting while the window is
//!   full) and sends it; if the connection is gone the message stays in the window and goes
//!   out again once the connection is back.
//! - [`Link::recv`] takes acknowledgements, drops duplicates, and hides a lost connection
//!   from the node while it is re-established: the link redials the peer at its address from
//!   the job's node list (the peer may dial back too; the transport keeps one connection).
//!   Only when the connection stays lost, or a message stays unacknowledged, past the retry
//!   limit does the node see [`Received::Lost`], so what depends on the peer fails with an
//!   error naming it instead of hanging.
//! - A timer task sends resends and acknowledgements that are due, one sender task per peer
//!   so that a peer that stops reading holds up only itself.
//!
//! Registration (before a node has its id) stays bare: the provisional ids do not outlive it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use psnet_transport::device::copy_all;
use psnet_transport::{CodecError, Event, NodeId, OutMessage, Segment, Transport, TransportError};
use tokio::sync::Notify;
use tokio::task::AbortHandle;

use crate::error::KvError;
use crate::proto::ids::{self, describe};
use crate::proto::msg::{self, Envelope, Msg, NodeInfo, ENVELOPE_LEN};
use crate::proto::resend::{Delivery, GaveUp, ResendConfig, Resender, SendError, Stats, Transmit};
use crate::wire::{self, Received};

mod tasks;

use tasks::{pump, reconnect, sender};

/// A node's way to its peers: the transport, with `PS_RESEND` when configured.
pub struct Link<T: Transport> {
    inner: Arc<Inner<T>>,
}

struct Inner<T> {
    t: Arc<T>,
    resend: Option<Resend>,
}

struct Resend {
    state: Mutex<State>,
    /// Wakes the timer task: a timer may have moved earlier, or something became due.
    pump: Notify,
    /// Wakes `recv`: a peer was given up.
    lost_ready: Notify,
    /// Wakes senders waiting for window space.
    window: Notify,
    /// Wakes sends blocked on a peer that was just given up.
    gave_up: Notify,
}

struct State {
    resender: Resender,
    addrs: HashMap<NodeId, SocketAddr>,
    /// Peers given up, for `recv` to report.
    lost: VecDeque<(NodeId, String)>,
    /// Peers with a sender task running.
    senders: HashSet<NodeId>,
    /// Peers with a reconnect task running.
    reconnecting: HashSet<NodeId>,
    tasks: Vec<AbortHandle>,
    closed: bool,
}

impl Resend {
    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding it; a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lets the timer task recompute its deadline if the state asks for it.
    fn wake(&self, s: &mut State) {
        if s.resender.take_wake() {
            self.pump.notify_one();
        }
    }
}

impl State {
    fn spawn(&mut self, task: impl Future<Output = ()> + Send + 'static) {
        if self.closed {
            return;
        }
        let handle = tokio::spawn(task).abort_handle();
        self.tasks.retain(|t| !t.is_finished());
        self.tasks.push(handle);
    }
}

impl<T: Transport> Drop for Link<T> {
    fn drop(&mut self) {
        self.inner.stop_tasks();
    }
}

impl<T: Transport> Link<T> {
    /// A link over `t`; `resend`: `PS_RESEND` with this timeout (None: off). With `PS_RESEND`
    /// it runs a task on the current tokio runtime until the link is dropped or closed.
    pub fn new(t: Arc<T>, resend: Option<Duration>) -> Self {
        let resend = resend.map(|timeout| Resend {
            state: Mutex::new(State {
                resender: Resender::new(ResendConfig::new(timeout)),
                addrs: HashMap::new(),
                lost: VecDeque::new(),
                senders: HashSet::new(),
                reconnecting: HashSet::new(),
                tasks: Vec::new(),
                closed: false,
            }),
            pump: Notify::new(),
            lost_ready: Notify::new(),
            window: Notify::new(),
            gave_up: Notify::new(),
        });
        let inner = Arc::new(Inner { t, resend });
        if let Some(r) = &inner.resend {
            r.lock().spawn(pump(inner.clone()));
        }
        Link { inner }
    }

    /// The transport.
    pub fn transport(&self) -> &Arc<T> {
        &self.inner.t
    }

    /// `PS_RESEND`'s counters (None when off).
    pub fn resend_stats(&self) -> Option<Stats> {
        self.inner
            .resend
            .as_ref()
            .map(|r| r.lock().resender.stats())
    }

    /// Where `peer` listens, for redialling it after a lost connection.
    pub fn learn(&self, peer: NodeId, addr: SocketAddr) {
        if let Some(r) = &self.inner.resend {
            if peer != self.inner.t.local_id() {
                r.lock().addrs.insert(peer, addr);
            }
        }
    }

    /// `node` was restarted and took its id back: it listens at a new address, and with
    /// `PS_RESEND` its sequence numbers start again, so whatever this link had in flight
    /// with the old process is forgotten (the kv calls send their requests again).
    pub fn rejoined(&self, node: &NodeInfo) {
        if let Some(r) = &self.inner.resend {
            let mut s = r.lock();
            s.addrs.insert(node.id, node.addr);
            s.resender.forget_peer(node.id);
            s.lost.retain(|(peer, _)| *peer != node.id);
        }
    }

    /// [`Link::learn`] for every node of the job.
    pub fn learn_nodes(&self, nodes: &[NodeInfo]) {
        for n in nodes {
            self.learn(n.id, n.addr);
        }
    }

    /// With `PS_RESEND`, waits until every message sent is acknowledged (or its peer given
    /// up), at most until `deadline`: the last words of a node (the scheduler's shutdown)
    /// must survive a connection reset as any other message does. At once without it.
    pub async fn flush(&self, deadline: tokio::time::Instant) {
        let Some(r) = &self.inner.resend else {
            return;
        };
        let poll = r.lock().resender.config().give_up_after() / 50;
        while r.lock().resender.unacked_total() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(poll.max(std::time::Duration::from_millis(1))).await;
        }
    }

    /// Stops the link's tasks and shuts the transport down.
    pub fn close(&self) {
        self.inner.stop_tasks();
        self.inner.t.shutdown();
    }

    fn reliable_to(&self, peer: NodeId) -> Option<&Resend> {
        self.inner
            .resend
            .as_ref()
            .filter(|_| !ids::is_provisional(peer))
    }

    /// Sends `msg` with an optional value segment. With `PS_RESEND`, `Ok` means the message
    /// is in the peer's window: it will be delivered exactly once, or the peer given up.
    pub async fn send(&self, to: NodeId, msg: &Msg, value: Option<&[u8]>) -> Result<(), KvError> {
        self.send_segment(to, msg, value.map(Segment::new)).await
    }

    /// [`send`](Self::send) with the value as a segment (host or device memory). With
    /// `PS_RESEND` the value is copied to the host once, as host values are, to send again.
    pub async fn send_segment(
        &self,
        to: NodeId,
        msg: &Msg,
        value: Option<Segment<'_>>,
    ) -> Result<(), KvError> {
        let Some(r) = self.reliable_to(to) else {
            return wire::send_segment(&*self.inner.t, to, msg, value).await;
        };
        let meta = Bytes::from(msg.encode());
        self.inner
            .check_limits(to, meta.len(), value.map_or(0, |v| v.len()))?;
        let value = match value {
            None => None,
            Some(v) => Some(match (v.host(), v.device_bytes()) {
                (Some(host), _) => Bytes::copy_from_slice(host),
                (None, Some(device)) => Bytes::from(
                    copy_all(device)
                        .await
                        .map_err(|source| TransportError::Device { peer: to, source })?,
                ),
                (None, None) => Bytes::new(),
            }),
        };
        let tx = loop {
            let freed = r.window.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            {
                let mut s = r.lock();
                match s
                    .resender
                    .send(to, meta.clone(), value.clone(), crate::clock::now())
                {
                    Ok(tx) => {
                        r.wake(&mut s);
                        break tx;
                    }
                    Err(SendError::Failed(reason)) => {
                        return Err(KvError::NodeLost {
                            node: describe(to),
                            reason,
                        })
                    }
                    Err(SendError::Full) => {
                        tracing::trace!(to = %describe(to), "PS_RESEND window full, waiting");
                    }
                }
            }
            freed.await;
        };
        tracing::trace!(
            to = %describe(to),
            ?msg,
            seq = tx.seq,
            bytes = tx.value.as_ref().map_or(0, Bytes::len),
            "send"
        );
        self.inner.transmit(tx).await
    }

    /// The next event for the node, decoded. With `PS_RESEND`: duplicates and
    /// acknowledgements are consumed here, a lost connection is reported only once the peer
    /// is given up. Cancel-safe.
    pub async fn recv(&self) -> Result<Received, KvError> {
        let Some(r) = &self.inner.resend else {
            return wire::recv(&*self.inner.t).await;
        };
        loop {
            let lost = r.lost_ready.notified();
            tokio::pin!(lost);
            lost.as_mut().enable();
            if let Some((peer, reason)) = r.lock().lost.pop_front() {
                return Ok(Received::Lost { peer, reason });
            }
            let event = tokio::select! {
                event = self.inner.t.recv() => event?,
                _ = &mut lost => continue,
            };
            if let Some(received) = self.inner.on_event(event) {
                return Ok(received);
            }
        }
    }
}

impl<T: Transport> Inner<T> {
    fn resend(&self) -> &Resend {
        self.resend.as_ref().expect("only called with PS_RESEND on")
    }

    fn stop_tasks(&self) {
        if let Some(r) = &self.resend {
            let mut s = r.lock();
            s.closed = true;
            for t in s.tasks.drain(..) {
                t.abort();
            }
        }
    }

    /// Refuses, before it takes a sequence number, a message the transport would refuse.
    fn check_limits(&self, to: NodeId, meta: usize, value: usize) -> Result<(), KvError> {
        let caps = self.t.capabilities();
        let meta = (meta + ENVELOPE_LEN) as u64;
        let total = meta.saturating_add(value as u64);
        let source = if meta > u64::from(caps.max_meta) {
            CodecError::MetaTooLarge {
                len: meta,
                limit: caps.max_meta,
            }
        } else if total > caps.max_message {
            CodecError::MessageTooLarge {
                len: total,
                limit: caps.max_message,
            }
        } else {
            return Ok(());
        };
        Err(KvError::Transport(TransportError::Invalid {
            peer: to,
            source,
        }))
    }

    /// Sends a transmit; a lost connection keeps it for resending.
    async fn transmit(self: &Arc<Self>, tx: Transmit) -> Result<(), KvError> {
        let r = self.resend();
        let peer = tx.peer;
        let meta = Envelope {
            seq: tx.seq,
            ack: Some(tx.ack),
        }
        .encode(&tx.meta);
        let seg;
        let segs: &[Segment<'_>] = match &tx.value {
            Some(v) => {
                seg = [Segment::new(v)];
                &seg
            }
            None => &[],
        };
        let send = self.t.send(peer, OutMessage::new(&meta, segs));
        tokio::pin!(send);
        let result = loop {
            let gave_up = r.gave_up.notified();
            tokio::pin!(gave_up);
            gave_up.as_mut().enable();
            if let Some(reason) = r.lock().resender.failure(peer) {
                // A send to a peer given up must not hang on it (dropping it closes that
                // connection, which is fine now).
                return Err(KvError::NodeLost {
                    node: describe(peer),
                    reason: reason.to_string(),
                });
            }
            tokio::select! {
                result = &mut send => break result,
                _ = &mut gave_up => {}
            }
        };
        match result {
            Ok(()) => Ok(()),
            Err(e @ (TransportError::NotConnected { .. } | TransportError::PeerLost { .. })) => {
                // It stays in the window and goes out again once the connection is back.
                self.on_down(peer, &e.to_string());
                Ok(())
            }
            Err(TransportError::Closed) => Err(KvError::Transport(TransportError::Closed)),
            Err(e) => {
                // Never deliverable, and its number would leave a hole: give the peer up.
                let mut s = r.lock();
                s.resender
                    .fail_peer(peer, format!("a message could not be sent: {e}"));
                r.wake(&mut s);
                Err(KvError::Transport(e))
            }
        }
    }

    /// Starts a sender task for `peer` if it has something to send now and none runs.
    fn kick(self: &Arc<Self>, s: &mut State, peer: NodeId, now: Instant) {
        if s.resender.has_transmit(peer, now) && s.senders.insert(peer) {
            s.spawn(sender(self.clone(), peer));
        }
    }

    /// The connection to `peer` is gone: redial it if we know where it listens.
    fn on_down(self: &Arc<Self>, peer: NodeId, reason: &str) {
        let r = self.resend();
        let mut s = r.lock();
        if s.resender
            .handle_peer_lost(peer, reason, crate::clock::now())
        {
            tracing::info!(peer = %describe(peer), %reason, "connection lost; re-establishing it (PS_RESEND)");
            let addr = s.addrs.get(&peer).copied();
            if let Some(addr) = addr {
                if s.reconnecting.insert(peer) {
                    let deadline = crate::clock::now() + s.resender.config().give_up_after();
                    s.spawn(reconnect(self.clone(), peer, addr, deadline));
                }
            }
        }
        r.wake(&mut s);
    }

    /// Handles one transport event; returns what the node must see, if anything.
    fn on_event(self: &Arc<Self>, event: Event) -> Option<Received> {
        let r = self.resend();
        match event {
            Event::Message(m) => {
                let (envelope, body) = match msg::split_frame(&m.meta) {
                    Ok(split) => split,
                    Err(e) => {
                        // Without a readable envelope there is no sequence number to take:
                        // the sender resends until it gives this node up, and its requests
                        // then fail naming it.
                        tracing::warn!(from = %describe(m.peer), error = %e, "dropping a message with a malformed PS_RESEND envelope");
                        return None;
                    }
                };
                let from = m.peer;
                let Some(envelope) = envelope else {
                    // Bare: registration, or a peer without PS_RESEND.
                    return Some(wire::decode(from, &m.meta, m.segments.into_iter()));
                };
                let len = m.meta.len() + m.segments.iter().map(Bytes::len).sum::<usize>();
                let now = crate::clock::now();
                let mut s = r.lock();
                let freed = envelope
                    .ack
                    .map_or(0, |ack| s.resender.handle_ack(from, ack));
                let delivery = envelope
                    .seq
                    .map(|seq| (seq, s.resender.handle_incoming(from, seq, len, now)));
                self.kick(&mut s, from, now);
                r.wake(&mut s);
                drop(s);
                if freed > 0 {
                    r.window.notify_waiters();
                }
                match (delivery, body) {
                    // Delivered once, readable or not: a message that does not decode is
                    // still answered, never resent.
                    (Some((_, Delivery::Deliver)), Some(body)) => {
                        Some(wire::decode(from, body, m.segments.into_iter()))
                    }
                    (Some((seq, d)), _) => {
                        tracing::debug!(from = %describe(from), seq, delivery = ?d, "PS_RESEND: dropping a message already delivered");
                        None
                    }
                    (None, _) => {
                        tracing::trace!(from = %describe(from), ack = envelope.ack, "ack");
                        None
                    }
                }
            }
            Event::PeerConnected { peer, addr } => {
                if !ids::is_provisional(peer) {
                    let mut s = r.lock();
                    s.resender.handle_peer_connected(peer);
                    let unacked = s.resender.unacked(peer);
                    self.kick(&mut s, peer, crate::clock::now());
                    if unacked > 0 {
                        tracing::debug!(peer = %describe(peer), %addr, unacked, "connected; resending what is unacknowledged (PS_RESEND)");
                    }
                }
                Some(Received::Connected(peer))
            }
            Event::PeerLost { peer, reason } => {
                if ids::is_provisional(peer) {
                    return Some(Received::Lost { peer, reason });
                }
                // Possibly transient: reported only if the peer is given up.
                self.on_down(peer, &reason);
                None
            }
        }
    }
}
