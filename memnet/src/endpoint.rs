//! One endpoint of a [`MemNet`]: the transport contract over the shared network state.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use psnet_transport::auth;
use psnet_transport::device::{copy_all, DevicePath, PathLog, DEFAULT_STAGE_CHUNK};
use psnet_transport::placement::{Placer, ReceivePlacing};
use psnet_transport::session::Role;
use psnet_transport::{
    Admission, Binding, Capabilities, CodecError, Event, Incoming, NodeId, OutMessage,
    RegisteredBuf, Transport, TransportError,
};
use smallvec::SmallVec;
use tokio::time::Instant;

use crate::net::{Ending, MemNet, Traffic};

/// An endpoint on a [`MemNet`], implementing [`Transport`]. Dropping it shuts it down.
pub struct MemTransport {
    net: MemNet,
    ep: u64,
    addr: SocketAddr,
    device_paths: PathLog,
    /// Received segments placed in device memory (`Transport::set_placer`).
    placing: ReceivePlacing,
}

/// What a waiting call does after looking at the network.
enum Step<T> {
    Done(T),
    /// Wait for a change, or until the instant.
    Wait(Option<Instant>),
}

impl MemTransport {
    pub(crate) fn new(net: MemNet, ep: u64, addr: SocketAddr) -> Self {
        MemTransport {
            net,
            ep,
            addr,
            device_paths: PathLog::default(),
            placing: ReceivePlacing::new("mem", DEFAULT_STAGE_CHUNK),
        }
    }

    /// The next event, as the network delivers it.
    async fn next_event(&self) -> Result<Event, TransportError> {
        self.until(|net, ep| {
            net.pump();
            let modelled = net.wires.is_some();
            let landing = net.next_landing();
            let Some(me) = net.ep(ep).filter(|e| !e.closed) else {
                return Step::Done(Err(TransportError::Closed));
            };
            if me.frozen {
                return Step::Wait(None);
            }
            match me.next_visible(modelled) {
                Ok(i) => {
                    let q = me.inbox.remove(i).expect("index from the inbox");
                    me.inbox_bytes -= q.bytes;
                    if matches!(q.event, Event::Message(_)) {
                        me.traffic.received_messages += 1;
                        me.traffic.received_bytes += q.bytes as u64;
                    }
                    Step::Done(Ok(q.event))
                }
                // Whatever comes first: the next entry visible, or the links landing one.
                Err(at) => Step::Wait(match (at, landing) {
                    (Some(a), Some(l)) => Some(a.min(l)),
                    (a, l) => a.or(l),
                }),
            }
        })
        .await
    }

    /// The network this endpoint is on.
    pub fn net(&self) -> &MemNet {
        &self.net
    }

    /// Bytes of every message this endpoint has sent so far, metadata included: what a
    /// protocol puts on the wire, counted by the network.
    pub fn bytes_sent(&self) -> u64 {
        self.traffic().sent_bytes
    }

    /// Messages and bytes this endpoint has sent and received so far.
    pub fn traffic(&self) -> Traffic {
        self.net
            .lock()
            .eps
            .get(&self.ep)
            .map_or(Traffic::default(), |e| e.traffic)
    }

