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
mod tests {
    use std::fs::File;
    use std::io::IoSlice;
    use std::mem::MaybeUninit;
    use std::os::fd::{AsFd, OwnedFd};
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};

    use rustix::fs::MemfdFlags;
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

    use super::handover::{fetch_descriptors, random, REQUIRED_SEALS, TOKEN};
    use super::*;

    #[test]
    fn ring_allocation_wraps_and_frees_out_of_order() {
        let mut a = Alloc::default();
        assert_eq!(a.alloc(40, 100, None), Some(0));
        assert_eq!(a.alloc(40, 100, None), Some(40));
        assert_eq!(
            a.alloc(40, 100, None),
            None,
            "only 20 left at the end, 0 at the start"
        );
        assert!(a.free(40, 40));
        assert_eq!(
            a.alloc(30, 100, None),
            None,
            "the oldest region still blocks the start"
        );
        assert!(a.free(0, 40));
        assert_eq!(a.alloc(30, 100, None), Some(0), "empty ring restarts at 0");
        assert_eq!(a.alloc(60, 100, None), Some(30));
        assert!(a.free(0, 30));
        assert_eq!(
            a.alloc(20, 100, None),
            Some(0),
            "wraps before the live region at 30"
        );
        assert_eq!(a.alloc(10, 100, None), None, "head would meet the tail");
        assert!(!a.free(5, 5), "unknown region");
        assert_eq!(a.alloc(0, 100, None), None);
        assert_eq!(a.alloc(101, 100, None), None);
    }

    #[test]
    fn a_steady_stream_reuses_the_start_of_the_ring() {
        // Two messages in flight at a time, each freed after the next is handed out: the
        // regions stay within the first four slots however long the stream runs (a region
        // goes back to the start only once the space there is strictly larger than it).
        let (len, size) = (256, 1 << 20);
        let mut a = Alloc {
            base: 8,
            head: 8,
            ..Alloc::default()
        };
        let mut live = VecDeque::new();
        let mut highest = 0;
        for _ in 0..10_000 {
            let off = a.alloc(len, size, Some(8)).expect("room");
            highest = highest.max(off + len);
            live.push_back(off);
            if live.len() > 2 {
                let oldest = live.pop_front().unwrap();
                assert!(a.free(oldest, len));
            }
        }
        assert!(highest <= 8 + 4 * len, "the stream reached byte {highest}");
    }

    #[test]
    fn early_wraps_never_overlap_live_regions() {
        // Random sizes, frees in random order: every live region stays disjoint from the
        // others and inside the ring.
        let size = 4096;
        let mut a = Alloc {
            base: 8,
            head: 8,
            ..Alloc::default()
        };
        let mut live: Vec<(usize, usize)> = Vec::new();
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..20_000 {
            if next() % 3 != 0 {
                let len = 1 + (next() % 900) as usize;
                let phase = (next() % 70) as usize;
                let phase = (phase < RING_ALIGN).then_some(phase);
                if let Some(off) = a.alloc(len, size, phase) {
                    assert!(off >= 8 && off + len <= size);
                    if let Some(p) = phase {
                        assert_eq!(off % RING_ALIGN, p, "{off} is not at phase {p}");
                    }
                    for &(o, l) in &live {
                        assert!(off + len <= o || o + l <= off, "{off}+{len} meets {o}+{l}");
                    }
                    live.push((off, len));
                }
            } else if !live.is_empty() {
                let i = (next() % live.len() as u64) as usize;
                let (o, l) = live.swap_remove(i);
                assert!(a.free(o, l));
            }
        }
    }

    #[tokio::test]
    async fn the_largest_segment_lands_as_aligned_as_in_the_senders_memory() {
        let send = SendRing::create(1 << 20).expect("memfd ring");
        let header = [7u8; 5];
        let data = vec![3u8; 100_000];
        for skip in 0..2 * RING_ALIGN {
            let body = &data[skip..];
            let segs = [Segment::new(&header), Segment::new(body)];
            let (off, total) = send.put(&segs).expect("room");
            assert_eq!(total, header.len() + body.len());
            assert_eq!(
                (off + header.len()) % RING_ALIGN,
                body.as_ptr() as usize % RING_ALIGN,
                "skip {skip}: the body is at ring offset {}",
                off + header.len()
            );
            assert!(send.free(off, total));
        }
    }

    #[tokio::test]
    async fn a_ring_round_trips_through_shared_memory() {
        let send = SendRing::create(1 << 20).expect("memfd ring");
        let recv = Arc::new(RecvRing::fetch(&send.offer()).await.expect("same host"));
        send.activate();
        let a = vec![1u8; 300_000];
        let b = vec![2u8; 5];
        let segs = [Segment::new(&a), Segment::new(&b)];
        let (off, total) = send.put(&segs).unwrap();
        let control = Arc::new(Control::default());
        let got = recv
            .segments(&descriptor(off, &segs), &control, &Limits::default())
            .unwrap();
        assert_eq!(got.len(), 2);
        assert!(got[0] == a[..] && got[1] == b[..]);
        drop(got);
        let frames = control.take();
        assert_eq!(frames.len(), 1);
        assert_eq!(frames[0].0, FrameKind::ShmFree);
        let freed = parse_free(&frames[0].1).unwrap();
        assert_eq!(freed, vec![(off, total)]);
        assert!(send.free(off, total));
    }

    #[tokio::test]
    async fn bad_offers_and_descriptors_are_refused() {
        assert!(RecvRing::fetch(b"short").await.is_err());
        // An offer naming a file, as the old path-based offers did: refused, nothing opened.
        let mut offer = (DEFAULT_RING as u64).to_le_bytes().to_vec();
        offer.extend_from_slice(&7u64.to_le_bytes());
        offer.extend_from_slice(&[0; TOKEN]);
        offer.extend_from_slice(b"/etc/passwd");
        assert!(RecvRing::fetch(&offer).await.is_err());
        let send = SendRing::create(1 << 20).unwrap();
        let mut wrong = send.offer();
        wrong[8] ^= 1;
        assert!(RecvRing::fetch(&wrong).await.is_err(), "cookie mismatch");
        let send = SendRing::create(1 << 20).unwrap();
        let recv = Arc::new(RecvRing::fetch(&send.offer()).await.unwrap());
        let control = Arc::new(Control::default());
        let mut d = (1u64 << 20).to_le_bytes().to_vec();
        d.extend_from_slice(&1u32.to_le_bytes());
        d.extend_from_slice(&1u64.to_le_bytes());
        assert!(
            recv.segments(&d, &control, &Limits::default()).is_err(),
            "past the end"
        );
        let small = Limits {
            max_message: 100,
            ..Limits::default()
        };
        let mut big = (COOKIE as u64).to_le_bytes().to_vec();
        big.extend_from_slice(&1u32.to_le_bytes());
        big.extend_from_slice(&200u64.to_le_bytes());
        assert!(recv.segments(&big, &control, &Limits::default()).is_ok());
        let e = recv.segments(&big, &control, &small).unwrap_err();
        assert!(e.contains("PSNET_MAX_MESSAGE"), "{e}");
        assert!(recv
            .segments(&[0; 5], &control, &Limits::default())
            .is_err());
        assert!(parse_free(&[0; 15]).is_none());
    }

    /// An offer whose socket is served by `serve`, which hands over `fd` to whoever asks.
    fn rogue_offer(size: u64, fd: OwnedFd) -> Vec<u8> {
        let name = format!(
            "psnet-rogue-{:032x}",
            u128::from_le_bytes(random::<16>().unwrap())
        );
        let listener =
            UnixListener::bind_addr(&UnixAddr::from_abstract_name(&name).unwrap()).unwrap();
        std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            let fds = [fd.as_fd()];
            control.push(SendAncillaryMessage::ScmRights(&fds));
            let mut token = [0u8; TOKEN];
            let _ = std::io::Read::read_exact(&mut &stream, &mut token);
            let _ = rustix::net::sendmsg(
                &stream,
                &[IoSlice::new(&[1])],
                &mut control,
                SendFlags::empty(),
            );
        });
        let mut offer = size.to_le_bytes().to_vec();
        offer.extend_from_slice(&0u64.to_le_bytes());
        offer.extend_from_slice(&[0; TOKEN]);
        offer.extend_from_slice(name.as_bytes());
        offer
    }

    #[tokio::test]
    async fn an_unsealed_or_wrongly_sized_file_is_never_mapped() {
        // A plain file handed over (it could be truncated under the mapping: SIGBUS).
        let path = std::env::temp_dir().join(format!("psnet-unsealed-{}", std::process::id()));
        let file = File::create(&path).unwrap();
        file.set_len(1 << 20).unwrap();
        let _ = std::fs::remove_file(&path);
        let err = RecvRing::fetch(&rogue_offer(1 << 20, OwnedFd::from(file)))
            .await
            .err()
            .expect("refused");
        assert!(err.to_string().contains("sealed"), "{err}");
        // A memory file without seals.
        let fd = rustix::fs::memfd_create("rogue", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 1 << 20).unwrap();
        let err = RecvRing::fetch(&rogue_offer(1 << 20, fd))
            .await
            .err()
            .expect("refused");
        assert!(err.to_string().contains("sealed"), "{err}");
        // Sealed, but not the announced size.
        let fd = rustix::fs::memfd_create("rogue", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        rustix::fs::fcntl_add_seals(&fd, REQUIRED_SEALS).unwrap();
        let err = RecvRing::fetch(&rogue_offer(1 << 20, fd))
            .await
            .err()
            .expect("refused");
        assert!(err.to_string().contains("wrong size"), "{err}");
    }

    #[tokio::test]
    async fn the_descriptor_goes_only_to_the_token_and_cannot_be_resized() {
        let send = SendRing::create(1 << 20).unwrap();
        let offer = send.offer();
        let name = offer[16 + TOKEN..].to_vec();
        // Without the token: refused, and the real receiver still gets the ring after.
        let wrong = [0u8; TOKEN];
        let n = name.clone();
        let stolen = tokio::task::spawn_blocking(move || fetch_descriptors(&n, &wrong))
            .await
            .unwrap();
        assert!(stolen.is_err(), "handed to a connection without the token");
        let token: [u8; TOKEN] = offer[16..16 + TOKEN].try_into().unwrap();
        let fd = tokio::task::spawn_blocking(move || fetch_descriptors(&name, &token))
            .await
            .unwrap()
            .expect("the token fetches the ring")
            .pop()
            .unwrap();
        // The sender's seals hold for whoever has the descriptor: no truncation, no growth.
        assert!(rustix::fs::ftruncate(&fd, 0).is_err());
        assert!(rustix::fs::ftruncate(&fd, 2 << 20).is_err());
        // Nothing was ever created in /dev/shm.
        let leftovers = std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| e.file_name().to_string_lossy().starts_with("psnet"))
                    .count()
            })
            .unwrap_or(0);
        assert_eq!(leftovers, 0);
    }
}
