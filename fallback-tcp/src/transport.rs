use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use psnet_transport::codec::{FrameHeader, HeaderBuf, Hello};
use psnet_transport::{
    Admission, Capabilities, Event, FrameKind, NodeId, OutMessage, Proof, RegisteredBuf, Segment,
    Transport, TransportError,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;
use tokio::time::{sleep, timeout, Instant};

use crate::config::TcpConfig;
use crate::conn::Conn;
use crate::faults::{FaultCounts, Faults, Strike};
use crate::handshake::{self, Answer, Opening};
use crate::inbox::Inbox;
use crate::peers::{decide_hello, HelloDecision, Peers, PendingGuard, Slot, SIMULTANEOUS};
use crate::reader::{read_loop, Inflight, ReadEnd};
use crate::shm::{self, SHM_MIN};
use crate::socket::tune;

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
    inbox: Inbox,
    inflight: Inflight,
    closed: AtomicBool,
    acceptor: Mutex<Option<AbortHandle>>,
    admission: Mutex<Option<Arc<dyn Admission>>>,
    faults: Option<Faults>,
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
            inbox: Inbox::new(config.inbox_bytes),
            inflight: Inflight::new(config.inflight_bytes, config.inflight_wait),
            config,
            closed: AtomicBool::new(false),
            acceptor: Mutex::new(None),
            admission: Mutex::new(None),
            faults,
        });
        let task = tokio::spawn(accept_loop(listener, inner.clone()));
        *inner.acceptor.lock().unwrap_or_else(|p| p.into_inner()) = Some(task.abort_handle());
        tracing::debug!(%id, addr = %listen_addr, "tcp transport listening");
        Ok(TcpTransport { inner })
    }
}