    /// Runs `look` under the network's lock until it is done, waiting for a change (or the
    /// instant it names) between looks. The waiter is registered before the lock is released,
    /// so no change is missed.
    async fn until<T>(&self, mut look: impl FnMut(&mut crate::net::Net, u64) -> Step<T>) -> T {
        loop {
            let changed = self.net.shared.changed.notified();
            tokio::pin!(changed);
            let step = {
                let mut net = self.net.lock();
                changed.as_mut().enable();
                look(&mut net, self.ep)
            };
            match step {
                Step::Done(v) => {
                    self.net.wake_all();
                    return v;
                }
                Step::Wait(None) => changed.await,
                Step::Wait(Some(at)) => {
                    tokio::select! {
                        _ = &mut changed => {}
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
            }
        }
    }

    /// Connects to `peer`; with `refusal_is_final`, an address nobody listens on is an error
    /// at once instead of being waited on until the connect timeout.
    async fn dial(
        &self,
        peer: NodeId,
        addr: SocketAddr,
        refusal_is_final: bool,
    ) -> Result<(), TransportError> {
        let deadline = Instant::now() + self.net.config().connect_timeout;
        self.until(|net, ep| {
            let Some(me) = net.eps.get(&ep).filter(|e| !e.closed) else {
                return Step::Done(Err(TransportError::Closed));
            };
            if me.frozen {
                return Step::Wait(None);
            }
            if me.peers.contains_key(&peer) {
                return Step::Done(Ok(()));
            }
            let listener = net
                .listeners
                .get(&addr)
                .copied()
                .filter(|l| net.eps.get(l).is_some_and(|e| !e.closed && !e.frozen));
            match listener {
                Some(l) if net.eps[&l].id != peer => Step::Done(Err(TransportError::Handshake {
                    peer,
                    reason: format!("{addr} is {}, not {peer}", net.eps[&l].id),
                })),
                Some(l) => {
                    let theirs = &net.eps[&l];
                    // Err: the refusal's text, and whether it is a node still joining
                    // turning the dial away (the dialler tries again: not worth a warning).
                    let admitted =
                        auth::exchange_in_process(me.secret.as_ref(), theirs.secret.as_ref())
                            .map_err(|e| (e.to_string(), false))
                            .and_then(|session| {
                                let dialler = Binding::new(session.as_ref(), Role::Dialler);
                                let acceptor = Binding::new(session.as_ref(), Role::Acceptor);
                                theirs
                                    .admit(me.id, me.proof(&dialler).as_ref(), &dialler)
                                    .and_then(|()| {
                                        me.admit(peer, theirs.proof(&acceptor).as_ref(), &acceptor)
                                    })
                                    .map_err(|refusal| (refusal.to_string(), refusal.is_expected()))
                            });
                    if let Err((reason, expected)) = admitted {
                        if expected {
                            tracing::debug!(claimed = %me.id, %peer, %reason, "connection refused for now");
                        } else {
                            tracing::warn!(claimed = %me.id, %peer, %reason, "connection refused");
                        }
                        return Step::Done(Err(TransportError::Handshake { peer, reason }));
                    }
                    net.establish(ep, peer, l);
                    Step::Done(Ok(()))
                }
                // A stopped process still has its listening socket: only an address nobody
                // listens on refuses.
                None if (refusal_is_final && !net.listeners.contains_key(&addr))
                    || Instant::now() >= deadline =>
                {
                    Step::Done(Err(TransportError::Connect {
                        peer,
                        addr,
                        source: io::Error::new(
                            io::ErrorKind::ConnectionRefused,
                            "nothing answers at this address on the in-memory network",
                        ),
                    }))
                }
                None => Step::Wait(Some(deadline)),
            }
        })
        .await
    }

    fn check(&self, peer: NodeId, msg: &OutMessage<'_>) -> Result<usize, TransportError> {
        let limits = &self.net.config().limits;
        let invalid = |source| TransportError::Invalid { peer, source };
        if msg.meta.len() > limits.max_meta as usize {
            return Err(invalid(CodecError::MetaTooLarge {
                len: msg.meta.len() as u64,
                limit: limits.max_meta,
            }));
        }
        if msg.segments.len() > limits.max_segments as usize {
            return Err(invalid(CodecError::TooManySegments {
                count: msg.segments.len(),
                limit: limits.max_segments,
            }));
        }
        if msg.total_len() > limits.max_message {
            return Err(invalid(CodecError::MessageTooLarge {
                len: msg.total_len(),
                limit: limits.max_message,
            }));
        }
        Ok(msg.total_len() as usize)
    }
}

impl Drop for MemTransport {
    fn drop(&mut self) {
        self.shutdown();
        self.net.lock().eps.remove(&self.ep);
    }
}

impl Transport for MemTransport {
    fn local_id(&self) -> NodeId {
        self.net
            .lock()
            .eps
            .get(&self.ep)
            .map_or(NodeId(0), |e| e.id)
    }

    fn set_local_id(&self, id: NodeId) {
        if let Some(e) = self.net.lock().ep(self.ep) {
            e.id = id;
        }
    }

    fn set_admission(&self, admission: Arc<dyn Admission>) {
        if let Some(e) = self.net.lock().ep(self.ep) {
            e.admission = Some(admission);
        }
    }

    fn listen_addr(&self) -> SocketAddr {
        self.addr
    }

    fn capabilities(&self) -> Capabilities {
        let limits = &self.net.config().limits;
        Capabilities {
            name: "mem",
            max_message: limits.max_message,
            max_meta: limits.max_meta,
            max_segments: limits.max_segments,
            same_host_shm: false,
        }
    }

    async fn connect(&self, peer: NodeId, addr: SocketAddr) -> Result<(), TransportError> {
        self.dial(peer, addr, false).await
    }

    async fn redial(&self, peer: NodeId, addr: SocketAddr) -> Result<(), TransportError> {
        self.dial(peer, addr, true).await
    }

    async fn send<'a>(&'a self, peer: NodeId, msg: OutMessage<'a>) -> Result<(), TransportError> {
        let bytes = self.check(peer, &msg)?;
        // Device memory is copied out first: the network takes a message in one piece.
        let mut copied: SmallVec<[Option<Bytes>; 4]> = SmallVec::new();
        for seg in msg.segments {
            copied.push(match seg.device_bytes() {
                None => None,
                Some(device) => {
                    let path = DevicePath::Copied;
                    self.device_paths
                        .note("memnet", peer, device.ordinal(), path);
                    let host = copy_all(device)
                        .await
                        .map_err(|source| TransportError::Device { peer, source })?;
                    Some(Bytes::from(host))
                }
            });
        }
        let cap = self.net.config().inbox_bytes;
        let mut conn_seen = None;
        self.until(|net, ep| {
            let Some(me) = net.eps.get(&ep).filter(|e| !e.closed) else {
                return Step::Done(Err(TransportError::Closed));
            };
            if me.frozen {
                return Step::Wait(None);
            }
            let Some(end) = me.peers.get(&peer).copied() else {
                return Step::Done(Err(match conn_seen {
                    None => TransportError::NotConnected { peer },
                    Some(_) => TransportError::PeerLost {
                        peer,
                        reason: "connection closed while the send waited".into(),
                    },
                }));
            };
            if conn_seen.is_some_and(|c| c != end.conn) {
                return Step::Done(Err(TransportError::PeerLost {
                    peer,
                    reason: "connection replaced while the send waited".into(),
                }));
            }
            conn_seen = Some(end.conn);
            let queued = net.eps.get(&end.remote_ep).map_or(0, |r| r.inbox_bytes);
            if queued > 0 && queued + bytes > cap {
                return Step::Wait(None);
            }
            let (reset, delay) = net.dice.roll();
            if reset {
                let reason = format!(
                    "connection reset (injected fault, seed {})",
                    net.dice.faults().seed
                );
                tracing::debug!(%peer, %reason, "memnet");
                net.end_connection(ep, peer, Ending::Reset, &reason);
                return Step::Done(Err(TransportError::PeerLost { peer, reason }));
            }
            let incoming = Incoming {
                peer: end.key_at_remote,
                meta: Bytes::copy_from_slice(msg.meta),
                segments: msg
                    .segments
                    .iter()
                    .zip(&copied)
                    .map(|(s, c)| match (s.host(), c) {
                        (Some(host), _) => Bytes::copy_from_slice(host),
                        (None, c) => c.clone().unwrap_or_default(),
                    })
                    .collect::<SmallVec<[Bytes; 4]>>(),
                placed: None,
            };
            net.enqueue_message(
                ep,
                end.remote_ep,
                end.conn,
                bytes,
                delay,
                Event::Message(incoming),
            );
            if let Some(me) = net.ep(ep) {
                me.traffic.sent_messages += 1;
                me.traffic.sent_bytes += bytes as u64;
            }
            Step::Done(Ok(()))
        })
        .await
    }

    async fn recv(&self) -> Result<Event, TransportError> {
        // Messages arrive whole here: a placed segment is copied there after it arrived.
        if let Some(placed) = self.placing.finish().await {
            return Ok(placed);
        }
        let event = self.next_event().await?;
        Ok(self.placing.place(event).await)
    }

    fn set_placer(&self, placer: Arc<dyn Placer>) -> bool {
        if !self.net.config().places {
            return false;
        }
        self.placing.set_placer(placer);
        true
    }

    fn disconnect(&self, peer: NodeId) {
        self.net
            .lock()
            .end_connection(self.ep, peer, Ending::Closed, "closed by the peer");
        self.net.wake_all();
    }

    fn connected_peers(&self) -> Vec<NodeId> {
        let mut peers: Vec<NodeId> = self
            .net
            .lock()
            .eps
            .get(&self.ep)
            .map(|e| e.peers.keys().copied().collect())
            .unwrap_or_default();
        peers.sort_unstable();
        peers
    }

    fn alloc_registered(&self, len: usize) -> Result<RegisteredBuf, TransportError> {
        Ok(RegisteredBuf::unregistered(len))
    }

    fn shutdown(&self) {
        self.net
            .lock()
            .close_endpoint(self.ep, Ending::Closed, "closed by the peer");
        self.net.wake_all();
    }
}
