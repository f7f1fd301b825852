//! The network: every endpoint's state behind one lock, so that each step (a send, a
//! connection made or reset) is atomic and the order of events is the order of steps.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use psnet_transport::auth::Secret;
use psnet_transport::{Admission, Binding, Event, Limits, NodeId, Proof, Refusal};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::endpoint::MemTransport;
use crate::faults::{Dice, Faults};
use crate::links::{HostLinks, MessageId};
use crate::wires::Wires;

/// Settings of a [`MemNet`].
#[derive(Clone, Debug)]
pub struct MemNetConfig {
    /// The faults and their seed.
    pub faults: Faults,
    /// Bytes queued for one receiver before its senders wait (back-pressure).
    pub inbox_bytes: usize,
    /// How long `connect` keeps trying to reach an address nobody listens on.
    pub connect_timeout: Duration,
    /// Message limits, as a real transport has them.
    pub limits: Limits,
    /// Whether endpoints place received segments in device memory when asked
    /// (`Transport::set_placer`); false stands for a transport that cannot.
    pub places: bool,
    /// The hosts and their links ([`crate::LinkModel`]), in simulated time: a message
    /// lands once its bytes have crossed the sender's uplink and the receiver's downlink
    /// (or the local path of a host), plus their latency. Endpoints go on the hosts in turn
    /// as they bind, or where [`MemNet::bind_on`] puts them. Empty (the default): messages
    /// land at once, after their fault delay alone. Endpoints on host `h` listen at
    /// 127.0.0.1 + `h` (a made-up address: nothing is bound on this machine).
    pub hosts: Vec<HostLinks>,
}

impl Default for MemNetConfig {
    fn default() -> Self {
        MemNetConfig {
            faults: Faults::none(),
            inbox_bytes: 64 << 20,
            connect_timeout: Duration::from_secs(2),
            limits: Limits::default(),
            places: true,
            hosts: Vec::new(),
        }
    }
}

/// An in-memory network that endpoints bind to. Cloning it gives another handle to the same
/// network.
#[derive(Clone)]
pub struct MemNet {
    pub(crate) shared: Arc<Shared>,
}

pub(crate) struct Shared {
    pub(crate) state: Mutex<Net>,
    /// Woken on every change; waiters re-check what they wait for.
    pub(crate) changed: Notify,
    pub(crate) config: MemNetConfig,
}

/// One endpoint's end of a connection.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnEnd {
    pub(crate) conn: u64,
    pub(crate) remote_ep: u64,
    /// The id this endpoint has at the remote end.
    pub(crate) key_at_remote: NodeId,
}

pub(crate) struct Queued {
    /// When it can be received (not yet known while it is `crossing`).
    pub(crate) visible_at: Instant,
    /// The connection a message came over (lost with it on a reset); None for events.
    pub(crate) conn: Option<u64>,
    pub(crate) bytes: usize,
    pub(crate) event: Event,
    /// The peer it comes from or tells of: one peer's entries are received in order.
    pub(crate) from: NodeId,
    /// The link model's id while the message crosses its links.
    pub(crate) crossing: Option<MessageId>,
    /// The fault delay it takes once it has crossed.
    pub(crate) delay: Duration,
}

pub(crate) struct Ep {
    pub(crate) id: NodeId,
    pub(crate) addr: SocketAddr,
    pub(crate) peers: HashMap<NodeId, ConnEnd>,
    pub(crate) inbox: VecDeque<Queued>,
    pub(crate) inbox_bytes: usize,
    pub(crate) last_visible: Instant,
    pub(crate) closed: bool,
    pub(crate) frozen: bool,
    /// Who may connect to this endpoint (see [`Admission`]); None believes every id.
    pub(crate) admission: Option<Arc<dyn Admission>>,
    /// The job's shared secret this endpoint proves and asks for (see
    /// [`psnet_transport::auth`]); None: an open job.
    pub(crate) secret: Option<Secret>,
    /// What this endpoint has sent and received.
    pub(crate) traffic: Traffic,
}

