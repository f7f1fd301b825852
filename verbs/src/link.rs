//! One reliable-connected queue pair to one peer, and the protocol state that drives it.
//!
//! The state lives behind one mutex taken briefly by senders and by the completion poller;
//! posting happens under it, so work requests enter the queue in the order decisions are made.
//! Nothing here blocks: a sender that lacks a credit, a send buffer or send-queue room waits on
//! [`Link::changed`], which the poller signals whenever completions free some.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use psnet_transport::codec::FrameHeader;
use psnet_transport::{FrameKind, Incoming, Limits, NodeId, OutMessage, TransportError};
use rdma_mummy_sys::ibv_sge;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    GenericCompletionQueue, WorkCompletionOperationType, WorkCompletionStatus,
};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::queue_pair::{
    GenericQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, SetInlineData,
    SetScatterGatherEntry, WorkRequestFlags,
};
use smallvec::SmallVec;
use tokio::sync::{oneshot, Notify};

use crate::device::Device;
use crate::memory::{self, RecvPool, Region, Slab};
use crate::proto::credits::{Class, Credits};
use crate::proto::offers::{Offered, Offers, RemoteBuf, PER_CLASS};
use crate::proto::order::Reorder;
use crate::proto::wire::{self, Base, Cts, DataHeader, Kind};

/// Largest byte count one work request carries (providers limit a message to 2 GiB).
const MAX_WR_BYTES: u64 = 1 << 30;
/// Rendezvous sequence numbers and work-request indices share 28 bits.
const SEQ_MASK: u32 = 0x0FFF_FFFF;
/// Index of an inline send: its buffer went back to the free list when it was posted.
const INLINE_INDEX: u32 = SEQ_MASK;

/// What a work request was, encoded in its id with the link and an index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WrKind {
    Recv = 1,
    Send = 2,
    Write = 3,
}

/// Builds a work-request id.
pub(crate) fn wr_id(link: u32, kind: WrKind, index: u32) -> u64 {
    ((link as u64) << 32) | ((kind as u64) << 28) | (index & SEQ_MASK) as u64
}

/// Splits a work-request id into link, kind and index.
pub(crate) fn split_wr_id(id: u64) -> (u32, Option<WrKind>, u32) {
    let kind = match (id >> 28) & 0xF {
        1 => Some(WrKind::Recv),
        2 => Some(WrKind::Send),
        3 => Some(WrKind::Write),
        _ => None,
    };
    ((id >> 32) as u32, kind, id as u32 & SEQ_MASK)
}

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

/// Where a queue pair is, exchanged over the TCP control connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpInfo {
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number it sends with.
    pub psn: u32,
    /// LID (InfiniBand).
    pub lid: u16,
    /// GID (RoCE, or routed InfiniBand).
    pub gid: [u8; 16],
    /// Path MTU as the `ibv_mtu` value.
    pub mtu: u32,
    /// Receive buffers it posted.
    pub recv_depth: u32,
    /// Bytes per receive buffer.
    pub slot_size: u32,
}

struct OutRndv {
    sges: SmallVec<[ibv_sge; 4]>,
    total: u64,
    // Registrations made for this send; dropped (deregistered) when it completes.
    _regs: Vec<Arc<MemoryRegion>>,
    wrs: u32,
    cts: Option<Cts>,
    /// The immediate ending the writes (the rendezvous' seq); `None` for a write into an
    /// offered buffer, which a direct message follows instead.
    imm: Option<u32>,
    done: Option<oneshot::Sender<Result<(), String>>>,
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
    /// Buffers this side has offered and the peer has not written yet.
    pub offered_now: u64,
}

struct InRndv {
    region: Region,
    meta: Option<Bytes>,
    meta_len: usize,
    seg_lens: Vec<u64>,
    total: u64,
}

struct DeferredRts {
    seq: u32,
    header: DataHeader,
    meta: Option<Bytes>,
}

struct State {
    qp: GenericQueuePair,
    credits: Credits,
    free_slots: Vec<u32>,
    sq_free: u32,
    next_seq: u32,
    remote_ready: bool,
    out: HashMap<u32, OutRndv>,
    inbound: HashMap<u32, InRndv>,
    order: Reorder<Incoming>,
    cts_backlog: VecDeque<(u32, Cts)>,
    write_backlog: VecDeque<u32>,
    deferred_rts: VecDeque<DeferredRts>,
    repost: Vec<u32>,
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
}

/// One work completion, as the poller read it.
pub(crate) struct Completion {
    pub kind: WrKind,
    pub index: u32,
    pub status: u32,
    pub opcode: u32,
    pub byte_len: u32,
    pub imm: u32,
}

