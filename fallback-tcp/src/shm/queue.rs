//! The same-host message queue: one sender, one receiver, in a memory file both map.
//!
//! Between processes on one host, every message of a connection goes through this queue once
//! both sides agreed to it, so that none waits for the kernel's TCP stack: a small message is
//! copied into the queue whole; a large one sits in the ring and the queue carries its
//! descriptor; one that must cross the socket (device memory, a full ring) leaves a marker
//! in the queue, so the receiver delivers everything in the order it was sent. The receiver
//! polls the queue for a while after each message, then sleeps on an eventfd that the sender
//! signals only when the receiver said it was sleeping.
//!
//! Layout (all counters little-endian, as the host is):
//! ```text
//! 0    cookie
//! 64   head:  bytes the sender has published (only the sender writes it)
//! 128  tail:  bytes the receiver has consumed (only the receiver writes it)
//! 192  sleeping: 1 while the receiver waits on the eventfd
//! 256  released ring regions: head (this side's, written by the queue's owner), 320 tail,
//!      512 entries (see `releases`)
//! 64 KiB + 512  records, a circular area of a power-of-two size
//! ```
//! A record is an 8-byte header (`kind u32`, `len u32`) and `len` bytes, padded to 8; a
//! record never wraps (a padding record fills the end of the area instead). Each side checks
//! everything it reads from the other: a broken or hostile peer gives an error, not a panic.

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use psnet_transport::le::LeReader;
use psnet_transport::Limits;
use rustix::event::EventfdFlags;
use smallvec::SmallVec;
use tokio::io::unix::AsyncFd;
use tokio::task::AbortHandle;

use super::handover::{self, Offer};
use super::releases::{self, ReleaseReader};
use super::sys::SharedArea;
use crate::buffers::LargeBuffers;

/// Default bytes of records per connection and direction (`PSNET_SHM_QUEUE`).
pub const DEFAULT_QUEUE: usize = 1 << 20;
/// Smallest and largest record areas a peer may offer.
const MIN_QUEUE: usize = 4096;
const MAX_QUEUE: usize = 64 << 20;
/// Bytes of counters at the start.
const HEADER: usize = 512;
/// Where the records start, after the counters and the released ring regions.
const RECORDS: usize = HEADER + releases::BYTES;
const HEAD: usize = 64;
const TAIL: usize = 128;
const SLEEPING: usize = 192;
/// Bytes of a record's header.
const RECORD_HEADER: usize = 8;
/// Records at least this large are copied into pooled buffers.
const POOLED: usize = 16 << 10;

/// What a record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum Kind {
    /// Fills the area's end; skipped.
    Pad = 1,
    /// The first record: how many data frames the sender wrote to the socket before it.
    Start = 2,
    /// A whole message: `meta_len u32, count u32, count x length u64`, the metadata, then
    /// the segments.
    Inline = 3,
    /// A message in the ring: `meta_len u32`, the metadata, then the ring descriptor.
    Ring = 4,
    /// The next message comes through the socket.
    Socket = 5,
}

impl Kind {
    fn from_u32(v: u32) -> Option<Kind> {
        Some(match v {
            1 => Kind::Pad,
            2 => Kind::Start,
            3 => Kind::Inline,
            4 => Kind::Ring,
            5 => Kind::Socket,
            _ => return None,
        })
    }
}

/// One record, read and checked.
#[derive(Debug)]
pub(crate) enum Record {
    /// Data frames the sender wrote to the socket before its first record.
    Start(u64),
    /// A message copied out of the queue.
    Inline {
        /// Its metadata.
        meta: Bytes,
        /// Its segments.
        segments: SmallVec<[Bytes; 4]>,
    },
    /// A message in the ring.
    Ring {
        /// Its metadata.
        meta: Bytes,
        /// The ring descriptor of its segments.
        descriptor: Bytes,
    },
    /// The next message is the next data frame on the socket.
    Socket,
}

fn align8(n: usize) -> usize {
    n.div_ceil(8) * 8
}

/// The record area's size behind a memory file of `total` bytes, if it is a valid one.
fn area_of(total: u64) -> Option<usize> {
    let cap = usize::try_from(total).ok()?.checked_sub(RECORDS)?;
    (cap.is_power_of_two() && (MIN_QUEUE..=MAX_QUEUE).contains(&cap)).then_some(cap)
}

