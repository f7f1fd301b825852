//! One `connect` call's part of the handshake, free of I/O: it starts a request (over the
//! control connection or through rdma_cm), repeats it while unanswered, falls back from
//! rdma_cm to sockets when rdma_cm stays silent or its connection fails before it carried
//! anything (`PSNET_RDMA_CONNECT=auto`), and ends when the peer's link is ready, fails, or
//! the connect timeout passes.
//!
//! The driver polls [`Connect::poll`] with the peer's [`Links`] (under the lock that guards
//! them) whenever a link changes or the step's wake-up time comes, and does what the step
//! says.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use psnet_transport::NodeId;

use super::{LinkHandle, Links, Phase};
use crate::control::Control;

/// How often an unanswered queue-pair request is repeated.
pub const REQUEST_RESEND: Duration = Duration::from_millis(300);
/// With `PSNET_RDMA_CONNECT=auto`: how long an rdma_cm connection may take before the queue
/// pair is connected over the TCP control connection instead. rdma_cm's own retry of a lost
/// request comes after about 4 s.
pub const CM_FALLBACK: Duration = Duration::from_secs(6);

/// What a `connect` call does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step<L> {
    /// The peer's link is ready: the call succeeds.
    Done,
    /// The handshake failed, for this reason: the call fails.
    Fail(String),
    /// Start an rdma_cm connect request for `link` (its events then drive it; see
    /// [`super::rdma_cm`]). If starting fails, the link goes and the call fails.
    StartCm(L),
    /// Send `msg` over the control connection, after dropping the rdma_cm ids of link
    /// `abandon_cm` (the rdma_cm connection given up for sockets). If sending fails, the
    /// peer's link goes ("control connection lost") and the call fails.
    Send {
        /// The message.
        msg: Control,
        /// A link whose rdma_cm connection is abandoned.
        abandon_cm: Option<u32>,
    },
    /// Wait until a link changes or `until` comes, then poll again (after
    /// [`Connect::handle_timeout`] when `until` came).
    Wait(Instant),
}

/// What [`Connect::poll`] needs next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Poll<L> {
    /// Do this.
    Step(Step<L>),
    /// The peer has no link: build one (with a fresh random nonce) and hand it to
    /// [`Connect::handle_new_link`] while still holding the [`Links`] (a request crossing it
    /// must see it); if building fails, the call fails with that error.
    NewLink,
}

/// One `connect` call to `peer`.
#[derive(Clone, Debug)]
pub struct Connect<L> {
    peer: NodeId,
    addr: SocketAddr,
    timeout: Duration,
    deadline: Instant,
    resend_at: Instant,
    fallback_at: Instant,
    /// Requests go through rdma_cm (else over the control connection).
    via_cm: bool,
    /// An rdma_cm request that does not complete falls back to sockets.
    cm_fallback: bool,
    /// The link this call made: its failure is reported once it is gone from the table.
    mine: Option<L>,
    /// This call already replaced a failed rdma_cm link by one over the control connection.
    retried_over_sockets: bool,
}

impl<L: LinkHandle> Connect<L> {
    /// A `connect` to `peer` at `addr` starting at `now`, failing after `timeout`; requests go
    /// through rdma_cm if `via_cm`, falling back to sockets if `cm_fallback`.
    pub fn new(
        peer: NodeId,
        addr: SocketAddr,
        now: Instant,
        timeout: Duration,
        via_cm: bool,
        cm_fallback: bool,
    ) -> Self {
        Connect {
            peer,
            addr,
            timeout,
            deadline: now + timeout,
            resend_at: now + REQUEST_RESEND,
            fallback_at: now + CM_FALLBACK,
            via_cm,
            cm_fallback,
            mine: None,
            retried_over_sockets: false,
        }
    }

