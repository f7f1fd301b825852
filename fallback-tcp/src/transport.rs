use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use psnet_transport::codec::FrameHeader;
use psnet_transport::device::{DevicePath, PathLog, StreamError};
use psnet_transport::session::{Role, Session, SessionBase};
use psnet_transport::{
    Admission, Binding, Capabilities, Event, FrameKind, NodeId, OutMessage, Placer, Proof,
    RegisteredBuf, Transport, TransportError,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;
use tokio::time::sleep;

use crate::config::TcpConfig;
use crate::conn::Conn;
use crate::faults::{FaultCounts, Faults, Strike};
use crate::inbox::Inbox;
use crate::peers::Peers;
use crate::reader::{read_loop, Inflight, ReadEnd};
use crate::send::Path;
use crate::shm::{self, SHM_MIN};

mod opening;

use opening::{accept_loop, Side};

/// How long `shutdown` waits, at most, for the peers' kernels to acknowledge what was sent.
const SHUTDOWN_LINGER: std::time::Duration = std::time::Duration::from_secs(1);

/// The TCP implementation of [`Transport`].
///
/// Listens from [`TcpTransport::bind`] on; dropping it (or calling
/// [`Transport::shutdown`]) closes every connection.
pub struct TcpTransport {
    inner: Arc<Inner>,
}

struct Inner {
    local_id: AtomicU64,
    listen_addr: SocketAddr,
    config: TcpConfig,
    peers: Peers,
    inbox: Arc<Inbox>,
    inflight: Inflight,
    closed: AtomicBool,
    acceptor: Mutex<Option<AbortHandle>>,
    admission: Mutex<Option<Arc<dyn Admission>>>,
    faults: Option<Faults>,
    /// The paths device segments took, logged once per peer.
    device_paths: PathLog,
    /// Messages sent by each path.
    paths: PathCounts,
}

impl TcpTransport {
    /// Listens on `config.bind` as node `id`. Needs a tokio runtime.
    pub async fn bind(id: NodeId, config: TcpConfig) -> Result<Self, TransportError> {
        let listener =
            TcpListener::bind(config.bind)
                .await
                .map_err(|source| TransportError::Bind {
                    addr: config.bind,
                    source,
                })?;
        let listen_addr = listener
            .local_addr()
            .map_err(|source| TransportError::Bind {
                addr: config.bind,
                source,
            })?;
        let faults = config.faults.clone().map(Faults::new);
        if let Some(f) = &faults {
            tracing::warn!(%id, faults = %f.spec(), "PSNET_FAULTS: injecting faults into this node's sends");
        }
        let inner = Arc::new(Inner {
            local_id: AtomicU64::new(id.0),
            listen_addr,
            peers: Peers::default(),
            inbox: Arc::new(Inbox::new(config.inbox_bytes, config.gpu_stage_chunk)),
            inflight: Inflight::new(
                config.inflight_bytes,
                config.inflight_wait,
                config.frame_stall,
            ),
            config,
            closed: AtomicBool::new(false),
            acceptor: Mutex::new(None),
            admission: Mutex::new(None),
            faults,
            device_paths: PathLog::default(),
            paths: PathCounts::default(),
        });
        let task = tokio::spawn(accept_loop(listener, inner.clone()));
        *inner.acceptor.lock().unwrap_or_else(|p| p.into_inner()) = Some(task.abort_handle());
        tracing::debug!(%id, addr = %listen_addr, "tcp transport listening");
        Ok(TcpTransport { inner })
    }
}

/// The session of a live connection, as [`TcpTransport::session_with`] tells it.
#[derive(Clone, Debug)]
pub enum PeerSession {
    /// The job has no secret: the connection has no session (an open job).
    Open,
    /// The connection's session, and which end of it this node is.
    Keyed(SessionBase, Role),
    /// No live connection to the peer.
    NotConnected,
}

impl TcpTransport {
    /// The session of the live connection to `peer`: what a channel beside it between the
    /// same two nodes (RDMA's queue pairs, whose control connection this is) derives its
    /// keys from ([`psnet_transport::session::Session::channel`]).
    pub fn session_with(&self, peer: NodeId) -> PeerSession {
        if self.inner.config.secret.is_none() {
            return PeerSession::Open;
        }
        match self.inner.peers.get(peer) {
            Some(conn) if !conn.is_broken() => match &conn.session {
                Some((base, role)) => PeerSession::Keyed(base.clone(), *role),
                None => PeerSession::NotConnected,
            },
            _ => PeerSession::NotConnected,
        }
    }

    /// What `PSNET_FAULTS` injected so far (`None` without it).
    pub fn fault_counts(&self) -> Option<FaultCounts> {
        self.inner.faults.as_ref().map(Faults::counts)
    }

    /// How many messages this transport sent by each path so far.
    pub fn send_paths(&self) -> SendPaths {
        self.inner.paths.get()
    }
}

/// A ring region holding a message not yet sent: freed if the send fails or is dropped
/// first, so that one abandoned send cannot pin the ring for the rest of the connection (the
/// ring frees from its oldest region). Once the descriptor may have reached the peer, the
/// connection is closed (see `send_message`) or the send returned.
struct UnsentRegion {
    ring: Arc<shm::SendRing>,
    off: usize,
    len: usize,
    sent: bool,
}

impl Drop for UnsentRegion {
    fn drop(&mut self) {
        if !self.sent {
            self.ring.free(self.off, self.len);
        }
    }
}

/// Messages a [`TcpTransport`] sent, by the path they took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendPaths {
    /// Copied whole into a same-host peer's shared-memory queue.
    pub queue: u64,
    /// In a same-host peer's shared-memory ring, described in the queue or on the socket.
    pub ring: u64,
    /// Through the socket.
    pub socket: u64,
}