/// Messages and bytes (header and segments) an endpoint has sent and received: what a
/// protocol puts on the wire, counted by the network.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Messages sent.
    pub sent_messages: u64,
    /// Their bytes.
    pub sent_bytes: u64,
    /// Messages received (taken by `recv`).
    pub received_messages: u64,
    /// Their bytes.
    pub received_bytes: u64,
    /// The most bytes queued for the endpoint at once: crossing the links to it, or landed
    /// and not yet taken by `recv` (what its socket buffers and the network hold for it).
    pub peak_queued_bytes: u64,
}

impl Ep {
    /// Where the next entry to receive is in the inbox, or when to look again (None:
    /// at a change, or when the link model lands something). Without the link model the
    /// inbox is received in its order; with it, each peer's entries in their order and,
    /// among the peers, the first to land first.
    pub(crate) fn next_visible(&self, modelled: bool) -> Result<usize, Option<Instant>> {
        let now = Instant::now();
        if !modelled {
            return match self.inbox.front() {
                Some(q) if q.visible_at <= now => Ok(0),
                Some(q) => Err(Some(q.visible_at)),
                None => Err(None),
            };
        }
        // A set, not a list: a server of a thousand workers has entries from each in its
        // inbox, and looking through a list of them for each entry made every look
        // quadratic.
        let mut seen: HashSet<NodeId> = HashSet::new();
        let mut first: Option<(Instant, usize)> = None;
        for (i, q) in self.inbox.iter().enumerate() {
            if !seen.insert(q.from) {
                continue;
            }
            if q.crossing.is_none() && first.is_none_or(|(at, _)| q.visible_at < at) {
                first = Some((q.visible_at, i));
            }
        }
        match first {
            Some((at, i)) if at <= now => Ok(i),
            other => Err(other.map(|(at, _)| at)),
        }
    }
}

impl Ep {
    /// The proof this endpoint presents under its current id on the connection of `binding`.
    pub(crate) fn proof(&self, binding: &Binding) -> Option<Proof> {
        self.admission
            .as_ref()
            .and_then(|a| a.proof(self.id, binding))
    }

    /// Whether this endpoint lets in `peer` presenting `proof` made for `binding`.
    pub(crate) fn admit(
        &self,
        peer: NodeId,
        proof: Option<&Proof>,
        binding: &Binding,
    ) -> Result<(), Refusal> {
        self.admission
            .as_ref()
            .map_or(Ok(()), |a| a.admit(peer, proof, binding))
    }
}

pub(crate) struct Net {
    pub(crate) dice: Dice,
    /// The link model, where the network has hosts.
    pub(crate) wires: Option<Wires>,
    pub(crate) eps: HashMap<u64, Ep>,
    pub(crate) listeners: HashMap<SocketAddr, u64>,
    next_ep: u64,
    next_port: u16,
    next_conn: u64,
}

/// How a connection ends.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// Closed on purpose: what was sent is still delivered; the closing side is not told.
    Closed,
    /// Reset or crashed: undelivered data is lost; both sides are told.
    Reset,
    /// Crashed: undelivered data is lost; only the survivors are told.
    Crash,
}

impl Net {
    pub(crate) fn ep(&mut self, ep: u64) -> Option<&mut Ep> {
        self.eps.get_mut(&ep)
    }

    /// Queues `event` for `ep`, visible after `delay` and never before what is queued there.
    pub(crate) fn enqueue(
        &mut self,
        ep: u64,
        conn: Option<u64>,
        bytes: usize,
        delay: Duration,
        event: Event,
    ) {
        if let Some(e) = self.eps.get_mut(&ep) {
            let visible_at = e.last_visible.max(Instant::now() + delay);
            e.last_visible = visible_at;
            e.inbox_bytes += bytes;
            e.traffic.peak_queued_bytes = e.traffic.peak_queued_bytes.max(e.inbox_bytes as u64);
            e.inbox.push_back(Queued {
                visible_at,
                conn,
                bytes,
                from: about(&event),
                event,
                crossing: None,
                delay,
            });
        }
    }

