//! One reliable-connected queue pair to one peer, and the protocol state that drives it.
//!
//! The state lives behind one mutex taken briefly by senders and by the completion poller;
//! posting happens under it, so work requests enter the queue in the order decisions are made.
//! Nothing here blocks: a sender that lacks a credit, a send buffer or send-queue room waits on
//! [`Link::changed`], which the poller signals whenever completions free some.
//!
//! The parts: `setup.rs` brings a queue pair up (INIT, then RTR and RTS from the peer's
//! [`QpInfo`] or from rdma_cm's attributes); `send.rs` posts small messages and picks a send
//! path: `eager.rs` (copied into a pre-posted buffer), `device_send.rs` (GPU memory: read by
//! the NIC where it is registered with it, else staged through host memory chunk by chunk),
//! `rendezvous.rs` (request-to-send, clear-to-send, RDMA WRITE WITH IMMEDIATE, in batches as a
//! staged send's chunks land), `direct.rs` (written into a buffer the peer offered); `recv.rs` handles completions and received messages; `pump.rs` does the work
//! completions left behind (reposts, deferred requests, offers, credits).
//!
//! None of them touches the queue pair: the protocol state ([`State`]) only records the work
//! requests it decides on ([`WorkRequest`]), and `post.rs`, the thin poster, hands them to the
//! queue pair in order before the lock that decided them is released.

use std::collections::{HashMap, VecDeque};
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use psnet_transport::session::{Opener, Sealer, TAG_LEN};
use psnet_transport::{Limits, NodeId, TransportError};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::queue_pair::{QueuePairAttribute, QueuePairState};
use tokio::sync::{oneshot, Notify};

use crate::device::Device;
use crate::error::VerbsError;
use crate::landing::{Arrival, Asked, Landings, NicPlacement};
use crate::memory::{RecvPool, Region};
use crate::proto::credits::Credits;
use crate::proto::destination::Destination;
use crate::proto::offers::{Offered, Offers};
use crate::proto::order::Reorder;
use crate::proto::wire::{Cts, DataHeader, PlacedCts};
use crate::sys::memory::{Slab, Slot};
pub(crate) use crate::sys::verbs::{split_wr_id, wr_id, WorkCompletion, WrKind};
use crate::sys::verbs::{Gather, QueuePair, INDEX_MASK};
use post::WorkRequest;

mod device_send;
mod direct;
mod eager;
mod post;
mod pump;
mod recv;
mod rendezvous;
mod send;
mod setup;

pub use crate::qp::QpInfo;

/// Rendezvous sequence numbers and work-request indices share 28 bits.
const SEQ_MASK: u32 = INDEX_MASK;
/// Index of an inline send: its buffer went back to the free list when it was posted.
const INLINE_INDEX: u32 = SEQ_MASK;

/// Sizes of a link's queues and buffers.
#[derive(Clone, Debug)]
pub struct LinkParams {
    /// Receive buffers posted (the peer's credits).
    pub recv_depth: u32,
    /// Send buffers.
    pub send_slots: u32,
    /// Bytes per eager buffer (the largest eager message, header included).
    pub slot_size: usize,
    /// Largest message sent inline (copied into the work request at post time); 0: none.
    pub inline_bytes: u32,
    /// Message limits.
    pub limits: Limits,
    /// Bytes of receive buffers offered to the peer in advance at most; 0: none.
    pub offer_bytes: u64,
}

impl LinkParams {
    /// Send-queue depth: every send buffer and the writes of every rendezvous in flight.
    pub fn sq_depth(&self, max_sge: u32) -> u32 {
        let writes_per_msg = (self.limits.max_segments as u32 + 1).div_ceil(max_sge.max(1)) + 1;
        self.send_slots + self.recv_depth.min(64) * writes_per_msg.min(4) + 8
    }
}

struct OutRndv {
    gather: Gather,
    total: u64,
    // Registrations made for this send; dropped (deregistered) when it completes.
    _regs: Vec<Arc<MemoryRegion>>,
    /// Gather entries whose bytes are in place: all of them, except while a staged send
    /// (device memory copied out chunk by chunk) is still copying; the entries are written in
    /// order, so this is a prefix.
    ready: usize,
    /// Gather entries already posted as writes (a prefix of the ready ones).
    posted: usize,
    /// Bytes of the message those writes cover: where the next batch starts in it.
    written: u64,
    /// Work requests of each batch of writes posted and not completed, in posting order (the
    /// last of a batch is signalled, and a queue pair completes in order).
    batches: VecDeque<u32>,
    /// Where the writes go: known from the clear-to-send, or from the offer at once.
    to: Option<Destination>,
    /// The immediate ending the writes (the rendezvous' seq); `None` for a write into an
    /// offered buffer, which a direct message follows instead.
    imm: Option<u32>,
    done: Option<oneshot::Sender<Result<(), VerbsError>>>,
}