#[derive(Default)]
struct PathCounts([AtomicU64; 3]);

impl PathCounts {
    fn count(&self, path: Path) {
        let i = match path {
            Path::Inline => 0,
            Path::Ring => 1,
            Path::Socket => 2,
        };
        self.0[i].fetch_add(1, Ordering::Relaxed);
    }

    fn get(&self) -> SendPaths {
        let n = |i: usize| self.0[i].load(Ordering::Relaxed);
        SendPaths {
            queue: n(0),
            ring: n(1),
            socket: n(2),
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.inner.shutdown();
    }
}

impl Inner {
    fn local(&self) -> NodeId {
        NodeId(self.local_id.load(Ordering::Relaxed))
    }

    fn admission(&self) -> Option<Arc<dyn Admission>> {
        self.admission
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The proof our hello carries under the current id on the connection of `binding`.
    fn own_proof(&self, binding: &Binding) -> Option<Proof> {
        self.admission()
            .and_then(|a| a.proof(self.local(), binding))
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn shutdown(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(f) = &self.faults {
            let c = f.counts();
            tracing::warn!(
                sends = c.sends,
                drops = c.drops,
                resets = c.resets,
                "PSNET_FAULTS: faults injected into this node's sends"
            );
        }
        if let Some(h) = self
            .acceptor
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            h.abort();
        }
        let conns = self.peers.drain();
        for conn in &conns {
            conn.begin_graceful_close();
        }
        // Blocking, but bounded: a process that exits right after shutting down must not take
        // its last messages with it (closing with anything unread makes the kernel reset the
        // connection and drop what it still holds). Acknowledgements come from the peers'
        // kernels, not their applications, so this is quick unless a peer stopped reading.
        let deadline = std::time::Instant::now() + SHUTDOWN_LINGER;
        let mut pause = std::time::Duration::from_micros(20);
        // A connection is asked until it answers yes once: the check reads (and so clears)
        // the socket's pending error, and a reset one would answer no again.
        let mut waiting: Vec<&Arc<Conn>> = conns.iter().collect();
        loop {
            waiting.retain(|c| !c.all_acknowledged());
            if waiting.is_empty() {
                break;
            }
            if std::time::Instant::now() >= deadline {
                tracing::debug!(id = %self.local(), "shutting down with sent data unacknowledged");
                break;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_millis(5));
        }
        for conn in &conns {
            conn.finish_graceful_close();
        }
        self.inbox.close();
        tracing::debug!(id = %self.local(), "tcp transport shut down");
    }

    /// Splits an established stream, installs it and starts its reader. An accepted stream is
    /// installed only if its marker still holds the peer's slot; returns false otherwise.
    fn install(
        self: &Arc<Self>,
        peer: NodeId,
        side: Side,
        stream: TcpStream,
        leftover: BytesMut,
        session: Option<SessionBase>,
    ) -> io::Result<bool> {
        let addr = stream.peer_addr()?;
        // Every frame from here on is tagged under keys bound to both ends' ids.
        let (sealer, opener, kept) = match session {
            None => (None, None, None),
            Some(base) => {
                let local = self.local();
                let (role, dialler, acceptor) = match side {
                    Side::Dialled => (Role::Dialler, local, peer),
                    Side::Accepted(_) => (Role::Acceptor, peer, local),
                };
                let (sealer, opener) = Session::bound(&base, role, dialler, acceptor);
                let sealer = sealer.encrypting(self.config.encrypt);
                (Some(sealer), Some(opener), Some((base, role)))
            }
        };
        let control = stream.into_std()?;
        let dup = control.try_clone()?;
        let stream = TcpStream::from_std(control)?;
        let (read, write) = stream.into_split();
        let same_host = addr.ip().is_loopback() || addr.ip() == self.listen_addr.ip();
        let conn = Arc::new(Conn::new(
            peer,
            side == Side::Dialled,
            same_host,
            write,
            dup,
            sealer,
            kept,
        ));
        match side {
            Side::Dialled => self.peers.install_dialled(peer, conn.clone()),
            Side::Accepted(token) => {
                if !self.peers.install_accepted(peer, token, conn.clone()) {
                    conn.close();
                    return Ok(false);
                }
            }
        }
        // Announced before the reader starts, so that the connection's first message never
        // reaches the inbox ahead of its PeerConnected.
        self.inbox.push_event(Event::PeerConnected { peer, addr });
        let inner = self.clone();
        let reader_conn = conn.clone();
        let task = tokio::spawn(async move {
            let end = read_loop(
                read,
                leftover,
                reader_conn.clone(),
                &inner.inbox,
                inner.config.limits,
                &inner.inflight,
                inner.config.shm_spin,
                opener,
            )
            .await;
            inner.connection_ended(&reader_conn, end);
        });
        conn.set_reader(task.abort_handle());
        let control_conn = conn.clone();
        let control = tokio::spawn(async move {
            loop {
                control_conn.control.notify.notified().await;
                for (kind, body) in control_conn.control.take() {
                    if control_conn.write_control(kind, &body).await.is_err() {
                        return;
                    }
                }
            }
        });
        conn.set_control_task(control.abort_handle());
        if self.config.shm_ring > 0 {
            conn.offer_queue(self.config.shm_queue);
        }
        if self.is_closed() {
            conn.close_and_stop_reader();
            return Ok(false);
        }
        tracing::debug!(local = %self.local(), %peer, %addr, "connected");
        Ok(true)
    }

    fn connection_ended(&self, conn: &Arc<Conn>, end: ReadEnd) {
        let reason = match end {
            ReadEnd::Shutdown => {
                conn.close();
                return;
            }
            ReadEnd::Closed => {
                conn.close();
                "closed by the peer".to_string()
            }
            ReadEnd::Failed(why) => {
                conn.close();
                why
            }
            ReadEnd::Refused(why) => {
                // Tell the peer why before closing (a frame over the limits, a malformed
                // one): its error then says so instead of "closed by the peer". Bounded: a
                // peer that does not read is not waited for.
                let (conn, notice) = (conn.clone(), why.clone());
                tokio::spawn(async move { conn.close_with_notice(&notice).await });
                why
            }
        };
        // A connection replaced by a newer one to the same peer is not a loss of the peer.
        if self.peers.remove_conn(conn) && !self.is_closed() {
            tracing::info!(local = %self.local(), peer = %conn.peer, %reason, "peer lost");
            self.inbox.push_event(Event::PeerLost {
                peer: conn.peer,
                reason,
            });
        }
    }
}

impl Transport for TcpTransport {
    fn local_id(&self) -> NodeId {
        self.inner.local()
    }

