//! Splitting large arrays across threads.
//!
//! Chunks start at multiples of [`CHUNK_UNIT`] elements, a multiple of both the 2-bit word
//! (16 elements) and the 1-bit word (32 elements), so every chunk's compressed bytes are a
//! contiguous, word-aligned slice of the sequential result: parallel output is byte-identical.

use rayon::prelude::*;

/// Chunk boundaries are multiples of this many elements.
pub(crate) const CHUNK_UNIT: usize = 1024;

/// How an operation splits an array across threads (the rayon global pool).
///
/// An array is split only when each thread gets at least [`min_chunk`](Self::min_chunk)
/// elements, so small arrays stay on the calling thread. The default is
/// [`Parallelism::auto`]: all threads of the pool, chunks of at least
/// [`Parallelism::DEFAULT_MIN_CHUNK`] elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parallelism {
    threads: usize,
    min_chunk: usize,
}

impl Parallelism {
    /// Default minimum number of elements per thread (256 Ki elements = 1 MiB of `f32`):
    /// below this the cost of waking threads outweighs the work.
    pub const DEFAULT_MIN_CHUNK: usize = 256 * 1024;

    /// Always run on the calling thread.
    pub fn sequential() -> Self {
        Self::threads(1)
    }

    /// All threads of the rayon global pool.
    pub fn auto() -> Self {
        Self::threads(0)
    }

    /// At most `threads` chunks (`0` = as many as the rayon global pool has threads).
    pub fn threads(threads: usize) -> Self {
        Parallelism {
            threads,
            min_chunk: Self::DEFAULT_MIN_CHUNK,
        }
    }

    /// Sets the minimum number of elements per chunk (rounded up to a multiple of 1024;
    /// small values are useful in tests to exercise the split on small arrays).
    #[must_use]
    pub fn with_min_chunk(mut self, elements: usize) -> Self {
        self.min_chunk = elements.max(1);
        self
    }

    /// The minimum number of elements per chunk.
    pub fn min_chunk(&self) -> usize {
        self.min_chunk
    }

    /// The number of threads this setting uses at most (`0` resolved to the pool size).
    pub fn thread_count(&self) -> usize {
        if self.threads == 0 {
            rayon::current_num_threads().max(1)
        } else {
            self.threads
        }
    }

    /// The chunk length for an `n`-element array, or `None` to run sequentially.
    pub(crate) fn chunk_len(&self, n: usize) -> Option<usize> {
        let threads = self.thread_count();
        if threads <= 1 {
            return None;
        }
        let chunks = threads.min(n / self.min_chunk.max(1));
        if chunks <= 1 {
            return None;
        }
        let chunk = n.div_ceil(chunks).next_multiple_of(CHUNK_UNIT);
        (chunk < n).then_some(chunk)
    }
}

impl Default for Parallelism {
    fn default() -> Self {
        Self::auto()
    }
}

/// Runs `kernel(grad, residual, out)` over matching chunks; `per_byte` elements per output byte.
pub(crate) fn quantize_chunks<K>(
    par: Parallelism,
    per_byte: usize,
    grad: &[f32],
    residual: &mut [f32],
    out: &mut [u8],
    kernel: K,
) where
    K: Fn(&[f32], &mut [f32], &mut [u8]) + Sync,
{
    match par.chunk_len(grad.len()) {
        None => kernel(grad, residual, out),
        Some(chunk) => grad
            .par_chunks(chunk)
            .zip(residual.par_chunks_mut(chunk))
            .zip(out.par_chunks_mut(chunk / per_byte))
            .for_each(|((g, r), o)| kernel(g, r, o)),
    }
}

/// Runs `kernel(compressed, values)` over matching chunks; `per_byte` elements per input byte.
pub(crate) fn dequantize_chunks<K>(
    par: Parallelism,
    per_byte: usize,
    compressed: &[u8],
    values: &mut [f32],
    kernel: K,
) where
    K: Fn(&[u8], &mut [f32]) + Sync,
{
    match par.chunk_len(values.len()) {
        None => kernel(compressed, values),
        Some(chunk) => compressed
            .par_chunks(chunk / per_byte)
            .zip(values.par_chunks_mut(chunk))
            .for_each(|(c, v)| kernel(c, v)),
    }
}

/// Runs `kernel(parts, values)` over matching chunks of `values` and of every part;
/// `per_byte` elements per input byte.
pub(crate) fn dequantize_sum_chunks<K>(
    par: Parallelism,
    per_byte: usize,
    parts: &[&[u8]],
    values: &mut [f32],
    kernel: K,
) where
    K: Fn(&[&[u8]], &mut [f32]) + Sync,
{
    match par.chunk_len(values.len()) {
        None => kernel(parts, values),
        Some(chunk) => {
            let bytes = chunk / per_byte;
            values.par_chunks_mut(chunk).enumerate().for_each(|(k, v)| {
                let at = k * bytes;
                let sub: Vec<&[u8]> = parts
                    .iter()
                    .map(|p| &p[at..(at + bytes).min(p.len())])
                    .collect();
                kernel(&sub, v)
            })
        }
    }
}

/// `dst.copy_from_slice(src)`, split like the compression kernels (the memcpy reference).
pub(crate) fn copy(par: Parallelism, src: &[f32], dst: &mut [f32]) {
    match par.chunk_len(src.len()) {
        None => dst.copy_from_slice(src),
        Some(chunk) => src
            .par_chunks(chunk)
            .zip(dst.par_chunks_mut(chunk))
            .for_each(|(s, d)| d.copy_from_slice(s)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_arrays_stay_sequential() {
        assert_eq!(Parallelism::threads(4).chunk_len(1000), None);
        assert_eq!(Parallelism::sequential().chunk_len(1 << 30), None);
        assert_eq!(
            Parallelism::threads(4).chunk_len(Parallelism::DEFAULT_MIN_CHUNK),
            None
        );
    }

    #[test]
    fn chunks_are_unit_multiples_and_cover_the_array() {
        for n in [2048usize, 4097, 10_000, 1 << 20, (1 << 20) + 17] {
            for threads in 2..6 {
                let par = Parallelism::threads(threads).with_min_chunk(1);
                if let Some(chunk) = par.chunk_len(n) {
                    assert_eq!(chunk % CHUNK_UNIT, 0);
                    assert!(chunk < n);
                    assert!(n.div_ceil(chunk) <= threads);
                }
            }
        }
    }

    #[test]
    fn parallel_copy_copies() {
        let src: Vec<f32> = (0..100_000).map(|i| i as f32).collect();
        let mut dst = vec![0.0; src.len()];
        copy(Parallelism::threads(3).with_min_chunk(1000), &src, &mut dst);
        assert_eq!(src, dst);
    }
}
