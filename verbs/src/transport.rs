//! [`VerbsTransport`]: the transport contract over RDMA reliable-connected queue pairs.
//!
//! Data moves over one queue pair per peer; a TCP connection per peer (psnet's TCP transport,
//! on the same address) carries the queue-pair handshake and tells when a peer process dies,
//! the way NCCL and perftest exchange queue-pair numbers over a socket. A single task polls
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
    Capabilities, Event, Incoming, NodeId, OutMessage, RegionKey, RegisteredBuf, Transport,
    TransportError,
};
use sideway::ibverbs::completion::PollCompletionQueueError;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch, Notify};

use crate::control::Control;
use crate::device::{Device, DeviceSpec};
use crate::events;
use crate::link::{self, Link, LinkParams};
use crate::memory::{self, RecvPool};
use crate::proto::wire::DataHeader;
use crate::regcache::RegCache;
use crate::sys;

/// How often an unanswered queue-pair request is repeated.
const REQUEST_RESEND: Duration = Duration::from_millis(300);
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
        });
        let fd = sys::watch_channel(inner.dev.channel.clone())
            .map_err(|e| unavailable(format!("completion channel: {e}")))?;
        tokio::spawn(poll_loop(inner.clone(), fd, inner.stop.subscribe()));
        tokio::spawn(control_loop(inner.clone(), fail_rx, inner.stop.subscribe()));
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
                        // Both sides requested at once: the larger nonce wins on both sides.
                        Some(c) if c.phase == Phase::Requested && c.link.nonce > nonce => return,
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
                let link = match self
                    .new_link(peer, reply_nonce)
                    .and_then(|l| l.connect_to(&info).map(|()| l))
                {
                    Ok(l) => l,
                    Err(reason) => {
                        tracing::warn!(%peer, %reason, "cannot build the queue pair a peer asked for");
                        self.tcp.disconnect(peer);
                        return;
                    }
                };
                let reply = Control::Reply {
                    request: nonce,
                    nonce: reply_nonce,
                    info: link.local_info(),
                };
                // Swap under one lock hold: a `connect` racing with us must never see the peer
                // without a link (it would start a request of its own).
                let replaced = {
                    let mut links = lock(&self.links);
                    let superseded = links.get(&peer).is_some_and(|c| match c.phase {
                        Phase::Requested => c.link.nonce > nonce,
                        Phase::Connected => true,
                    });
                    if superseded {
                        None
                    } else {
                        Some(links.insert(
                            peer,
                            Current {
                                link: link.clone(),
                                phase: Phase::Connected,
                                announced: true,
                                answered: Some((nonce, reply)),
                            },
                        ))
                    }
                };
                let Some(old) = replaced else {
                    link.fail("superseded during the handshake");
                    lock(&self.by_id).remove(&link.id);
                    return;
                };
                if let Some(old) = old {
                    old.link.fail("replaced by a new queue pair");
                    lock(&self.by_id).remove(&old.link.id);
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
                    self.tcp.disconnect(peer);
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

    fn announce(&self, peer: NodeId) {
        let addr = lock(&self.addrs)
            .get(&peer)
            .copied()
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        tracing::debug!(%peer, %addr, "RDMA link up");
        self.inbox.push_event(Event::PeerConnected { peer, addr });
    }
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

async fn control_loop(
    inner: Arc<Inner>,
    mut failures: mpsc::UnboundedReceiver<(NodeId, u32, String)>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
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
                        inner.tcp.disconnect(m.peer);
                        if inner.remove_link(m.peer, None, "malformed control message") == Some(true) {
                            inner.inbox.push_event(Event::PeerLost {
                                peer: m.peer,
                                reason: "malformed RDMA control message".into(),
                            });
                        }
                    }
                },
                Ok(Event::PeerLost { peer, reason }) => {
                    if inner.remove_link(peer, None, &reason) == Some(true) {
                        inner.inbox.push_event(Event::PeerLost { peer, reason });
                    }
                }
                Err(_) => return,
            },
            Some((peer, id, reason)) = failures.recv() => {
                if inner.remove_link(peer, Some(id), &reason) == Some(true) {
                    inner.tcp.disconnect(peer);
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
        loop {
            let notified = inner.links_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if inner.is_closed() {
                return Err(TransportError::Closed);
            }
            let request = {
                let mut links = lock(&inner.links);
                match links.get(&peer) {
                    Some(c) if c.link.is_ready() => return Ok(()),
                    Some(c) => match c.link.failure() {
                        Some(reason) => {
                            return Err(TransportError::Handshake { peer, reason });
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
                        let info = link.local_info();
                        let nonce = link.nonce;
                        links.insert(
                            peer,
                            Current {
                                link,
                                phase: Phase::Requested,
                                announced: false,
                                answered: None,
                            },
                        );
                        Some(Control::Request { nonce, info })
                    }
                }
            };
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
        self.inner.tcp.disconnect(peer);
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