/// The result of handling completions: messages now deliverable in order.
#[derive(Default)]
pub(crate) struct Progress {
    pub delivered: Vec<Incoming>,
    pub failure: Option<String>,
}

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
    // Field order: the queue pair (in `st`) is destroyed before the buffers it used.
    st: Mutex<State>,
    recv: Slab,
    send: Slab,
    pool: Arc<RecvPool>,
    dev: Arc<Device>,
}

fn lost(peer: NodeId, reason: impl Into<String>) -> TransportError {
    TransportError::PeerLost {
        peer,
        reason: reason.into(),
    }
}

impl Link {
    /// A queue pair in INIT with all receive buffers posted.
    pub fn new(
        dev: Arc<Device>,
        pool: Arc<RecvPool>,
        id: u32,
        peer: NodeId,
        nonce: u64,
        params: LinkParams,
        tag: u32,
    ) -> Result<Link, String> {
        let recv = Slab::new(&dev.pd, params.recv_depth, params.slot_size)?;
        let send = Slab::new(&dev.pd, params.send_slots, params.slot_size)?;
        let sq_depth = params.sq_depth(dev.max_sge);
        let recv_wr = params.recv_depth + 1;
        let build = |inline: u32| {
            let cq = GenericCompletionQueue::from(Arc::clone(&dev.cq));
            dev.pd
                .create_qp_builder()
                .setup_send_cq(cq.clone())
                .setup_recv_cq(cq)
                .setup_max_send_wr(sq_depth)
                .setup_max_recv_wr(recv_wr)
                .setup_max_send_sge(dev.max_sge)
                .setup_max_recv_sge(1)
                .setup_max_inline_data(inline)
                .build()
                .map_err(|e| format!("create queue pair: {e}"))
        };
        let mut params = params;
        let qp = match build(params.inline_bytes) {
            Err(e) if params.inline_bytes > 0 => {
                tracing::info!(device = %dev.name, inline = params.inline_bytes, error = %e,
                    "the device refuses inline sends of this size; sending without");
                params.inline_bytes = 0;
                build(0)?
            }
            built => built?,
        };
        let mut qp: GenericQueuePair = qp.into();
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(dev.port)
            .setup_access_flags(memory::access());
        qp.modify(&attr)
            .map_err(|e| format!("queue pair to INIT: {e}"))?;
        let qpn = qp.qp_number();
        let link = Link {
            id,
            qpn,
            peer,
            nonce,
            changed: Notify::new(),
            max_sge: dev.max_sge,
            tag,
            local_psn: (nonce as u32) & 0xFF_FFFF,
            st: Mutex::new(State {
                qp,
                credits: Credits::new(4),
                free_slots: (0..params.send_slots).rev().collect(),
                sq_free: sq_depth,
                next_seq: 1,
                remote_ready: false,
                out: HashMap::new(),
                inbound: HashMap::new(),
                order: Reorder::default(),
                cts_backlog: VecDeque::new(),
                write_backlog: VecDeque::new(),
                deferred_rts: VecDeque::new(),
                repost: Vec::new(),
                offered: Offered::new(params.offer_bytes),
                to_offer: VecDeque::new(),
                offer_backlog: VecDeque::new(),
                offers: Offers::default(),
                stats: LinkStats::default(),
                failed: None,
            }),
            params,
            recv,
            send,
            pool,
            dev,
        };
        {
            let mut st = link.lock();
            for slot in 0..link.recv.slots() {
                link.post_recv(&mut st, slot)?;
            }
        }
        Ok(link)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The queue pair's number.
    pub fn qp_number(&self) -> u32 {
        self.qpn
    }

    /// This side's queue pair, for the handshake.
    pub fn local_info(&self) -> QpInfo {
        let st = self.lock();
        QpInfo {
            qpn: st.qp.qp_number(),
            psn: self.local_psn,
            lid: self.dev.lid,
            gid: Into::<std::net::Ipv6Addr>::into(self.dev.gid).octets(),
            mtu: self.dev.mtu as u32,
            recv_depth: self.params.recv_depth,
            slot_size: self.params.slot_size as u32,
        }
    }

    /// Connects the queue pair to the peer's (RTR, then RTS). Receiving works from here;
    /// sending waits for [`Link::set_remote_ready`].
    pub fn connect_to(&self, remote: &QpInfo) -> Result<(), String> {
        self.check_peer_buffers(remote.recv_depth, remote.slot_size)?;
        let mtu = Mtu::from(remote.mtu.min(self.dev.mtu as u32));
        let mut st = self.lock();
        st.credits = Credits::new(remote.recv_depth);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(remote.lid)
            .setup_port(self.dev.port)
            .setup_service_level(0);
        if self.dev.ethernet || remote.gid != [0; 16] && remote.lid == 0 {
            ah.setup_grh_dest_gid(&Gid::from(std::net::Ipv6Addr::from(remote.gid)))
                .setup_grh_src_gid_index(self.dev.gid_index)
                .setup_grh_hop_limit(64);
        }
        let mut rtr = QueuePairAttribute::new();
        rtr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(1)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&ah);
        st.qp
            .modify(&rtr)
            .map_err(|e| format!("queue pair to RTR: {e}"))?;
        let mut rts = QueuePairAttribute::new();
        rts.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.local_psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            // Finite: credits make receiver-not-ready impossible, so running out is a bug or a
            // dead peer, reported as an error rather than retried for ever.
            .setup_rnr_retry(6)
            .setup_max_read_atomic(1);
        st.qp
            .modify(&rts)
            .map_err(|e| format!("queue pair to RTS: {e}"))?;
        Ok(())
    }

