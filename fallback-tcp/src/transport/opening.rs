//! Opening connections: dialling a peer (with retries, the tie-break of simultaneous
//! connects and the answer's checks) and accepting one (secret, admission, data path, the
//! tie-break), then handing the stream to [`Inner::install`].

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use psnet_transport::codec::Hello;
use psnet_transport::session::{Role, SessionBase};
use psnet_transport::{Binding, FrameKind, NodeId, TransportError};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{sleep, timeout, Instant};

use super::Inner;
use crate::handshake::{self, Answer, Opening};
use crate::peers::{decide_hello, HelloDecision, PendingGuard, Slot, SIMULTANEOUS};
use crate::socket::tune;

impl Inner {
    /// Connects to `peer`; with `refusal_is_final`, an address that refuses is an error at
    /// once (a redial: the peer's process is gone) rather than retried until the timeout.
    pub(super) async fn connect(
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
        let (mut stream, answer, leftover, session) =
            self.dial(peer, addr, deadline, refusal_is_final).await?;
        if let (Answer::Ack(hello), Some(admission)) = (&answer, self.admission()) {
            if hello.id == peer {
                let binding = Binding::new(session.as_ref(), Role::Acceptor);
                if let Err(refusal) = admission.admit(peer, hello.proof.as_ref(), &binding) {
                    let reason = refusal.to_string();
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
                    .install(peer, Side::Dialled, stream, leftover, session)
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
    ) -> Result<(TcpStream, Answer, BytesMut, Option<SessionBase>), TransportError> {
        let mut backoff = Duration::from_millis(20);
        loop {
            let attempt = async {
                let mut stream = TcpStream::connect(addr).await?;
                tune(&stream, &self.config)?;
                let (answer, rest, session) = handshake::dial(
                    &mut stream,
                    self.local(),
                    self.config.data_path,
                    |binding| self.own_proof(binding),
                    self.config.secret.as_ref(),
                )
                .await?;
                Ok::<_, io::Error>((stream, answer, rest, session))
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let err = match timeout(left, attempt).await {
                Ok(Ok(opened)) => return Ok(opened),
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
    pub(super) async fn accept(self: Arc<Self>, mut stream: TcpStream) -> io::Result<()> {
        tune(&stream, &self.config)?;
        let opening = timeout(
            self.config.handshake_timeout,
            handshake::accept_opening(&mut stream, self.config.secret.as_ref()),
        )
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no hello in time"))??;
        let (hello, leftover, mut session) = match opening {
            Opening::Hello(hello, leftover, session) => (*hello, leftover, session),
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
        let base = session.as_ref().map(|s| &s.base);
        if let Some(admission) = self.admission() {
            let binding = Binding::new(base, Role::Dialler);
            if let Err(refusal) = admission.admit(peer, hello.proof.as_ref(), &binding) {
                let from = stream.peer_addr().ok();
                let reason = refusal.to_string();
                // A node still joining turns dials away as a matter of course: the dialler
                // tries again, so only a stranger's or a faulty claim is worth a warning.
                if refusal.is_expected() {
                    tracing::debug!(claimed = %peer, ?from, %reason, "refusing a connection for now");
                } else {
                    tracing::warn!(claimed = %peer, ?from, %reason, "refusing a connection");
                }
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
                let binding = Binding::new(session.as_ref().map(|s| &s.base), Role::Acceptor);
                let proof = self.own_proof(&binding);
                let ack = psnet_transport::codec::encode_hello_proved(
                    local,
                    self.config.data_path,
                    proof.as_ref(),
                );
                handshake::write_ack(&mut stream, &ack, session.as_mut()).await?;
                let base = session.map(|s| s.base);
                self.install(peer, Side::Accepted(token), stream, leftover, base)?;
                drop(guard);
                Ok(())
            }
        }
    }
}

/// Which side of the handshake a stream comes from.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    /// We dialled and the peer acknowledged.
    Dialled,
    /// We accepted, under this marker.
    Accepted(u64),
}

pub(super) async fn accept_loop(listener: TcpListener, inner: Arc<Inner>) {
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