impl TcpTransport {
    /// What `PSNET_FAULTS` injected so far (`None` without it).
    pub fn fault_counts(&self) -> Option<FaultCounts> {
        self.inner.faults.as_ref().map(Faults::counts)
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

    /// The proof our hellos carry under the current id.
    fn own_proof(&self) -> Option<Proof> {
        self.admission().and_then(|a| a.proof(self.local()))
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
        for conn in self.peers.drain() {
            conn.close_and_stop_reader();
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
    ) -> io::Result<bool> {
        let addr = stream.peer_addr()?;
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
        if self.is_closed() {
            conn.close_and_stop_reader();
            return Ok(false);
        }
        tracing::debug!(local = %self.local(), %peer, %addr, "connected");
        Ok(true)
    }

    fn connection_ended(&self, conn: &Arc<Conn>, end: ReadEnd) {
        conn.close();
        let reason = match end {
            ReadEnd::Shutdown => return,
            ReadEnd::Closed => "closed by the peer".to_string(),
            ReadEnd::Failed(why) => why,
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

    /// Connects to `peer`; with `refusal_is_final`, an address that refuses is an error at
    /// once (a redial: the peer's process is gone) rather than retried until the timeout.
    async fn connect(
        self: &Arc<Self>,
        peer: NodeId,
        addr: SocketAddr,
        refusal_is_final: bool,
    ) -> Result<(), TransportError> {
        let deadline = Instant::now() + self.config.connect_timeout;
        let token = loop {
            if self.is_closed() {
                return Err(TransportError::Closed);
            }
            let changed = self.peers.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut slots = self.peers.lock();
                match slots.get(&peer) {
                    Some(Slot::Connected(c)) if !c.is_broken() => return Ok(()),
                    Some(Slot::Dialing(_) | Slot::Accepting(_)) => {}
                    _ => {
                        let token = self.peers.token();
                        slots.insert(peer, Slot::Dialing(token));
                        break token;
                    }
                }
            }
            // Someone else is setting up this peer's connection: wait for the outcome.
            if timeout(deadline.saturating_duration_since(Instant::now()), changed)
                .await
                .is_err()
            {
                return Err(TransportError::Handshake {
                    peer,
                    reason: "timed out waiting for a concurrent connection attempt".into(),
                });
            }
        };
        let guard = PendingGuard {
            peers: &self.peers,
            peer,
            token,
        };
        let (mut stream, answer, leftover) =
            self.dial(peer, addr, deadline, refusal_is_final).await?;
        if let (Answer::Ack(hello), Some(admission)) = (&answer, self.admission()) {
            if hello.id == peer {
                if let Err(reason) = admission.admit(peer, hello.proof.as_ref()) {
                    tracing::warn!(%peer, %addr, %reason, "refusing the node that answered");
                    let _ = handshake::write_frame(
                        &mut stream,
                        FrameKind::HelloReject,
                        reason.as_bytes(),
                    )
                    .await;
                    return Err(TransportError::Handshake { peer, reason });
                }
            }
        }
        match answer {
            Answer::Ack(Hello { id, path, .. }) if id == peer && path != self.config.data_path => {
                let reason =
                    handshake::path_mismatch(self.local(), self.config.data_path, peer, path);
                let _ =
                    handshake::write_frame(&mut stream, FrameKind::HelloReject, reason.as_bytes())
                        .await;
                Err(TransportError::Handshake { peer, reason })
            }
            Answer::Ack(Hello { id, .. }) if id == peer => {
                let installed = self
                    .install(peer, Side::Dialled, stream, leftover)
                    .map_err(|e| TransportError::Connect {
                        peer,
                        addr,
                        source: e,
                    })?;
                drop(guard);
                if installed {
                    Ok(())
                } else {
                    Err(TransportError::Closed)
                }
            }
            Answer::Ack(Hello { id, .. }) => {
                let _ = handshake::write_frame(&mut stream, FrameKind::HelloReject, b"wrong peer")
                    .await;
                Err(TransportError::Handshake {
                    peer,
                    reason: format!("{addr} answered as {id}"),
                })
            }
            Answer::Reject(reason) if reason == SIMULTANEOUS => {
                // The peer's own dial wins; keep our marker so that its hello is accepted, and
                // wait until that connection is installed.
                drop(stream);
                self.wait_connected(peer, deadline).await
            }
            Answer::Reject(reason) => Err(TransportError::Handshake { peer, reason }),
        }
    }

    /// Dials `addr` until it answers the handshake or the deadline passes.
    async fn dial(
        &self,
        peer: NodeId,
        addr: SocketAddr,
        deadline: Instant,
        refusal_is_final: bool,
    ) -> Result<(TcpStream, Answer, BytesMut), TransportError> {
        let mut backoff = Duration::from_millis(20);
        loop {
            let attempt = async {
                let mut stream = TcpStream::connect(addr).await?;
                tune(&stream, &self.config)?;
                let proof = self.own_proof();
                let (answer, rest) = handshake::dial(
                    &mut stream,
                    self.local(),
                    self.config.data_path,
                    proof.as_ref(),
                    self.config.secret.as_ref(),
                )
                .await?;
                Ok::<_, io::Error>((stream, answer, rest))
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let err = match timeout(left, attempt).await {
                Ok(Ok((stream, answer, rest))) => return Ok((stream, answer, rest)),
                Ok(Err(e)) => e,
                Err(_) => io::Error::new(io::ErrorKind::TimedOut, "connect timed out"),
            };
            let refused = err.kind() == io::ErrorKind::ConnectionRefused;
            let retryable = (refused && !refusal_is_final)
                || matches!(
                    err.kind(),
                    io::ErrorKind::ConnectionReset
                        | io::ErrorKind::ConnectionAborted
                        | io::ErrorKind::UnexpectedEof
                        | io::ErrorKind::NotConnected
                );
            if !retryable || Instant::now() + backoff >= deadline || self.is_closed() {
                return Err(TransportError::Connect {
                    peer,
                    addr,
                    source: err,
                });
            }
            tracing::debug!(%peer, %addr, error = %err, "connect failed, retrying");
            sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    async fn wait_connected(&self, peer: NodeId, deadline: Instant) -> Result<(), TransportError> {
        loop {
            let changed = self.peers.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.peers.get(peer).is_some() {
                return Ok(());
            }
            if self.is_closed() {
                return Err(TransportError::Closed);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if timeout(left, changed).await.is_err() {
                return Err(TransportError::Handshake {
                    peer,
                    reason: "the peer's own connection never arrived".into(),
                });
            }
        }
    }

    /// Handles one accepted socket: reads the hello, applies the tie-break, answers.
    async fn accept(self: Arc<Self>, mut stream: TcpStream) -> io::Result<()> {
        tune(&stream, &self.config)?;
        let opening = timeout(
            self.config.handshake_timeout,
            handshake::accept_opening(&mut stream, self.config.secret.as_ref()),
        )
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no hello in time"))??;
        let (hello, leftover) = match opening {
            Opening::Hello(hello, leftover) => (hello, leftover),
            Opening::Refuse(reason) => {
                let from = stream
                    .peer_addr()
                    .map_or_else(|_| "an unknown address".into(), |a| a.to_string());
                tracing::warn!(%from, %reason, "refusing a connection");
                return handshake::write_frame(
                    &mut stream,
                    FrameKind::HelloReject,
                    reason.as_bytes(),
                )
                .await;
            }
        };
        let (peer, path) = (hello.id, hello.path);
        let local = self.local();
        if let Some(admission) = self.admission() {
            if let Err(reason) = admission.admit(peer, hello.proof.as_ref()) {
                let from = stream.peer_addr().ok();
                tracing::warn!(claimed = %peer, ?from, %reason, "refusing a connection");
                return handshake::write_frame(
                    &mut stream,
                    FrameKind::HelloReject,
                    reason.as_bytes(),
                )
                .await;
            }
        }
        if path != self.config.data_path {
            let reason = handshake::path_mismatch(local, self.config.data_path, peer, path);
            tracing::warn!(%peer, %reason, "refusing connection");
            return handshake::write_frame(&mut stream, FrameKind::HelloReject, reason.as_bytes())
                .await;
        }
        let token = self.peers.token();
        let decision = {
            let mut slots = self.peers.lock();
            let decision = decide_hello(local, peer, Slot::existing(slots.get(&peer)));
            if decision == HelloDecision::Accept {
                if let Some(Slot::Connected(old)) = slots.insert(peer, Slot::Accepting(token)) {
                    // Replaced: the peer gave it up, or the tie-break prefers the new one.
                    old.close();
                }
            }
            decision
        };
        match decision {
            HelloDecision::Reject(reason) => {
                tracing::debug!(%local, %peer, reason, "refusing connection");
                handshake::write_frame(&mut stream, FrameKind::HelloReject, reason.as_bytes()).await
            }
            HelloDecision::Accept => {
                let guard = PendingGuard {
                    peers: &self.peers,
                    peer,
                    token,
                };
                let proof = self.own_proof();
                let ack = psnet_transport::codec::encode_hello_proved(
                    local,
                    self.config.data_path,
                    proof.as_ref(),
                );
                handshake::write_frame(&mut stream, FrameKind::HelloAck, &ack).await?;
                self.install(peer, Side::Accepted(token), stream, leftover)?;
                drop(guard);
                Ok(())
            }
        }
    }
}

/// Which side of the handshake a stream comes from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    /// We dialled and the peer acknowledged.
    Dialled,
    /// We accepted, under this marker.
    Accepted(u64),
}

async fn accept_loop(listener: TcpListener, inner: Arc<Inner>) {
    loop {
        match listener.accept().await {
            Ok((stream, from)) => {
                let inner = inner.clone();
                tokio::spawn(async move {
                    if let Err(e) = inner.accept(stream).await {
                        tracing::warn!(%from, error = %e, "incoming connection failed");
                    }
                });
            }
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                sleep(Duration::from_millis(50)).await;
            }
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
            eager_limit: 0,
            zero_copy_send: true,
            prefers_registered: false,
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
        let conn = inner
            .peers
            .get(peer)
            .ok_or(TransportError::NotConnected { peer })?;
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
        let mut head = HeaderBuf::new();
        if header.body_len() - u64::from(header.meta_len) >= SHM_MIN as u64 {
            // The first large message to a peer on this host offers the bulk path; it goes
            // through the socket itself, later ones through the ring once accepted.
            conn.offer_ring(inner.config.shm_ring);
            if let Some(descriptor) = conn
                .active_ring()
                .and_then(|ring| ring.put(msg.segments))
                .map(|(off, _)| shm::descriptor(off, msg.segments))
            {
                let segs = [Segment::new(&descriptor)];
                let out = OutMessage::new(msg.meta, &segs);
                let header =
                    FrameHeader::for_message(FrameKind::ShmData, &out, &inner.config.limits)
                        .map_err(|source| TransportError::Invalid { peer, source })?;
                header.encode_into(&mut head);
                conn.write_frame(&head, out.meta, out.segments)
                    .await
                    .map_err(lost)?;
                if strike == Strike::Reset {
                    conn.close();
                }
                return Ok(());
            }
        }
        header.encode_into(&mut head);
        conn.write_frame(&head, msg.meta, msg.segments)
            .await
            .map_err(lost)?;
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
