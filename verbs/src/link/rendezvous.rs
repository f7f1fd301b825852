//! The rendezvous path: register the message's parts, send a request-to-send, and on the
//! peer's clear-to-send write the parts into its buffer, ending with RDMA WRITE WITH
//! IMMEDIATE. A message that fits an offered buffer takes the direct path instead
//! (`direct.rs`); both share the writes posted here.

use std::collections::VecDeque;
use std::sync::Arc;

use psnet_transport::{DeviceError, OutMessage, Segment, TransportError};
use sideway::ibverbs::memory_region::MemoryRegion;
use smallvec::SmallVec;
use tokio::sync::oneshot;

use super::device_send::direct_lkey;
use super::{lost, Link, OutRndv, PendingSend, State, WorkRequest, SEQ_MASK};
use crate::error::VerbsError;
use crate::proto::credits::Class;
use crate::proto::destination::Destination;
use crate::proto::wire::{self, Base, Kind};
use crate::registrar::Registrar;
use crate::sys::verbs::{Gather, WriteGroup};

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

/// Where a segment's bytes come from in a large send.
pub(super) enum Part<'b> {
    /// The segment itself: host memory, or device memory the NIC reads in place.
    Own,
    /// A host buffer the segment's device bytes are copied into, chunk by chunk (a staged
    /// send): registered here, and written in entries of `chunk` bytes as they land.
    Staged { host: &'b [u8], chunk: usize },
}

/// A large send's gather list and the registrations made for it.
pub(super) struct LargeSend {
    gather: Gather,
    regs: Vec<Arc<MemoryRegion>>,
    /// For each of the message's segments, the gather entry its bytes start at.
    starts: SmallVec<[usize; 4]>,
    /// Entries in place when the send starts: all, or a staged send's up to its first chunk
    /// not yet copied.
    ready: usize,
}

impl LargeSend {
    /// Entries in the gather list.
    pub(super) fn entries(&self) -> usize {
        self.gather.len()
    }

    /// The gather entry segment `index` of the message starts at.
    pub(super) fn start_of(&self, index: usize) -> usize {
        self.starts.get(index).copied().unwrap_or(self.gather.len())
    }

    /// Marks the first `ready` entries in place before the send starts.
    pub(super) fn set_ready(&mut self, ready: usize) {
        self.ready = ready.min(self.gather.len());
    }
}

