//! Buffers the compressed allreduce borrows for its codes and sums, kept between calls. A
//! buffer of megabytes allocated per call is fresh pages per call: page faults, zeroing, and
//! on unmapping, TLB shootdowns on every core (`perf` of 4 ranks, 2-bit, 16 MiB, on this
//! 2-core host: page faults and shootdowns beside the quantization itself).

use std::sync::Mutex;

/// Buffers kept per kind; a call takes at most three.
const KEPT: usize = 4;

/// Kept buffers of one element type.
#[derive(Debug, Default)]
pub(crate) struct Pool<E> {
    kept: Mutex<Vec<Vec<E>>>,
}

impl<E: Copy + Default> Pool<E> {
    /// A buffer of `len` elements, all `E::default()` (zero): a kept one if any (the
    /// largest), else a new one.
    pub(crate) fn take(&self, len: usize) -> Vec<E> {
        let kept = {
            let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
            let largest = (0..kept.len()).max_by_key(|&i| kept[i].capacity());
            largest.map(|i| kept.swap_remove(i))
        };
        let mut v = kept.unwrap_or_default();
        v.clear();
        v.resize(len, E::default());
        v
    }

    /// Keeps `v` for a later call (the smallest one kept goes when there are too many).
    pub(crate) fn give(&self, v: Vec<E>) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.push(v);
        if kept.len() > KEPT {
            if let Some(i) = (0..kept.len()).min_by_key(|&i| kept[i].capacity()) {
                kept.swap_remove(i);
            }
        }
    }
}

/// A communicator's kept buffers.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    /// Codes sent and received.
    pub(crate) bytes: Pool<u8>,
    /// Sums of decoded codes.
    pub(crate) floats: Pool<f32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_buffer_comes_back_zeroed_and_at_most_a_few_are_kept() {
        let pool = Pool::<u8>::default();
        let mut a = pool.take(16);
        a.fill(7);
        let ptr = a.as_ptr();
        pool.give(a);
        let b = pool.take(8);
        assert_eq!(b, vec![0u8; 8]);
        assert_eq!(b.as_ptr(), ptr, "the kept buffer, not a new one");
        pool.give(b);
        for len in 1..=8 {
            pool.give(vec![1; len]);
        }
        assert_eq!(pool.kept.lock().unwrap().len(), KEPT);
        // The largest are kept.
        assert!(pool.kept.lock().unwrap().iter().all(|v| v.capacity() >= 5));
    }
}
