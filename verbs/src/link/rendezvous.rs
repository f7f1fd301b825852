//! The rendezvous path: register the message's parts, send a request-to-send, and on the
//! peer's clear-to-send write the parts into its buffer, ending with RDMA WRITE WITH
//! IMMEDIATE. A message that fits an offered buffer takes the direct path instead
//! (`direct.rs`); both share the writes posted here.

use psnet_transport::{DeviceError, OutMessage, Segment, TransportError};
use smallvec::SmallVec;
use tokio::sync::oneshot;

use super::device_send::direct_lkey;
use super::{lost, Link, OutRndv, PendingSend, State, WorkRequest, SEQ_MASK};
use crate::error::VerbsError;
use crate::proto::credits::Class;
use crate::proto::wire::{self, Base, Cts, Kind};
use crate::registrar::Registrar;
use crate::sys::verbs::Gather;

/// Largest byte count one work request carries (providers limit a message to 2 GiB).
const MAX_WR_BYTES: u64 = 1 << 30;

/// Calls `push(at, n)` for pieces of `len` bytes that one work request may carry each.
fn push_split(len: usize, mut push: impl FnMut(usize, usize)) {
    let mut at = 0usize;
    while at < len {
        let n = (len - at).min(MAX_WR_BYTES as usize);
        push(at, n);
        at += n;
    }
}

impl Link {
    /// Sends `msg` by rendezvous (or directly into an offered buffer); completes when the
    /// peer's buffer holds its bytes.
    pub(super) async fn send_rendezvous(
        &self,
        msg: OutMessage<'_>,
        header_len: usize,
        registrar: &Registrar,
    ) -> Result<(), TransportError> {
        let peer = self.peer;
        let meta_inline = header_len + msg.meta.len() <= self.params.slot_size;
        let mut gather = Gather::default();
        let mut regs = Vec::new();
        // The metadata when it does not fit the request, then every segment.
        let meta_part = (!meta_inline).then_some(Segment::new(msg.meta));
        for seg in meta_part.iter().chain(msg.segments) {
            if seg.is_empty() {
                continue;
            }
            if let Some(device) = seg.device_bytes() {
                // Only segments the NIC reads in place get here (`device_send.rs`).
                let (Some(lkey), Some(nic)) = (direct_lkey(seg, registrar), device.nic()) else {
                    return Err(TransportError::Device {
                        peer,
                        source: DeviceError {
                            ordinal: device.ordinal(),
                            reason: "device memory without this NIC's registration reached \
                                     the zero-copy path"
                                .into(),
                        },
                    });
                };
                push_split(seg.len(), |at, n| {
                    gather.push_device(nic.addr + at as u64, n, lkey)
                });
                continue;
            }
            let part = seg.host().unwrap_or_default();
            let lkey = match seg.region().and_then(|key| registrar.own_lkey(key)) {
                Some(lkey) => lkey,
                None => {
                    let mr = registrar.register(part).map_err(|e| e.into_lost(peer))?;
                    let lkey = mr.lkey();
                    regs.push(mr);
                    lkey
                }
            };
            push_split(part.len(), |at, n| gather.push(&part[at..at + n], lkey));
        }
        let total = gather.total();
        let (tx, rx) = oneshot::channel();
        let mut done = Some(tx);
        let mut pending = Some((gather, regs));
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
                });
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
            Ok(Err(e)) => Err(e.into_lost(peer)),
            Err(_) => Err(lost(
                peer,
                self.failure().unwrap_or_else(|| "link closed".into()),
            )),
        }
    }

    /// Decides the RDMA writes of large send `seq`; false if the send queue lacks room.
    pub(super) fn post_writes(&self, st: &mut State, seq: u32) -> bool {
        let max_sge = self.max_sge as usize;
        let Some(out) = st.out.get_mut(&seq) else {
            return true;
        };
        let to = out.cts.expect("writes follow a clear-to-send or an offer");
        let imm = out.imm;
        let groups = write_groups(&out.gather, max_sge);
        let wrs = groups.len() as u32;
        if st.sq_free < wrs {
            return false;
        }
        out.wrs = wrs;
        st.sq_free -= wrs;
        st.wrs.push(WorkRequest::Writes {
            seq,
            groups,
            to,
            imm,
        });
        true
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
pub(super) fn track_send(
    st: &mut State,
    pending: &mut PendingSend,
    done: &mut Option<oneshot::Sender<Result<(), VerbsError>>>,
    total: u64,
    to: Option<Cts>,
) -> u32 {
    let seq = st.next_seq;
    st.next_seq = (seq + 1) & SEQ_MASK;
    let (gather, regs) = pending.take().expect("tracked once");
    st.out.insert(
        seq,
        OutRndv {
            gather,
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

/// Groups a gather list's entries into RDMA writes of at most `max_sge` entries and
/// [`MAX_WR_BYTES`] each: `(first, end, bytes)` per write.
pub(super) fn write_groups(gather: &Gather, max_sge: usize) -> SmallVec<[(usize, usize, u64); 4]> {
    let mut groups = SmallVec::new();
    let (mut start, mut bytes) = (0usize, 0u64);
    let lens = gather.lens();
    let entries = lens.len();
    for (i, len) in lens.enumerate() {
        if i > start && (i - start == max_sge.max(1) || bytes + len > MAX_WR_BYTES) {
            groups.push((start, i, bytes));
            start = i;
            bytes = 0;
        }
        bytes += len;
    }
    groups.push((start, entries, bytes));
    groups
}