    /// Queues message `event` of `bytes` from endpoint `from` for endpoint `to` over `conn`:
    /// with the link model, it crosses the links first and takes `delay` after; without,
    /// as [`enqueue`](Self::enqueue).
    pub(crate) fn enqueue_message(
        &mut self,
        from: u64,
        to: u64,
        conn: u64,
        bytes: usize,
        delay: Duration,
        event: Event,
    ) {
        let Some(wires) = self.wires.as_mut() else {
            return self.enqueue(to, Some(conn), bytes, delay, event);
        };
        if let Some(e) = self.eps.get_mut(&to) {
            let msg = wires.send(conn, from, to, bytes);
            e.inbox_bytes += bytes;
            e.traffic.peak_queued_bytes = e.traffic.peak_queued_bytes.max(e.inbox_bytes as u64);
            e.inbox.push_back(Queued {
                visible_at: Instant::now(),
                conn: Some(conn),
                bytes,
                from: about(&event),
                event,
                crossing: Some(msg),
                delay,
            });
        }
    }

    /// Lands what has crossed the links by now: each becomes visible after its delay.
    pub(crate) fn pump(&mut self) {
        let Some(wires) = self.wires.as_mut() else {
            return;
        };
        for (ep, msg, at) in wires.land() {
            let Some(e) = self.eps.get_mut(&ep) else {
                continue;
            };
            if let Some(q) = e.inbox.iter_mut().find(|q| q.crossing == Some(msg)) {
                q.crossing = None;
                q.visible_at = at + q.delay;
            }
        }
    }

    /// When the link model next finishes a message's crossing (it lands after the links'
    /// latency), if it has one crossing.
    pub(crate) fn next_landing(&mut self) -> Option<Instant> {
        self.wires.as_mut().and_then(Wires::next_landing)
    }

    fn purge(&mut self, ep: u64, conn: u64) {
        if let Some(wires) = self.wires.as_mut() {
            wires.close(conn);
        }
        if let Some(e) = self.eps.get_mut(&ep) {
            let mut freed = 0;
            e.inbox.retain(|q| {
                let lost = q.conn == Some(conn);
                if lost {
                    freed += q.bytes;
                }
                !lost
            });
            e.inbox_bytes -= freed;
        }
    }

    /// Ends `ep`'s connection to `peer`, if it has one.
    pub(crate) fn end_connection(&mut self, ep: u64, peer: NodeId, ending: Ending, reason: &str) {
        let Some(end) = self.eps.get_mut(&ep).and_then(|e| e.peers.remove(&peer)) else {
            return;
        };
        if ending != Ending::Closed {
            self.purge(ep, end.conn);
            self.purge(end.remote_ep, end.conn);
        }
        if ending == Ending::Reset {
            let lost = Event::PeerLost {
                peer,
                reason: reason.to_string(),
            };
            self.enqueue(ep, None, 0, Duration::ZERO, lost);
        }
        let remote_has_it = self
            .eps
            .get(&end.remote_ep)
            .and_then(|r| r.peers.get(&end.key_at_remote))
            .is_some_and(|r| r.conn == end.conn);
        if remote_has_it {
            if let Some(r) = self.eps.get_mut(&end.remote_ep) {
                r.peers.remove(&end.key_at_remote);
            }
            let lost = Event::PeerLost {
                peer: end.key_at_remote,
                reason: reason.to_string(),
            };
            self.enqueue(end.remote_ep, None, 0, Duration::ZERO, lost);
        }
    }