/// The counters of a mapped queue.
struct Counters<'a> {
    head: &'a AtomicU64,
    tail: &'a AtomicU64,
    sleeping: &'a std::sync::atomic::AtomicU32,
}

fn counters(area: &SharedArea) -> Counters<'_> {
    // The area is at least RECORDS bytes and page-aligned (checked when it was mapped), so
    // the counters always exist.
    Counters {
        head: area.u64_at(HEAD).expect("the header is mapped"),
        tail: area.u64_at(TAIL).expect("the header is mapped"),
        sleeping: area.u32_at(SLEEPING).expect("the header is mapped"),
    }
}

/// The writing side, over a mapped queue of `cap` bytes of records.
pub(crate) struct Producer {
    area: SharedArea,
    /// Released regions of the peer's ring published so far (see `releases`).
    released: u64,
    cap: usize,
    /// What this side published; the copy in shared memory is only for the peer.
    head: u64,
}

/// What a push found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pushed {
    /// Published; `wake` if the receiver was asleep and must be signalled.
    Done { wake: bool },
    /// No room now (the receiver has not consumed enough yet).
    Full,
}

impl Producer {
    fn new(area: SharedArea) -> io::Result<Producer> {
        let cap = area_of(area.len() as u64)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "bad queue size"))?;
        let head = counters(&area).head.load(Ordering::Acquire);
        Ok(Producer {
            area,
            released: 0,
            cap,
            head,
        })
    }

    /// The largest record payload this queue takes.
    pub(crate) fn max_payload(&self) -> usize {
        self.cap / 4
    }

    /// Appends a record of `kind` holding `parts`, if it fits with `reserve` bytes still free
    /// after it. An error means the receiver's counter is impossible: the peer is broken.
    pub(crate) fn push(
        &mut self,
        kind: Kind,
        parts: &[&[u8]],
        reserve: usize,
    ) -> Result<Pushed, String> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len > self.max_payload() || u32::try_from(len).is_err() {
            return Err(format!(
                "a record of {len} bytes is larger than the queue takes"
            ));
        }
        let c = counters(&self.area);
        let tail = c.tail.load(Ordering::Acquire);
        let used = self.head.wrapping_sub(tail);
        if tail > self.head || used > self.cap as u64 {
            return Err("the receiver's queue counter is corrupt".into());
        }
        let free = self.cap - used as usize;
        let rec = RECORD_HEADER + align8(len);
        let at = (self.head % self.cap as u64) as usize;
        let pad = if self.cap - at < rec {
            self.cap - at
        } else {
            0
        };
        if pad + rec + reserve > free {
            return Ok(Pushed::Full);
        }
        let mut at = at;
        if pad > 0 {
            self.write_header(at, Kind::Pad, pad - RECORD_HEADER);
            self.head += pad as u64;
            at = 0;
        }
        self.write_header(at, kind, len);
        let mut off = RECORDS + at + RECORD_HEADER;
        for p in parts {
            let written = self.area.write(off, p);
            debug_assert!(written, "the record was checked to fit");
            off += p.len();
        }
        self.head += rec as u64;
        // SeqCst with the receiver's store of `sleeping` and load of `head`: either it sees
        // this record before it sleeps, or this side sees it sleeping and wakes it.
        c.head.store(self.head, Ordering::SeqCst);
        let wake = c.sleeping.swap(0, Ordering::SeqCst) == 1;
        Ok(Pushed::Done { wake })
    }

    /// Hands a region of the peer's ring back; false if the release area is full.
    pub(crate) fn push_release(&mut self, off: usize, len: usize) -> Result<bool, String> {
        releases::push(&self.area, &mut self.released, off, len)
    }

    fn write_header(&self, at: usize, kind: Kind, len: usize) {
        let mut h = [0u8; RECORD_HEADER];
        h[..4].copy_from_slice(&(kind as u32).to_le_bytes());
        h[4..].copy_from_slice(&(len as u32).to_le_bytes());
        let written = self.area.write(RECORDS + at, &h);
        debug_assert!(written, "record headers lie in the area");
    }
}

/// The reading side, over a mapped queue of `cap` bytes of records.
pub(crate) struct Consumer {
    area: Arc<SharedArea>,
    cap: usize,
    tail: u64,
    /// Buffers that large records are copied into, reused once their message is dropped:
    /// fresh allocations of 128 KiB and more come from mmap, a page fault per 4 KiB.
    pool: LargeBuffers,
}

