//! The same-host bulk path. When both ends of a connection share a host, each sender maps a
//! ring of shared memory (a file in `/dev/shm`, offered to the peer after the handshake) and
//! puts large messages' segments there: one copy into the ring, and the receiver hands out
//! segments that point straight into it, instead of two copies through the kernel's TCP
//! stack. Only a small descriptor frame crosses the socket, in order with the other frames.
//! The receiver tells the sender which regions it is done with; a full ring simply sends
//! through the socket. A peer on another host cannot open the file and declines the offer.
//!
//! All memory mapping is confined to this module.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use memmap2::{Mmap, MmapMut, MmapOptions};
use psnet_transport::{FrameKind, Segment};
use tokio::sync::Notify;

/// Messages with at least this many segment bytes go through the ring.
pub(crate) const SHM_MIN: usize = 256 << 10;
/// Default ring size per connection and direction (`PSNET_SHM_RING`).
pub const DEFAULT_RING: usize = 64 << 20;
/// Largest ring a peer may offer.
const MAX_RING: u64 = 16 << 30;
/// Bytes at the start of a ring holding its cookie.
const COOKIE: usize = 8;
/// Where rings are created.
const SHM_DIR: &str = "/dev/shm";

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
    /// A contiguous region of `len` bytes in a ring of `size`, if there is room.
    fn alloc(&mut self, len: usize, size: usize) -> Option<usize> {
        if len == 0 || self.base + len > size {
            return None;
        }
        let off = match self.regions.front() {
            None => self.base,
            Some(&(tail, _, _)) if self.head > tail => {
                if self.head + len <= size {
                    self.head
                } else if self.base + len < tail {
                    self.base
                } else {
                    return None;
                }
            }
            // Wrapped: free space runs from head up to the oldest live region.
            Some(&(tail, _, _)) => {
                if self.head + len < tail {
                    self.head
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
    path: PathBuf,
    cookie: u64,
    alloc: Mutex<Alloc>,
    active: AtomicBool,
}

static NEXT_RING: AtomicU64 = AtomicU64::new(0);

impl SendRing {
    /// Creates and maps a ring file of `size` bytes; its first 8 bytes hold a cookie the
    /// receiver checks. The file is filled with zeros first, so that a full `/dev/shm` is an
    /// error here rather than a SIGBUS when the ring is written later.
    pub(crate) fn create(size: usize) -> io::Result<SendRing> {
        let n = NEXT_RING.fetch_add(1, Ordering::Relaxed);
        let cookie = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ (u64::from(std::process::id()) << 32)
            ^ n;
        let path =
            PathBuf::from(SHM_DIR).join(format!("psnet-{}-{n}-{cookie:x}", std::process::id()));
        if size <= COOKIE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "ring too small",
            ));
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
        let zeros = vec![0u8; 1 << 20];
        let mut left = size;
        while left > 0 {
            let n = left.min(zeros.len());
            if let Err(e) = file.write_all(&zeros[..n]) {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
            left -= n;
        }
        // SAFETY: the file was just created by this process under a unique name, filled to
        // `size` bytes above (so every page exists), and is only written through this mapping.
        let mut map = unsafe { MmapOptions::new().len(size).map_mut(&file)? };
        map[..8].copy_from_slice(&cookie.to_le_bytes());
        Ok(SendRing {
            map: Mutex::new(map),
            size,
            path,
            cookie,
            alloc: Mutex::new(Alloc {
                regions: VecDeque::new(),
                head: COOKIE,
                base: COOKIE,
            }),
            active: AtomicBool::new(false),
        })
    }

    /// The offer's body: size, cookie, path.
    pub(crate) fn offer(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&(self.size as u64).to_le_bytes());
        out.extend_from_slice(&self.cookie.to_le_bytes());
        out.extend_from_slice(self.path.to_string_lossy().as_bytes());
        out
    }

    /// The receiver accepted: the file's name is no longer needed.
    pub(crate) fn activate(&self) {
        let _ = std::fs::remove_file(&self.path);
        self.active.store(true, Ordering::Release);
    }

    /// Whether messages may use the ring.
    pub(crate) fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    /// Copies `segments` into one new region; None if the ring has no room.
    pub(crate) fn put(&self, segments: &[Segment<'_>]) -> Option<(usize, usize)> {
        let total: usize = segments.iter().map(Segment::len).sum();
        let off = lock(&self.alloc).alloc(total, self.size)?;
        let mut map = lock(&self.map);
        let mut at = off;
        for s in segments {
            map[at..at + s.len()].copy_from_slice(s.bytes());
            at += s.len();
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
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Frames the connection's control task writes: offers, answers to offers, and the regions
/// this side has released. Readers only queue here, so a reader never waits for the socket's
/// write side (two readers waiting on two blocked writers would deadlock).
#[derive(Default)]
pub(crate) struct Control {
    frames: Mutex<Vec<(FrameKind, Vec<u8>)>>,
    released: Mutex<Vec<(u64, u64)>>,
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
        lock(&self.released).push((off as u64, len as u64));
        self.notify.notify_one();
    }

    /// Everything queued so far, released regions as one `ShmFree` frame.
    pub(crate) fn take(&self) -> Vec<(FrameKind, Vec<u8>)> {
        let mut frames = std::mem::take(&mut *lock(&self.frames));
        let released = std::mem::take(&mut *lock(&self.released));
        if !released.is_empty() {
            let body = released
                .iter()
                .flat_map(|(o, l)| o.to_le_bytes().into_iter().chain(l.to_le_bytes()))
                .collect();
            frames.push((FrameKind::ShmFree, body));
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
    /// Opens an offered ring; fails (and the offer is declined) unless it is a file of the
    /// announced size carrying the announced cookie, i.e. the peer is on this host.
    pub(crate) fn open(offer: &[u8]) -> io::Result<RecvRing> {
        let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_string());
        if offer.len() < 17 {
            return Err(bad("short shared-memory offer"));
        }
        let size = u64::from_le_bytes(offer[..8].try_into().expect("8 bytes"));
        let cookie = u64::from_le_bytes(offer[8..16].try_into().expect("8 bytes"));
        let path = std::str::from_utf8(&offer[16..]).map_err(|_| bad("path is not UTF-8"))?;
        if !path.starts_with(SHM_DIR) || path.contains("..") || size > MAX_RING || size <= 8 {
            return Err(bad("unexpected shared-memory offer"));
        }
        let file = File::open(path)?;
        if file.metadata()?.len() != size {
            return Err(bad("ring file has the wrong size"));
        }
        let size = size as usize;
        // SAFETY: the peer owns the file and writes only regions it has not yet described to
        // us; we read only regions described by a frame it sent after writing them (the
        // socket write/read orders the two), and the file's length was checked above.
        let map = unsafe { MmapOptions::new().len(size).map(&file)? };
        if map[..8] != cookie.to_le_bytes() {
            return Err(bad("cookie mismatch: not the same host"));
        }
        Ok(RecvRing { map, size })
    }

    /// The message's segments, pointing into the ring, from a `ShmData` descriptor
    /// (`offset u64, count u32, count x length u64`).
    pub(crate) fn segments(
        self: &Arc<Self>,
        descriptor: &[u8],
        control: &Arc<Control>,
    ) -> Result<smallvec::SmallVec<[Bytes; 4]>, String> {
        if descriptor.len() < 12 {
            return Err("short shared-memory descriptor".into());
        }
        let off = u64::from_le_bytes(descriptor[..8].try_into().expect("8 bytes"));
        let count = u32::from_le_bytes(descriptor[8..12].try_into().expect("4 bytes")) as usize;
        let lens = &descriptor[12..];
        if lens.len() != count * 8 {
            return Err("shared-memory descriptor length mismatch".into());
        }
        let lens: Vec<u64> = lens
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let total = lens.iter().try_fold(0u64, |a, &l| a.checked_add(l));
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
    let mut d = Vec::with_capacity(12 + 8 * segments.len());
    d.extend_from_slice(&(off as u64).to_le_bytes());
    d.extend_from_slice(&(segments.len() as u32).to_le_bytes());
    for s in segments {
        d.extend_from_slice(&(s.len() as u64).to_le_bytes());
    }
    d
}

/// Parses a `ShmFree` body.
pub(crate) fn parse_free(body: &[u8]) -> Option<Vec<(usize, usize)>> {
    if body.len() % 16 != 0 {
        return None;
    }
    Some(
        body.chunks_exact(16)
            .map(|c| {
                let o = u64::from_le_bytes(c[..8].try_into().expect("8 bytes"));
                let l = u64::from_le_bytes(c[8..].try_into().expect("8 bytes"));
                (o as usize, l as usize)
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_allocation_wraps_and_frees_out_of_order() {
        let mut a = Alloc::default();
        assert_eq!(a.alloc(40, 100), Some(0));
        assert_eq!(a.alloc(40, 100), Some(40));
        assert_eq!(
            a.alloc(40, 100),
            None,
            "only 20 left at the end, 0 at the start"
        );
        assert!(a.free(40, 40));
        assert_eq!(
            a.alloc(30, 100),
            None,
            "the oldest region still blocks the start"
        );
        assert!(a.free(0, 40));
        assert_eq!(a.alloc(30, 100), Some(0), "empty ring restarts at 0");
        assert_eq!(a.alloc(60, 100), Some(30));
        assert!(a.free(0, 30));
        assert_eq!(
            a.alloc(20, 100),
            Some(0),
            "wraps before the live region at 30"
        );
        assert_eq!(a.alloc(10, 100), None, "head would meet the tail");
        assert!(!a.free(5, 5), "unknown region");
        assert_eq!(a.alloc(0, 100), None);
        assert_eq!(a.alloc(101, 100), None);
    }

    #[test]
    fn a_ring_round_trips_through_shared_memory() {
        let Ok(send) = SendRing::create(1 << 20) else {
            eprintln!("SKIPPED: /dev/shm unavailable");
            return;
        };
        let recv = Arc::new(RecvRing::open(&send.offer()).expect("same host"));
        send.activate();
        let a = vec![1u8; 300_000];
        let b = vec![2u8; 5];
        let segs = [Segment::new(&a), Segment::new(&b)];
        let (off, total) = send.put(&segs).unwrap();
        let control = Arc::new(Control::default());
        let got = recv.segments(&descriptor(off, &segs), &control).unwrap();
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

    #[test]
    fn bad_offers_and_descriptors_are_refused() {
        assert!(RecvRing::open(b"short").is_err());
        let mut offer = (DEFAULT_RING as u64).to_le_bytes().to_vec();
        offer.extend_from_slice(&7u64.to_le_bytes());
        offer.extend_from_slice(b"/etc/passwd");
        assert!(RecvRing::open(&offer).is_err());
        let Ok(send) = SendRing::create(1 << 20) else {
            return;
        };
        let mut wrong = send.offer();
        wrong[8] ^= 1;
        assert!(RecvRing::open(&wrong).is_err(), "cookie mismatch");
        let recv = Arc::new(RecvRing::open(&send.offer()).unwrap());
        let control = Arc::new(Control::default());
        let mut d = (1u64 << 20).to_le_bytes().to_vec();
        d.extend_from_slice(&1u32.to_le_bytes());
        d.extend_from_slice(&1u64.to_le_bytes());
        assert!(recv.segments(&d, &control).is_err(), "past the end");
        assert!(recv.segments(&[0; 5], &control).is_err());
        assert!(parse_free(&[0; 15]).is_none());
    }
}