    /// Connects `ep` (the dialler) to `listener`, whose id is `peer`.
    pub(crate) fn establish(&mut self, ep: u64, peer: NodeId, listener: u64) {
        let conn = self.next_conn;
        self.next_conn += 1;
        let (my_id, my_addr) = {
            let me = &self.eps[&ep];
            (me.id, me.addr)
        };
        let their_addr = self.eps[&listener].addr;
        // A node that dials again under the same id replaces its old connection, as a process
        // that restarted would.
        self.end_connection(
            listener,
            my_id,
            Ending::Reset,
            "replaced by a new connection from the same node id",
        );
        let mine = ConnEnd {
            conn,
            remote_ep: listener,
            key_at_remote: my_id,
        };
        let theirs = ConnEnd {
            conn,
            remote_ep: ep,
            key_at_remote: peer,
        };
        if let Some(me) = self.eps.get_mut(&ep) {
            me.peers.insert(peer, mine);
        }
        if let Some(l) = self.eps.get_mut(&listener) {
            l.peers.insert(my_id, theirs);
        }
        let to_listener = Event::PeerConnected {
            peer: my_id,
            addr: my_addr,
        };
        self.enqueue(listener, None, 0, Duration::ZERO, to_listener);
        let to_me = Event::PeerConnected {
            peer,
            addr: their_addr,
        };
        self.enqueue(ep, None, 0, Duration::ZERO, to_me);
    }

    /// Closes `ep`: it stops listening, its connections end, its calls fail with `Closed`.
    pub(crate) fn close_endpoint(&mut self, ep: u64, ending: Ending, reason: &str) {
        let Some(e) = self.eps.get_mut(&ep) else {
            return;
        };
        if e.closed {
            return;
        }
        e.closed = true;
        let addr = e.addr;
        let peers: Vec<NodeId> = e.peers.keys().copied().collect();
        if self.listeners.get(&addr) == Some(&ep) {
            self.listeners.remove(&addr);
        }
        for peer in peers {
            self.end_connection(ep, peer, ending, reason);
        }
    }

    /// The live endpoint whose id is `node`.
    pub(crate) fn find(&self, node: NodeId) -> Option<u64> {
        let mut found: Vec<u64> = self
            .eps
            .iter()
            .filter(|(_, e)| e.id == node && !e.closed)
            .map(|(k, _)| *k)
            .collect();
        found.sort_unstable();
        found.pop()
    }
}

impl MemNet {
    /// A network with these settings.
    pub fn new(config: MemNetConfig) -> Self {
        MemNet {
            shared: Arc::new(Shared {
                state: Mutex::new(Net {
                    dice: Dice::new(config.faults.clone()),
                    wires: Wires::new(&config.hosts),
                    eps: HashMap::new(),
                    listeners: HashMap::new(),
                    next_ep: 1,
                    next_port: 10_000,
                    next_conn: 1,
                }),
                changed: Notify::new(),
                config,
            }),
        }
    }

    /// A network without faults.
    pub fn reliable() -> Self {
        MemNet::new(MemNetConfig::default())
    }

    /// A network whose faults come from `faults`.
    pub fn with_faults(faults: Faults) -> Self {
        MemNet::new(MemNetConfig {
            faults,
            ..MemNetConfig::default()
        })
    }