impl Consumer {
    fn new(area: Arc<SharedArea>) -> io::Result<Consumer> {
        let cap = area_of(area.len() as u64)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad queue size"))?;
        let tail = counters(&area).tail.load(Ordering::Acquire);
        Ok(Consumer {
            area,
            cap,
            tail,
            pool: LargeBuffers::default(),
        })
    }

    /// Says this side is about to sleep; false (and not sleeping) if a record came first.
    pub(crate) fn sleep(&self) -> bool {
        let c = counters(&self.area);
        c.sleeping.store(1, Ordering::SeqCst);
        if c.head.load(Ordering::SeqCst) != self.tail {
            c.sleeping.store(0, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// Says this side is awake.
    pub(crate) fn wake(&self) {
        counters(&self.area).sleeping.store(0, Ordering::SeqCst);
    }

    /// The next record, if one is waiting; an error if what the peer wrote breaks the format
    /// or `limits`.
    pub(crate) fn next(&mut self, limits: &Limits) -> Result<Option<Record>, String> {
        loop {
            let c = counters(&self.area);
            let head = c.head.load(Ordering::Acquire);
            let avail = head.wrapping_sub(self.tail);
            if head < self.tail || avail > self.cap as u64 {
                return Err("the sender's queue counter is corrupt".into());
            }
            if avail == 0 {
                return Ok(None);
            }
            let avail = avail as usize;
            let at = (self.tail % self.cap as u64) as usize;
            let mut h = [0u8; RECORD_HEADER];
            if avail < RECORD_HEADER || !self.area.read(RECORDS + at, &mut h) {
                return Err("a truncated record in the queue".into());
            }
            let kind = u32::from_le_bytes(h[..4].try_into().expect("4 bytes"));
            let len = u32::from_le_bytes(h[4..].try_into().expect("4 bytes")) as usize;
            let rec = RECORD_HEADER + align8(len);
            if rec > avail || at + rec > self.cap {
                return Err(format!(
                    "a queue record of {len} bytes runs past the published ones"
                ));
            }
            let Some(kind) = Kind::from_u32(kind) else {
                return Err(format!("unknown queue record kind {kind}"));
            };
            if kind == Kind::Pad {
                self.consume(rec);
                continue;
            }
            let from = RECORDS + at + RECORD_HEADER;
            let payload = if len >= POOLED {
                let (mut buf, size) = self.pool.take(len);
                let copied = self.area.append_to(from, len, &mut buf);
                let payload = buf.split().freeze();
                self.pool.give_back(buf, size);
                copied.then_some(payload)
            } else {
                let mut payload = vec![0u8; len];
                self.area.read(from, &mut payload).then(|| payload.into())
            };
            let Some(payload) = payload else {
                return Err("a queue record outside the area".into());
            };
            // Consumed once copied: the sender may reuse the space from now on.
            self.consume(rec);
            return parse(kind, payload, limits).map(Some);
        }
    }

    fn consume(&mut self, rec: usize) {
        self.tail += rec as u64;
        counters(&self.area)
            .tail
            .store(self.tail, Ordering::Release);
    }
}

fn parse(kind: Kind, payload: Bytes, limits: &Limits) -> Result<Record, String> {
    match kind {
        Kind::Start => {
            let b: [u8; 8] = payload[..]
                .try_into()
                .map_err(|_| "a malformed start record".to_string())?;
            Ok(Record::Start(u64::from_le_bytes(b)))
        }
        Kind::Socket if payload.is_empty() => Ok(Record::Socket),
        Kind::Socket => Err("a socket marker with a body".into()),
        Kind::Ring => {
            let meta_len = LeReader::new(&payload)
                .u32()
                .map_err(|_| "a short ring record".to_string())?
                as usize;
            if meta_len > limits.max_meta as usize || 4 + meta_len > payload.len() {
                return Err(format!("a ring record with {meta_len} bytes of metadata"));
            }
            Ok(Record::Ring {
                meta: payload.slice(4..4 + meta_len),
                descriptor: payload.slice(4 + meta_len..),
            })
        }
        Kind::Inline => parse_inline(payload, limits),
        Kind::Pad => unreachable!("padding is skipped before parsing"),
    }
}

fn parse_inline(payload: Bytes, limits: &Limits) -> Result<Record, String> {
    let short = |_| "a short inline record".to_string();
    let mut r = LeReader::new(&payload);
    let meta_len = r.u32().map_err(short)? as usize;
    let count = r.u32().map_err(short)? as usize;
    // The same bounds as a frame on the socket: the queue is no way around them.
    if meta_len > limits.max_meta as usize {
        return Err(format!(
            "an inline message with {meta_len} bytes of metadata exceeds the limit of {}",
            limits.max_meta
        ));
    }
    if count > usize::from(limits.max_segments) {
        return Err(format!(
            "an inline message of {count} segments exceeds the limit of {}",
            limits.max_segments
        ));
    }
    let mut lens: SmallVec<[usize; 4]> = SmallVec::new();
    for _ in 0..count {
        lens.push(usize::try_from(r.u64().map_err(short)?).unwrap_or(usize::MAX));
    }
    let body = r.remaining();
    let total = lens
        .iter()
        .try_fold(meta_len, |a, &l| a.checked_add(l))
        .filter(|&t| t == body);
    if total.is_none() {
        return Err("an inline record's lengths do not add up".into());
    }
    if (body - meta_len) as u64 > limits.max_message {
        return Err(format!(
            "an inline message of {} bytes exceeds the limit of {} (PSNET_MAX_MESSAGE)",
            body - meta_len,
            limits.max_message
        ));
    }
    let start = payload.len() - body;
    let all = payload;
    let meta = all.slice(start..start + meta_len);
    let mut at = start + meta_len;
    let segments = lens
        .into_iter()
        .map(|l| {
            let s = all.slice(at..at + l);
            at += l;
            s
        })
        .collect();
    Ok(Record::Inline { meta, segments })
}

/// The first part of an inline record: metadata length, segment count and lengths.
pub(crate) fn inline_header(meta: &[u8], segments: &[&[u8]]) -> SmallVec<[u8; 64]> {
    let mut h = SmallVec::new();
    h.extend_from_slice(&(meta.len() as u32).to_le_bytes());
    h.extend_from_slice(&(segments.len() as u32).to_le_bytes());
    for s in segments {
        h.extend_from_slice(&(s.len() as u64).to_le_bytes());
    }
    h
}

/// Makes a queue's memory file of `cap` bytes of records and maps it; the cookie is written.
fn create_file(cap: usize) -> io::Result<(File, SharedArea, u64)> {
    if area_of((cap + RECORDS) as u64).is_none() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a shared-memory queue of {cap} bytes (a power of two from {MIN_QUEUE} to {MAX_QUEUE})"),
        ));
    }
    let file = handover::sealed_memfd("psnet-queue", cap + RECORDS)?;
    let area = SharedArea::map(&file, cap + RECORDS)?;
    let cookie = u64::from_le_bytes(handover::random::<8>()?);
    area.write(0, &cookie.to_le_bytes());
    Ok((file, area, cookie))
}

