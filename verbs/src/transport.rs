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

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_transport::codec::DataPath;
use psnet_transport::{
    Admission, Capabilities, Event, Incoming, NodeId, OutMessage, RegionKey, RegisteredBuf,
    Transport, TransportError,
};
use sideway::ibverbs::completion::PollCompletionQueueError;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::QueuePairState;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch, Notify};

use crate::control::{self, CmMessage, Control, OwnLink, Refusal};
use crate::device::{Device, DeviceSpec};
use crate::events;
use crate::link::{self, Link, LinkParams};
use crate::memory::{self, RecvPool};
use crate::proto::wire::DataHeader;
use crate::rdmacm::{self, CmChannel, CmEvent, CmId, ConnParam};
use crate::regcache::RegCache;
use crate::sys;

/// How often an unanswered queue-pair request is repeated.
const REQUEST_RESEND: Duration = Duration::from_millis(300);
/// How long rdma_cm may take to resolve an address or a route.
const CM_RESOLVE_MS: i32 = 2000;
/// With `PSNET_RDMA_CONNECT=auto`: how long an rdma_cm connection may take before the queue
/// pair is connected over the TCP control connection instead. rdma_cm's own retry of a lost
/// request comes after about 4 s.
const CM_FALLBACK: Duration = Duration::from_secs(6);
/// Polls of an empty completion queue before sleeping on the completion channel, at least
/// (the time budget `spin_us` usually allows more).
const SPIN_POLLS: u32 = 64;

/// Settings of a [`VerbsTransport`].
#[derive(Clone, Debug)]
pub struct VerbsConfig {
    /// The TCP control connections: listening address (the interface's IP), limits, connect
    /// timeout, inbox bound. Its shared-memory ring is not used.
    pub tcp: TcpConfig,
    /// The device port.
    pub device: DeviceSpec,
    /// Bytes per eager buffer (`PSNET_RDMA_EAGER`).
    pub eager_bytes: usize,
    /// Receive buffers per peer (`PSNET_RDMA_RECV_DEPTH`).
    pub recv_depth: u32,
    /// Cached registrations of plain user buffers (`PSNET_RDMA_REG_CACHE`); 0: none.
    pub reg_cache: usize,
    /// Idle rendezvous receive buffers kept for reuse, in bytes.
    pub pool_bytes: usize,
    /// Largest message sent inline (`PSNET_RDMA_INLINE`); 0: none.
    pub inline_bytes: u32,
    /// Microseconds of polling after the last completion before sleeping
    /// (`PSNET_RDMA_SPIN_US`).
    pub spin_us: u64,
    /// Bytes of receive buffers offered to each peer in advance (`PSNET_RDMA_OFFER_BYTES`);
    /// 0: every large message takes the rendezvous round trip.
    pub offer_bytes: u64,
    /// How this side connects queue pairs (`PSNET_RDMA_CONNECT`); it accepts both ways.
    pub handshake: Handshake,
}

/// How queue pairs are connected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handshake {
    /// rdma_cm where this node can use it (librdmacm, the kernel's rdma_ucm, a listener on
    /// the interface's address), sockets otherwise.
    Auto,
    /// rdma_cm resolves the route from the interface's address and runs the connection
    /// exchange; disconnects and rejections arrive as its events.
    RdmaCm,
    /// Queue-pair numbers, GIDs and sequence numbers travel over the TCP control connection.
    Socket,
}

impl std::str::FromStr for Handshake {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Handshake::Auto),
            "rdma_cm" | "rdmacm" | "cm" => Ok(Handshake::RdmaCm),
            "socket" | "tcp" => Ok(Handshake::Socket),
            other => Err(format!("{other:?} is not auto, rdma_cm or socket")),
        }
    }
}

impl VerbsConfig {
    /// Defaults for `device`, listening on `bind`.
    pub fn new(bind: SocketAddr, device: DeviceSpec) -> Self {
        VerbsConfig {
            tcp: TcpConfig::new(bind),
            device,
            eager_bytes: 16 << 10,
            recv_depth: 64,
            reg_cache: 0,
            pool_bytes: 256 << 20,
            inline_bytes: 128,
            spin_us: 200,
            offer_bytes: 16 << 20,
            handshake: Handshake::Auto,
        }
    }
}