    /// The settings.
    pub fn config(&self) -> &MemNetConfig {
        &self.shared.config
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Net> {
        // Nothing panics while holding the lock; a poisoned one is still consistent.
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn wake_all(&self) {
        self.shared.changed.notify_waiters();
    }

    /// A new endpoint with id `id`, listening at a fresh address (127.0.0.1, or its host's
    /// with [`MemNetConfig::hosts`], and a port of this network's own: nothing is bound on
    /// this machine).
    pub fn bind(&self, id: NodeId) -> MemTransport {
        self.bind_with_secret(id, None)
    }

    /// Like [`MemNet::bind`], for a node holding the job's shared secret: its connections,
    /// made or accepted, go through the same exchange as on a wire
    /// ([`psnet_transport::auth`]), and a peer that cannot prove the secret is refused.
    pub fn bind_with_secret(&self, id: NodeId, secret: Option<Secret>) -> MemTransport {
        self.bind_at(id, secret, None)
    }

    /// Like [`MemNet::bind`], on host `host` of [`MemNetConfig::hosts`] (modulo their
    /// count): it shares that host's links with the other endpoints there. Without hosts,
    /// `host` is ignored.
    pub fn bind_on(&self, host: usize, id: NodeId) -> MemTransport {
        self.bind_at(id, None, Some(host))
    }

    fn bind_at(&self, id: NodeId, secret: Option<Secret>, host: Option<usize>) -> MemTransport {
        let (ep, addr) = {
            let mut net = self.lock();
            let ep = net.next_ep;
            net.next_ep += 1;
            let port = net.next_port;
            net.next_port = net.next_port.checked_add(1).unwrap_or(10_000);
            // With hosts, each has an address of its own (127.0.0.1 + host), as on a
            // cluster: a job that looks at addresses (kv splits values across hosts) sees
            // several.
            let host = net.wires.as_mut().map_or(0, |w| w.place(ep, host));
            let ip = Ipv4Addr::from(u32::from(Ipv4Addr::LOCALHOST).wrapping_add(host as u32));
            let addr = SocketAddr::new(IpAddr::V4(ip), port);
            net.eps.insert(
                ep,
                Ep {
                    id,
                    addr,
                    peers: HashMap::new(),
                    inbox: VecDeque::new(),
                    inbox_bytes: 0,
                    last_visible: Instant::now(),
                    closed: false,
                    frozen: false,
                    admission: None,
                    secret,
                    traffic: Traffic::default(),
                },
            );
            net.listeners.insert(addr, ep);
            (ep, addr)
        };
        self.wake_all();
        MemTransport::new(self.clone(), ep, addr)
    }

    /// Kills the node with id `node` as a crash would: its connections are reset (what was in
    /// flight to or from it is lost), peers see it lost, and its own calls fail with `Closed`.
    /// Returns whether such a node was live.
    pub fn kill(&self, node: NodeId) -> bool {
        let found = {
            let mut net = self.lock();
            let found = net.find(node);
            if let Some(ep) = found {
                tracing::debug!(%node, "memnet: node killed");
                net.close_endpoint(ep, Ending::Crash, &format!("{node} crashed (killed)"));
            }
            found.is_some()
        };
        self.wake_all();
        found
    }

    /// Freezes (`true`) or thaws (`false`) the node with id `node`, as SIGSTOP / SIGCONT
    /// would: while frozen it receives nothing, its sends do not complete, and nobody can
    /// connect to it; its connections stay up and its peers' messages queue for it. Returns
    /// whether such a node was live.
    pub fn freeze(&self, node: NodeId, frozen: bool) -> bool {
        let found = {
            let mut net = self.lock();
            let found = net.find(node);
            if let Some(e) = found.and_then(|ep| net.ep(ep)) {
                e.frozen = frozen;
            }
            found.is_some()
        };
        self.wake_all();
        found
    }

    /// Resets the connection between `a` and `b`, if there is one: data in flight is lost
    /// and both sides see the other lost. Returns whether there was one.
    pub fn reset(&self, a: NodeId, b: NodeId) -> bool {
        let done = {
            let mut net = self.lock();
            match net.find(a) {
                Some(ep) if net.eps[&ep].peers.contains_key(&b) => {
                    net.end_connection(ep, b, Ending::Reset, "connection reset (injected)");
                    true
                }
                _ => false,
            }
        };
        self.wake_all();
        done
    }

    /// What the endpoint listening at `addr` has sent and received (None: nobody listens
    /// there), for whoever gave the endpoint away.
    pub fn traffic_at(&self, addr: SocketAddr) -> Option<Traffic> {
        let net = self.lock();
        net.listeners.get(&addr).map(|ep| net.eps[ep].traffic)
    }

    /// How many connections the endpoint listening at `addr` holds (None: nobody listens
    /// there).
    pub fn connections_at(&self, addr: SocketAddr) -> Option<usize> {
        let net = self.lock();
        net.listeners.get(&addr).map(|ep| net.eps[ep].peers.len())
    }

    /// The seed this network's faults come from.
    pub fn seed(&self) -> u64 {
        self.lock().dice.faults().seed
    }
}

/// The peer an event comes from or tells of.
fn about(event: &Event) -> NodeId {
    match event {
        Event::Message(m) => m.peer,
        Event::PeerConnected { peer, .. } | Event::PeerLost { peer, .. } => *peer,
    }
}
