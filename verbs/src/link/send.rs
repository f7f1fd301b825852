//! Sending: the choice between the eager and the large-message paths, waiting for credits,
//! buffers and queue room, and posting a small message (eager data, requests, grants,
//! offers, credits) from a send buffer or inline.

use psnet_transport::codec::FrameHeader;
use psnet_transport::session::TAG_LEN;
use psnet_transport::{FrameKind, OutMessage, TransportError};

use smallvec::SmallVec;

use super::{lost, Link, State, WorkRequest};
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
        let eager = eager_len <= self.room() as u64;
        if msg.has_device() {
            return self.send_with_device(msg, header_len, eager, cache).await;
        }
        if eager {
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
                    // What was decided is posted before the lock goes, so that a refusal
                    // reaches this sender rather than a later one.
                    match attempt(&mut st).and_then(|decided| st.post().map(|()| decided)) {
                        Ok(Some(v)) => return Ok(v),
                        Ok(None) => {}
                        Err(e) => {
                            let failed = st.fail(&e.to_string());
                            drop(st);
                            if failed {
                                self.changed.notify_waiters();
                            }
                            return Err(e.into_lost(self.peer));
                        }
                    }
                }
            }
            notified.await;
        }
    }

    /// Decides to send a small message built by `fill` from a send buffer; false if a
    /// credit, a buffer or queue room is missing.
    pub(super) fn try_post_small(
        &self,
        st: &mut State,
        class: Class,
        fill: impl FnOnce(&mut [u8], u16) -> usize,
    ) -> bool {
        if st.sq_free == 0 || st.free_slots.is_empty() || !st.credits.try_take(class, 1) {
            return false;
        }
        let mut slot = st.free_slots.pop().expect("checked");
        st.sq_free -= 1;
        let report = st.credits.take_report();
        // The slot was free (its previous send completed) and is ours until posted.
        let buf = self.send.fill(&mut slot);
        let room = buf.len() - TAG_LEN;
        let mut len = fill(&mut buf[..room], report);
        if let Some((sealer, _)) = st.tags.as_mut() {
            let tag = sealer.tag_message(&buf[..len]);
            buf[len..len + TAG_LEN].copy_from_slice(&tag);
            len += TAG_LEN;
        }
        if len <= self.params.inline_bytes as usize {
            // The bytes travel in the work request itself: the buffer is free again.
            st.wrs
                .push(WorkRequest::SendInline(SmallVec::from_slice(&buf[..len])));
            st.free_slots.push(slot);
        } else {
            // The slot is not reused before the send's completion returns it.
            st.wrs.push(WorkRequest::Send { slot, len });
        }
        true
    }
}