    fn check_peer_buffers(&self, recv_depth: u32, slot_size: u32) -> Result<(), String> {
        if recv_depth < 4 || slot_size as usize != self.params.slot_size {
            return Err(format!(
                "peer's buffers ({recv_depth} x {slot_size} bytes) do not match this side's ({} \
                 bytes, at least 4): set PSNET_RDMA_EAGER alike on every node",
                self.params.slot_size
            ));
        }
        Ok(())
    }

    /// Connects the queue pair with the attributes rdma_cm computed for it (`rtr`, `rts`:
    /// route, path MTU, remote queue pair, sequence numbers), to a peer that posted
    /// `recv_depth` buffers of `slot_size` bytes. As with [`Link::connect_to`], sending waits
    /// for [`Link::set_remote_ready`].
    pub fn connect_with(
        &self,
        recv_depth: u32,
        slot_size: u32,
        mut rtr: QueuePairAttribute,
        mut rts: QueuePairAttribute,
    ) -> Result<(), String> {
        self.check_peer_buffers(recv_depth, slot_size)?;
        let mut st = self.lock();
        st.credits = Credits::new(recv_depth);
        rtr.setup_min_rnr_timer(12);
        st.qp
            .modify(&rtr)
            .map_err(|e| format!("queue pair to RTR (rdma_cm attributes): {e}"))?;
        // The same timeouts as the socket handshake's queue pairs: a dead peer is an error
        // completion after about 2 s rather than never.
        rts.setup_timeout(14).setup_retry_cnt(7).setup_rnr_retry(6);
        st.qp
            .modify(&rts)
            .map_err(|e| format!("queue pair to RTS (rdma_cm attributes): {e}"))?;
        Ok(())
    }

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
        let mut st = self.lock();
        if st.failed.is_some() {
            return false;
        }
        st.failed = Some(reason.to_string());
        for (_, mut out) in st.out.drain() {
            if let Some(done) = out.done.take() {
                let _ = done.send(Err(reason.to_string()));
            }
        }
        let mut err = QueuePairAttribute::new();
        err.setup_state(QueuePairState::Error);
        if let Err(e) = st.qp.modify(&err) {
            tracing::debug!(peer = %self.peer, error = %e, "queue pair to ERROR");
        }
        drop(st);
        self.changed.notify_waiters();
        true
    }

    fn post_recv(&self, st: &mut State, slot: u32) -> Result<(), String> {
        let mut guard = st.qp.start_post_recv();
        let wr = guard.construct_wr(wr_id(self.id, WrKind::Recv, slot));
        // SAFETY: the slot belongs to this link's receive slab, which outlives the queue pair;
        // it is not read again until its completion arrives.
        unsafe {
            wr.setup_sge(
                self.recv.lkey(),
                self.recv.addr(slot),
                self.recv.slot_size() as u32,
            )
        };
        match guard.post() {
            Ok(()) => Ok(()),
            // Soft-RoCE reports a momentarily full receive queue as ENOMEM: retry later.
            Err(sideway::ibverbs::queue_pair::PostRecvError::NotEnoughResources(_)) => {
                st.repost.push(slot);
                Ok(())
            }
            Err(e) => Err(format!("post receive: {e}")),
        }
    }

    /// Posts a small message built by `fill` into a send buffer; false if a credit, a buffer
    /// or queue room is missing.
    fn try_post_small(
        &self,
        st: &mut State,
        class: Class,
        fill: impl FnOnce(&mut [u8], u16) -> usize,
    ) -> Result<bool, String> {
        if st.sq_free == 0 || st.free_slots.is_empty() || !st.credits.try_take(class, 1) {
            return Ok(false);
        }
        let slot = st.free_slots.pop().expect("checked");
        st.sq_free -= 1;
        let report = st.credits.take_report();
        // SAFETY: the slot was free (its previous send completed) and is ours until posted.
        let buf = unsafe { self.send.write(slot) };
        let len = fill(buf, report);
        let inline = len <= self.params.inline_bytes as usize;
        let index = if inline { INLINE_INDEX } else { slot };
        let mut guard = st.qp.start_post_send();
        let wr = guard
            .construct_wr(
                wr_id(self.id, WrKind::Send, index),
                WorkRequestFlags::Signaled,
            )
            .setup_send();
        if inline {
            // The bytes are copied into the work request now: the buffer is free again.
            wr.setup_inline_data(&buf[..len]);
        } else {
            // SAFETY: the send slab outlives the queue pair; the slot is not reused before
            // the send's completion returns it.
            unsafe { wr.setup_sge(self.send.lkey(), self.send.addr(slot), len as u32) };
        }
        guard.post().map_err(|e| format!("post send: {e}"))?;
        if inline {
            st.free_slots.push(slot);
        }
        Ok(true)
    }

    /// Sends `msg`; completes when its bytes are no longer needed (copied for eager messages,
    /// written to the peer for rendezvous).
    pub async fn send(
        &self,
        msg: OutMessage<'_>,
        cache: &crate::transport::Registrar,
    ) -> Result<(), TransportError> {
        let peer = self.peer;
        let limits = &self.params.limits;
        if let Err(source) = FrameHeader::for_message(FrameKind::Data, &msg, limits) {
            return Err(TransportError::Invalid { peer, source });
        }
        let nseg = msg.segments.len();
        let header_len = DataHeader::encoded_len(nseg);
        let eager_len = header_len as u64 + msg.total_len();
        if eager_len <= self.params.slot_size as u64 {
            return self.send_eager(msg, header_len).await;
        }
        self.send_rendezvous(msg, header_len, cache).await
    }

    async fn wait_for<T>(
        &self,
        mut attempt: impl FnMut(&mut State) -> Result<Option<T>, String>,
    ) -> Result<T, TransportError> {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self.lock();
                if let Some(reason) = &st.failed {
                    return Err(lost(self.peer, reason.clone()));
                }
                if st.remote_ready {
                    match attempt(&mut st) {
                        Ok(Some(v)) => return Ok(v),
                        Ok(None) => {}
                        Err(reason) => {
                            drop(st);
                            self.fail(&reason);
                            return Err(lost(self.peer, reason));
                        }
                    }
                }
            }
            notified.await;
        }
    }

    async fn send_eager(
        &self,
        msg: OutMessage<'_>,
        header_len: usize,
    ) -> Result<(), TransportError> {
        self.wait_for(|st| {
            let posted = self.try_post_small(st, Class::Normal, |buf, credits| {
                let base = Base {
                    kind: Kind::Eager,
                    credits,
                    seq: 0,
                };
                let lens = msg.segments.iter().map(|s| s.len() as u64);
                let mut at = wire::put_data_header(buf, base, msg.meta.len() as u32, 0, lens);
                debug_assert_eq!(at, header_len);
                for part in std::iter::once(msg.meta).chain(msg.segments.iter().map(|s| s.bytes()))
                {
                    buf[at..at + part.len()].copy_from_slice(part);
                    at += part.len();
                }
                at
            })?;
            Ok(posted.then_some(()))
        })
        .await
    }

    async fn send_rendezvous(
        &self,
        msg: OutMessage<'_>,
        header_len: usize,
        registrar: &crate::transport::Registrar,
    ) -> Result<(), TransportError> {
        let peer = self.peer;
        let meta_inline = header_len + msg.meta.len() <= self.params.slot_size;
        let mut sges: SmallVec<[ibv_sge; 4]> = SmallVec::new();
        let mut regs = Vec::new();
        let remote_parts = (!meta_inline)
            .then_some(msg.meta)
            .into_iter()
            .chain(msg.segments.iter().map(|s| s.bytes()));
        for (i, part) in remote_parts.enumerate() {
            if part.is_empty() {
                continue;
            }
            let region = if meta_inline || i > 0 {
                let seg_index = if meta_inline { i } else { i - 1 };
                msg.segments[seg_index].region()
            } else {
                None
            };
            let lkey = match region.and_then(|key| registrar.own_lkey(key)) {
                Some(lkey) => lkey,
                None => {
                    let mr = registrar
                        .register(part)
                        .map_err(|reason| lost(peer, reason))?;
                    let lkey = mr.lkey();
                    regs.push(mr);
                    lkey
                }
            };
            // Split parts above what one work request may carry.
            let mut at = 0usize;
            while at < part.len() {
                let n = (part.len() - at).min(MAX_WR_BYTES as usize);
                sges.push(ibv_sge {
                    addr: part[at..].as_ptr() as u64,
                    length: n as u32,
                    lkey,
                });
                at += n;
            }
        }
        let total: u64 = sges.iter().map(|s| s.length as u64).sum();
        let (tx, rx) = oneshot::channel();
        let mut done = Some(tx);
        let mut pending = Some((sges, regs));
        let seq = self
            .wait_for(|st| {
                let offer = meta_inline.then(|| st.offers.fitting(total)).flatten();
                if let Some(offer) = offer {
                    return self.post_direct(st, &msg, offer, &mut pending, &mut done, total);
                }
                // One credit for the request, one for the write-with-immediate that ends it.
                if st.sq_free == 0 || st.free_slots.is_empty() || st.credits.available() < 3 {
                    return Ok(None);
                }
                let seq = st.next_seq;
                let posted = self.try_post_small(st, Class::Normal, |buf, credits| {
                    let base = Base {
                        kind: Kind::Rts,
                        credits,
                        seq,
                    };
                    let lens = msg.segments.iter().map(|s| s.len() as u64);
                    let flags = if meta_inline {
                        wire::RTS_META_INLINE
                    } else {
                        0
                    };
                    let at = wire::put_data_header(buf, base, msg.meta.len() as u32, flags, lens);
                    if meta_inline {
                        buf[at..at + msg.meta.len()].copy_from_slice(msg.meta);
                        at + msg.meta.len()
                    } else {
                        at
                    }
                })?;
                if !posted {
                    return Ok(None);
                }
                assert!(
                    st.credits.try_take(Class::Normal, 1),
                    "credit checked above"
                );
                let tracked = track_send(st, &mut pending, &mut done, total, None);
                debug_assert_eq!(tracked, seq);
                st.stats.sent_rendezvous += 1;
                Ok(Some(seq))
            })
            .await?;
        // From here the peer may write-read our memory: if this future is dropped before the
        // write completes, the link must go (the borrowed bytes are about to be freed).
        let guard = AbandonGuard {
            link: self,
            seq,
            armed: true,
        };
        let result = rx.await;
        let mut guard = guard;
        guard.armed = false;
        match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(reason)) => Err(lost(peer, reason)),
            Err(_) => Err(lost(
                peer,
                self.failure().unwrap_or_else(|| "link closed".into()),
            )),
        }
    }

    /// Writes `msg`'s segments into the peer's offered buffer, then sends the direct message
    /// naming it; `Ok(None)` while a credit, a send buffer or queue room is missing.
    fn post_direct(
        &self,
        st: &mut State,
        msg: &OutMessage<'_>,
        offer: RemoteBuf,
        pending: &mut PendingSend,
        done: &mut Option<oneshot::Sender<Result<(), String>>>,
        total: u64,
    ) -> Result<Option<u32>, String> {
        let sges = &pending.as_ref().expect("posted once").0;
        let wrs = write_groups(sges, self.max_sge as usize).len() as u32;
        // The writes, then the direct message (one credit, one send buffer).
        if st.sq_free < wrs + 1 || st.free_slots.is_empty() || st.credits.available() < 2 {
            return Ok(None);
        }
        let offer = st.offers.take(offer.id).expect("offer just found");
        let to = Cts {
            addr: offer.addr,
            rkey: offer.rkey,
            len: offer.len,
        };
        let seq = track_send(st, pending, done, total, Some(to));
        if !self.post_writes(st, seq)? {
            return Err("no queue room for a direct write after checking for it".into());
        }
        let posted = self.try_post_small(st, Class::Normal, |buf, credits| {
            let base = Base {
                kind: Kind::Direct,
                credits,
                seq: offer.id,
            };
            let lens = msg.segments.iter().map(|s| s.len() as u64);
            let at = wire::put_data_header(buf, base, msg.meta.len() as u32, 0, lens);
            buf[at..at + msg.meta.len()].copy_from_slice(msg.meta);
            at + msg.meta.len()
        })?;
        if !posted {
            return Err("no credit for a direct message after checking for one".into());
        }
        st.stats.sent_direct += 1;
        Ok(Some(seq))
    }

    fn post_writes(&self, st: &mut State, seq: u32) -> Result<bool, String> {
        let Some(out) = st.out.get(&seq) else {
            return Ok(true);
        };
        let cts = out.cts.expect("writes follow a clear-to-send or an offer");
        let imm = out.imm;
        let groups = write_groups(&out.sges, self.max_sge as usize);
        let wrs = groups.len() as u32;
        if st.sq_free < wrs {
            return Ok(false);
        }
        st.sq_free -= wrs;
        let sges = out.sges.clone();
        let mut guard = st.qp.start_post_send();
        let mut remote = cts.addr;
        for (n, &(from, to, bytes)) in groups.iter().enumerate() {
            let last = n + 1 == groups.len();
            let flags = if last {
                WorkRequestFlags::Signaled
            } else {
                WorkRequestFlags::none()
            };
            let wr = guard.construct_wr(wr_id(self.id, WrKind::Write, seq), flags);
            let wr = match imm {
                Some(imm) if last => wr.setup_write_imm(cts.rkey, remote, imm.to_be()),
                _ => wr.setup_write(cts.rkey, remote),
            };
            // SAFETY: the entries point into the sender's borrowed segments (kept alive by the
            // pending send future: dropping it fails the link first) or into registrations
            // held by `OutRndv` until the write completes.
            unsafe { wr.setup_sge_list(&sges[from..to]) };
            remote += bytes;
        }
        guard.post().map_err(|e| format!("post RDMA write: {e}"))?;
        if let Some(out) = st.out.get_mut(&seq) {
            out.wrs = wrs;
        }
        Ok(true)
    }

    /// Handles one completion of this link.
    pub(crate) fn on_completion(&self, c: Completion, inbox_full: bool) -> Result<(), String> {
        let Completion {
            kind,
            index,
            status,
            opcode,
            byte_len,
            imm,
        } = c;
        let mut st = self.lock();
        if st.failed.is_some() {
            return Ok(());
        }
        if status != WorkCompletionStatus::Success as u32 {
            let what = WorkCompletionStatus::from(status);
            return Err(format!(
                "{kind:?} work request failed: {what:?} (status {status})"
            ));
        }
        match kind {
            WrKind::Send => {
                if index != INLINE_INDEX {
                    st.free_slots.push(index);
                }
                st.sq_free += 1;
            }
            WrKind::Write => {
                if let Some(mut out) = st.out.remove(&index) {
                    st.sq_free += out.wrs;
                    if let Some(done) = out.done.take() {
                        let _ = done.send(Ok(()));
                    }
                }
            }
            WrKind::Recv => {
                let data = if opcode == WorkCompletionOperationType::ReceiveWithImmediate as u32 {
                    self.on_write_landed(&mut st, u32::from_be(imm), byte_len)?;
                    true
                } else {
                    // SAFETY: the receive completed and the slot is re-posted only below,
                    // after the bytes were copied out.
                    let bytes = unsafe { self.recv.read(index, byte_len as usize) };
                    self.on_message(&mut st, bytes, inbox_full)?
                };
                self.post_recv(&mut st, index)?;
                st.credits.slot_reposted(data && inbox_full);
            }
        }
        Ok(())
    }

    /// Handles a received message; returns whether it was data (its credit may be withheld).
    fn on_message(&self, st: &mut State, bytes: &[u8], inbox_full: bool) -> Result<bool, String> {
        let base = wire::parse_base(bytes).map_err(|e| e.to_string())?;
        st.credits.granted(base.credits);
        match base.kind {
            Kind::Credit => Ok(false),
            Kind::Offer => {
                let offer = wire::parse_cts(bytes).map_err(|e| e.to_string())?;
                st.offers.add(RemoteBuf {
                    id: base.seq,
                    addr: offer.addr,
                    rkey: offer.rkey,
                    len: offer.len,
                })?;
                Ok(false)
            }
            Kind::Direct => {
                self.on_direct(st, base.seq, bytes)?;
                Ok(true)
            }
            Kind::Cts => {
                let cts = wire::parse_cts(bytes).map_err(|e| e.to_string())?;
                let out = st
                    .out
                    .get_mut(&base.seq)
                    .ok_or_else(|| format!("clear-to-send for unknown rendezvous {}", base.seq))?;
                if out.cts.is_some() || cts.len < out.total {
                    return Err(format!(
                        "bad clear-to-send for rendezvous {} ({} bytes offered, {} needed)",
                        base.seq, cts.len, out.total
                    ));
                }
                out.cts = Some(cts);
                st.write_backlog.push_back(base.seq);
                Ok(false)
            }
            Kind::Eager => {
                let (h, at) = wire::parse_data_header(bytes, &self.params.limits)
                    .map_err(|e| e.to_string())?;
                let payload = h.payload_len() as usize;
                if at + payload > bytes.len() {
                    return Err(format!(
                        "eager message claims {payload} bytes but carries {}",
                        bytes.len() - at
                    ));
                }
                let body = Bytes::copy_from_slice(&bytes[at..at + payload]);
                let msg = split_message(self.peer, &body, h.meta_len as usize, &h.seg_lens);
                st.order.push_ready(msg);
                Ok(true)
            }
            Kind::Rts => {
                let (h, at) = wire::parse_data_header(bytes, &self.params.limits)
                    .map_err(|e| e.to_string())?;
                let meta = if h.flags & wire::RTS_META_INLINE != 0 {
                    let n = h.meta_len as usize;
                    if at + n > bytes.len() {
                        return Err("request-to-send truncated".into());
                    }
                    Some(Bytes::copy_from_slice(&bytes[at..at + n]))
                } else {
                    None
                };
                if st.inbound.contains_key(&base.seq) {
                    return Err(format!("duplicate rendezvous {}", base.seq));
                }
                st.order.push_pending(base.seq);
                let rts = DeferredRts {
                    seq: base.seq,
                    header: h,
                    meta,
                };
                if inbox_full || !st.deferred_rts.is_empty() {
                    st.deferred_rts.push_back(rts);
                } else {
                    self.accept_rts(st, rts)?;
                }
                Ok(true)
            }
        }
    }

    fn accept_rts(&self, st: &mut State, rts: DeferredRts) -> Result<(), String> {
        let meta_len = rts.header.meta_len as usize;
        let remote_meta = if rts.meta.is_some() {
            0
        } else {
            meta_len as u64
        };
        let total = remote_meta + rts.header.seg_lens.iter().sum::<u64>();
        let region = self.pool.take(total as usize)?;
        let cts = Cts {
            addr: region.addr(),
            rkey: region.rkey(),
            len: total,
        };
        st.inbound.insert(
            rts.seq,
            InRndv {
                region,
                meta: rts.meta,
                meta_len,
                seg_lens: rts.header.seg_lens,
                total,
            },
        );
        st.cts_backlog.push_back((rts.seq, cts));
        Ok(())
    }

    /// A direct message: the peer wrote its segments into offer `id`, which is handed on and
    /// replaced by a fresh offer of the same size.
    fn on_direct(&self, st: &mut State, id: u32, bytes: &[u8]) -> Result<(), String> {
        let (h, at) =
            wire::parse_data_header(bytes, &self.params.limits).map_err(|e| e.to_string())?;
        let meta_len = h.meta_len as usize;
        if at + meta_len > bytes.len() {
            return Err("direct message truncated".into());
        }
        let meta = Bytes::copy_from_slice(&bytes[at..at + meta_len]);
        let (class, region) = st.offered.redeem(id).ok_or_else(|| {
            format!("direct message for buffer {id}, which is not on offer (never, or no more)")
        })?;
        let total: u64 = h.seg_lens.iter().sum();
        if total > region.len() as u64 {
            return Err(format!(
                "direct message of {total} bytes for an offered buffer of {}",
                region.len()
            ));
        }
        // SAFETY: the peer's writes into the region were posted before this message on the
        // same reliable-connected queue pair, so they are placed; the offer was redeemed
        // above, so the peer will not write it again and it is offered to no one else.
        let body = unsafe { self.pool.into_bytes(region, total as usize) };
        st.order.push_ready(Incoming {
            peer: self.peer,
            meta,
            segments: split_segments(&body, 0, &h.seg_lens),
        });
        st.stats.received_direct += 1;
        self.want_offer(st, class);
        Ok(())
    }

    /// Asks for a buffer of `class` bytes to be offered to the peer (sent from `pump`).
    fn want_offer(&self, st: &mut State, class: u64) {
        // Bounded: at most what could be outstanding of every size at once.
        if self.params.offer_bytes > 0 && st.to_offer.len() < 4 * PER_CLASS as usize {
            st.to_offer.push_back(class);
        }
    }

    fn on_write_landed(&self, st: &mut State, seq: u32, byte_len: u32) -> Result<(), String> {
        let inbound = st
            .inbound
            .remove(&seq)
            .ok_or_else(|| format!("write for unknown rendezvous {seq}"))?;
        if inbound.total <= u32::MAX as u64 && byte_len as u64 != inbound.total {
            return Err(format!(
                "rendezvous {seq}: {byte_len} bytes written, {} expected",
                inbound.total
            ));
        }
        // A message like this one is likely to come again (the same key): offer its size in
        // advance, if the sender can use an offer (its metadata travels in the message).
        if inbound.meta.is_some() {
            self.want_offer(st, inbound.region.len() as u64);
        }
        // SAFETY: the write-with-immediate completed, so the sender's writes into the region
        // are done, and it was offered for this rendezvous only.
        let body = unsafe { self.pool.into_bytes(inbound.region, inbound.total as usize) };
        let msg = match inbound.meta {
            Some(meta) => Incoming {
                peer: self.peer,
                meta,
                segments: split_segments(&body, 0, &inbound.seg_lens),
            },
            None => split_message(self.peer, &body, inbound.meta_len, &inbound.seg_lens),
        };
        if !st.order.complete(seq, msg) {
            return Err(format!("rendezvous {seq} completed twice"));
        }
        Ok(())
    }

    /// After completions: retries, deferred work, credits; returns deliverable messages.
    pub(crate) fn pump(&self, inbox_full: bool) -> Progress {
        let mut progress = Progress::default();
        let mut st = self.lock();
        if st.failed.is_some() {
            return progress;
        }
        let result = (|| -> Result<(), String> {
            for slot in std::mem::take(&mut st.repost) {
                self.post_recv(&mut st, slot)?;
            }
            if !inbox_full {
                st.credits.release_withheld();
                while let Some(rts) = st.deferred_rts.pop_front() {
                    self.accept_rts(&mut st, rts)?;
                }
                while let Some(class) = st.to_offer.pop_front() {
                    if st.offered.wants(class) {
                        let region = self.pool.take(class as usize)?;
                        let cts = Cts {
                            addr: region.addr(),
                            rkey: region.rkey(),
                            len: region.len() as u64,
                        };
                        let id = st.offered.offer(class, region);
                        st.offer_backlog.push_back((id, cts));
                    }
                }
            }
            while let Some(&seq) = st.write_backlog.front() {
                if !self.post_writes(&mut st, seq)? {
                    break;
                }
                st.write_backlog.pop_front();
            }
            while let Some(&(seq, cts)) = st.cts_backlog.front() {
                let posted = self.try_post_small(&mut st, Class::Normal, |buf, credits| {
                    let base = Base {
                        kind: Kind::Cts,
                        credits,
                        seq,
                    };
                    wire::put_cts(buf, base, cts)
                })?;
                if !posted {
                    break;
                }
                st.cts_backlog.pop_front();
            }
            while let Some(&(id, offer)) = st.offer_backlog.front() {
                let posted = self.try_post_small(&mut st, Class::Normal, |buf, credits| {
                    let base = Base {
                        kind: Kind::Offer,
                        credits,
                        seq: id,
                    };
                    wire::put_cts(buf, base, offer)
                })?;
                if !posted {
                    break;
                }
                st.offer_backlog.pop_front();
            }
            if st.credits.wants_credit_message() {
                self.try_post_small(&mut st, Class::CreditReturn, |buf, credits| {
                    let base = Base {
                        kind: Kind::Credit,
                        credits,
                        seq: 0,
                    };
                    wire::put_base(buf, base);
                    wire::BASE_LEN
                })?;
            }
            Ok(())
        })();
        while let Some(msg) = st.order.pop_ready() {
            progress.delivered.push(msg);
        }
        drop(st);
        if let Err(reason) = result {
            progress.failure = Some(reason);
        }
        self.changed.notify_waiters();
        progress
    }

    /// The transport tag in registration keys handed out by this transport.
    pub fn tag(&self) -> u32 {
        self.tag
    }
}

