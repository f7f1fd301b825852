//! Receiving: posting receive buffers, handling each completion, and turning received
//! messages (eager data, requests-to-send, grants, offers, direct messages, credits) and
//! landed writes into deliverable messages.

use bytes::Bytes;
use psnet_transport::session::TAG_LEN;
use psnet_transport::{Incoming, NodeId};
use sideway::ibverbs::completion::{WorkCompletionOperationType, WorkCompletionStatus};
use smallvec::SmallVec;

use psnet_transport::device::DevicePath;
use psnet_transport::Placed;

use super::{
    Completion, DeferredRts, Grant, InRndv, Link, Slot, State, WorkRequest, WrKind, INLINE_INDEX,
};
use crate::error::VerbsError;
use crate::landing::{Arrival, Asked, Decision};
use crate::proto::destination::Destination;
use crate::proto::offers::{RemoteBuf, PER_CLASS};
use crate::proto::wire::{self, Cts, Kind, PlacedCts};

impl Link {
    /// Posts receive buffer `slot`; it is read again only once its completion returns it.
    pub(super) fn post_recv(&self, st: &mut State, slot: Slot) {
        st.wrs.push(WorkRequest::Recv(slot));
    }

    /// Handles one completion of this link.
    pub(crate) fn on_completion(&self, c: Completion, inbox_full: bool) -> Result<(), VerbsError> {
        let Completion { kind, index, wc } = c;
        let (status, opcode, byte_len, imm) = (wc.status(), wc.opcode(), wc.byte_len(), wc.imm());
        let mut st = self.lock();
        if st.failed.is_some() {
            return Ok(());
        }
        if status != WorkCompletionStatus::Success as u32 {
            let what = WorkCompletionStatus::from(status);
            return Err(VerbsError::WorkRequest {
                kind: kind.name(),
                name: format!("{what:?}"),
                status,
            });
        }
        match kind {
            WrKind::Send => {
                if index != INLINE_INDEX {
                    let slot = self.send.completed(&wc).ok_or(VerbsError::Internal(
                        "a send completed for a buffer that was not posted",
                    ))?;
                    st.free_slots.push(slot);
                }
                st.sq_free += 1;
            }
            WrKind::Write => {
                let st = &mut *st;
                if let Some(out) = st.out.get_mut(&index) {
                    st.sq_free += out.batches.pop_front().unwrap_or(0);
                    // Done once its last batch, the one with every entry, has completed.
                    if out.batches.is_empty() && out.posted == out.gather.len() {
                        if let Some(mut out) = st.out.remove(&index) {
                            if let Some(done) = out.done.take() {
                                let _ = done.send(Ok(()));
                            }
                        }
                    }
                }
            }
            WrKind::Recv => {
                let slot = self.recv.completed(&wc).ok_or(VerbsError::Internal(
                    "a receive completed into a buffer that was not posted",
                ))?;
                let data = if opcode == WorkCompletionOperationType::ReceiveWithImmediate as u32 {
                    self.on_write_landed(&mut st, u32::from_be(imm), byte_len)?;
                    true
                } else {
                    // The slot is re-posted only below, once this borrow of it has ended.
                    let bytes = self.recv.read(&slot, byte_len as usize);
                    self.on_message(&mut st, bytes, inbox_full)?
                };
                self.post_recv(&mut st, slot);
                st.credits.slot_reposted(data && inbox_full);
            }
        }
        st.post()
    }

