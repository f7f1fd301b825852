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

use psnet_transport::Limits;
use rustix::event::EventfdFlags;
use tokio::io::unix::AsyncFd;
use tokio::task::AbortHandle;

use super::handover::{self, Offer};
use super::releases::{self, ReleaseReader};
use super::sys::SharedArea;

mod record;

use crate::buffers::LargeBuffers;
use record::parse;
pub(crate) use record::{inline_header, Kind, QueueError, Record};

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
    ) -> Result<Pushed, QueueError> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len > self.max_payload() || u32::try_from(len).is_err() {
            return Err(QueueError::RecordTooLarge { len });
        }
        let c = counters(&self.area);
        let tail = c.tail.load(Ordering::Acquire);
        let used = self.head.wrapping_sub(tail);
        if tail > self.head || used > self.cap as u64 {
            return Err(QueueError::CorruptCounter("receiver's"));
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
    pub(crate) fn push_release(&mut self, off: usize, len: usize) -> Result<bool, QueueError> {
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
    pub(crate) fn next(&mut self, limits: &Limits) -> Result<Option<Record>, QueueError> {
        loop {
            let c = counters(&self.area);
            let head = c.head.load(Ordering::Acquire);
            let avail = head.wrapping_sub(self.tail);
            if head < self.tail || avail > self.cap as u64 {
                return Err(QueueError::CorruptCounter("sender's"));
            }
            if avail == 0 {
                return Ok(None);
            }
            let avail = avail as usize;
            let at = (self.tail % self.cap as u64) as usize;
            let mut h = [0u8; RECORD_HEADER];
            if avail < RECORD_HEADER || !self.area.read(RECORDS + at, &mut h) {
                return Err(QueueError::Truncated);
            }
            let kind = u32::from_le_bytes(h[..4].try_into().expect("4 bytes"));
            let len = u32::from_le_bytes(h[4..].try_into().expect("4 bytes")) as usize;
            let rec = RECORD_HEADER + align8(len);
            if rec > avail || at + rec > self.cap {
                return Err(QueueError::PastPublished { len });
            }
            let Some(kind) = Kind::from_u32(kind) else {
                return Err(QueueError::UnknownKind(kind));
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
                return Err(QueueError::OutsideArea);
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
    pub(crate) fn push_release(&self, off: usize, len: usize) -> Result<bool, QueueError> {
        self.producer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_release(off, len)
    }

    /// Appends a record; false if there is no room now. Wakes the receiver if it sleeps.
    pub(crate) fn push(
        &self,
        kind: Kind,
        parts: &[&[u8]],
        reserve: usize,
    ) -> Result<bool, QueueError> {
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
mod tests;