struct AbandonGuard<'a> {
    link: &'a Link,
    seq: u32,
    armed: bool,
}

impl Drop for AbandonGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            let pending = self.link.lock().out.contains_key(&self.seq);
            if pending {
                self.link
                    .fail("a rendezvous send was abandoned before its write completed");
            }
        }
    }
}

/// Tracks a large send under the next sequence number until its writes complete. A direct
/// write knows its destination (`to`) now and ends without an immediate; a rendezvous learns
/// it from the clear-to-send and ends with an immediate naming the sequence number.
fn track_send(
    st: &mut State,
    pending: &mut PendingSend,
    done: &mut Option<oneshot::Sender<Result<(), String>>>,
    total: u64,
    to: Option<Cts>,
) -> u32 {
    let seq = st.next_seq;
    st.next_seq = (seq + 1) & SEQ_MASK;
    let (sges, regs) = pending.take().expect("tracked once");
    st.out.insert(
        seq,
        OutRndv {
            sges,
            total,
            _regs: regs,
            wrs: 0,
            imm: to.is_none().then_some(seq),
            cts: to,
            done: done.take(),
        },
    );
    seq
}

/// Registered parts and the registrations made for them, until a send is posted.
type PendingSend = Option<(SmallVec<[ibv_sge; 4]>, Vec<Arc<MemoryRegion>>)>;