/// Registers plain user memory for rendezvous sends, through the cache when enabled, and
/// recognises buffers this transport handed out.
pub struct Registrar {
    pd: Arc<ProtectionDomain>,
    tag: u32,
    cache: Option<Mutex<RegCache<Arc<MemoryRegion>>>>,
}

impl Registrar {
    /// The local key of a buffer from this transport's [`Transport::alloc_registered`].
    pub fn own_lkey(&self, key: RegionKey) -> Option<u32> {
        ((key.0 >> 32) as u32 == self.tag).then_some(key.0 as u32)
    }

    /// A registration covering `bytes`.
    pub fn register(&self, bytes: &[u8]) -> Result<Arc<MemoryRegion>, String> {
        let register = || {
            // SAFETY: the registration pins the pages it covers; it is held by the send until
            // the write completes (or by the cache, whose stale-entry hazard is documented and
            // opt-in), and the NIC only reads through it while the send borrows `bytes`.
            unsafe { memory::register(&self.pd, bytes.as_ptr(), bytes.len()) }
        };
        match &self.cache {
            Some(cache) => cache
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_register(bytes.as_ptr() as usize, bytes.len(), register),
            None => register(),
        }
    }

    /// Drops cached registrations overlapping `[addr, addr + len)`; call before freeing a
    /// buffer that was sent while `PSNET_RDMA_REG_CACHE` is on.
    pub fn invalidate(&self, addr: usize, len: usize) -> usize {
        match &self.cache {
            Some(cache) => cache
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .invalidate(addr, len),
            None => 0,
        }
    }
}

#[derive(PartialEq, Eq, Clone, Copy, Debug)]
enum Phase {
    /// We sent a request and wait for the reply.
    Requested,
    /// Our queue pair is connected (we may receive); sends wait for the peer's.
    Connected,
}

struct Current {
    link: Arc<Link>,
    phase: Phase,
    announced: bool,
    /// For a link built on a peer's request: that request's nonce and our reply, sent again
    /// if the request is repeated (its first copy or our reply may have been on a TCP
    /// connection that a simultaneous connect closed).
    answered: Option<(u64, Control)>,
    /// Connected (or being connected) through rdma_cm.
    via_cm: bool,
}

/// rdma_cm's side of the transport: the channel, the listening id, and the ids of the links.
struct CmState {
    channel: Arc<CmChannel>,
    _listener: CmId,
    conns: Mutex<HashMap<usize, CmConn>>,
}

/// An rdma_cm id serving a link.
struct CmConn {
    id: CmId,
    peer: NodeId,
    link: u32,
    /// This side sent the connect request.
    active: bool,
    /// Where the request goes (active side).
    addr: Option<SocketAddr>,
}

struct Inbox {
    tx: mpsc::UnboundedSender<(Event, usize)>,
    rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<(Event, usize)>>,
    bytes: AtomicUsize,
    limit: usize,
}

impl Inbox {
    fn full(&self) -> bool {
        self.bytes.load(Ordering::Acquire) >= self.limit
    }

    fn push_message(&self, m: Incoming) {
        let n = m.meta.len() + m.segments.iter().map(|s| s.len()).sum::<usize>();
        self.bytes.fetch_add(n, Ordering::AcqRel);
        let _ = self.tx.send((Event::Message(m), n));
    }

