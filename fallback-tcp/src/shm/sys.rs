//! Every `unsafe` operation of the same-host paths: mapping memory files, and reading and
//! writing memory that another process maps too.
//!
//! Memory shared with a peer is never turned into a Rust reference to its bytes (the peer
//! may write them at any time): `SharedArea` copies bytes in and out through raw pointers,
//! and reaches its counters only as atomics.

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64};

use memmap2::{Mmap, MmapMut, MmapOptions, MmapRaw};

/// Maps `size` bytes of a memory file this process created, sized and sealed against
/// shrinking, for writing.
pub(crate) fn map_own_ring(file: &File, size: usize) -> io::Result<MmapMut> {
    // SAFETY: the caller created the memory file, sized it to `size` and sealed it against
    // shrinking (so every mapped page stays backed), and writes it only through this mapping;
    // the peer maps it read-only.
    unsafe { MmapOptions::new().len(size).map_mut(file) }
}

/// Maps a peer's ring for reading.
pub(crate) fn map_peer_ring(file: &File, size: usize) -> io::Result<Mmap> {
    // SAFETY: the caller checked that the descriptor is a memory file sealed against
    // shrinking, of exactly `size` bytes, so no mapped page can lose its backing. The peer
    // writes only regions it has not yet described to us; we read only regions described by
    // a message it sent after writing them (the socket or the queue orders the two).
    unsafe { MmapOptions::new().len(size).map(file) }
}

/// A mapping shared with another process, which may write it at any time.
pub(crate) struct SharedArea {
    map: MmapRaw,
}

impl SharedArea {
    /// Maps all `len` bytes of `file` for reading and writing. The caller has checked (or
    /// made sure, for its own file) that the file is sealed against shrinking and `len`
    /// bytes long, so that every page stays backed.
    pub(crate) fn map(file: &File, len: usize) -> io::Result<SharedArea> {
        let map = MmapOptions::new().len(len).map_raw(file)?;
        Ok(SharedArea { map })
    }

    /// The mapping's length.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether `[off, off + len)` lies in the mapping.
    fn holds(&self, off: usize, len: usize) -> bool {
        off.checked_add(len)
            .is_some_and(|end| end <= self.map.len())
    }

    /// The 8-byte counter at `off` (8-aligned); None if it is outside or misaligned.
    pub(crate) fn u64_at(&self, off: usize) -> Option<&AtomicU64> {
        if off % 8 != 0 || !self.holds(off, 8) {
            return None;
        }
        // SAFETY: the mapping is page-aligned, so `off` being a multiple of 8 aligns the
        // pointer for an AtomicU64, and its 8 bytes lie in the mapping (checked), which lives
        // as long as the returned reference. Atomics are the one sound way to share the word
        // with another process writing it concurrently.
        Some(unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) })
    }

    /// The 4-byte flag at `off` (4-aligned); None if it is outside or misaligned.
    pub(crate) fn u32_at(&self, off: usize) -> Option<&AtomicU32> {
        if off % 4 != 0 || !self.holds(off, 4) {
            return None;
        }
        // SAFETY: as for `u64_at`, with 4-byte alignment.
        Some(unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU32) })
    }

    /// Copies `bytes` into the mapping at `off`; false (nothing written) if they do not fit.
    pub(crate) fn write(&self, off: usize, bytes: &[u8]) -> bool {
        if !self.holds(off, bytes.len()) {
            return false;
        }
        // SAFETY: the destination range lies in the mapping (checked) and cannot overlap
        // `bytes`, a Rust slice of this process that is not part of the shared mapping. The
        // protocol gives this side the range alone until it publishes it.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.map.as_mut_ptr().add(off),
                bytes.len(),
            );
        }
        true
    }

    /// Copies `out.len()` bytes at `off` out of the mapping; false (nothing read) if the range
    /// is outside it.
    pub(crate) fn read(&self, off: usize, out: &mut [u8]) -> bool {
        if !self.holds(off, out.len()) {
            return false;
        }
        // SAFETY: the source range lies in the mapping (checked); `out` is this process's own
        // memory. A peer breaking the protocol could change the bytes during the copy, which
        // gives garbage bytes (checked by the parser like any input), never a bad pointer.
        unsafe {
            std::ptr::copy_nonoverlapping(self.map.as_ptr().add(off), out.as_mut_ptr(), out.len());
        }
        true
    }
}

/// Registers an owned eventfd with tokio's reactor, for readiness to read.
pub(crate) fn watch_eventfd(
    fd: std::os::fd::OwnedFd,
) -> io::Result<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>> {
    // SAFETY: the AsyncFd owns the descriptor: it stays open, and the same one, until the
    // AsyncFd is dropped (an OwnedFd's raw descriptor never changes).
    unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
        .map_err(|e| e.into_parts().1)
}

impl SharedArea {
    /// Appends `len` bytes at `off` of the mapping to `out`; false (nothing appended) if the
    /// range is outside the mapping.
    pub(crate) fn append_to(&self, off: usize, len: usize, out: &mut bytes::BytesMut) -> bool {
        if !self.holds(off, len) {
            return false;
        }
        out.reserve(len);
        let spare = out.spare_capacity_mut();
        // SAFETY: the source range lies in the mapping (checked); `spare` is this process's
        // own memory with room for `len` bytes (reserved above), not part of the mapping. The
        // copy initializes exactly the `len` bytes that `set_len` then counts. A peer breaking
        // the protocol can only make them garbage, which the parser checks like any input.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(off),
                spare.as_mut_ptr().cast::<u8>(),
                len,
            );
            out.set_len(out.len() + len);
        }
        true
    }
}