/// Groups scatter-gather entries into RDMA writes of at most `max_sge` entries and
/// [`MAX_WR_BYTES`] each: `(first, end, bytes)` per write.
fn write_groups(sges: &[ibv_sge], max_sge: usize) -> SmallVec<[(usize, usize, u64); 4]> {
    let mut groups = SmallVec::new();
    let (mut start, mut bytes) = (0usize, 0u64);
    for (i, sge) in sges.iter().enumerate() {
        if i > start && (i - start == max_sge.max(1) || bytes + sge.length as u64 > MAX_WR_BYTES) {
            groups.push((start, i, bytes));
            start = i;
            bytes = 0;
        }
        bytes += sge.length as u64;
    }
    groups.push((start, sges.len(), bytes));
    groups
}

fn split_segments(body: &Bytes, mut at: usize, lens: &[u64]) -> SmallVec<[Bytes; 4]> {
    lens.iter()
        .map(|&len| {
            let s = body.slice(at..at + len as usize);
            at += len as usize;
            s
        })
        .collect()
}

fn split_message(peer: NodeId, body: &Bytes, meta_len: usize, lens: &[u64]) -> Incoming {
    Incoming {
        peer,
        meta: body.slice(..meta_len),
        segments: split_segments(body, meta_len, lens),
    }
}