/// A large send whose request went out: the peer may read this side's memory from now on.
pub(super) struct Started<'a> {
    seq: u32,
    rx: oneshot::Receiver<Result<(), VerbsError>>,
    guard: AbandonGuard<'a>,
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
        let parts: SmallVec<[Part<'_>; 4]> = msg.segments.iter().map(|_| Part::Own).collect();
        let large = self.gather_parts(&msg, header_len, &parts, registrar)?;
        let started = self.start_large(&msg, header_len, large, true).await?;
        self.finish_large(started).await
    }

    /// The gather list of `msg` (its metadata when that does not fit the request, then its
    /// segments, each from where `parts` says), registering what needs it. Entry `i` of a
    /// staged part starts at byte `i * chunk` of it.
    pub(super) fn gather_parts(
        &self,
        msg: &OutMessage<'_>,
        header_len: usize,
        parts: &[Part<'_>],
        registrar: &Registrar,
    ) -> Result<LargeSend, TransportError> {
        let peer = self.peer;
        let meta_inline = header_len + msg.meta.len() <= self.room();
        let mut gather = Gather::default();
        let mut regs = Vec::new();
        let mut starts = SmallVec::new();
        // The metadata when it does not fit the request, then every segment.
        let meta_part = (!meta_inline).then_some(Segment::new(msg.meta));
        let own = Part::Own;
        let segments = meta_part.iter().map(|seg| (seg, &own, false)).chain(
            msg.segments
                .iter()
                .zip(parts)
                .map(|(seg, part)| (seg, part, true)),
        );
        for (seg, part, counted) in segments {
            if counted {
                starts.push(gather.len());
            }
            if seg.is_empty() {
                continue;
            }
            if let Part::Staged { host, chunk } = part {
                let mr = registrar.register(host).map_err(|e| e.into_lost(peer))?;
                let lkey = mr.lkey();
                regs.push(mr);
                for piece in host.chunks((*chunk).max(1)) {
                    gather.push(piece, lkey);
                }
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
        let ready = gather.len();
        Ok(LargeSend {
            gather,
            regs,
            starts,
            ready,
        })
    }

    /// Sends the request-to-send of `msg`, whose bytes `large` gathers, or, if `may_direct`
    /// and an offered buffer fits, writes it there at once. From here the peer may read this
    /// side's memory: the caller must keep it until [`Link::finish_large`] returns.
    pub(super) async fn start_large(
        &self,
        msg: &OutMessage<'_>,
        header_len: usize,
        large: LargeSend,
        may_direct: bool,
    ) -> Result<Started<'_>, TransportError> {
        let meta_inline = header_len + msg.meta.len() <= self.room();
        let total = large.gather.total();
        let ready = large.ready;
        let (tx, rx) = oneshot::channel();
        let mut done = Some(tx);
        let mut pending = Some((large.gather, large.regs));
        let seq = self
            .wait_for(|st| {
                let offer = (meta_inline && may_direct)
                    .then(|| st.offers.fitting(total))
                    .flatten();
                if let Some(offer) = offer {
                    return self.post_direct(st, msg, offer, &mut pending, &mut done, total);
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
                if let Some(out) = st.out.get_mut(&seq) {
                    out.ready = ready;
                }
                st.stats.sent_rendezvous += 1;
                Ok(Some(seq))
            })
            .await?;
        // From here the peer may write-read our memory: if the send is dropped before the
        // write completes, the link must go (the borrowed bytes are about to be freed).
        Ok(Started {
            seq,
            rx,
            guard: AbandonGuard {
                link: self,
                seq,
                armed: true,
            },
        })
    }

    /// Marks the first `ready` entries of started send `started` in place (a staged send's
    /// chunks, as they land), and writes them if the peer's clear-to-send came.
    pub(super) fn large_ready(&self, started: &Started<'_>, ready: usize) {
        let mut st = self.lock();
        let st = &mut *st;
        let Some(out) = st.out.get_mut(&started.seq) else {
            return;
        };
        out.ready = ready.clamp(out.ready, out.gather.len());
        if out.to.is_some() && !self.post_writes(st, started.seq) {
            // No queue room now: completions will make some (`pump`).
            st.write_backlog.push_back(started.seq);
        }
    }

    /// Waits until the peer's buffer holds every byte of started send `started`.
    pub(super) async fn finish_large(&self, started: Started<'_>) -> Result<(), TransportError> {
        let Started { rx, mut guard, .. } = started;
        let result = rx.await;
        guard.armed = false;
        match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.into_lost(self.peer)),
            Err(_) => Err(lost(
                self.peer,
                self.failure().unwrap_or_else(|| "link closed".into()),
            )),
        }
    }

    /// Decides the RDMA writes of large send `seq` whose entries are in place and not yet
    /// written (all of them but for a staged send still copying); false if the send queue
    /// lacks room.
    pub(super) fn post_writes(&self, st: &mut State, seq: u32) -> bool {
        let max_sge = self.max_sge as usize;
        let Some(out) = st.out.get_mut(&seq) else {
            return true;
        };
        if out.posted == out.ready {
            return true;
        }
        let to = out.to.expect("writes follow a clear-to-send or an offer");
        let groups = write_groups(
            &out.gather,
            out.posted..out.ready,
            max_sge,
            out.written,
            to.edges(),
        );
        let wrs = groups.len() as u32;
        if st.sq_free < wrs {
            return false;
        }
        // The immediate ends the last batch only: the peer takes the message once it lands.
        let last = out.ready == out.gather.len();
        out.written += groups.iter().map(|g| g.bytes).sum::<u64>();
        out.posted = out.ready;
        out.batches.push_back(wrs);
        st.sq_free -= wrs;
        let groups = groups
            .iter()
            .map(|g| {
                let (rkey, remote) = to.locate(g.off);
                WriteGroup {
                    first: g.first,
                    end: g.end,
                    bytes: g.bytes,
                    rkey,
                    remote,
                }
            })
            .collect();
        st.wrs.push(WorkRequest::Writes {
            seq,
            groups,
            imm: if last { out.imm } else { None },
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
    to: Option<Destination>,
) -> u32 {
    let seq = st.next_seq;
    st.next_seq = (seq + 1) & SEQ_MASK;
    let (gather, regs) = pending.take().expect("tracked once");
    let ready = gather.len();
    st.out.insert(
        seq,
        OutRndv {
            gather,
            total,
            _regs: regs,
            ready,
            posted: 0,
            written: 0,
            batches: VecDeque::new(),
            imm: to.is_none().then_some(seq),
            to,
            done: done.take(),
        },
    );
    seq
}

/// One RDMA write of a batch: gather entries `first..end`, `bytes` in all, starting at byte
/// `off` of the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Group {
    pub first: usize,
    pub end: usize,
    pub bytes: u64,
    pub off: u64,
}

/// Groups gather entries `entries`, the first of which starts at message byte `from`, into
/// RDMA writes of at most `max_sge` entries and [`MAX_WR_BYTES`] each, none crossing an edge of
/// the destination (`edges`: where a placed range starts and ends).
pub(super) fn write_groups(
    gather: &Gather,
    entries: std::ops::Range<usize>,
    max_sge: usize,
    from: u64,
    edges: Option<(u64, u64)>,
) -> SmallVec<[Group; 4]> {
    let is_edge = |off: u64| edges.is_some_and(|(a, b)| off == a || off == b);
    let mut groups = SmallVec::new();
    let mut group = Group {
        first: entries.start,
        end: entries.start,
        bytes: 0,
        off: from,
    };
    let mut off = from;
    let lens = gather
        .lens()
        .enumerate()
        .skip(entries.start)
        .take(entries.len());
    for (i, len) in lens {
        let full = i - group.first == max_sge.max(1) || group.bytes + len > MAX_WR_BYTES;
        if i > group.first && (full || is_edge(off)) {
            groups.push(Group { end: i, ..group });
            group = Group {
                first: i,
                end: i,
                bytes: 0,
                off,
            };
        }
        group.bytes += len;
        off += len;
    }
    groups.push(Group {
        end: entries.end,
        ..group
    });
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gather(lens: &[u64]) -> Gather {
        let mut g = Gather::default();
        for (i, &len) in lens.iter().enumerate() {
            // Addresses only: nothing is posted.
            g.push_device(0x1000 * (i as u64 + 1), len as usize, 7);
        }
        g
    }

    fn tuples(groups: &[Group]) -> Vec<(usize, usize, u64)> {
        groups.iter().map(|g| (g.first, g.end, g.bytes)).collect()
    }

    #[test]
    fn groups_cover_exactly_the_entries_asked_for() {
        let g = gather(&[5, 7, 9, 11, 13]);
        assert_eq!(
            tuples(&write_groups(&g, 0..5, 2, 0, None)),
            [(0, 2, 12), (2, 4, 20), (4, 5, 13)]
        );
        // A staged send's later batch: entries 1..5 only, grouped from entry 1.
        let later = write_groups(&g, 1..5, 2, 5, None);
        assert_eq!(tuples(&later), [(1, 3, 16), (3, 5, 24)]);
        assert_eq!(
            later[1].off,
            5 + 16,
            "where each write starts in the message"
        );
        assert_eq!(tuples(&write_groups(&g, 3..4, 30, 21, None)), [(3, 4, 11)]);
    }

    #[test]
    fn a_group_stays_within_the_bytes_one_write_may_carry() {
        let half = MAX_WR_BYTES / 2 + 1;
        let g = gather(&[half, half, 10, half]);
        assert_eq!(
            tuples(&write_groups(&g, 0..4, 30, 0, None)),
            [(0, 1, half), (1, 3, half + 10), (3, 4, half)]
        );
        assert_eq!(
            tuples(&write_groups(&g, 2..4, 30, 2 * half, None)),
            [(2, 4, 10 + half)]
        );
    }

    #[test]
    fn no_write_crosses_a_placed_range_edge() {
        // Entries of 5, 7, 9, 11, 13 bytes; the placed range is the 9-byte entry (12..21).
        let g = gather(&[5, 7, 9, 11, 13]);
        let groups = write_groups(&g, 0..5, 30, 0, Some((12, 21)));
        assert_eq!(tuples(&groups), [(0, 2, 12), (2, 3, 9), (3, 5, 24)]);
        assert_eq!(
            groups.iter().map(|g| g.off).collect::<Vec<_>>(),
            [0, 12, 21]
        );
        // A later batch that starts on an edge.
        let later = write_groups(&g, 2..5, 30, 12, Some((12, 21)));
        assert_eq!(tuples(&later), [(2, 3, 9), (3, 5, 24)]);
    }
}
