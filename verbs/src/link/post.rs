//! The thin poster: hands the work requests the link's state decided on to the queue pair, in
//! the order they were decided, before the lock under which they were decided is released.
//! It makes no decision: buffers, credits and queue room were accounted for by the state.

use smallvec::SmallVec;

use super::{wr_id, Link, Locked, Slot, WrKind, INLINE_INDEX};
use crate::error::VerbsError;
use crate::sys::verbs::WriteGroup;

/// Bytes of an inline send kept in the request itself (larger inline limits spill to the heap).
const INLINE_KEPT: usize = 128;

/// A work request the link's state decided on.
#[derive(Debug)]
pub(crate) enum WorkRequest {
    /// Post receive buffer `slot` (the NIC owns it until its completion).
    Recv(Slot),
    /// Send the first `len` bytes of send buffer `slot` (the NIC owns it until its completion).
    Send { slot: Slot, len: usize },
    /// Send `bytes` inline: copied into the work request when posted. Their send buffer was
    /// free again as soon as they were copied here.
    SendInline(SmallVec<[u8; INLINE_KEPT]>),
    /// A batch of the RDMA writes of large send `seq` (its gather list is in `State::out`):
    /// one per group, each into the peer's memory where it says; the last is signalled, and
    /// carries `imm` if given.
    Writes {
        seq: u32,
        groups: SmallVec<[WriteGroup; 4]>,
        imm: Option<u32>,
    },
}

impl Link {
    /// Posts every decided work request, in order. A receive the queue cannot take now is kept
    /// for the next pump; any other refusal is an error (the link then fails).
    pub(super) fn post_decided(&self, locked: &mut Locked) -> Result<(), VerbsError> {
        let Locked { state, qp } = locked;
        let mut wrs = std::mem::take(&mut state.wrs);
        let mut result = Ok(());
        for wr in wrs.drain(..) {
            let posted = match wr {
                WorkRequest::Recv(slot) => match qp.post_recv(&self.recv, slot) {
                    Ok(()) => Ok(()),
                    // Soft-RoCE reports a momentarily full receive queue as ENOMEM: retry later.
                    Err((
                        slot,
                        sideway::ibverbs::queue_pair::PostRecvError::NotEnoughResources(_),
                    )) => {
                        state.repost.push(slot);
                        Ok(())
                    }
                    Err((_, e)) => Err(VerbsError::os("ibv_post_recv", "post receive", &e)),
                },
                WorkRequest::Send { slot, len } => qp
                    .post_send(&self.send, slot, len)
                    .map_err(|e| VerbsError::os("ibv_post_send", "post send", &e)),
                WorkRequest::SendInline(bytes) => qp
                    .post_send_inline(wr_id(self.id, WrKind::Send, INLINE_INDEX), &bytes)
                    .map_err(|e| VerbsError::os("ibv_post_send", "post send", &e)),
                WorkRequest::Writes { seq, groups, imm } => match state.out.get(&seq) {
                    // The entries point into the sender's borrowed segments (kept alive by the
                    // pending send future: dropping it fails the link first) or into
                    // registrations held by `OutRndv` until the write completes.
                    Some(out) => qp
                        .post_writes(
                            wr_id(self.id, WrKind::Write, seq),
                            &out.gather,
                            &groups,
                            imm,
                        )
                        .map_err(|e| VerbsError::os("ibv_post_send", "post RDMA write", &e)),
                    None => Err(VerbsError::Internal(
                        "writes decided for a send no longer tracked",
                    )),
                },
            };
            if let Err(e) = posted {
                // What is left is not posted: the link fails, and its queue pair with it.
                result = Err(e);
                break;
            }
        }
        wrs.clear();
        if state.wrs.is_empty() {
            // Keep the allocation for the next decisions.
            state.wrs = wrs;
        }
        result
    }
}
