//! Sending: the choice between the eager and the large-message paths, waiting for credits,
//! buffers and queue room, and posting a small message (eager data, requests, grants,
//! offers, credits) from a send buffer or inline.

use psnet_transport::codec::FrameHeader;
use psnet_transport::{FrameKind, OutMessage, TransportError};

use super::{lost, wr_id, Link, State, WrKind, INLINE_INDEX};
use crate::error::VerbsError;
use crate::proto::credits::Class;
use crate::proto::wire::DataHeader;
use crate::registrar::Registrar;

impl Link {
    /// Sends `msg`; completes when its bytes are no longer needed (copied for eager messages,
    /// written to the peer for rendezvous).
    pub async fn send(&self, msg: OutMessage<'_>, cache: &Registrar) -> Result<(), TransportError> {
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

    pub(super) async fn wait_for<T>(
        &self,
        mut attempt: impl FnMut(&mut State) -> Result<Option<T>, VerbsError>,
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
                        Err(e) => {
                            drop(st);
                            self.fail(&e.to_string());
                            return Err(e.into_lost(self.peer));
                        }
                    }
                }
            }
            notified.await;
        }
    }

    /// Posts a small message built by `fill` into a send buffer; false if a credit, a buffer
    /// or queue room is missing.
    pub(super) fn try_post_small(
        &self,
        st: &mut State,
        class: Class,
        fill: impl FnOnce(&mut [u8], u16) -> usize,
    ) -> Result<bool, VerbsError> {
        if st.sq_free == 0 || st.free_slots.is_empty() || !st.credits.try_take(class, 1) {
            return Ok(false);
        }
        let mut slot = st.free_slots.pop().expect("checked");
        st.sq_free -= 1;
        let report = st.credits.take_report();
        // The slot was free (its previous send completed) and is ours until posted.
        let buf = self.send.fill(&mut slot);
        let len = fill(buf, report);
        let inline = len <= self.params.inline_bytes as usize;
        let post_error = |e| VerbsError::os("ibv_post_send", "post send", &e);
        if inline {
            // The bytes are copied into the work request now: the buffer is free again.
            st.qp
                .post_send_inline(wr_id(self.id, WrKind::Send, INLINE_INDEX), &buf[..len])
                .map_err(post_error)?;
            st.free_slots.push(slot);
        } else {
            // The slot is not reused before the send's completion returns it.
            st.qp.post_send(&self.send, slot, len).map_err(post_error)?;
        }
        Ok(true)
    }
}
