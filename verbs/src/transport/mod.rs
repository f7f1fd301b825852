//! [`VerbsTransport`]: the transport contract over RDMA reliable-connected queue pairs.
//!
//! Data moves over one queue pair per peer. A TCP connection per peer (psnet's TCP transport,
//! on the same address) names the peer and tells when its process dies. The queue pairs are
//! connected by rdma_cm (route resolved from the interface's address, REQ / REP / RTU, the
//! handshake in private data, as ps-lite does) or, with `PSNET_RDMA_CONNECT=socket`, by
//! exchanging queue-pair numbers over that TCP connection (as NCCL and perftest do); every
//! node accepts both. A single task polls
//! the completion queue every queue pair shares, spinning briefly and then sleeping on the
//! completion channel, so an idle node burns no core.
//!
//! The parts, by concern: `config.rs` ([`VerbsConfig`], [`Handshake`]: settings and
//! defaults), `registrar.rs` ([`Registrar`]: registering user memory), `connect/` (the control
//! loop and the drivers of both handshakes, `socket.rs` and `rdma_cm.rs`, whose decisions are
//! [`crate::proto::handshake`]'s), `progress.rs` (completion polling
//! and the poller task), `device_events.rs` (the device's asynchronous events); the queue
//! pairs themselves are [`crate::link`]'s.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use psnet_fallback_tcp::TcpTransport;
use psnet_transport::codec::DataPath;
use psnet_transport::device::DEFAULT_STAGE_CHUNK;
use psnet_transport::placement::ReceivePlacing;
use psnet_transport::{
    Admission, Capabilities, Event, NodeId, OutMessage, Placer, RegionKey, RegisteredBuf,
    Transport, TransportError,
};
use tokio::sync::{mpsc, watch, Notify};

use crate::device::Device;
use crate::error::VerbsError;
use crate::landing::{Arrival, Asked, HostLanding, Landings};
use crate::link::{Link, LinkParams};
use crate::memory::RecvPool;
use crate::proto::handshake::Links;
use crate::proto::wire::DataHeader;
use crate::rdmacm;
use crate::regcache::RegCache;
use crate::sys;

mod connect;
mod device_events;
#[cfg(feature = "cuda")]
mod gpu;
mod progress;

pub use crate::config::{Handshake, VerbsConfig};
pub use crate::registrar::Registrar;

use connect::{control_loop, listen_cm, CmState};
use device_events::device_event_loop;
use progress::poll_loop;

/// How long `shutdown` waits, at most, for posted sends to complete.
const SHUTDOWN_LINGER: Duration = Duration::from_secs(1);

/// An event for `recv`, the bytes it counts against the inbox's bound, and what the placer
/// said about it before its data came.
type InboxItem = (Event, usize, Asked);

struct Inbox {
    tx: mpsc::UnboundedSender<InboxItem>,
    rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<InboxItem>>,
    bytes: AtomicUsize,
    limit: usize,
}

impl Inbox {
    fn full(&self) -> bool {
        self.bytes.load(Ordering::Acquire) >= self.limit
    }

    fn push_message(&self, arrival: Arrival) {
        let Arrival { msg: m, asked } = arrival;
        let n = m.meta.len() + m.segments.iter().map(|s| s.len()).sum::<usize>();
        self.bytes.fetch_add(n, Ordering::AcqRel);
        let _ = self.tx.send((Event::Message(m), n, asked));
    }

    fn push_event(&self, e: Event) {
        let _ = self.tx.send((e, 0, Asked::No));
    }
}