/// How a link's large messages went, for tests and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Large messages sent with a request-to-send / clear-to-send round trip.
    pub sent_rendezvous: u64,
    /// Large messages written straight into a buffer the peer offered.
    pub sent_direct: u64,
    /// Large messages received into a buffer this side offered.
    pub received_direct: u64,
    /// Large messages received with a segment the peer's NIC wrote straight into memory the
    /// placer chose (zero-copy receive).
    pub received_placed: u64,
    /// Buffers this side has offered and the peer has not written yet.
    pub offered_now: u64,
}

struct InRndv {
    region: Region,
    meta: Option<Bytes>,
    meta_len: usize,
    seg_lens: Vec<u64>,
    total: u64,
    /// The segment the peer's NIC writes into memory the placer chose, not into `region`.
    nic: Option<NicPlacement>,
    /// What the placer said when the request came.
    asked: Asked,
}

/// The answer to a request-to-send: where the sender writes.
#[derive(Clone, Copy, Debug)]
enum Grant {
    /// All of the message into one host buffer.
    Whole(Cts),
    /// One segment into memory the placer chose, the rest into a host buffer.
    Placed(PlacedCts),
}

struct DeferredRts {
    seq: u32,
    header: DataHeader,
    meta: Option<Bytes>,
}

/// The protocol state of a link: what is owed, offered, granted and in flight. It decides
/// which work requests to post and records them in `wrs`; it never posts them itself.
struct State {
    /// Work requests decided on and not yet posted, in order.
    wrs: Vec<WorkRequest>,
    credits: Credits,
    free_slots: Vec<Slot>,
    sq_free: u32,
    next_seq: u32,
    remote_ready: bool,
    out: HashMap<u32, OutRndv>,
    inbound: HashMap<u32, InRndv>,
    order: Reorder<Arrival>,
    cts_backlog: VecDeque<(u32, Grant)>,
    write_backlog: VecDeque<u32>,
    deferred_rts: VecDeque<DeferredRts>,
    repost: Vec<Slot>,
    /// Buffers offered to the peer and not yet written (receiver side).
    offered: Offered<Region>,
    /// Sizes to offer again once the inbox has room.
    to_offer: VecDeque<u64>,
    /// Offers made but not yet sent to the peer.
    offer_backlog: VecDeque<(u32, Cts)>,
    /// The peer's offers (sender side).
    offers: Offers,
    stats: LinkStats,
    failed: Option<String>,
    /// With a job secret: the keys that tag every message this link sends and check every
    /// one it receives ([`Link::protect`]).
    tags: Option<(Sealer, Opener)>,
}

/// What the link's mutex guards: the protocol state, and the queue pair its decisions are
/// posted to. Bring-up and teardown modify the queue pair directly; data-path work requests go
/// through [`State::wrs`] and the poster.
struct Locked {
    state: State,
    qp: QueuePair,
}

/// The link's lock, held while deciding. Work requests decided under it and not posted
/// explicitly ([`Guard::post`]) are posted when it is released; if that fails, the link fails.
struct Guard<'a> {
    link: &'a Link,
    locked: MutexGuard<'a, Locked>,
}

impl Deref for Guard<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.locked.state
    }
}

impl DerefMut for Guard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.locked.state
    }
}

impl Guard<'_> {
    /// Posts the work requests decided so far, in order.
    fn post(&mut self) -> Result<(), VerbsError> {
        self.link.post_decided(&mut self.locked)
    }

    /// The queue pair, for bring-up and teardown (state changes, not work requests).
    fn qp(&mut self) -> &mut QueuePair {
        &mut self.locked.qp
    }

    /// Marks the link failed under this lock; false if it had already failed.
    fn fail(&mut self, reason: &str) -> bool {
        let st = &mut self.locked.state;
        if st.failed.is_some() {
            return false;
        }
        st.failed = Some(reason.to_string());
        st.wrs.clear();
        for (_, mut out) in st.out.drain() {
            if let Some(done) = out.done.take() {
                let _ = done.send(Err(VerbsError::LinkFailed(reason.to_string())));
            }
        }
        let mut err = QueuePairAttribute::new();
        err.setup_state(QueuePairState::Error);
        if let Err(e) = self.locked.qp.modify(&err) {
            tracing::debug!(peer = %self.link.peer, error = %e, "queue pair to ERROR");
        }
        // Receives that will not land now: their buffers go back (deregistered, if the pool
        // does not keep them) and memory lent for placed writes is free again. The queue
        // pair is in error, so the peer can no longer write any of it through this link.
        let st = &mut self.locked.state;
        st.inbound.clear();
        st.cts_backlog.clear();
        true
    }
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        if self.locked.state.wrs.is_empty() {
            return;
        }
        if let Err(e) = self.post() {
            if self.fail(&e.to_string()) {
                // Waiters re-check under the lock once it is released.
                self.link.changed.notify_waiters();
            }
        }
    }
}