    fn set_local_id(&self, id: NodeId) {
        self.inner.local_id.store(id.0, Ordering::Relaxed);
    }

    fn set_admission(&self, admission: Arc<dyn Admission>) {
        *self
            .inner
            .admission
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(admission);
    }

    fn set_placer(&self, placer: Arc<dyn Placer>) -> bool {
        self.inner.inbox.placing.set_placer(placer);
        true
    }

    fn listen_addr(&self) -> SocketAddr {
        self.inner.listen_addr
    }

    fn capabilities(&self) -> Capabilities {
        let limits = self.inner.config.limits;
        Capabilities {
            name: "tcp",
            max_message: limits.max_message,
            max_meta: limits.max_meta,
            max_segments: limits.max_segments,
            same_host_shm: self.inner.config.shm_ring > 0 && self.inner.config.shm_queue > 0,
        }
    }

    fn connect(
        &self,
        peer: NodeId,
        addr: SocketAddr,
    ) -> impl std::future::Future<Output = Result<(), TransportError>> + Send + '_ {
        self.inner.connect(peer, addr, false)
    }

    fn redial(
        &self,
        peer: NodeId,
        addr: SocketAddr,
    ) -> impl std::future::Future<Output = Result<(), TransportError>> + Send + '_ {
        self.inner.connect(peer, addr, true)
    }