struct Inner {
    tcp: TcpTransport,
    config: VerbsConfig,
    params: LinkParams,
    closed: AtomicBool,
    stop: watch::Sender<bool>,
    inbox: Inbox,
    /// Signalled when the inbox drains below its bound (withheld credits can go out).
    drained: Notify,
    /// Signalled when a link is created, connected or removed.
    links_changed: Notify,
    /// Every peer's link and where its handshake stands.
    links: Mutex<Links<Arc<Link>>>,
    by_id: Mutex<HashMap<u32, Arc<Link>>>,
    addrs: Mutex<HashMap<NodeId, SocketAddr>>,
    next_link: AtomicU32,
    fail_tx: mpsc::UnboundedSender<(NodeId, u32, String)>,
    registrar: Registrar,
    pool: Arc<RecvPool>,
    /// Held while polling the completion queue: the poller task and `recv` both poll.
    poll_gate: Mutex<()>,
    dev: Arc<Device>,
    /// `None` where rdma_cm is unavailable (then only the socket handshake works).
    cm: Option<CmState>,
    /// `PSNET_RDMA_CONNECT=auto`: an rdma_cm connection that does not complete falls back to
    /// the socket handshake.
    cm_fallback: bool,
    /// Received segments placed in device memory (`Transport::set_placer`), and the memory
    /// registered for peers' NICs to write them into.
    landings: Arc<Landings>,
}

