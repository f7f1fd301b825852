//! Connection set-up as plain state, free of I/O: which link each peer has and where its
//! handshake stands ([`Links`]), the socket handshake's decisions ([`socket`]), rdma_cm's
//! ([`rdma_cm`]) and the `connect` call's retries and timeouts ([`connect`]).
//!
//! Inputs come in through `handle_*` methods and `poll`, with the time passed in where a
//! timeout matters; what to do comes back as a returned step (send this message, build a
//! queue pair, refuse this request with this reason, retire this link). The transport's
//! drivers (`transport/connect/`) create queue pairs, move the messages and feed the results
//! back, so every decision here is tested without an RDMA device.
//!
//! The links themselves are the driver's: the table holds them through [`LinkHandle`], which
//! tells a link's number, nonce, queue pair, readiness and failure (a link may fail at any
//! time from the data path, so those are read from the link, never copied).

use std::collections::HashMap;

use psnet_transport::NodeId;

use crate::control::{self, Control, OwnLink};
use crate::qp::QpInfo;

pub mod connect;
pub mod rdma_cm;
pub mod socket;

#[cfg(test)]
mod tests;

/// Why a link built on a peer's request is dropped again: a link that wins over the request
/// came meanwhile (see [`Links::install_answer`]).
pub const SUPERSEDED: &str = "superseded during the handshake";
/// Why the link an answered request replaces is retired.
pub const REPLACED: &str = "replaced by a new queue pair";

/// What the handshakes read from one of the driver's links.
pub trait LinkHandle: Clone {
    /// The link's number, unique within this node.
    fn id(&self) -> u32;
    /// Its random tag in the handshake.
    fn nonce(&self) -> u64;
    /// This side's queue pair, as the socket handshake sends it.
    fn local_info(&self) -> QpInfo;
    /// Whether sends may start (both queue pairs connected, not failed).
    fn is_ready(&self) -> bool;
    /// Why the link failed, if it did.
    fn failure(&self) -> Option<String>;
}

/// Where a peer's link stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// We sent a request and wait for the reply.
    Requested,
    /// Our queue pair is connected (we may receive); sends wait for the peer's.
    Connected,
}

/// A peer's link and its handshake.
#[derive(Clone, Debug)]
pub struct Slot<L> {
    link: L,
    phase: Phase,
    /// For a link built on a peer's socket request: that request's nonce and our reply, sent
    /// again if the request is repeated (its first copy or our reply may have been on a TCP
    /// connection that a simultaneous connect closed).
    answered: Option<(u64, Control)>,
    /// Connected (or being connected) through rdma_cm.
    via_cm: bool,
}

impl<L: LinkHandle> Slot<L> {
    /// The link.
    pub fn link(&self) -> &L {
        &self.link
    }

    /// Where its handshake stands.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Whether it is connected (or being connected) through rdma_cm.
    pub fn via_cm(&self) -> bool {
        self.via_cm
    }

    /// Whether `PeerConnected` was reported for it: every link is announced as it connects.
    pub fn announced(&self) -> bool {
        self.phase == Phase::Connected
    }

    /// Whether it wins over a request (with `nonce`) from the peer: settled by
    /// [`control::answers_request`], alike for both handshakes.
    fn beats_request(&self, nonce: u64) -> bool {
        let own = match self.phase {
            Phase::Requested => OwnLink::Requested(self.link.nonce()),
            Phase::Connected => OwnLink::Connected,
        };
        !control::answers_request(own, nonce)
    }
}

/// Every peer's link, as the handshakes see them: at most one per peer.
#[derive(Clone, Debug)]
pub struct Links<L> {
    peers: HashMap<NodeId, Slot<L>>,
}

impl<L> Default for Links<L> {
    fn default() -> Self {
        Links {
            peers: HashMap::new(),
        }
    }
}

impl<L: LinkHandle> Links<L> {
    /// No links.
    pub fn new() -> Self {
        Self::default()
    }

    /// `peer`'s link, if it has one.
    pub fn get(&self, peer: NodeId) -> Option<&Slot<L>> {
        self.peers.get(&peer)
    }

    /// Every peer with a link, and the link.
    pub fn iter(&self) -> impl Iterator<Item = (NodeId, &Slot<L>)> {
        self.peers.iter().map(|(p, s)| (*p, s))
    }

    /// Every peer with a link.
    pub fn peers(&self) -> Vec<NodeId> {
        self.peers.keys().copied().collect()
    }

    /// Whether a request (with `nonce`) from `peer` is answered: no link wins over it (ours,
    /// requested with a larger nonce, or one already connected).
    pub fn answers(&self, peer: NodeId, nonce: u64) -> bool {
        !self
            .peers
            .get(&peer)
            .is_some_and(|s| s.beats_request(nonce))
    }

    /// Makes `link` (built on the peer's request with `request`) the peer's link, connected,
    /// and hands back the one it replaces, to be retired ([`REPLACED`]); all in one call, so
    /// a `connect` racing with it never sees the peer without a link (it would start a
    /// request of its own). Unless a link that wins over the request is there: then `link`
    /// comes back as the error, to be dropped ([`SUPERSEDED`]).
    pub fn install_answer(
        &mut self,
        peer: NodeId,
        request: u64,
        link: L,
        answered: Option<(u64, Control)>,
        via_cm: bool,
    ) -> Result<Option<L>, L> {
        if !self.answers(peer, request) {
            return Err(link);
        }
        let slot = Slot {
            link,
            phase: Phase::Connected,
            answered,
            via_cm,
        };
        Ok(self.peers.insert(peer, slot).map(|old| old.link))
    }

    /// Records this side's own request: `link` is the peer's link, waiting for the reply.
    fn insert_request(&mut self, peer: NodeId, link: L, via_cm: bool) {
        let slot = Slot {
            link,
            phase: Phase::Requested,
            answered: None,
            via_cm,
        };
        self.peers.insert(peer, slot);
    }

    /// Our request's answer arrived and link `link` is connected: it counts as connected
    /// (and announced) if it is still the peer's link.
    pub fn handle_connected(&mut self, peer: NodeId, link: u32) {
        if let Some(s) = self.peers.get_mut(&peer) {
            if s.link.id() == link {
                s.phase = Phase::Connected;
            }
        }
    }

    /// Removes `peer`'s link (only if it is link `only`, when given) and returns it; the
    /// driver fails it, forgets it and reports the peer lost if it was announced.
    pub fn remove(&mut self, peer: NodeId, only: Option<u32>) -> Option<Slot<L>> {
        if let Some(id) = only {
            if self.peers.get(&peer).map(|s| s.link.id()) != Some(id) {
                return None;
            }
        }
        self.peers.remove(&peer)
    }

    /// A new control connection from `peer` came up: a connected link (which belonged to the
    /// connection it replaced: the peer disconnected and dialled again) is gone too. Returns
    /// the number of the link to remove, with the reason.
    pub fn handle_control_connected(&self, peer: NodeId) -> Option<(u32, &'static str)> {
        self.peers
            .get(&peer)
            .filter(|s| s.phase == Phase::Connected)
            .map(|s| (s.link.id(), "the peer reconnected"))
    }
}