/// The sending side's queue, with the eventfd that wakes the receiver.
pub(crate) struct SendQueue {
    /// Pushes happen under the connection's writer lock; this lock only makes that safe to
    /// rely on.
    producer: Mutex<Producer>,
    wake: OwnedFd,
    offer: Vec<u8>,
    active: AtomicBool,
    handover: Mutex<Option<AbortHandle>>,
}

impl SendQueue {
    /// A queue of `cap` bytes of records (a power of two), offered to the peer. Needs a tokio
    /// runtime.
    pub(crate) fn create(cap: usize) -> io::Result<SendQueue> {
        let (file, area, cookie) = create_file(cap)?;
        let wake = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        let peer_wake = wake.try_clone()?;
        let (offer, task) = handover::serve(
            vec![file.into(), peer_wake],
            (cap + RECORDS) as u64,
            cookie,
            "psnet-queue",
        )?;
        Ok(SendQueue {
            producer: Mutex::new(Producer::new(area)?),
            wake,
            offer: offer.encode(),
            active: AtomicBool::new(false),
            handover: Mutex::new(Some(task)),
        })
    }

    /// The offer's body.
    pub(crate) fn offer(&self) -> &[u8] {
        &self.offer
    }

    /// The receiver mapped the queue.
    pub(crate) fn activate(&self) {
        self.active.store(true, Ordering::Release);
    }

    /// Whether messages may use the queue.
    pub(crate) fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    /// The largest record payload the queue takes.
    pub(crate) fn max_payload(&self) -> usize {
        self.producer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .max_payload()
    }

    /// Hands a region of the peer's ring back through shared memory; false if the release
    /// area is full.
    pub(crate) fn push_release(&self, off: usize, len: usize) -> Result<bool, String> {
        self.producer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_release(off, len)
    }