/// The RDMA transport.
pub struct VerbsTransport {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

impl VerbsTransport {
    /// Opens the device, listens for control connections, and starts the completion poller.
    pub async fn bind(id: NodeId, config: VerbsConfig) -> Result<Self, TransportError> {
        let unavailable = TransportError::Unavailable;
        let min_slot = DataHeader::encoded_len(config.tcp.limits.max_segments as usize)
            + 64
            + psnet_transport::session::TAG_LEN;
        if config.eager_bytes < min_slot {
            return Err(unavailable(format!(
                "PSNET_RDMA_EAGER={} is below {min_slot} bytes (a request-to-send for {} segments)",
                config.eager_bytes, config.tcp.limits.max_segments
            )));
        }
        if config.recv_depth < 4 {
            return Err(unavailable(
                "PSNET_RDMA_RECV_DEPTH must be at least 4".into(),
            ));
        }
        let params = LinkParams {
            recv_depth: config.recv_depth,
            send_slots: config.recv_depth,
            slot_size: config.eager_bytes,
            inline_bytes: config.inline_bytes.min(config.eager_bytes as u32),
            limits: config.tcp.limits,
            offer_bytes: config.offer_bytes,
        };
        let per_link =
            2 * config.recv_depth as u64 * config.eager_bytes as u64 + config.offer_bytes;
        sys::os::check_memlock(per_link * 4 + (16 << 20)).map_err(VerbsError::into_unavailable)?;
        sys::verbs::fork_init_once();
        let cq_per_link = params.recv_depth + params.sq_depth(16) + 1;
        let dev = Device::open(&config.device, cq_per_link.saturating_mul(256).min(1 << 17))
            .map_err(VerbsError::into_unavailable)?;
        tracing::info!(device = %dev.name, port = dev.port, gid_index = dev.gid_index,
            gid = %dev.gid, roce = dev.ethernet, "RDMA device opened");
        let dev = Arc::new(dev);
        let mut tcp_config = config.tcp.clone();
        tcp_config.shm_ring = 0;
        tcp_config.data_path = DataPath::Rdma;
        let tcp = TcpTransport::bind(id, tcp_config).await?;
        let mut config = config;
        let cm_fallback = config.handshake == Handshake::Auto;
        let cm = match listen_cm(&dev, tcp.listen_addr()) {
            Ok(cm) => {
                if config.handshake == Handshake::Auto {
                    config.handshake = Handshake::RdmaCm;
                }
                Some(cm)
            }
            Err(e) if config.handshake == Handshake::RdmaCm => {
                return Err(unavailable(format!(
                    "{e}; set PSNET_RDMA_CONNECT=socket to connect queue pairs over the TCP \
                     control connection instead"
                )))
            }
            Err(e) => {
                tracing::info!(error = %e, "rdma_cm unavailable; queue pairs connect over sockets only");
                config.handshake = Handshake::Socket;
                None
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let (fail_tx, fail_rx) = mpsc::unbounded_channel();
        let tag = (random_u64() as u32) | 1;
        let inner = Arc::new(Inner {
            tcp,
            params,
            closed: AtomicBool::new(false),
            stop: watch::channel(false).0,
            inbox: Inbox {
                tx,
                rx: tokio::sync::Mutex::new(rx),
                bytes: AtomicUsize::new(0),
                limit: config.tcp.inbox_bytes,
            },
            drained: Notify::new(),
            links_changed: Notify::new(),
            links: Mutex::new(Links::new()),
            by_id: Mutex::new(HashMap::new()),
            addrs: Mutex::new(HashMap::new()),
            next_link: AtomicU32::new(1),
            fail_tx,
            registrar: Registrar {
                pd: dev.pd.clone(),
                tag,
                cache: (config.reg_cache > 0)
                    .then(|| Mutex::new(RegCache::new(config.reg_cache, 1 << 34))),
            },
            pool: RecvPool::new(dev.pd.clone(), config.pool_bytes),
            poll_gate: Mutex::new(()),
            dev,
            config,
            cm,
            cm_fallback,
            landings: Arc::new(Landings::new(
                ReceivePlacing::new("rdma", DEFAULT_STAGE_CHUNK),
                tag,
            )),
        });
        let fd = sys::verbs::watch_channel(inner.dev.channel.clone())
            .map_err(|e| unavailable(format!("completion channel: {e}")))?;
        tokio::spawn(poll_loop(inner.clone(), fd, inner.stop.subscribe()));
        let cm_fd = match &inner.cm {
            Some(cm) => Some(
                rdmacm::watch(cm.channel.clone())
                    .map_err(|e| unavailable(format!("rdma_cm event channel: {e}")))?,
            ),
            None => None,
        };
        tokio::spawn(control_loop(
            inner.clone(),
            fail_rx,
            cm_fd,
            inner.stop.subscribe(),
        ));
        match sys::verbs::watch_async_events(inner.dev.ctx.clone()) {
            Ok(fd) => {
                tokio::spawn(device_event_loop(inner.clone(), fd, inner.stop.subscribe()));
            }
            // Not fatal: failures still surface as error completions, only later.
            Err(e) => tracing::warn!(device = %inner.dev.name, error = %e,
                "cannot watch the device's asynchronous events; a port going down is noticed only when a transfer fails"),
        }
        Ok(VerbsTransport { inner })
    }

    /// The device this transport runs on.
    pub fn device(&self) -> &Device {
        &self.inner.dev
    }

    /// How large messages to and from `peer` went (rendezvous or written into an offered
    /// buffer), or `None` if no queue pair to `peer` exists.
    pub fn link_stats(&self, peer: NodeId) -> Option<crate::link::LinkStats> {
        lock(&self.inner.links).get(peer).map(|c| c.link().stats())
    }

    /// `len` bytes of host memory registered with this transport's NIC, into which a peer's
    /// NIC writes a segment the placer puts there, with no copy ([`HostLanding`]: answer a
    /// [`Placer`] with it).
    pub fn host_landing(&self, len: usize) -> Result<Arc<HostLanding>, TransportError> {
        HostLanding::new(&self.inner.dev.pd, len, &self.inner.landings)
            .map_err(VerbsError::into_unavailable)
    }

    /// How this node connects queue pairs ([`Handshake::Auto`] resolved at bind).
    pub fn handshake(&self) -> Handshake {
        self.inner.config.handshake
    }

    /// How the queue pair to `peer` was connected (by whichever side dialled), or `None` if
    /// no queue pair to `peer` exists.
    pub fn connected_via(&self, peer: NodeId) -> Option<Handshake> {
        lock(&self.inner.links).get(peer).map(|c| {
            if c.via_cm() {
                Handshake::RdmaCm
            } else {
                Handshake::Socket
            }
        })
    }

    /// Drops cached registrations of `[addr, addr + len)` (see `PSNET_RDMA_REG_CACHE`).
    pub fn invalidate_registrations(&self, addr: usize, len: usize) -> usize {
        self.inner.registrar.invalidate(addr, len)
    }
}

impl Drop for VerbsTransport {
    fn drop(&mut self) {
        self.inner.shutdown();
    }
}

impl Inner {
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn new_link(&self, peer: NodeId, nonce: u64) -> Result<Arc<Link>, VerbsError> {
        let id = self.next_link.fetch_add(1, Ordering::Relaxed);
        let link = Arc::new(Link::new(
            self.dev.clone(),
            self.pool.clone(),
            self.landings.clone(),
            id,
            peer,
            nonce,
            self.params.clone(),
        )?);
        lock(&self.by_id).insert(id, link.clone());
        Ok(link)
    }

    /// Removes `peer`'s link (if it is `only_id`, when given); returns it and whether a
    /// `PeerConnected` was reported for it.
    fn remove_link(&self, peer: NodeId, only_id: Option<u32>, reason: &str) -> Option<bool> {
        // The loss is reported out of band (rdma_cm, the control connection), possibly before
        // the poller has handled the peer's last messages: deliver what the completion queue
        // holds first, so that they come before the loss, as they were sent.
        self.drain_completions();
        let current = lock(&self.links).remove(peer, only_id)?;
        current.link().fail(reason);
        lock(&self.by_id).remove(&current.link().id);
        self.drop_cm_of_link(current.link().id);
        self.links_changed.notify_waiters();
        Some(current.announced())
    }

    fn shutdown(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.linger();
        let _ = self.stop.send(true);
        self.tcp.shutdown();
        let peers: Vec<NodeId> = lock(&self.links).peers();
        for peer in peers {
            self.remove_link(peer, None, "transport shut down");
        }
        lock(&self.by_id).clear();
        // Wake a pending `recv`; it sees `closed` and reports it.
        self.inbox.push_event(Event::PeerLost {
            peer: NodeId(u64::MAX),
            reason: "transport shut down".into(),
        });
        self.links_changed.notify_waiters();
    }

    /// Waits, at most `SHUTDOWN_LINGER`, for the sends already handed to the queue pairs to
    /// complete: disconnecting moves a queue pair to the error state, which would flush what
    /// it had not yet sent (a job's last message, a process about to exit). Polls the
    /// completion queue itself, so it needs no other task to run.
    fn linger(&self) {
        let deadline = Instant::now() + SHUTDOWN_LINGER;
        let mut pause = Duration::from_micros(10);
        loop {
            self.drain_completions();
            let links: Vec<Arc<Link>> = lock(&self.by_id).values().cloned().collect();
            if !links.iter().any(|l| l.has_unfinished_sends()) {
                return;
            }
            if Instant::now() >= deadline {
                tracing::debug!(local = %self.tcp.local_id(), "shutting down with sends unfinished");
                return;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(2));
        }
    }

    /// Lets link `id` to `peer`, which failed, go: the peer is told by the end of the control
    /// connection, and this side's application by a `PeerLost` (once per link).
    fn forget_link(&self, peer: NodeId, id: u32, reason: String) {
        if self.remove_link(peer, Some(id), &reason) == Some(true) {
            self.drop_control(peer);
            self.inbox.push_event(Event::PeerLost { peer, reason });
        }
    }

    fn fail_link(&self, link: &Link, reason: String) {
        if link.fail(&reason) {
            tracing::warn!(peer = %link.peer, %reason, "RDMA link failed");
            let _ = self.fail_tx.send((link.peer, link.id, reason));
        }
    }
}

impl Transport for VerbsTransport {
    fn local_id(&self) -> NodeId {
        self.inner.tcp.local_id()
    }

    fn set_local_id(&self, id: NodeId) {
        self.inner.tcp.set_local_id(id)
    }

    // Every RDMA link starts from a control connection (rdma_cm requests are answered only for
    // peers that have one), so admitting control connections admits the links.
    fn set_admission(&self, admission: Arc<dyn Admission>) {
        self.inner.tcp.set_admission(admission)
    }

    fn listen_addr(&self) -> SocketAddr {
        self.inner.tcp.listen_addr()
    }

    fn capabilities(&self) -> Capabilities {
        let limits = self.inner.config.tcp.limits;
        Capabilities {
            name: "rdma",
            max_message: limits.max_message,
            max_meta: limits.max_meta,
            max_segments: limits.max_segments,
            same_host_shm: false,
        }
    }

    async fn connect(&self, peer: NodeId, addr: SocketAddr) -> Result<(), TransportError> {
        self.inner.connect_peer(peer, addr).await
    }

    // The control connection comes first: a refused one means the peer's process is gone.
    async fn redial(&self, peer: NodeId, addr: SocketAddr) -> Result<(), TransportError> {
        self.inner.tcp.redial(peer, addr).await?;
        self.inner.connect_peer(peer, addr).await
    }

    async fn send<'a>(&'a self, peer: NodeId, msg: OutMessage<'a>) -> Result<(), TransportError> {
        if self.inner.is_closed() {
            return Err(TransportError::Closed);
        }
        let link = lock(&self.inner.links)
            .get(peer)
            .map(|c| c.link().clone())
            .ok_or(TransportError::NotConnected { peer })?;
        let sent = link.send(msg, &self.inner.registrar).await;
        if sent.is_err() {
            // A link that failed under this send (a staged copy that stopped half-way, a
            // refused post) goes at once, as those the poller finds failed do: a `connect`
            // right after this error makes a new one rather than finding this one.
            if let Some(reason) = link.failure() {
                self.inner.forget_link(peer, link.id, reason);
            }
        }
        sent
    }

    async fn recv(&self) -> Result<Event, TransportError> {
        let inner = &self.inner;
        if inner.is_closed() {
            return Err(TransportError::Closed);
        }
        if let Some(placed) = inner.landings.placing.finish().await {
            return Ok(placed);
        }
        let mut rx = inner.inbox.rx.lock().await;
        // Poll the completion queue from here for a while before sleeping: a message that is
        // about to arrive is then handed over without waking any task (the poller's way,
        // through the completion channel, costs a wake-up on each side).
        let spin = Duration::from_micros(inner.config.spin_us);
        let started = Instant::now();
        let mut next = rx.try_recv().ok();
        while next.is_none() && started.elapsed() < spin && !inner.is_closed() {
            if inner.try_drain_completions() == 0 {
                std::hint::spin_loop();
            }
            next = rx.try_recv().ok();
        }
        let next = match next {
            Some(next) => Some(next),
            None => rx.recv().await,
        };
        drop(rx);
        match next {
            Some((event, n, asked)) if !inner.is_closed() => {
                if n > 0 {
                    let before = inner.inbox.bytes.fetch_sub(n, Ordering::AcqRel);
                    if before >= inner.inbox.limit && before - n < inner.inbox.limit {
                        inner.drained.notify_one();
                    }
                }
                // A segment the NIC did not write where the placer said (`landing`) landed
                // in a registered host buffer with the rest: it is copied there now.
                let placing = &inner.landings.placing;
                Ok(match (event, asked) {
                    (event, Asked::No) => placing.place(event).await,
                    (Event::Message(m), Asked::Answered(Some(p))) => placing.place_as(m, p).await,
                    (event, Asked::Answered(_)) => event,
                })
            }
            _ => Err(TransportError::Closed),
        }
    }

    fn set_placer(&self, placer: Arc<dyn Placer>) -> bool {
        self.inner.landings.placing.set_placer(placer);
        true
    }

    fn disconnect(&self, peer: NodeId) {
        self.inner.remove_link(peer, None, "disconnected");
        self.inner.drop_control(peer);
    }

    fn connected_peers(&self) -> Vec<NodeId> {
        let mut peers: Vec<NodeId> = lock(&self.inner.links)
            .iter()
            .filter(|(_, c)| c.link().is_ready())
            .map(|(p, _)| p)
            .collect();
        peers.sort();
        peers
    }

    fn alloc_registered(&self, len: usize) -> Result<RegisteredBuf, TransportError> {
        let tag = self.inner.registrar.tag as u64;
        sys::memory::alloc_registered(&self.inner.dev.pd, len, |lkey| {
            RegionKey((tag << 32) | lkey as u64)
        })
        .map_err(VerbsError::into_unavailable)
    }

    fn shutdown(&self) {
        self.inner.shutdown();
    }
}