    /// Handles a received message; returns whether it was data (its credit may be withheld).
    fn on_message(
        &self,
        st: &mut State,
        bytes: &[u8],
        inbox_full: bool,
    ) -> Result<bool, VerbsError> {
        let bytes = match st.tags.as_mut() {
            None => bytes,
            Some((_, opener)) => {
                let Some(body_len) = bytes.len().checked_sub(TAG_LEN) else {
                    return Err(VerbsError::Protocol(format!(
                        "a {}-byte message, too short for its session tag",
                        bytes.len()
                    )));
                };
                let (body, tag) = bytes.split_at(body_len);
                opener
                    .check_message(body, tag)
                    .map_err(|e| VerbsError::Protocol(format!("RDMA message: {e}")))?;
                body
            }
        };
        let base = wire::parse_base(bytes)?;
        st.credits.granted(base.credits)?;
        match base.kind {
            Kind::Credit => Ok(false),
            Kind::Offer => {
                let offer = wire::parse_cts(bytes)?;
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
            Kind::Cts | Kind::CtsPlaced => {
                let out = st.out.get_mut(&base.seq).ok_or_else(|| {
                    VerbsError::Protocol(format!(
                        "clear-to-send for unknown rendezvous {}",
                        base.seq
                    ))
                })?;
                let to = if out.to.is_some() {
                    Err("a second one".to_string())
                } else if base.kind == Kind::Cts {
                    Destination::whole(wire::parse_cts(bytes)?, out.total)
                        .map_err(|e| e.to_string())
                } else {
                    let cts = wire::parse_placed_cts(bytes)?;
                    Destination::placed(cts, out.total, out.gather.lens())
                        .map_err(|e| e.to_string())
                };
                out.to = Some(to.map_err(|e| {
                    VerbsError::Protocol(format!(
                        "bad clear-to-send for rendezvous {}: {e}",
                        base.seq
                    ))
                })?);
                st.write_backlog.push_back(base.seq);
                Ok(false)
            }
            Kind::Eager => {
                let (h, at) = wire::parse_data_header(bytes, &self.params.limits)?;
                let payload = h.payload_len() as usize;
                if at + payload > bytes.len() {
                    return Err(VerbsError::Protocol(format!(
                        "eager message claims {payload} bytes but carries {}",
                        bytes.len() - at
                    )));
                }
                let body = Bytes::copy_from_slice(&bytes[at..at + payload]);
                let msg = split_message(self.peer, &body, h.meta_len as usize, &h.seg_lens);
                st.order.push_ready(Arrival::plain(msg));
                Ok(true)
            }
            Kind::Rts => {
                let (h, at) = wire::parse_data_header(bytes, &self.params.limits)?;
                let meta = if h.flags & wire::RTS_META_INLINE != 0 {
                    let n = h.meta_len as usize;
                    if at + n > bytes.len() {
                        return Err(VerbsError::Protocol("request-to-send truncated".into()));
                    }
                    Some(Bytes::copy_from_slice(&bytes[at..at + n]))
                } else {
                    None
                };
                if st.inbound.contains_key(&base.seq) {
                    return Err(VerbsError::Protocol(format!(
                        "duplicate rendezvous {}",
                        base.seq
                    )));
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

    pub(super) fn accept_rts(&self, st: &mut State, rts: DeferredRts) -> Result<(), VerbsError> {
        let meta_len = rts.header.meta_len as usize;
        let remote_meta = if rts.meta.is_some() {
            0
        } else {
            meta_len as u64
        };
        let total = remote_meta + rts.header.seg_lens.iter().sum::<u64>();
        let seg_lens = rts.header.seg_lens;
        // The placer is asked now only if its segment may go straight where it belongs; then
        // the metadata must have come with the request (it names the message).
        let decision = match &rts.meta {
            Some(meta) => self.landings.decide(self.peer, meta, &seg_lens),
            None => Decision::NotAsked,
        };
        let (nic, asked) = match decision {
            Decision::NotAsked => (None, Asked::No),
            Decision::Copy(answer) => (None, Asked::Answered(answer)),
            Decision::Nic(nic) => (Some(nic), Asked::Answered(None)),
        };
        let host_len = total - nic.as_ref().map_or(0, |n| n.len);
        let region = self.pool.take(host_len as usize)?;
        let host = Cts {
            addr: region.addr(),
            rkey: region.rkey(),
            len: host_len,
        };
        let grant = match &nic {
            Some(n) => Grant::Placed(PlacedCts {
                host,
                at: seg_lens[..n.segment].iter().sum(),
                to: Cts {
                    addr: n.addr,
                    rkey: n.rkey,
                    len: n.len,
                },
            }),
            None => Grant::Whole(host),
        };
        st.inbound.insert(
            rts.seq,
            InRndv {
                region,
                meta: rts.meta,
                meta_len,
                seg_lens,
                total,
                nic,
                asked,
            },
        );
        st.cts_backlog.push_back((rts.seq, grant));
        Ok(())
    }

    /// A direct message: the peer wrote its segments into offer `id`, which is handed on and
    /// replaced by a fresh offer of the same size, unless the NIC could have written the
    /// message where the placer wants it (then the next one of its size asks first).
    fn on_direct(&self, st: &mut State, id: u32, bytes: &[u8]) -> Result<(), VerbsError> {
        let (h, at) = wire::parse_data_header(bytes, &self.params.limits)?;
        let meta_len = h.meta_len as usize;
        if at + meta_len > bytes.len() {
            return Err(VerbsError::Protocol("direct message truncated".into()));
        }
        let meta = Bytes::copy_from_slice(&bytes[at..at + meta_len]);
        let (class, region) = st.offered.redeem(id).ok_or_else(|| {
            VerbsError::Protocol(format!(
                "direct message for buffer {id}, which is not on offer (never, or no more)"
            ))
        })?;
        let total: u64 = h.seg_lens.iter().sum();
        if total > region.len() as u64 {
            return Err(VerbsError::Protocol(format!(
                "direct message of {total} bytes for an offered buffer of {}",
                region.len()
            )));
        }
        // A message the NIC could have written where the placer wants it came past the
        // request-to-send: it is copied there, and its size is not offered again, so the next
        // one asks (and is written in place).
        let (asked, offer_again) = match self.landings.decide(self.peer, &meta, &h.seg_lens) {
            Decision::NotAsked => (Asked::No, true),
            Decision::Copy(answer) => (Asked::Answered(answer), true),
            Decision::Nic(nic) => {
                let p = nic.placement();
                // Dropped here: the memory is free for the copy.
                drop(nic);
                (Asked::Answered(Some(p)), false)
            }
        };
        // The peer's writes into the region were posted before this message on the same
        // reliable-connected queue pair, so they are placed; the offer was redeemed above, so
        // the peer will not write it again and it is offered to no one else.
        let body = self.pool.into_bytes(region, total as usize);
        let msg = Incoming {
            peer: self.peer,
            meta,
            segments: split_segments(&body, 0, &h.seg_lens),
            placed: None,
        };
        st.order.push_ready(Arrival { msg, asked });
        st.stats.received_direct += 1;
        if offer_again {
            self.want_offer(st, class);
        }
        Ok(())
    }

    /// Asks for a buffer of `class` bytes to be offered to the peer (sent from `pump`).
    fn want_offer(&self, st: &mut State, class: u64) {
        // Bounded: at most what could be outstanding of every size at once.
        if self.params.offer_bytes > 0 && st.to_offer.len() < 4 * PER_CLASS as usize {
            st.to_offer.push_back(class);
        }
    }

    fn on_write_landed(&self, st: &mut State, seq: u32, byte_len: u32) -> Result<(), VerbsError> {
        let inbound = st
            .inbound
            .remove(&seq)
            .ok_or_else(|| VerbsError::Protocol(format!("write for unknown rendezvous {seq}")))?;
        // The write carrying the immediate reports its own bytes: all of them when the message
        // went in one write, the last batch's when it went in several (a staged send writes
        // each chunk as it is copied out of the device).
        if byte_len as u64 > inbound.total {
            return Err(VerbsError::Protocol(format!(
                "rendezvous {seq}: {byte_len} bytes written, {} expected",
                inbound.total
            )));
        }
        let InRndv {
            region,
            meta,
            meta_len,
            mut seg_lens,
            total,
            nic,
            asked,
        } = inbound;
        // A message like this one is likely to come again (the same key): offer its size in
        // advance, if the sender can use an offer (its metadata travels in the message) and
        // the message was not placed (an offered buffer would take the next one past the
        // placer).
        if meta.is_some() && nic.is_none() {
            self.want_offer(st, region.len() as u64);
        }
        // The placed segment is not in the host buffer: the rest is, in order.
        let placed = nic.map(|n| {
            st.stats.received_placed += 1;
            seg_lens[n.segment] = 0;
            let result = n.landed();
            self.landings
                .placing
                .note(self.peer, n.dest.ordinal(), DevicePath::Direct);
            Placed {
                segment: n.segment,
                len: n.len,
                result,
            }
        });
        let host_len = total - placed.as_ref().map_or(0, |p| p.len);
        // The write-with-immediate completed, so the sender's writes into the region are done,
        // and it was offered for this rendezvous only.
        let body = self.pool.into_bytes(region, host_len as usize);
        let mut msg = match meta {
            Some(meta) => Incoming {
                peer: self.peer,
                meta,
                segments: split_segments(&body, 0, &seg_lens),
                placed: None,
            },
            None => split_message(self.peer, &body, meta_len, &seg_lens),
        };
        msg.placed = placed;
        if !st.order.complete(seq, Arrival { msg, asked }) {
            return Err(VerbsError::Protocol(format!(
                "rendezvous {seq} completed twice"
            )));
        }
        Ok(())
    }
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
        placed: None,
    }
}