    /// The next step at `now`, given the peer's link in `links`. `cm_pending(link)` tells
    /// whether an rdma_cm request of that link is under way; `control_up()` whether the
    /// peer's control connection is.
    pub fn poll(
        &mut self,
        links: &mut Links<L>,
        now: Instant,
        cm_pending: impl FnOnce(u32) -> bool,
        control_up: impl FnOnce() -> bool,
    ) -> Poll<L> {
        let peer = self.peer;
        let mut abandon_cm = None;
        if let Some(s) = links.peers.get_mut(&peer) {
            if s.via_cm
                && self.cm_fallback
                && s.phase == Phase::Requested
                && now >= self.fallback_at
                && s.link.failure().is_none()
            {
                // Seen on Soft-RoCE after its interface went down and up: rdma_cm's
                // messages are lost while queue pairs still work.
                tracing::warn!(%peer, addr = %self.addr, "rdma_cm did not connect within {CM_FALLBACK:?}; \
                    connecting the queue pair over the TCP control connection instead \
                    (PSNET_RDMA_CONNECT=rdma_cm never does)");
                s.via_cm = false;
                abandon_cm = Some(s.link.id());
                self.resend_at = now;
            }
        }
        let wait = |c: &Self| Poll::Step(Step::Wait(c.resend_at.min(c.deadline)));
        let s = match links.peers.get(&peer) {
            Some(s) => s,
            None => {
                // The link this call made failed and is gone already (an rdma_cm refusal is
                // handled by the control loop): report it, do not retry; except that an
                // rdma_cm connection failing before it was established (seen on Soft-RoCE
                // under load: rdma_establish answering EINVAL) is made again, once, over the
                // control connection when falling back is allowed.
                if let Some(reason) = self.mine.as_ref().and_then(|l| l.failure()) {
                    if !self.may_retry_over_sockets() {
                        return Poll::Step(Step::Fail(reason));
                    }
                    tracing::warn!(%peer, addr = %self.addr, %reason, "the rdma_cm connection failed; \
                        connecting the queue pair over the TCP control connection instead \
                        (PSNET_RDMA_CONNECT=rdma_cm never does)");
                    self.via_cm = false;
                    self.retried_over_sockets = true;
                    self.mine = None;
                    self.resend_at = now + REQUEST_RESEND;
                }
                if !control_up() {
                    return Poll::Step(Step::Fail(
                        "control connection closed during the RDMA handshake".into(),
                    ));
                }
                return Poll::NewLink;
            }
        };
        if s.link.is_ready() {
            return Poll::Step(Step::Done);
        }
        if let Some(reason) = s.link.failure() {
            let mine = self.mine.as_ref().is_some_and(|m| m.id() == s.link.id());
            if mine && s.via_cm && s.phase == Phase::Requested && self.may_retry_over_sockets() {
                // Retried over sockets once the driver has removed it (which wakes us).
                return wait(self);
            }
            return Poll::Step(Step::Fail(reason));
        }
        if s.via_cm {
            // Checked every REQUEST_RESEND: the peer may have refused for now (its own
            // request crossed ours, or its control connection was not up yet); then ask
            // again.
            if now >= self.resend_at {
                self.resend_at = now + REQUEST_RESEND;
                if s.phase == Phase::Requested && !cm_pending(s.link.id()) {
                    return Poll::Step(Step::StartCm(s.link.clone()));
                }
            }
            return wait(self);
        }
        if now < self.resend_at {
            return wait(self);
        }
        self.resend_at = now + REQUEST_RESEND;
        let msg = match (s.phase, s.answered) {
            // Our request may have gone out on a connection a simultaneous connect closed:
            // repeat it now and then.
            (Phase::Requested, _) => Control::Request {
                nonce: s.link.nonce(),
                info: s.link.local_info(),
            },
            // Our reply or the peer's confirmation may have been lost the same way.
            (Phase::Connected, Some((_, reply))) => reply,
            (Phase::Connected, None) => return wait(self),
        };
        Poll::Step(Step::Send { msg, abandon_cm })
    }

    /// Whether a failed rdma_cm link of this call may be replaced by one over sockets.
    fn may_retry_over_sockets(&self) -> bool {
        self.via_cm && self.cm_fallback && !self.retried_over_sockets
    }

    /// The link built after [`Poll::NewLink`]: it becomes the peer's link, requested, and
    /// the request starts.
    pub fn handle_new_link(&mut self, links: &mut Links<L>, link: L) -> Step<L> {
        self.mine = Some(link.clone());
        links.insert_request(self.peer, link.clone(), self.via_cm);
        if self.via_cm {
            Step::StartCm(link)
        } else {
            Step::Send {
                msg: Control::Request {
                    nonce: link.nonce(),
                    info: link.local_info(),
                },
                abandon_cm: None,
            }
        }
    }

    /// The wait of [`Step::Wait`] ended at `now` with nothing changed: the reason the call
    /// fails if its deadline passed.
    pub fn handle_timeout(&self, now: Instant) -> Option<String> {
        (now >= self.deadline).then(|| {
            format!(
                "RDMA queue-pair handshake timed out after {:?}",
                self.timeout
            )
        })
    }
}
