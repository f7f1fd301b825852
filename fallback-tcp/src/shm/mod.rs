//! The same-host bulk path. When both ends of a connection share a host, each sender maps a
//! ring of shared memory and puts large messages' segments there: one copy into the ring, and
//! the receiver hands out segments that point straight into it, instead of two copies through
//! the kernel's TCP stack. Only a small descriptor frame crosses the socket, in order with the
//! other frames. The receiver tells the sender which regions it is done with; a full ring
//! simply sends through the socket.
//!
//! The ring is handed over as memory, never as a name: an anonymous `memfd`, sealed against
//! shrinking and growing, whose descriptor the sender passes with `SCM_RIGHTS` over a one-shot
//! Unix socket in the abstract namespace (no file anywhere, nothing left behind by a
//! `kill -9`). The offer sent over the TCP connection names that socket and carries a random
//! token; the sender hands the descriptor only to a connection from the same user that
//! presents the token, and the receiver maps only a sealed memory file of the offered size,
//! so a truncation cannot turn its reads into a SIGBUS. A peer on another host (or in another
//! network namespace) cannot reach the socket and declines the offer.
//!
//! All memory mapping and descriptor passing is confined to this module.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use memmap2::{Mmap, MmapMut};
use psnet_transport::le::{LeReader, LeWriter};
use psnet_transport::{FrameKind, Limits, Segment};
use smallvec::SmallVec;
use tokio::sync::Notify;
use tokio::task::AbortHandle;

mod handover;
pub(crate) mod queue;
pub(crate) mod releases;
mod sys;

use handover::Offer;

/// Messages with at least this many segment bytes go through the ring; smaller ones cross
/// the socket. 2-rank 128 KiB allreduces (64 KiB messages) ran at 1.21x Open MPI's shared
/// memory through the ring and 0.74x through the socket, in back-to-back runs; smaller
/// messages were not tried through the ring.
pub(crate) const SHM_MIN: usize = 64 << 10;
/// The same once the peer's message queue is in use: smaller messages are copied into the
/// queue whole. 4-rank allreduces of 256 and 512 KiB (64 and 128 KiB messages) took 2-3x
/// less time copied into the queue than through the ring (alternating runs, 2 cores); on 2
/// ranks the two were even.
pub(crate) const QUEUED_RING_MIN: usize = 256 << 10;
/// Default ring size per connection and direction (`PSNET_SHM_RING`).
pub const DEFAULT_RING: usize = 64 << 20;
/// Largest ring a peer may offer.
const MAX_RING: u64 = 16 << 30;
/// Bytes at the start of a ring holding its cookie.
const COOKIE: usize = 8;
/// A message's largest segment goes into the ring at the same offset from a multiple of this
/// as it has in the sender's memory (see `SendRing::put`).
const RING_ALIGN: usize = 64;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Allocation state of a sender's ring: regions in the order they were handed out, inside
/// `[base, size)` (the ring's first bytes hold the cookie).
#[derive(Debug, Default)]
struct Alloc {
    regions: VecDeque<(usize, usize, bool)>,
    head: usize,
    base: usize,
}

impl Alloc {
    /// A contiguous region of `len` bytes in a ring of `size`, if there is room; with
    /// `phase`, one that starts `phase` bytes past a multiple of [`RING_ALIGN`] (see `put`).
    fn alloc(&mut self, len: usize, size: usize, phase: Option<usize>) -> Option<usize> {
        let at = |x: usize| match phase {
            Some(p) => x + (p % RING_ALIGN + RING_ALIGN - x % RING_ALIGN) % RING_ALIGN,
            None => x,
        };
        if len == 0 || at(self.base) + len > size {
            return None;
        }
        let off = match self.regions.front() {
            None => at(self.base),
            // Back to the start as soon as the oldest live region leaves room there, rather
            // than at the end of the ring: the live regions then stay on the few pages used
            // last (in cache, already faulted in) instead of sweeping the whole ring. A
            // steady stream of 256 KiB messages otherwise met fresh pages on every one of a
            // 64 MiB ring's first 256 uses, and cold ones after.
            Some(&(tail, _, _)) if self.head > tail => {
                if at(self.base) + len < tail {
                    at(self.base)
                } else if at(self.head) + len <= size {
                    at(self.head)
                } else {
                    return None;
                }
            }
            // Wrapped: free space runs from head up to the oldest live region.
            Some(&(tail, _, _)) => {
                if at(self.head) + len < tail {
                    at(self.head)
                } else {
                    return None;
                }
            }
        };
        self.regions.push_back((off, len, false));
        self.head = off + len;
        Some(off)
    }