    /// Appends a record; false if there is no room now. Wakes the receiver if it sleeps.
    pub(crate) fn push(&self, kind: Kind, parts: &[&[u8]], reserve: usize) -> Result<bool, String> {
        let pushed = self
            .producer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(kind, parts, reserve)?;
        match pushed {
            Pushed::Full => Ok(false),
            Pushed::Done { wake } => {
                if wake {
                    // A full counter (EAGAIN) means a wake-up is pending anyway.
                    let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
                }
                Ok(true)
            }
        }
    }
}

impl Drop for SendQueue {
    fn drop(&mut self) {
        if let Some(task) = self
            .handover
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            task.abort();
        }
    }
}

/// The receiving side's queue, with the eventfd it sleeps on.
pub(crate) struct RecvQueue {
    pub(crate) consumer: Consumer,
    wake: AsyncFd<OwnedFd>,
}

impl RecvQueue {
    /// Fetches an offered queue and its eventfd from the offering peer and maps it. Fails
    /// (and the offer is declined) unless the peer is on this host, this user's, and hands
    /// over a sealed memory file of a valid, announced size with the announced cookie.
    pub(crate) async fn fetch(offer: &[u8]) -> io::Result<RecvQueue> {
        let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_string());
        let offer = Offer::parse(offer)?;
        if area_of(offer.size).is_none() {
            return Err(bad("shared-memory queue offer of an unexpected size"));
        }
        let mut fds = offer.fetch(2).await?.into_iter();
        let (Some(file), Some(wake)) = (fds.next(), fds.next()) else {
            return Err(bad("two descriptors expected"));
        };
        let file = handover::check_sealed(file, offer.size, "queue")?;
        // The second descriptor must be an eventfd: anything else could block the reader.
        let is_eventfd = std::fs::read_link(format!("/proc/self/fd/{}", {
            use std::os::fd::AsRawFd;
            wake.as_raw_fd()
        }))
        .is_ok_and(|target| target.to_string_lossy() == "anon_inode:[eventfd]");
        if !is_eventfd {
            return Err(bad("the queue's wake-up descriptor is not an eventfd"));
        }
        rustix::fs::fcntl_setfl(&wake, rustix::fs::OFlags::NONBLOCK)?;
        let area = Arc::new(SharedArea::map(&file, offer.size as usize)?);
        let mut cookie = [0u8; 8];
        if !area.read(0, &mut cookie) || cookie != offer.cookie.to_le_bytes() {
            return Err(bad("cookie mismatch"));
        }
        Ok(RecvQueue {
            consumer: Consumer::new(area)?,
            wake: super::sys::watch_eventfd(wake)?,
        })
    }

    /// The reader of the regions of this side's ring that the peer released.
    pub(crate) fn releases(&self) -> ReleaseReader {
        ReleaseReader::new(self.consumer.area.clone())
    }

    /// Waits until the sender signals the eventfd, and clears it.
    pub(crate) async fn wait(&self) -> io::Result<()> {
        loop {
            let mut guard = self.wake.readable().await?;
            let mut count = [0u8; 8];
            match rustix::io::read(self.wake.get_ref(), &mut count) {
                Ok(_) => return Ok(()),
                Err(rustix::io::Errno::AGAIN) => guard.clear_ready(),
                Err(e) => return Err(e.into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A producer and a consumer over one memory file of `cap` bytes of records.
    fn pair(cap: usize) -> (Producer, Consumer) {
        let (file, area, _) = create_file(cap).unwrap();
        let other = Arc::new(SharedArea::map(&file, cap + RECORDS).unwrap());
        (Producer::new(area).unwrap(), Consumer::new(other).unwrap())
    }

    fn inline(meta: &[u8], segs: &[&[u8]]) -> Vec<u8> {
        let mut v = inline_header(meta, segs).to_vec();
        v.extend_from_slice(meta);
        for s in segs {
            v.extend_from_slice(s);
        }
        v
    }

    #[test]
    fn records_round_trip_and_wrap() {
        let (mut p, mut c) = pair(4096);
        let limits = Limits::default();
        assert!(c.next(&limits).unwrap().is_none());
        assert_eq!(
            p.push(Kind::Start, &[&3u64.to_le_bytes()], 0),
            Ok(Pushed::Done { wake: false })
        );
        assert!(matches!(c.next(&limits).unwrap(), Some(Record::Start(3))));
        // Many records of awkward sizes, through several wraps.
        for i in 0..2000usize {
            let a = vec![i as u8; i % 700];
            let b = vec![!(i as u8); i % 13];
            let body = inline(b"m", &[&a, &b]);
            assert_eq!(
                p.push(Kind::Inline, &[&body], 0),
                Ok(Pushed::Done { wake: false })
            );
            assert_eq!(
                p.push(Kind::Socket, &[], 0),
                Ok(Pushed::Done { wake: false })
            );
            match c.next(&limits).unwrap() {
                Some(Record::Inline { meta, segments }) => {
                    assert_eq!(&meta[..], b"m");
                    assert_eq!(segments.len(), 2);
                    assert!(segments[0] == a[..] && segments[1] == b[..], "record {i}");
                }
                other => panic!("record {i}: {other:?}"),
            }
            assert!(matches!(c.next(&limits).unwrap(), Some(Record::Socket)));
            assert!(c.next(&limits).unwrap().is_none());
        }
    }

    #[test]
    fn a_full_queue_refuses_until_consumed_and_keeps_the_reserve() {
        let (mut p, mut c) = pair(4096);
        let limits = Limits::default();
        let mut body = vec![7u8; 1000];
        body[..4].copy_from_slice(&0u32.to_le_bytes());
        let mut pushed = 0;
        while p.push(Kind::Ring, &[&body], 0) != Ok(Pushed::Full) {
            pushed += 1;
        }
        assert_eq!(pushed, 4, "4 records of 1008 bytes fit in 4096");
        assert_eq!(
            p.push(Kind::Socket, &[], 0),
            Ok(Pushed::Done { wake: false }),
            "a marker still fits"
        );
        assert!(
            matches!(c.next(&limits).unwrap(), Some(Record::Ring { meta, descriptor }) if meta.is_empty() && descriptor[..] == body[4..])
        );
        assert_eq!(
            p.push(Kind::Ring, &[&body], 100),
            Ok(Pushed::Full),
            "the reserve is kept"
        );
        assert_eq!(
            p.push(Kind::Ring, &[&body], 0),
            Ok(Pushed::Done { wake: false })
        );
        assert!(
            p.push(Kind::Ring, &[&vec![0; 1025]], 0).is_err(),
            "over a quarter of the area"
        );
    }

    #[test]
    fn a_sleeping_receiver_is_woken_exactly_once() {
        let (mut p, c) = pair(4096);
        assert!(c.sleep());
        assert_eq!(
            p.push(Kind::Socket, &[], 0),
            Ok(Pushed::Done { wake: true })
        );
        assert_eq!(
            p.push(Kind::Socket, &[], 0),
            Ok(Pushed::Done { wake: false })
        );
        assert!(!c.sleep(), "records are waiting: no sleep");
    }

    #[test]
    fn corrupt_queues_are_errors_not_panics() {
        let limits = Limits::default();
        let (mut p, mut c) = pair(4096);
        // A head beyond what the area can hold.
        counters(&p.area).head.store(1 << 40, Ordering::SeqCst);
        assert!(c.next(&limits).is_err());
        // A record header claiming more than was published, an unknown kind, lengths that do
        // not add up, limits exceeded.
        let cases: Vec<(u32, Vec<u8>)> = vec![
            (99, vec![]),
            (Kind::Start as u32, vec![1, 2, 3]),
            (Kind::Socket as u32, vec![1]),
            (Kind::Inline as u32, vec![0; 3]),
            (Kind::Inline as u32, {
                let mut v = inline_header(b"", &[&[0; 10]]).to_vec();
                v.extend_from_slice(&[0; 9]);
                v
            }),
            (Kind::Inline as u32, {
                let mut v = 0u32.to_le_bytes().to_vec();
                v.extend_from_slice(&u32::MAX.to_le_bytes());
                v
            }),
        ];
        for (kind, body) in cases {
            let (p2, mut c2) = pair(4096);
            let mut h = kind.to_le_bytes().to_vec();
            h.extend_from_slice(&(body.len() as u32).to_le_bytes());
            p2.area.write(RECORDS, &h);
            p2.area.write(RECORDS + RECORD_HEADER, &body);
            counters(&p2.area).head.store(
                (RECORD_HEADER + align8(body.len())) as u64,
                Ordering::SeqCst,
            );
            assert!(c2.next(&limits).is_err(), "kind {kind} body {body:?}");
        }
        // A length past the published bytes.
        let (p3, mut c3) = pair(4096);
        let mut h = (Kind::Ring as u32).to_le_bytes().to_vec();
        h.extend_from_slice(&4000u32.to_le_bytes());
        p3.area.write(RECORDS, &h);
        counters(&p3.area).head.store(16, Ordering::SeqCst);
        assert!(c3.next(&limits).is_err());
        // The receiver's tail moved past the head: the producer refuses to go on.
        counters(&c.area).tail.store(1 << 41, Ordering::SeqCst);
        p.head = 0;
        assert!(p.push(Kind::Socket, &[], 0).is_err());
        // Over the receiver's limits.
        let (mut p4, mut c4) = pair(4096);
        let small = Limits {
            max_message: 10,
            ..Limits::default()
        };
        p4.push(Kind::Inline, &[&inline(b"", &[&[0; 11]])], 0)
            .unwrap();
        let e = c4.next(&small).unwrap_err();
        assert!(e.contains("PSNET_MAX_MESSAGE"), "{e}");
    }

    #[test]
    fn random_bytes_in_the_queue_never_panic_the_reader() {
        // Whatever a peer writes (records, counters), reading gives records or an error.
        let limits = Limits {
            max_segments: 8,
            max_meta: 64,
            ..Limits::default()
        };
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..3000 {
            let (p, mut c) = pair(4096);
            let mut junk = vec![0u8; 4096];
            for b in junk.iter_mut() {
                *b = next() as u8;
            }
            // Plausible headers now and then, so parsing goes past the first check.
            for at in (0..4096).step_by(8 * (1 + next() as usize % 64)) {
                junk[at..at + 4].copy_from_slice(&(1 + next() as u32 % 6).to_le_bytes());
                junk[at + 4..at + 8].copy_from_slice(&(next() as u32 % 300).to_le_bytes());
            }
            p.area.write(RECORDS, &junk);
            let head = match next() % 3 {
                0 => next(),
                _ => next() % 4097,
            };
            counters(&p.area).head.store(head, Ordering::SeqCst);
            for _ in 0..64 {
                match c.next(&limits) {
                    Ok(Some(_)) => continue,
                    Ok(None) | Err(_) => break,
                }
            }
        }
    }

    #[test]
    fn two_threads_pass_every_record_in_order() {
        // The producer pushes as fast as room allows, the consumer sleeps whenever the queue
        // is empty; with the wake-up flag alone (no eventfd) a lost wake-up would hang here,
        // so the consumer only waits while `sleep()` said it may and the producer saw it.
        let (mut p, mut c) = pair(8192);
        let woken = std::sync::Arc::new((std::sync::Mutex::new(0u64), std::sync::Condvar::new()));
        let w = woken.clone();
        const N: u64 = 200_000;
        let producer = std::thread::spawn(move || {
            for i in 0..N {
                let body = i.to_le_bytes();
                let len = (i % 300) as usize;
                let pad = vec![i as u8; len];
                loop {
                    match p
                        .push(Kind::Ring, &[&0u32.to_le_bytes(), &body, &pad], 0)
                        .unwrap()
                    {
                        Pushed::Full => std::thread::yield_now(),
                        Pushed::Done { wake } => {
                            if wake {
                                let (m, cv) = &*w;
                                *m.lock().unwrap() += 1;
                                cv.notify_one();
                            }
                            break;
                        }
                    }
                }
            }
        });
        let limits = Limits::default();
        let mut next = 0u64;
        let mut seen_wakes = 0u64;
        while next < N {
            match c.next(&limits).unwrap() {
                Some(Record::Ring { descriptor: b, .. }) => {
                    assert_eq!(u64::from_le_bytes(b[..8].try_into().unwrap()), next);
                    assert_eq!(b.len(), 8 + (next % 300) as usize);
                    next += 1;
                }
                Some(other) => panic!("{other:?}"),
                None => {
                    if c.sleep() {
                        let (m, cv) = &*woken;
                        let mut g = m.lock().unwrap();
                        while *g == seen_wakes {
                            let (next, waited) = cv
                                .wait_timeout(g, std::time::Duration::from_secs(20))
                                .unwrap();
                            assert!(!waited.timed_out(), "a wake-up was lost");
                            g = next;
                        }
                        seen_wakes = *g;
                        c.wake();
                    }
                }
            }
        }
        producer.join().unwrap();
    }
}
