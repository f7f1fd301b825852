//! The socket handshake's decisions: queue-pair numbers, GIDs and sequence numbers exchanged
//! over the TCP control connection ([`Control`]: request, reply, ready), as NCCL and perftest
//! do.
//!
//! The requester (a `connect` call, see [`super::connect`]) sends a request with its queue
//! pair; the responder builds a queue pair, connects it to the requester's, installs it
//! ([`Links::handle_answer_built`]) and replies; the requester connects its own
//! ([`Links::handle_reply`]) and confirms; the confirmation lets the responder send
//! ([`Links::handle_ready`]). Crossing requests are settled by nonce
//! ([`crate::control::answers_request`]); repeated requests and replies (their first copies
//! may have gone out on a TCP connection that a simultaneous connect closed) are answered
//! again from what is recorded.

use psnet_transport::NodeId;

use super::{LinkHandle, Links, Phase};
use crate::control::Control;

/// What to do about a peer's request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnRequest {
    /// Nothing: our own request wins over it, or a link is connected already.
    Ignore,
    /// Send this reply again (our first one may have been lost).
    Resend(Control),
    /// Build a queue pair, connect it to the requester's and report it through
    /// [`Links::handle_answer_built`]. If that fails, the control connection is closed (the
    /// requester's `connect` then fails).
    Answer,
}

/// What to do with the queue pair built on a peer's request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answered<L> {
    /// It is the peer's link now: retire the one it replaced ([`super::REPLACED`]), announce
    /// the peer and send `reply`; if sending fails, the peer's link goes ("control connection
    /// lost").
    Installed {
        /// The link it replaced.
        retired: Option<L>,
        /// The reply to send.
        reply: Control,
    },
    /// A link that wins over the request came meanwhile: drop this one
    /// ([`super::SUPERSEDED`]).
    Superseded(L),
}

/// What to do about a reply to a request of ours.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OnReply<L> {
    /// Nothing: it answers no request the peer's link stands for.
    Ignore,
    /// A repeated reply (our confirmation was lost): send this confirmation again.
    Resend(Control),
    /// Connect `link` to the reply's queue pair. If that fails, the link goes and the control
    /// connection is closed; if it works, report it ([`Links::handle_connected`]), announce
    /// the peer, send `ready` (if that fails, the link goes: "control connection lost") and
    /// then mark the link's peer ready.
    Connect {
        /// Our link that made the request.
        link: L,
        /// The confirmation to send once connected.
        ready: Control,
    },
}

impl<L: LinkHandle> Links<L> {
    /// A [`Control::Request`] with `nonce` arrived from `peer`.
    pub fn handle_request(&self, peer: NodeId, nonce: u64) -> OnRequest {
        match self.peers.get(&peer) {
            // Both sides requested at once and ours wins.
            Some(s) if s.phase == Phase::Requested && s.beats_request(nonce) => OnRequest::Ignore,
            Some(s) if s.phase == Phase::Connected => match s.answered {
                // Our reply may have been lost: send it again.
                Some((answered, reply)) if answered == nonce => OnRequest::Resend(reply),
                // A request the peer gave up when both sides requested at once (a new
                // connection removes this link before its requests come).
                _ => OnRequest::Ignore,
            },
            _ => OnRequest::Answer,
        }
    }

    /// The queue pair answering `peer`'s request `request` is built and connected: installs
    /// it (see [`Links::install_answer`]) with the reply that goes back, recorded to be sent
    /// again if the request is repeated.
    pub fn handle_answer_built(&mut self, peer: NodeId, request: u64, link: L) -> Answered<L> {
        let reply = Control::Reply {
            request,
            nonce: link.nonce(),
            info: link.local_info(),
        };
        match self.install_answer(peer, request, link, Some((request, reply)), false) {
            Ok(retired) => Answered::Installed { retired, reply },
            Err(link) => Answered::Superseded(link),
        }
    }

    /// A [`Control::Reply`] to our request `request` arrived from `peer`, from the responder's
    /// link `nonce`.
    pub fn handle_reply(&self, peer: NodeId, request: u64, nonce: u64) -> OnReply<L> {
        let ready = Control::Ready { nonce };
        match self.peers.get(&peer) {
            Some(s) if s.link.nonce() == request => {
                if s.phase == Phase::Requested {
                    OnReply::Connect {
                        link: s.link.clone(),
                        ready,
                    }
                } else {
                    OnReply::Resend(ready)
                }
            }
            _ => OnReply::Ignore,
        }
    }

    /// A [`Control::Ready`] for link `nonce` arrived from `peer`: returns the link whose peer
    /// is now ready (sends may start), if it is still the peer's link.
    pub fn handle_ready(&self, peer: NodeId, nonce: u64) -> Option<L> {
        self.peers
            .get(&peer)
            .filter(|s| s.link.nonce() == nonce)
            .map(|s| s.link.clone())
    }
}
