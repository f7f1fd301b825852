//! The direct path: a large message whose metadata fits a buffer and whose segments fit a
//! buffer the peer offered in advance is written there at once, then named by a direct
//! message: no request-to-send round trip.

use psnet_transport::OutMessage;
use tokio::sync::oneshot;

use super::rendezvous::{track_send, write_groups};
use super::{Link, PendingSend, State};
use crate::error::VerbsError;
use crate::proto::credits::Class;
use crate::proto::destination::Destination;
use crate::proto::offers::RemoteBuf;
use crate::proto::wire::{self, Base, Cts, Kind};

impl Link {
    /// Writes `msg`'s segments into the peer's offered buffer, then sends the direct message
    /// naming it; `Ok(None)` while a credit, a send buffer or queue room is missing.
    pub(super) fn post_direct(
        &self,
        st: &mut State,
        msg: &OutMessage<'_>,
        offer: RemoteBuf,
        pending: &mut PendingSend,
        done: &mut Option<oneshot::Sender<Result<(), VerbsError>>>,
        total: u64,
    ) -> Result<Option<u32>, VerbsError> {
        let gather = &pending.as_ref().expect("posted once").0;
        let wrs =
            write_groups(gather, 0..gather.len(), self.max_sge as usize, 0, None).len() as u32;
        // The writes, then the direct message (one credit, one send buffer).
        if st.sq_free < wrs + 1 || st.free_slots.is_empty() || st.credits.available() < 2 {
            return Ok(None);
        }
        let offer = st.offers.take(offer.id).expect("offer just found");
        let to = Destination::whole(
            Cts {
                addr: offer.addr,
                rkey: offer.rkey,
                len: offer.len,
            },
            total,
        )
        .map_err(|e| VerbsError::Protocol(format!("offered buffer: {e}")))?;
        let seq = track_send(st, pending, done, total, Some(to));
        if !self.post_writes(st, seq) {
            return Err(VerbsError::Internal(
                "no queue room for a direct write after checking for it",
            ));
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
        });
        if !posted {
            return Err(VerbsError::Internal(
                "no credit for a direct message after checking for one",
            ));
        }
        st.stats.sent_direct += 1;
        Ok(Some(seq))
    }
}
