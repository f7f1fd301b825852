//! The rdma_cm handshake's decisions: psnet's handshake ([`CmMessage`]) rides in the private
//! data of the connection manager's REQ, REP and REJ, as ps-lite does; rdma_cm itself
//! resolves the route and connects (REQ / REP / RTU), and reports each step as an event.
//!
//! Active side (a `connect` call, see [`super::connect`]): address resolved, route resolved
//! ([`check_route`], then [`hello`] in the request), the peer's accept
//! ([`Links::handle_welcome`]) or refusal ([`handle_rejected`]). Passive side: a connect
//! request is admitted or refused with a reason ([`admit_hello`]: psnet's, from a node whose
//! control connection is up; then [`Links::handle_hello`]: not crossed by a request of ours
//! that wins), its queue pair is installed ([`Links::handle_cm_answer_built`]) and the accept
//! carries [`CmMessage::Welcome`]. Every other event of a link's rdma_cm id is
//! [`on_event`]'s.

use std::net::SocketAddr;

use psnet_transport::NodeId;

use super::{LinkHandle, Links, Phase};
use crate::control::{CmMessage, Refusal};
use crate::error::VerbsError;
use crate::rdmacm::{self, kind};

/// A connect request that passed the admission checks of [`admit_hello`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The requesting node.
    pub peer: NodeId,
    /// Its link's nonce.
    pub nonce: u64,
    /// Receive buffers it posted.
    pub recv_depth: u32,
    /// Bytes per receive buffer.
    pub slot_size: u32,
}

/// What to do about an admitted connect request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnHello {
    /// Reject it, saying why.
    Refuse(Refusal),
    /// Build a queue pair for the peer, connect it with rdma_cm's attributes and the peer's
    /// receive buffers, and report it through [`Links::handle_cm_answer_built`]; if that
    /// fails, refuse with [`cannot_answer`]'s reason.
    Answer(Hello),
}

/// What to do with the queue pair built on a connect request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CmAnswered<L> {
    /// It is the peer's link now: retire the one it replaced ([`super::REPLACED`]) and
    /// accept with `welcome`. If accepting fails, the link goes ("rdma_cm cannot accept");
    /// if it works, the id serves the link (passive) and the peer is announced.
    Accept {
        /// The link it replaced.
        retired: Option<L>,
        /// The accept's private data.
        welcome: CmMessage,
    },
    /// A link that wins over the request came meanwhile: drop this one
    /// ([`super::SUPERSEDED`]) and refuse with `why`.
    Refuse {
        /// The link built for nothing.
        link: L,
        /// The refusal.
        why: Refusal,
    },
}

/// What to do about the peer's accept of our connect request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnWelcome {
    /// Connect the queue pair with rdma_cm's attributes and the peer's receive buffers,
    /// complete the exchange (RTU), then report it ([`Links::handle_connected`]), announce
    /// the peer and let the link send. A failure there fails the link.
    Connect {
        /// Receive buffers the peer posted.
        recv_depth: u32,
        /// Bytes per receive buffer.
        slot_size: u32,
        /// The peer's link nonce (with this side's, it names the queue pair's keys).
        nonce: u64,
    },
    /// The link was superseded by the peer's own request meanwhile: let this connection
    /// go (drop the link's rdma_cm ids).
    LetGo,
}

/// What an event on a link's rdma_cm id means.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OnEvent {
    /// Address resolved: resolve the route (failing the link if that cannot start).
    ResolveRoute,
    /// Route resolved: check it ([`check_route`]) and send the connect request ([`hello`]).
    SendHello,
    /// The peer accepted: [`Links::handle_welcome`] with the event's private data.
    Welcome,
    /// The connection is up and the link's peer is ready: let it send.
    PeerReady,
    /// The peer refused: [`handle_rejected`] with the event's private data and status.
    Rejected,
    /// The peer ended the connection or died: remove the link if it is still the peer's
    /// (reporting the peer lost if it was announced), else retire it; for this reason.
    Disconnected(String),
    /// Fail the link.
    Fail(VerbsError),
    /// Nothing to do.
    Ignore,
}

impl<L: LinkHandle> Links<L> {
    /// An admitted connect request: answered unless a link of ours wins over it (crossing
    /// requests, settled by [`crate::control::answers_request`]).
    pub fn handle_hello(&self, hello: Hello) -> OnHello {
        if self.answers(hello.peer, hello.nonce) {
            OnHello::Answer(hello)
        } else {
            OnHello::Refuse(Refusal::Crossed)
        }
    }

    /// The queue pair answering `peer`'s connect request `request` is built and connected:
    /// installs it (see [`Links::install_answer`]); the accept announces this side's
    /// receive buffers (`recv_depth` of `slot_size` bytes).
    pub fn handle_cm_answer_built(
        &mut self,
        peer: NodeId,
        request: u64,
        link: L,
        recv_depth: u32,
        slot_size: u32,
    ) -> CmAnswered<L> {
        let welcome = CmMessage::Welcome {
            nonce: link.nonce(),
            recv_depth,
            slot_size,
        };
        match self.install_answer(peer, request, link, None, true) {
            Ok(retired) => CmAnswered::Accept { retired, welcome },
            Err(link) => CmAnswered::Refuse {
                link,
                why: Refusal::Crossed,
            },
        }
    }

    /// `peer` accepted the connect request of link `link`, with private data `data`.
    pub fn handle_welcome(
        &self,
        peer: NodeId,
        link: u32,
        data: &[u8],
    ) -> Result<OnWelcome, VerbsError> {
        let Some(CmMessage::Welcome {
            nonce,
            recv_depth,
            slot_size,
        }) = CmMessage::decode(data)
        else {
            return Err(VerbsError::Protocol(
                "the peer accepted the RDMA connection without psnet's reply".into(),
            ));
        };
        let current = self
            .peers
            .get(&peer)
            .is_some_and(|s| s.link.id() == link && s.phase == Phase::Requested);
        Ok(if current {
            OnWelcome::Connect {
                recv_depth,
                slot_size,
                nonce,
            }
        } else {
            OnWelcome::LetGo
        })
    }
}