    async fn send<'a>(&'a self, peer: NodeId, msg: OutMessage<'a>) -> Result<(), TransportError> {
        let inner = &self.inner;
        if inner.is_closed() {
            return Err(TransportError::Closed);
        }
        let header = FrameHeader::for_message(FrameKind::Data, &msg, &inner.config.limits)
            .map_err(|source| TransportError::Invalid { peer, source })?;
        let conn = match inner.peers.get(peer) {
            Some(conn) => conn,
            None => inner
                .peers
                .settled(peer, inner.config.connect_timeout)
                .await
                .ok_or(TransportError::NotConnected { peer })?,
        };
        let lost = |e: std::io::Error| TransportError::PeerLost {
            peer,
            reason: e.to_string(),
        };
        let strike = match &inner.faults {
            None => Strike::None,
            Some(f) => {
                let (delay, strike) = f.draw();
                if !delay.is_zero() {
                    sleep(delay).await;
                }
                if strike == Strike::Drop {
                    tracing::info!(%peer, "PSNET_FAULTS: dropping the connection with a message");
                    conn.close();
                    return Ok(());
                }
                strike
            }
        };
        let mut ring = None;
        let mut region = None;
        let ring_min = conn
            .active_queue()
            .map_or(SHM_MIN, |q| crate::send::queued_ring_min(&q));
        if header.body_len() - u64::from(header.meta_len) >= ring_min as u64 {
            // The first large message to a peer on this host offers the bulk path; it goes
            // through the socket itself, later ones through the ring once accepted.
            conn.offer_ring(inner.config.shm_ring);
            conn.collect_releases();
            if let Some((send_ring, (off, len))) = conn
                .active_ring()
                .and_then(|r| r.put(msg.segments).map(|at| (r, at)))
            {
                ring = Some(shm::descriptor(off, msg.segments));
                region = Some(UnsentRegion {
                    ring: send_ring,
                    off,
                    len,
                    sent: false,
                });
            }
        }
        if msg.has_device() {
            for ordinal in msg.segments.iter().filter_map(|s| s.device_bytes()) {
                inner
                    .device_paths
                    .note("tcp", peer, ordinal.ordinal(), DevicePath::Staged);
            }
        }
        let path = conn
            .send_message(
                &msg,
                &inner.config.limits,
                ring,
                inner.config.gpu_stage_chunk,
            )
            .await
            .map_err(|e| match e {
                StreamError::Device(source) => TransportError::Device { peer, source },
                StreamError::Io(e) => lost(e),
            })?;
        // Sent: the peer releases it. (Dropped or failed before that, the guard frees it.)
        if let Some(region) = region.as_mut() {
            region.sent = true;
        }
        inner.paths.count(path);
        if strike == Strike::Reset {
            tracing::info!(%peer, "PSNET_FAULTS: resetting the connection after a message");
            conn.close();
        }
        Ok(())
    }

    fn recv(&self) -> impl std::future::Future<Output = Result<Event, TransportError>> + Send + '_ {
        self.inner.inbox.recv()
    }

    fn disconnect(&self, peer: NodeId) {
        if let Some(conn) = self.inner.peers.get(peer) {
            // Out of the table first, so that its reader's end reports no loss.
            self.inner.peers.remove_conn(&conn);
            conn.close();
        }
    }

    fn connected_peers(&self) -> Vec<NodeId> {
        self.inner.peers.connected()
    }

    fn alloc_registered(&self, len: usize) -> Result<RegisteredBuf, TransportError> {
        // TCP sends from any memory; registration is a no-op.
        Ok(RegisteredBuf::unregistered(len))
    }

    fn shutdown(&self) {
        self.inner.shutdown();
    }
}