/// One work completion of a link, as the poller read it.
pub(crate) struct Completion {
    pub kind: WrKind,
    pub index: u32,
    pub wc: WorkCompletion,
}

/// The result of handling completions: messages now deliverable in order.
#[derive(Default)]
pub(crate) struct Progress {
    pub delivered: Vec<Arrival>,
    pub failure: Option<VerbsError>,
}

/// Registered parts and the registrations made for them, until a send is posted.
type PendingSend = Option<(Gather, Vec<Arc<MemoryRegion>>)>;

/// One queue pair to one peer.
pub struct Link {
    /// Id used in work-request ids (unique per transport).
    pub id: u32,
    /// The peer.
    pub peer: NodeId,
    /// Random tag of this link in the control handshake.
    pub nonce: u64,
    /// Signalled when credits, buffers or queue room free up, or the link fails.
    pub changed: Notify,
    params: LinkParams,
    max_sge: u32,
    tag: u32,
    qpn: u32,
    local_psn: u32,
    // The queue pair (in `st`) keeps the slabs' memory registered until it is destroyed.
    st: Mutex<Locked>,
    recv: Slab,
    send: Slab,
    pool: Arc<RecvPool>,
    /// The placer, and the memory peers' NICs may write placed segments into.
    landings: Arc<Landings>,
    dev: Arc<Device>,
    /// The paths device segments to this peer took, each logged once.
    device_paths: psnet_transport::device::PathLog,
}

fn lost(peer: NodeId, reason: impl Into<String>) -> TransportError {
    TransportError::PeerLost {
        peer,
        reason: reason.into(),
    }
}

impl Link {
    fn lock(&self) -> Guard<'_> {
        Guard {
            link: self,
            locked: self.st.lock().unwrap_or_else(|p| p.into_inner()),
        }
    }

    /// The queue pair's number.
    pub fn qp_number(&self) -> u32 {
        self.qpn
    }

    /// This side's queue pair, for the handshake.
    pub fn local_info(&self) -> QpInfo {
        QpInfo {
            qpn: self.qpn,
            psn: self.local_psn,
            lid: self.dev.lid,
            gid: Into::<std::net::Ipv6Addr>::into(self.dev.gid).octets(),
            mtu: self.dev.mtu as u32,
            recv_depth: self.params.recv_depth,
            slot_size: self.params.slot_size as u32,
        }
    }

    /// Connects the queue pair to the peer's (RTR, then RTS). Receiving works from here;
    /// The peer's queue pair is ready to receive: sends may start.
    pub fn set_remote_ready(&self) {
        self.lock().remote_ready = true;
        self.changed.notify_waiters();
    }

    /// Whether sends may start.
    pub fn is_ready(&self) -> bool {
        let st = self.lock();
        st.remote_ready && st.failed.is_none()
    }

    /// How this link's large messages went so far.
    pub fn stats(&self) -> LinkStats {
        let st = self.lock();
        LinkStats {
            offered_now: st.offered.len() as u64,
            ..st.stats
        }
    }

    /// Why the link failed, if it did.
    pub fn failure(&self) -> Option<String> {
        self.lock().failed.clone()
    }

    /// Marks the link failed: waiting and future sends fail with `reason`, the queue pair
    /// stops. Returns false if it had already failed.
    pub fn fail(&self, reason: &str) -> bool {
        let failed = self.lock().fail(reason);
        if failed {
            self.changed.notify_waiters();
        }
        failed
    }

    /// Whether this side has work requests that have not completed yet (sends and writes
    /// posted, or decided and waiting for room in the send queue), on a link not failed.
    /// A completed send has reached the peer's receive queue. Grants and offers still to
    /// send do not count: they answer the peer's sends, and wait for credits it may withhold.
    pub fn has_unfinished_sends(&self) -> bool {
        let st = self.lock();
        st.failed.is_none()
            && (st.sq_free < self.params.sq_depth(self.max_sge)
                || !st.wrs.is_empty()
                || !st.write_backlog.is_empty())
    }

    /// The transport tag in registration keys handed out by this transport.
    pub fn tag(&self) -> u32 {
        self.tag
    }

    /// Tags every message this link sends from now on under `tags`' sealer, and checks every
    /// one it receives against their opener (a job secret: keys derived from the control
    /// connection's session, [`psnet_transport::session::Session::channel`]). Called before
    /// the queue pair is connected, so that no message goes or comes unchecked. RDMA writes
    /// (the payload of large messages) are not covered: see RELIABILITY.md.
    pub fn protect(&self, tags: Option<(Sealer, Opener)>) {
        self.lock().tags = tags;
    }

    /// Bytes of a send buffer a message may fill: the buffer less the room its tag takes
    /// (kept whether or not the link tags, so that both ends agree on what is eager).
    fn room(&self) -> usize {
        self.params.slot_size - TAG_LEN
    }
}