    fn push_event(&self, e: Event) {
        let _ = self.tx.send((e, 0));
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
    links: Mutex<HashMap<NodeId, Current>>,
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
        let min_slot = DataHeader::encoded_len(config.tcp.limits.max_segments as usize) + 64;
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
        sys::check_memlock(per_link * 4 + (16 << 20)).map_err(unavailable)?;
        sys::fork_init_once();
        let cq_per_link = params.recv_depth + params.sq_depth(16) + 1;
        let dev = Device::open(&config.device, cq_per_link.saturating_mul(256).min(1 << 17))
            .map_err(unavailable)?;
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
            links: Mutex::new(HashMap::new()),
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
        });
        let fd = sys::watch_channel(inner.dev.channel.clone())
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
        match sys::watch_async_events(inner.dev.ctx.clone()) {
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
        lock(&self.inner.links).get(&peer).map(|c| c.link.stats())
    }

    /// How this node connects queue pairs ([`Handshake::Auto`] resolved at bind).
    pub fn handshake(&self) -> Handshake {
        self.inner.config.handshake
    }

    /// How the queue pair to `peer` was connected (by whichever side dialled), or `None` if
    /// no queue pair to `peer` exists.
    pub fn connected_via(&self, peer: NodeId) -> Option<Handshake> {
        lock(&self.inner.links).get(&peer).map(|c| {
            if c.via_cm {
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

    fn new_link(&self, peer: NodeId, nonce: u64) -> Result<Arc<Link>, String> {
        let id = self.next_link.fetch_add(1, Ordering::Relaxed);
        let link = Arc::new(Link::new(
            self.dev.clone(),
            self.pool.clone(),
            id,
            peer,
            nonce,
            self.params.clone(),
            self.registrar.tag,
        )?);
        lock(&self.by_id).insert(id, link.clone());
        Ok(link)
    }

    /// Removes `peer`'s link (if it is `only_id`, when given); returns it and whether a
    /// `PeerConnected` was reported for it.
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

    fn remove_link(&self, peer: NodeId, only_id: Option<u32>, reason: &str) -> Option<bool> {
        let mut links = lock(&self.links);
        if let Some(id) = only_id {
            if links.get(&peer).map(|c| c.link.id) != Some(id) {
                return None;
            }
        }
        let current = links.remove(&peer)?;
        drop(links);
        current.link.fail(reason);
        lock(&self.by_id).remove(&current.link.id);
        self.drop_cm_of_link(current.link.id);
        self.links_changed.notify_waiters();
        Some(current.announced)
    }

    fn shutdown(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let _ = self.stop.send(true);
        self.tcp.shutdown();
        let peers: Vec<NodeId> = lock(&self.links).keys().copied().collect();
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

    fn fail_link(&self, link: &Link, reason: String) {
        if link.fail(&reason) {
            tracing::warn!(peer = %link.peer, %reason, "RDMA link failed");
            let _ = self.fail_tx.send((link.peer, link.id, reason));
        }
    }

    /// Handles every completion waiting in the queue; returns how many there were. Waits for
    /// a concurrent poll to finish, so that nothing queued before the call is left behind.
    fn drain_completions(&self) -> usize {
        let _polling = lock(&self.poll_gate);
        self.drain_polled()
    }

    /// As [`Inner::drain_completions`], unless someone else is polling right now.
    fn try_drain_completions(&self) -> usize {
        match self.poll_gate.try_lock() {
            Ok(_polling) => self.drain_polled(),
            Err(_) => 0,
        }
    }

    fn drain_polled(&self) -> usize {
        let mut handled = 0;
        let mut touched: Vec<Arc<Link>> = Vec::new();
        loop {
            let poller = match self.dev.cq.start_poll() {
                Ok(p) => p,
                Err(PollCompletionQueueError::CompletionQueueEmpty) => break,
                Err(e) => {
                    tracing::error!(error = %e, "polling the completion queue failed");
                    break;
                }
            };
            for wc in poller {
                handled += 1;
                let (link_id, kind, index) = link::split_wr_id(wc.wr_id());
                let Some(kind) = kind else { continue };
                let link = match touched.iter().find(|l| l.id == link_id) {
                    Some(l) => l.clone(),
                    None => match lock(&self.by_id).get(&link_id) {
                        Some(l) => {
                            touched.push(l.clone());
                            l.clone()
                        }
                        // A completion of a link already torn down.
                        None => continue,
                    },
                };
                let full = self.inbox.full();
                let completion = link::Completion {
                    kind,
                    index,
                    status: wc.status(),
                    opcode: wc.opcode(),
                    byte_len: wc.byte_len(),
                    imm: wc.imm_data(),
                };
                if let Err(reason) = link.on_completion(completion, full) {
                    self.fail_link(&link, reason);
                }
            }
        }
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
        if let Some(reason) = progress.failure {
            self.fail_link(link, reason);
        }
    }

    fn pump_all(&self) {
        let links: Vec<Arc<Link>> = lock(&self.by_id).values().cloned().collect();
        for link in links {
            self.pump(&link);
        }
    }

    async fn send_control(&self, peer: NodeId, msg: Control) -> Result<(), TransportError> {
        let bytes = msg.encode();
        self.tcp.send(peer, OutMessage::new(&bytes, &[])).await
    }

    async fn on_control(&self, peer: NodeId, msg: Control) {
        tracing::debug!(local = %self.tcp.local_id(), %peer, ?msg, "RDMA handshake message");
        match msg {
            Control::Request { nonce, info } => {
                let repeat = {
                    let links = lock(&self.links);
                    match links.get(&peer) {
                        // Both sides requested at once and ours wins.
                        Some(c) if c.phase == Phase::Requested && beats_request(c, nonce) => return,
                        Some(c) if c.phase == Phase::Connected => match c.answered {
                            // Our reply may have been lost: send it again.
                            Some((answered, reply)) if answered == nonce => Some(reply),
                            // A request the peer gave up when both sides requested at once
                            // (a new connection removes this link before its requests come).
                            _ => return,
                        },
                        _ => None,
                    }
                };
                if let Some(reply) = repeat {
                    let _ = self.send_control(peer, reply).await;
                    return;
                }
                let reply_nonce = random_u64();
                let link = match self.new_link(peer, reply_nonce).and_then(|l| {
                    l.connect_to(&info).map(|()| l.clone()).inspect_err(|e| {
                        l.fail(e);
                        lock(&self.by_id).remove(&l.id);
                    })
                }) {
                    Ok(l) => l,
                    Err(reason) => {
                        tracing::warn!(%peer, %reason, "cannot build the queue pair a peer asked for");
                        self.drop_control(peer);
                        return;
                    }
                };
                let reply = Control::Reply {
                    request: nonce,
                    nonce: reply_nonce,
                    info: link.local_info(),
                };
                let answer = Current {
                    link: link.clone(),
                    phase: Phase::Connected,
                    announced: true,
                    answered: Some((nonce, reply)),
                    via_cm: false,
                };
                if !self.install_answer(peer, nonce, answer) {
                    return;
                }
                self.links_changed.notify_waiters();
                self.announce(peer);
                if self.send_control(peer, reply).await.is_err() {
                    self.remove_link(peer, None, "control connection lost");
                }
            }
            Control::Reply {
                request,
                nonce,
                info,
            } => {
                let (link, repeated) = {
                    let links = lock(&self.links);
                    match links.get(&peer) {
                        Some(c) if c.link.nonce == request => {
                            (c.link.clone(), c.phase != Phase::Requested)
                        }
                        _ => return,
                    }
                };
                if repeated {
                    // A repeated reply: our confirmation was lost, send it again.
                    let _ = self.send_control(peer, Control::Ready { nonce }).await;
                    return;
                }
                if let Err(reason) = link.connect_to(&info) {
                    tracing::warn!(%peer, %reason, "cannot connect the queue pair");
                    self.remove_link(peer, Some(link.id), &reason);
                    self.drop_control(peer);
                    return;
                }
                if let Some(c) = lock(&self.links).get_mut(&peer) {
                    if c.link.id == link.id {
                        c.phase = Phase::Connected;
                        c.announced = true;
                    }
                }
                self.announce(peer);
                if self
                    .send_control(peer, Control::Ready { nonce })
                    .await
                    .is_err()
                {
                    self.remove_link(peer, Some(link.id), "control connection lost");
                    return;
                }
                link.set_remote_ready();
                self.links_changed.notify_waiters();
            }
            Control::Ready { nonce } => {
                let links = lock(&self.links);
                if let Some(c) = links.get(&peer) {
                    if c.link.nonce == nonce {
                        c.link.set_remote_ready();
                    }
                }
                drop(links);
                self.links_changed.notify_waiters();
            }
        }
    }

    /// Closes the control connection to `peer`, which then counts as not seen (see
    /// `on_cm_request`).
    fn drop_control(&self, peer: NodeId) {
        lock(&self.addrs).remove(&peer);
        self.tcp.disconnect(peer);
    }

    /// A queue pair received its first message: on a link accepted through rdma_cm that
    /// still waits for the RTU (lost, and repeated only after rdma_cm's timeout), the peer's
    /// queue pair is connected, so sending may start now.
    fn on_established(&self, qp_num: u32) {
        let Some(cm) = &self.cm else { return };
        let link = lock(&self.by_id)
            .values()
            .find(|l| l.qp_number() == qp_num)
            .cloned();
        let Some(link) = link else { return };
        let accepted = lock(&cm.conns)
            .values()
            .any(|c| c.link == link.id && !c.active);
        if accepted {
            link.set_remote_ready();
            self.links_changed.notify_waiters();
        }
    }

    /// Disconnects and destroys the rdma_cm ids serving link `link`.
    fn drop_cm_of_link(&self, link: u32) {
        let Some(cm) = &self.cm else { return };
        let gone: Vec<CmConn> = {
            let mut conns = lock(&cm.conns);
            let keys: Vec<usize> = conns
                .iter()
                .filter(|(_, c)| c.link == link)
                .map(|(k, _)| *k)
                .collect();
            keys.iter().filter_map(|k| conns.remove(k)).collect()
        };
        // Outside the lock: destroying an id may wait for the kernel.
        for conn in gone {
            // Tells the peer at once (it sees DISCONNECTED); fails harmlessly if never connected.
            let _ = conn.id.disconnect();
        }
    }

    /// Whether an rdma_cm connect request of link `link` is under way.
    fn cm_pending(&self, link: u32) -> bool {
        self.cm
            .as_ref()
            .is_some_and(|cm| lock(&cm.conns).values().any(|c| c.link == link && c.active))
    }

    /// Starts connecting `link` to `addr` through rdma_cm: resolve the address from this
    /// interface's, then the route, then send the request (see [`Inner::on_cm_event`]).
    fn start_cm_connect(&self, peer: NodeId, addr: SocketAddr, link: &Link) -> Result<(), String> {
        let cm = self.cm.as_ref().ok_or_else(|| {
            "rdma_cm is unavailable on this node (set PSNET_RDMA_CONNECT=socket)".to_string()
        })?;
        let id = cm
            .channel
            .create_id()
            .map_err(|e| format!("rdma_cm id: {e}"))?;
        let key = id.key();
        let local = self.tcp.listen_addr();
        let src = (!local.ip().is_unspecified()).then(|| SocketAddr::new(local.ip(), 0));
        let mut conns = lock(&cm.conns);
        // Registered before the call: its events may be read at once by the control loop.
        conns.insert(
            key,
            CmConn {
                id,
                peer,
                link: link.id,
                active: true,
                addr: Some(addr),
            },
        );
        let started = conns[&key].id.resolve_addr(src, addr, CM_RESOLVE_MS);
        if let Err(e) = started {
            let conn = conns.remove(&key);
            drop(conns);
            drop(conn);
            return Err(format!("rdma_cm cannot resolve {addr}: {e}"));
        }
        Ok(())
    }

    /// Acts on one rdma_cm event: the steps of a connection, and its failures as per-peer
    /// errors.
    fn on_cm_event(&self, ev: CmEvent) {
        let Some(cm) = &self.cm else { return };
        let name = rdmacm::event_name(ev.kind);
        tracing::debug!(local = %self.tcp.local_id(), event = name, status = ev.status, "rdma_cm event");
        if ev.kind == rdmacm::kind::CONNECT_REQUEST {
            if let Some(id) = ev.new_id {
                self.on_cm_request(id, &ev.private_data);
            }
            return;
        }
        let Some((peer, link_id, active, addr)) = lock(&cm.conns)
            .get(&ev.id)
            .map(|c| (c.peer, c.link, c.active, c.addr))
        else {
            return;
        };
        let Some(link) = lock(&self.by_id).get(&link_id).cloned() else {
            self.drop_cm_of_link(link_id);
            return;
        };
        let target = addr
            .map(|a| a.to_string())
            .unwrap_or_else(|| peer.to_string());
        let step = match ev.kind {
            rdmacm::kind::ADDR_RESOLVED => self
                .with_cm_id(ev.id, |id| id.resolve_route(CM_RESOLVE_MS))
                .map_err(|e| format!("rdma_cm cannot resolve a route to {target}: {e}")),
            rdmacm::kind::ROUTE_RESOLVED => self.send_cm_request(ev.id, &link, &target),
            rdmacm::kind::CONNECT_RESPONSE => self.on_cm_response(ev.id, peer, &link, &ev),
            rdmacm::kind::ESTABLISHED => {
                if !active {
                    link.set_remote_ready();
                    self.links_changed.notify_waiters();
                }
                Ok(())
            }
            rdmacm::kind::REJECTED => match CmMessage::decode(&ev.private_data) {
                // Retried by `connect` while the link waits (see `cm_pending`).
                Some(CmMessage::Refused(Refusal::Crossed | Refusal::NoControlConnection)) => {
                    tracing::debug!(%peer, "connect request refused for now; retrying");
                    if let Some(conn) = lock(&cm.conns).remove(&ev.id) {
                        drop(conn);
                    }
                    Ok(())
                }
                Some(CmMessage::Refused(why)) => Err(format!(
                    "{target} refused the RDMA connection: {}",
                    why.describe()
                )),
                _ => Err(format!(
                    "{target} refused the RDMA connection (rdma_cm reject reason {}{})",
                    ev.status,
                    if ev.status == 8 {
                        ": nothing listens there through rdma_cm; if the peer runs without \
                         rdma_cm, set PSNET_RDMA_CONNECT=socket"
                    } else {
                        ""
                    }
                )),
            },
            rdmacm::kind::DISCONNECTED => {
                // The peer ended this queue pair on purpose or died; its control connection
                // goes (or went) with it, and a new one may already be up: leave that alone.
                let reason = format!("{target} disconnected ({name})");
                match self.remove_link(peer, Some(link.id), &reason) {
                    Some(true) => self.inbox.push_event(Event::PeerLost { peer, reason }),
                    Some(false) => {}
                    None => {
                        link.fail(&reason);
                        lock(&self.by_id).remove(&link.id);
                        self.drop_cm_of_link(link.id);
                    }
                }
                Ok(())
            }
            rdmacm::kind::ADDR_ERROR
            | rdmacm::kind::ROUTE_ERROR
            | rdmacm::kind::CONNECT_ERROR
            | rdmacm::kind::UNREACHABLE
            | rdmacm::kind::DEVICE_REMOVAL => Err(format!(
                "rdma_cm: {name} for {target}: {}",
                std::io::Error::from_raw_os_error(ev.status.abs())
            )),
            _ => Ok(()),
        };
        if let Err(reason) = step {
            self.fail_link(&link, reason);
        }
    }

    fn with_cm_id<R>(
        &self,
        key: usize,
        f: impl FnOnce(&CmId) -> std::io::Result<R>,
    ) -> std::io::Result<R> {
        let cm = self
            .cm
            .as_ref()
            .ok_or_else(|| std::io::Error::other("no rdma_cm"))?;
        let conns = lock(&cm.conns);
        let conn = conns
            .get(&key)
            .ok_or_else(|| std::io::Error::other("rdma_cm id already gone"))?;
        f(&conn.id)
    }

    /// Active side, route resolved: checks rdma_cm chose this transport's port, then asks.
    fn send_cm_request(&self, key: usize, link: &Link, target: &str) -> Result<(), String> {
        let hello = CmMessage::Hello {
            from: self.tcp.local_id().0,
            nonce: link.nonce,
            recv_depth: self.params.recv_depth,
            slot_size: self.params.slot_size as u32,
        };
        let param = cm_param(link, hello);
        self.with_cm_id(key, |id| {
            if let Some((device, port)) = id.device_port() {
                if device != self.dev.name || port != self.dev.port {
                    return Err(std::io::Error::other(format!(
                        "rdma_cm routes to it through {device} port {port}, but this transport \
                         runs on {} port {} (check DMLC_INTERFACE and PSNET_IB_DEVICE)",
                        self.dev.name, self.dev.port
                    )));
                }
            }
            id.connect(&param)
        })
        .map_err(|e| format!("rdma_cm cannot connect to {target}: {e}"))
    }

    /// Active side: the peer accepted; connect the queue pair, complete the exchange, send.
    fn on_cm_response(
        &self,
        key: usize,
        peer: NodeId,
        link: &Arc<Link>,
        ev: &CmEvent,
    ) -> Result<(), String> {
        let Some(CmMessage::Welcome {
            nonce: _,
            recv_depth,
            slot_size,
        }) = CmMessage::decode(&ev.private_data)
        else {
            return Err("the peer accepted the RDMA connection without psnet's reply".into());
        };
        let current = lock(&self.links)
            .get(&peer)
            .is_some_and(|c| c.link.id == link.id && c.phase == Phase::Requested);
        if !current {
            // Superseded by the peer's own request meanwhile: let this connection go.
            self.drop_cm_of_link(link.id);
            return Ok(());
        }
        self.with_cm_id(key, |id| {
            let rtr = id.qp_attr(QueuePairState::ReadyToReceive)?;
            let rts = id.qp_attr(QueuePairState::ReadyToSend)?;
            link.connect_with(recv_depth, slot_size, rtr, rts)
                .map_err(std::io::Error::other)?;
            id.establish()
        })
        .map_err(|e| format!("cannot complete the RDMA connection: {e}"))?;
        if let Some(c) = lock(&self.links).get_mut(&peer) {
            if c.link.id == link.id {
                c.phase = Phase::Connected;
                c.announced = true;
            }
        }
        self.announce(peer);
        link.set_remote_ready();
        self.links_changed.notify_waiters();
        Ok(())
    }

    /// Passive side: a peer asks to connect. Builds and connects a queue pair and accepts,
    /// or refuses saying why; simultaneous requests are settled by nonce, as over sockets.
    fn on_cm_request(&self, id: CmId, data: &[u8]) {
        let refuse = |id: CmId, why: Refusal| {
            if let Err(e) = id.reject(&CmMessage::Refused(why).encode()) {
                tracing::debug!(error = %e, "rdma_cm reject");
            }
        };
        let Some(CmMessage::Hello {
            from,
            nonce,
            recv_depth,
            slot_size,
        }) = CmMessage::decode(data)
        else {
            tracing::warn!("refused an rdma_cm connect request that is not psnet's");
            return refuse(id, Refusal::Malformed);
        };
        let peer = NodeId(from);
        // The peer's control connection must be up and its arrival handled here: handling it
        // after this request would take the new link for a stale one. Refused for now
        // otherwise; the peer asks again.
        if !self.tcp.connected_peers().contains(&peer) || !lock(&self.addrs).contains_key(&peer) {
            return refuse(id, Refusal::NoControlConnection);
        }
        if lock(&self.links)
            .get(&peer)
            .is_some_and(|c| beats_request(c, nonce))
        {
            return refuse(id, Refusal::Crossed);
        }
        let reply_nonce = random_u64();
        let built = self.new_link(peer, reply_nonce).and_then(|link| {
            let connected = id
                .qp_attr(QueuePairState::ReadyToReceive)
                .and_then(|rtr| Ok((rtr, id.qp_attr(QueuePairState::ReadyToSend)?)))
                .map_err(|e| format!("rdma_cm queue-pair attributes: {e}"))
                .and_then(|(rtr, rts)| link.connect_with(recv_depth, slot_size, rtr, rts));
            if let Err(e) = connected {
                link.fail(&e);
                lock(&self.by_id).remove(&link.id);
                return Err(e);
            }
            Ok(link)
        });
        let link = match built {
            Ok(link) => link,
            Err(reason) => {
                tracing::warn!(%peer, %reason, "cannot build the queue pair a peer asked for");
                return refuse(id, Refusal::CannotConnect);
            }
        };
        let answer = Current {
            link: link.clone(),
            phase: Phase::Connected,
            announced: true,
            answered: None,
            via_cm: true,
        };
        if !self.install_answer(peer, nonce, answer) {
            return refuse(id, Refusal::Crossed);
        }
        let welcome = CmMessage::Welcome {
            nonce: reply_nonce,
            recv_depth: self.params.recv_depth,
            slot_size: self.params.slot_size as u32,
        };
        let param = cm_param(&link, welcome);
        if let Err(e) = id.accept(&param) {
            let reason = format!("rdma_cm cannot accept: {e}");
            tracing::warn!(%peer, %reason, "RDMA connection failed");
            self.remove_link(peer, Some(link.id), &reason);
            return;
        }
        if let Some(cm) = &self.cm {
            lock(&cm.conns).insert(
                id.key(),
                CmConn {
                    id,
                    peer,
                    link: link.id,
                    active: false,
                    addr: None,
                },
            );
        }
        self.links_changed.notify_waiters();
        self.announce(peer);
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

/// What rdma_cm sends for `link`: its queue pair and psnet's handshake message, with the
/// same retry limits as the socket handshake's queue pairs.
fn cm_param(link: &Link, message: CmMessage) -> ConnParam {
    ConnParam {
        qp_num: link.qp_number(),
        private_data: message.encode(),
        retry_count: 7,
        rnr_retry_count: 6,
    }
}

/// Opens rdma_cm's channel and listens on the control connection's address (the same IP and
/// port, in rdma_cm's own port space), so that peers find both at one address.
fn listen_cm(dev: &Device, addr: SocketAddr) -> Result<CmState, String> {
    let channel = CmChannel::new().map_err(|e| format!("rdma_cm event channel: {e}"))?;
    let listener = channel
        .create_id()
        .map_err(|e| format!("rdma_cm id: {e}"))?;
    listener
        .bind(addr)
        .map_err(|e| format!("rdma_cm cannot bind {addr}: {e}"))?;
    listener
        .listen(128)
        .map_err(|e| format!("rdma_cm cannot listen on {addr}: {e}"))?;
    if let Some((device, port)) = listener.device_port() {
        if device != dev.name || port != dev.port {
            return Err(format!(
                "rdma_cm binds {addr} to {device} port {port}, but this transport runs on {} \
                 port {}",
                dev.name, dev.port
            ));
        }
    }
    tracing::debug!(%addr, "rdma_cm listening");
    Ok(CmState {
        channel,
        _listener: listener,
        conns: Mutex::new(HashMap::new()),
    })
}

async fn poll_loop(
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
        if let Err(e) = sys::req_notify(&inner.dev.cq) {
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
                    sys::drain_cq_events(fd.get_ref());
                    guard.clear_ready();
                }
            }
            _ = inner.drained.notified() => inner.pump_all(),
            _ = stop.changed() => return,
        }
        idle = 0;
    }
}

/// Turns the device's asynchronous events into per-peer failures (see [`events::decide`]).
async fn device_event_loop(
    inner: Arc<Inner>,
    fd: AsyncFd<sys::AsyncEventFd>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            ready = fd.readable() => {
                let Ok(mut guard) = ready else { return };
                while let Some(event) = sys::next_async_event(&inner.dev.ctx) {
                    inner.on_device_event(&event);
                }
                guard.clear_ready();
            }
            _ = stop.changed() => return,
        }
    }
}

/// Handles the control connections' events, rdma_cm's events and link failures, in one task:
/// a peer's new control connection is seen before its rdma_cm request (which follows it).
async fn control_loop(
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
            eager_limit: self.inner.params.slot_size - DataHeader::encoded_len(1),
            zero_copy_send: true,
            prefers_registered: true,
        }
    }

    async fn connect(&self, peer: NodeId, addr: SocketAddr) -> Result<(), TransportError> {
        let inner = &self.inner;
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
                            .map_err(|reason| TransportError::Handshake { peer, reason })?;
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
                if let Err(reason) = inner.start_cm_connect(peer, addr, &link) {
                    inner.remove_link(peer, Some(link.id), &reason);
                    return Err(TransportError::Handshake { peer, reason });
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

    async fn send<'a>(&'a self, peer: NodeId, msg: OutMessage<'a>) -> Result<(), TransportError> {
        if self.inner.is_closed() {
            return Err(TransportError::Closed);
        }
        let link = lock(&self.inner.links)
            .get(&peer)
            .map(|c| c.link.clone())
            .ok_or(TransportError::NotConnected { peer })?;
        link.send(msg, &self.inner.registrar).await
    }

    async fn recv(&self) -> Result<Event, TransportError> {
        let inner = &self.inner;
        if inner.is_closed() {
            return Err(TransportError::Closed);
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
        match next {
            Some((event, n)) if !inner.is_closed() => {
                if n > 0 {
                    let before = inner.inbox.bytes.fetch_sub(n, Ordering::AcqRel);
                    if before >= inner.inbox.limit && before - n < inner.inbox.limit {
                        inner.drained.notify_one();
                    }
                }
                Ok(event)
            }
            _ => Err(TransportError::Closed),
        }
    }

    fn disconnect(&self, peer: NodeId) {
        self.inner.remove_link(peer, None, "disconnected");
        self.inner.drop_control(peer);
    }

    fn connected_peers(&self) -> Vec<NodeId> {
        let mut peers: Vec<NodeId> = lock(&self.inner.links)
            .iter()
            .filter(|(_, c)| c.link.is_ready())
            .map(|(p, _)| *p)
            .collect();
        peers.sort();
        peers
    }

    fn alloc_registered(&self, len: usize) -> Result<RegisteredBuf, TransportError> {
        let mut data = vec![0u8; len].into_boxed_slice();
        // SAFETY: the registration is stored in the RegisteredBuf next to the memory and is
        // dropped before it (RegisteredBuf's field order and Drop).
        let mr = unsafe { memory::register(&self.inner.dev.pd, data.as_mut_ptr(), len) }
            .map_err(TransportError::Unavailable)?;
        let key = RegionKey(((self.inner.registrar.tag as u64) << 32) | mr.lkey() as u64);
        Ok(RegisteredBuf::with_registration(data, key, mr))
    }

    fn shutdown(&self) {
        self.inner.shutdown();
    }
}