    /// Marks a region free; false if no such region was handed out.
    fn free(&mut self, off: usize, len: usize) -> bool {
        let Some(r) = self
            .regions
            .iter_mut()
            .find(|r| r.0 == off && r.1 == len && !r.2)
        else {
            return false;
        };
        r.2 = true;
        while self.regions.front().is_some_and(|r| r.2) {
            self.regions.pop_front();
        }
        if self.regions.is_empty() {
            self.head = self.base;
        }
        true
    }
}

/// The sending side's ring.
pub(crate) struct SendRing {
    map: Mutex<MmapMut>,
    size: usize,
    /// The offer's body.
    offer: Vec<u8>,
    alloc: Mutex<Alloc>,
    active: AtomicBool,
    /// The task that hands the descriptor to the peer, until it has or the ring is dropped.
    handover: Mutex<Option<AbortHandle>>,
}

impl SendRing {
    /// Creates and maps a sealed memory file of `size` bytes, its pages allocated now (so that
    /// a lack of memory is an error here, not a fault later), and starts listening for the
    /// peer's request for its descriptor. Needs a tokio runtime.
    pub(crate) fn create(size: usize) -> io::Result<SendRing> {
        if size <= COOKIE || size as u64 > MAX_RING {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "ring size out of range",
            ));
        }
        let file = handover::sealed_memfd("psnet-ring", size)?;
        let mut map = sys::map_own_ring(&file, size)?;
        let cookie = u64::from_le_bytes(handover::random::<8>()?);
        map[..COOKIE].copy_from_slice(&cookie.to_le_bytes());
        let (offer, task) = handover::serve(vec![file.into()], size as u64, cookie, "psnet-ring")?;
        Ok(SendRing {
            map: Mutex::new(map),
            size,
            offer: offer.encode(),
            alloc: Mutex::new(Alloc {
                regions: VecDeque::new(),
                head: COOKIE,
                base: COOKIE,
            }),
            active: AtomicBool::new(false),
            handover: Mutex::new(Some(task)),
        })
    }

    /// The offer's body.
    pub(crate) fn offer(&self) -> Vec<u8> {
        self.offer.clone()
    }

    /// The receiver accepted: the ring may carry messages.
    pub(crate) fn activate(&self) {
        self.active.store(true, Ordering::Release);
    }

    /// Whether messages may use the ring.
    pub(crate) fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    /// Copies `segments` into one new region; None if the ring has no room or a segment is
    /// device memory.
    pub(crate) fn put(&self, segments: &[Segment<'_>]) -> Option<(usize, usize)> {
        // Device memory takes the socket's staging pipeline instead (see `Conn::write_frame_staged`).
        let host: Option<SmallVec<[&[u8]; 4]>> = segments.iter().map(Segment::host).collect();
        let host = host?;
        let total: usize = host.iter().map(|b| b.len()).sum();
        // The largest segment lands at its own address's offset from a cache line, so that
        // the copy in (and the receiver's copy out, into memory usually placed like the
        // sender's) moves between equally aligned addresses: on AMD EPYC `rep movsb`, which
        // glibc's memcpy uses below 1 MiB there, ran 2-3x slower between addresses 8 bytes
        // apart from that (2-rank ring allreduces of 2 MiB in 256 KiB pieces: 230 us against
        // 525-668 us, alternating runs).
        let (prefix, largest) = host
            .iter()
            .scan(0usize, |at, b| {
                let start = *at;
                *at += b.len();
                Some((start, *b))
            })
            .max_by_key(|(_, b)| b.len())?;
        let phase = (largest.as_ptr() as usize).wrapping_sub(prefix) % RING_ALIGN;
        let off = lock(&self.alloc).alloc(total, self.size, Some(phase))?;
        let mut map = lock(&self.map);
        let mut at = off;
        for bytes in host {
            map[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        }
        Some((off, total))
    }

    /// The receiver is done with a region.
    pub(crate) fn free(&self, off: usize, len: usize) -> bool {
        lock(&self.alloc).free(off, len)
    }
}

impl Drop for SendRing {
    fn drop(&mut self) {
        if let Some(task) = lock(&self.handover).take() {
            task.abort();
        }
    }
}

/// Frames the connection's control task writes: offers, answers to offers, and the regions
/// this side has released. Readers only queue here, so a reader never waits for the socket's
/// write side (two readers waiting on two blocked writers would deadlock).
#[derive(Default)]
pub(crate) struct Control {
    frames: Mutex<Vec<(FrameKind, Vec<u8>)>>,
    released: Mutex<Vec<(u64, u64)>>,
    /// Our queue to the peer, once it mapped it: released regions go straight into its
    /// release area, with no task woken and no frame written.
    release_area: std::sync::OnceLock<Arc<queue::SendQueue>>,
    /// Woken when something was queued.
    pub(crate) notify: Notify,
}

impl Control {
    /// Queues a control frame.
    pub(crate) fn push(&self, kind: FrameKind, body: Vec<u8>) {
        lock(&self.frames).push((kind, body));
        self.notify.notify_one();
    }

    fn release(&self, off: usize, len: usize) {
        if let Some(queue) = self.release_area.get() {
            match queue.push_release(off, len) {
                Ok(true) => return,
                // Full: the socket takes it.
                Ok(false) => {}
                Err(why) => tracing::warn!(%why, "releasing a ring region through the socket"),
            }
        }
        lock(&self.released).push((off as u64, len as u64));
        self.notify.notify_one();
    }

    /// Our queue is mapped by the peer: releases go through its release area from now on.
    pub(crate) fn release_through(&self, queue: Arc<queue::SendQueue>) {
        let _ = self.release_area.set(queue);
    }

    /// Everything queued so far, released regions as one `ShmFree` frame.
    pub(crate) fn take(&self) -> Vec<(FrameKind, Vec<u8>)> {
        let mut frames = std::mem::take(&mut *lock(&self.frames));
        let released = std::mem::take(&mut *lock(&self.released));
        if !released.is_empty() {
            let regions: Vec<(usize, usize)> = released
                .into_iter()
                .map(|(o, l)| (o as usize, l as usize))
                .collect();
            frames.push((FrameKind::ShmFree, free_body(&regions)));
        }
        frames
    }
}

/// The receiving side's mapping of the peer's ring.
pub(crate) struct RecvRing {
    map: Mmap,
    size: usize,
}

/// A region of the peer's ring that a delivered message points into; released on drop.
struct Region {
    ring: Arc<RecvRing>,
    off: usize,
    len: usize,
    control: Arc<Control>,
}

impl AsRef<[u8]> for Region {
    fn as_ref(&self) -> &[u8] {
        &self.ring.map[self.off..self.off + self.len]
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        self.control.release(self.off, self.len);
    }
}

impl RecvRing {
    /// Fetches an offered ring's descriptor from the offering peer and maps it. Fails (and the
    /// offer is declined) unless the peer's socket is reachable (same host and network
    /// namespace), belongs to this user, and hands over a memory file sealed against
    /// shrinking and growing, of the announced size, carrying the announced cookie.
    pub(crate) async fn fetch(offer: &[u8]) -> io::Result<RecvRing> {
        let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_string());
        let offer = Offer::parse(offer)?;
        if offer.size > MAX_RING || offer.size <= COOKIE as u64 {
            return Err(bad("shared-memory offer of an unexpected size"));
        }
        let fd = offer
            .fetch(1)
            .await?
            .pop()
            .expect("one descriptor, counted");
        let file = handover::check_sealed(fd, offer.size, "ring")?;
        let (size, cookie) = (offer.size as usize, offer.cookie);
        let map = sys::map_peer_ring(&file, size)?;
        if map[..COOKIE] != cookie.to_le_bytes() {
            return Err(bad("cookie mismatch"));
        }
        Ok(RecvRing { map, size })
    }

    /// The message's segments, pointing into the ring, from a `ShmData` descriptor
    /// (`offset u64, count u32, count x length u64`).
    pub(crate) fn segments(
        self: &Arc<Self>,
        descriptor: &[u8],
        control: &Arc<Control>,
        limits: &Limits,
    ) -> Result<smallvec::SmallVec<[Bytes; 4]>, String> {
        let mut r = LeReader::new(descriptor);
        let short = |_| "short shared-memory descriptor".to_string();
        let off = r.u64().map_err(short)?;
        let count = r.u32().map_err(short)? as usize;
        if r.remaining() != count.saturating_mul(8) {
            return Err("shared-memory descriptor length mismatch".into());
        }
        // The same bounds as a message on the socket: the ring is no way around them.
        if count > usize::from(limits.max_segments) {
            return Err(format!(
                "shared-memory message of {count} segments exceeds the limit of {}",
                limits.max_segments
            ));
        }
        let lens: Vec<u64> = (0..count).map_while(|_| r.u64().ok()).collect();
        let total = lens.iter().try_fold(0u64, |a, &l| a.checked_add(l));
        if let Some(t) = total.filter(|t| *t > limits.max_message) {
            return Err(format!(
                "shared-memory message of {t} bytes exceeds the limit of {} (PSNET_MAX_MESSAGE)",
                limits.max_message
            ));
        }
        let end = total.and_then(|t| off.checked_add(t));
        match end {
            Some(end) if end <= self.size as u64 && off >= COOKIE as u64 => {}
            _ => return Err("shared-memory region outside the ring".into()),
        }
        let (off, total) = (off as usize, total.unwrap_or(0) as usize);
        let region = Bytes::from_owner(Region {
            ring: self.clone(),
            off,
            len: total,
            control: control.clone(),
        });
        let mut at = 0;
        Ok(lens
            .into_iter()
            .map(|l| {
                let s = region.slice(at..at + l as usize);
                at += l as usize;
                s
            })
            .collect())
    }
}

/// The `ShmData` descriptor for a region holding `segments`.
pub(crate) fn descriptor(off: usize, segments: &[Segment<'_>]) -> Vec<u8> {
    let mut d = LeWriter::with_capacity(12 + 8 * segments.len());
    d.u64(off as u64).u32(segments.len() as u32);
    for s in segments {
        d.u64(s.len() as u64);
    }
    d.into_vec()
}

/// A `ShmFree` body: (offset, length) pairs.
pub(crate) fn free_body(regions: &[(usize, usize)]) -> Vec<u8> {
    let mut body = LeWriter::with_capacity(16 * regions.len());
    for &(off, len) in regions {
        body.u64(off as u64).u64(len as u64);
    }
    body.into_vec()
}

/// Parses a `ShmFree` body.
pub(crate) fn parse_free(body: &[u8]) -> Option<Vec<(usize, usize)>> {
    if body.len() % 16 != 0 {
        return None;
    }
    let mut r = LeReader::new(body);
    let mut regions = Vec::with_capacity(body.len() / 16);
    while !r.is_empty() {
        regions.push((r.u64().ok()? as usize, r.u64().ok()? as usize));
    }
    Some(regions)
}

#[cfg(test)]
mod tests;
