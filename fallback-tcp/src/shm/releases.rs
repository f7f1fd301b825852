//! Ring regions a receiver is done with, handed back through shared memory.
//!
//! A receiver releases each ring message it has read. Telling the ring's owner through the
//! socket, or through the queue's records, wakes the owner's reader for every message: on a
//! 4-rank ring allreduce (each rank receives from one neighbour and sends to the other), that
//! cost more than the ring saved. Instead the receiver appends the region to a small
//! single-producer area in its own queue's memory file, which the ring's owner maps too, and
//! the owner collects what was released when it next allocates in the ring. No wake-up is
//! needed: nobody waits for a release.
//!
//! Layout, inside the queue's memory file: the producer's count at `HEAD`, the consumer's at
//! `TAIL`, then `ENTRIES` entries of (offset u64, length u64) from `AT`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use smallvec::SmallVec;

use super::queue::QueueError;
use super::sys::SharedArea;

/// Entries the area holds; a full area sends releases through the socket instead.
const ENTRIES: usize = 4096;
const ENTRY: usize = 16;
/// Bytes of entries.
pub(crate) const BYTES: usize = ENTRIES * ENTRY;
/// The producer's count (entries published).
const HEAD: usize = 256;
/// The consumer's count (entries collected).
const TAIL: usize = 320;
/// Where the entries start.
const AT: usize = 512;

/// Appends a released region; false if the area is full. `head` is the producer's own count.
/// An error means the consumer's count is impossible: the peer is broken.
pub(crate) fn push(
    area: &SharedArea,
    head: &mut u64,
    off: usize,
    len: usize,
) -> Result<bool, QueueError> {
    let (Some(h), Some(t)) = (area.u64_at(HEAD), area.u64_at(TAIL)) else {
        return Err(QueueError::ReleasesUnmapped);
    };
    let tail = t.load(Ordering::Acquire);
    if tail > *head || *head - tail > ENTRIES as u64 {
        return Err(QueueError::CorruptReleases);
    }
    if *head - tail == ENTRIES as u64 {
        return Ok(false);
    }
    let slot = AT + (*head % ENTRIES as u64) as usize * ENTRY;
    let mut entry = [0u8; ENTRY];
    entry[..8].copy_from_slice(&(off as u64).to_le_bytes());
    entry[8..].copy_from_slice(&(len as u64).to_le_bytes());
    if !area.write(slot, &entry) {
        return Err(QueueError::ReleasesUnmapped);
    }
    *head += 1;
    h.store(*head, Ordering::Release);
    Ok(true)
}

/// The ring owner's side: collects the regions the peer released.
pub(crate) struct ReleaseReader {
    area: Arc<SharedArea>,
    tail: u64,
}

impl ReleaseReader {
    pub(crate) fn new(area: Arc<SharedArea>) -> ReleaseReader {
        let tail = area.u64_at(TAIL).map_or(0, |t| t.load(Ordering::Acquire));
        ReleaseReader { area, tail }
    }

    /// Every region released since the last call; an error if the peer's count is impossible.
    pub(crate) fn collect(&mut self) -> Result<SmallVec<[(usize, usize); 16]>, QueueError> {
        let (Some(h), Some(t)) = (self.area.u64_at(HEAD), self.area.u64_at(TAIL)) else {
            return Err(QueueError::ReleasesUnmapped);
        };
        let head = h.load(Ordering::Acquire);
        if head < self.tail || head - self.tail > ENTRIES as u64 {
            return Err(QueueError::CorruptReleases);
        }
        let mut out = SmallVec::new();
        while self.tail < head {
            let slot = AT + (self.tail % ENTRIES as u64) as usize * ENTRY;
            let mut entry = [0u8; ENTRY];
            if !self.area.read(slot, &mut entry) {
                return Err(QueueError::ReleasesUnmapped);
            }
            let off = u64::from_le_bytes(entry[..8].try_into().expect("8 bytes"));
            let len = u64::from_le_bytes(entry[8..].try_into().expect("8 bytes"));
            out.push((
                usize::try_from(off).unwrap_or(usize::MAX),
                usize::try_from(len).unwrap_or(usize::MAX),
            ));
            self.tail += 1;
        }
        t.store(self.tail, Ordering::Release);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn area() -> (SharedArea, Arc<SharedArea>) {
        let size = AT + BYTES;
        let file = super::super::handover::sealed_memfd("test-releases", size).unwrap();
        (
            SharedArea::map(&file, size).unwrap(),
            Arc::new(SharedArea::map(&file, size).unwrap()),
        )
    }

    #[test]
    fn releases_arrive_in_order_and_a_full_area_refuses() {
        let (producer, shared) = area();
        let mut reader = ReleaseReader::new(shared);
        let mut head = 0;
        assert!(reader.collect().unwrap().is_empty());
        for round in 0..3usize {
            for i in 0..ENTRIES {
                assert_eq!(
                    push(&producer, &mut head, round * 10_000 + i, i + 1),
                    Ok(true)
                );
            }
            assert_eq!(push(&producer, &mut head, 1, 1), Ok(false), "full");
            let got = reader.collect().unwrap();
            assert_eq!(got.len(), ENTRIES);
            assert!(got
                .iter()
                .enumerate()
                .all(|(i, &r)| r == (round * 10_000 + i, i + 1)));
        }
    }

    #[test]
    fn impossible_counters_are_errors() {
        let (producer, shared) = area();
        let mut reader = ReleaseReader::new(shared.clone());
        shared
            .u64_at(HEAD)
            .unwrap()
            .store(ENTRIES as u64 + 1, Ordering::SeqCst);
        assert!(reader.collect().is_err());
        let mut head = 0;
        shared.u64_at(TAIL).unwrap().store(5, Ordering::SeqCst);
        assert!(push(&producer, &mut head, 0, 1).is_err());
    }
}