/// A connect request arrived with private data `data`: the admission checks, before
/// anything else and in this order: psnet's message, then a control connection from the
/// requesting node that `control_seen` (the TCP control connection authenticated the node; a
/// request handled before its arrival would take the new link for a stale one). Refused for
/// now without it; the peer asks again. Crossing requests come next ([`Links::handle_hello`]).
pub fn admit_hello(
    data: &[u8],
    control_seen: impl FnOnce(NodeId) -> bool,
) -> Result<Hello, Refusal> {
    let Some(CmMessage::Hello {
        from,
        nonce,
        recv_depth,
        slot_size,
    }) = CmMessage::decode(data)
    else {
        tracing::warn!("refused an rdma_cm connect request that is not psnet's");
        return Err(Refusal::Malformed);
    };
    let peer = NodeId(from);
    if !control_seen(peer) {
        return Err(Refusal::NoControlConnection);
    }
    Ok(Hello {
        peer,
        nonce,
        recv_depth,
        slot_size,
    })
}

/// Building or connecting the queue pair a connect request from `peer` asked for failed,
/// for `reason`: the request is refused with this.
pub fn cannot_answer(peer: NodeId, reason: &VerbsError) -> Refusal {
    tracing::warn!(%peer, %reason, "cannot build the queue pair a peer asked for");
    Refusal::CannotConnect
}

/// The connect request of `link`, from node `local` whose receive buffers are `recv_depth`
/// of `slot_size` bytes.
pub fn hello<L: LinkHandle>(local: NodeId, link: &L, recv_depth: u32, slot_size: u32) -> CmMessage {
    CmMessage::Hello {
        from: local.0,
        nonce: link.nonce(),
        recv_depth,
        slot_size,
    }
}

/// What a link's rdma_cm id is called in errors: where it connects to (active side), or
/// the peer (passive side).
pub fn target(addr: Option<SocketAddr>, peer: NodeId) -> String {
    addr.map(|a| a.to_string())
        .unwrap_or_else(|| peer.to_string())
}

/// Route resolved to `target`: rdma_cm must have chosen this transport's device port
/// (`own`), else the queue pair would be on another device than the route.
pub fn check_route(
    target: &str,
    routed: Option<(&str, u8)>,
    own: (&str, u8),
) -> Result<(), VerbsError> {
    match routed {
        Some((device, port)) if device != own.0 || port != own.1 => {
            Err(VerbsError::Setup(format!(
                "rdma_cm cannot connect to {target}: rdma_cm routes to it through {device} port \
                 {port}, but this transport runs on {} port {} (check DMLC_INTERFACE and \
                 PSNET_IB_DEVICE)",
                own.0, own.1
            )))
        }
        _ => Ok(()),
    }
}

/// Event `event` (with `status`) on the rdma_cm id of a link to `target`; `active`: the id
/// sent the connect request (else it accepted one).
pub fn on_event(event: u32, status: i32, active: bool, target: &str) -> OnEvent {
    let name = rdmacm::event_name(event);
    match event {
        kind::ADDR_RESOLVED => OnEvent::ResolveRoute,
        kind::ROUTE_RESOLVED => OnEvent::SendHello,
        kind::CONNECT_RESPONSE => OnEvent::Welcome,
        // The active side let its link send when it completed the exchange.
        kind::ESTABLISHED if established_readies(active) => OnEvent::PeerReady,
        kind::ESTABLISHED => OnEvent::Ignore,
        kind::REJECTED => OnEvent::Rejected,
        // The peer ended this queue pair on purpose or died; its control connection goes
        // (or went) with it, and a new one may already be up: leave that alone.
        kind::DISCONNECTED => OnEvent::Disconnected(format!("{target} disconnected ({name})")),
        kind::ADDR_ERROR
        | kind::ROUTE_ERROR
        | kind::CONNECT_ERROR
        | kind::UNREACHABLE
        | kind::DEVICE_REMOVAL => OnEvent::Fail(VerbsError::errno(
            name,
            format!("rdma_cm: {name} for {target}"),
            status.abs(),
        )),
        _ => OnEvent::Ignore,
    }
}

/// Whether the connection coming up (rdma_cm's ESTABLISHED, or the queue pair's first
/// message: the RTU may be lost and repeated only after rdma_cm's timeout) lets the link
/// send: on the passive side, whose peer's queue pair is connected once the exchange
/// completes.
pub fn established_readies(active: bool) -> bool {
    !active
}

/// `peer` (at `target`) refused our connect request with private data `data` and rdma_cm's
/// reject reason `status`: `Ok` when it is for now (crossing requests, no control connection
/// yet), the request being retried by `connect` once this id is dropped; else why the link
/// fails.
pub fn handle_rejected(
    peer: NodeId,
    target: &str,
    data: &[u8],
    status: i32,
) -> Result<(), VerbsError> {
    match CmMessage::decode(data) {
        Some(CmMessage::Refused(Refusal::Crossed | Refusal::NoControlConnection)) => {
            tracing::debug!(%peer, "connect request refused for now; retrying");
            Ok(())
        }
        Some(CmMessage::Refused(why)) => Err(VerbsError::Refused {
            target: target.to_string(),
            refusal: Some(why),
            status,
        }),
        _ => Err(VerbsError::Refused {
            target: target.to_string(),
            refusal: None,
            status,
        }),
    }
}
