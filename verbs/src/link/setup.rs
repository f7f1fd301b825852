//! Bringing a queue pair up: created in INIT with every receive buffer posted, then moved
//! to RTR and RTS with the peer's [`QpInfo`] (socket handshake) or with the attributes
//! rdma_cm computed.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use psnet_transport::NodeId;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::GenericCompletionQueue;
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::queue_pair::{GenericQueuePair, QueuePairAttribute, QueuePairState};
use tokio::sync::Notify;

use super::{Link, LinkParams, LinkStats, Locked, QpInfo, State};
use crate::device::Device;
use crate::error::VerbsError;
use crate::landing::Landings;
use crate::memory::{self, RecvPool};
use crate::proto::credits::Credits;
use crate::proto::offers::{Offered, Offers};
use crate::proto::order::Reorder;
use crate::sys::memory::Slab;
use crate::sys::verbs::{QueuePair, WrKind};

impl Link {
    /// A queue pair in INIT with all receive buffers posted.
    pub(crate) fn new(
        dev: Arc<Device>,
        pool: Arc<RecvPool>,
        landings: Arc<Landings>,
        id: u32,
        peer: NodeId,
        nonce: u64,
        params: LinkParams,
    ) -> Result<Link, VerbsError> {
        let tag = landings.tag();
        let (recv, recv_slots) = Slab::new(
            &dev.pd,
            params.recv_depth,
            params.slot_size,
            id,
            WrKind::Recv,
        )?;
        let (send, mut send_slots) = Slab::new(
            &dev.pd,
            params.send_slots,
            params.slot_size,
            id,
            WrKind::Send,
        )?;
        // Popped from the end: the first buffer goes first.
        send_slots.reverse();
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
                .map_err(|e| VerbsError::os("ibv_create_qp", "create queue pair", &e))
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
        let mut qp = QueuePair::new(GenericQueuePair::from(qp));
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(dev.port)
            .setup_access_flags(memory::access());
        qp.modify(&attr)
            .map_err(|e| VerbsError::os("ibv_modify_qp", "queue pair to INIT", &e))?;
        let qpn = qp.qp_number();
        let link = Link {
            id,
            qpn,
            peer,
            nonce,
            changed: Notify::new(),
            max_sge: dev.max_sge,
            tag,
            device_paths: Default::default(),
            local_psn: (nonce as u32) & 0xFF_FFFF,
            st: Mutex::new(Locked {
                qp,
                state: State {
                    wrs: Vec::new(),
                    credits: Credits::new(4),
                    free_slots: send_slots,
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
                    tags: None,
                },
            }),
            params,
            recv,
            send,
            pool,
            landings,
            dev,
        };
        {
            let mut st = link.lock();
            for slot in recv_slots {
                link.post_recv(&mut st, slot);
            }
            st.post()?;
        }
        Ok(link)
    }

    /// sending waits for [`Link::set_remote_ready`].
    pub fn connect_to(&self, remote: &QpInfo) -> Result<(), VerbsError> {
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
        st.qp()
            .modify(&rtr)
            .map_err(|e| VerbsError::os("ibv_modify_qp", "queue pair to RTR", &e))?;
        let mut rts = QueuePairAttribute::new();
        rts.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.local_psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            // Finite: credits make receiver-not-ready impossible, so running out is a bug or a
            // dead peer, reported as an error rather than retried for ever.
            .setup_rnr_retry(6)
            .setup_max_read_atomic(1);
        st.qp()
            .modify(&rts)
            .map_err(|e| VerbsError::os("ibv_modify_qp", "queue pair to RTS", &e))?;
        Ok(())
    }

    fn check_peer_buffers(&self, recv_depth: u32, slot_size: u32) -> Result<(), VerbsError> {
        if recv_depth < 4 || slot_size as usize != self.params.slot_size {
            return Err(VerbsError::IncompatiblePeer {
                recv_depth,
                slot_size,
                local_slot_size: self.params.slot_size,
            });
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
    ) -> Result<(), VerbsError> {
        self.check_peer_buffers(recv_depth, slot_size)?;
        let mut st = self.lock();
        st.credits = Credits::new(recv_depth);
        rtr.setup_min_rnr_timer(12);
        st.qp().modify(&rtr).map_err(|e| {
            VerbsError::os(
                "ibv_modify_qp",
                "queue pair to RTR (rdma_cm attributes)",
                &e,
            )
        })?;
        // The same timeouts as the socket handshake's queue pairs: a dead peer is an error
        // completion after about 2 s rather than never.
        rts.setup_timeout(14).setup_retry_cnt(7).setup_rnr_retry(6);
        st.qp().modify(&rts).map_err(|e| {
            VerbsError::os(
                "ibv_modify_qp",
                "queue pair to RTS (rdma_cm attributes)",
                &e,
            )
        })?;
        Ok(())
    }
}
