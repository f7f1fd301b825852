//! Recycled buffers for large received bodies (a connection's socket reader and its
//! same-host queue each keep a pool).

use std::collections::VecDeque;

use bytes::BytesMut;

/// Large buffers kept per connection, at most. A collective sends a buffer as many messages
/// at once (a 16 MiB allreduce on 2 ranks: 16 of 1 MiB, all received before the first is
/// applied); with only 4 kept, most came from fresh allocations (135,000 page faults in a
/// 2-rank 1-16 MiB sweep, 34,000 with 32 kept; 16 MiB busbw 1.38-1.57 GB/s before,
/// 1.62-2.08 after).
const LARGE_POOL: usize = 32;
/// Bytes of buffers kept per connection, at most: a node with many peers holds at most this
/// much per peer for reuse.
const LARGE_POOL_BYTES: usize = 32 << 20;

/// Recycled buffers for large bodies. Each entry owns an allocation that a delivered message
/// may still share; it is reused only when that message is gone.
#[derive(Default)]
pub(crate) struct LargeBuffers {
    /// Each buffer with the size of its allocation (what is left after a message was split
    /// off says nothing of it).
    pool: VecDeque<(BytesMut, usize)>,
    /// The allocations' sizes in `pool`, added up.
    bytes: usize,
}

impl LargeBuffers {
    /// An empty buffer with room for `len` bytes, and the size of its allocation.
    ///
    /// The most recently returned free buffer, which is likeliest still in cache: the pool
    /// fills to many buffers while a peer runs ahead, and taking the oldest made every receive
    /// of a steady 2-rank 2 MiB allreduce write lines of a buffer evicted since (sockets, in
    /// place, 1,000 iterations, 8 alternating runs: 434-595 us, median 569, against 469-819
    /// us, median 629; faster in 7 of the 8 pairs).
    pub(crate) fn take(&mut self, len: usize) -> (BytesMut, usize) {
        match self.pool.iter_mut().rposition(|(b, _)| b.try_reclaim(len)) {
            Some(i) => {
                let (buf, size) = self.pool.remove(i).expect("index from position");
                self.bytes -= size;
                (buf, size)
            }
            None => (BytesMut::with_capacity(len), len),
        }
    }

    /// Keeps `buf` (whose contents were split off), an allocation of `size` bytes, for
    /// reuse, dropping the oldest buffers beyond the pool's bounds.
    pub(crate) fn give_back(&mut self, buf: BytesMut, size: usize) {
        self.bytes += size;
        self.pool.push_back((buf, size));
        while self.pool.len() > LARGE_POOL || self.bytes > LARGE_POOL_BYTES {
            match self.pool.pop_front() {
                Some((_, old)) => self.bytes -= old,
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body read into a pooled buffer, split off and dropped, as the reader does.
    fn cycle(pool: &mut LargeBuffers, len: usize) -> *const u8 {
        let (mut big, size) = pool.take(len);
        big.resize(len, 7);
        let body = big.split().freeze();
        let at = body.as_ptr();
        pool.give_back(big, size);
        drop(body);
        at
    }

    #[test]
    fn a_buffer_whose_message_is_gone_is_reused() {
        let mut pool = LargeBuffers::default();
        let first = cycle(&mut pool, 1 << 20);
        assert_eq!(cycle(&mut pool, 1 << 20), first);
        assert_eq!(
            cycle(&mut pool, 512 << 10),
            first,
            "a smaller body fits too"
        );
        assert_eq!(pool.pool.len(), 1);
        assert_eq!(pool.bytes, 1 << 20);
    }

    #[test]
    fn the_buffer_freed_last_is_reused_first() {
        let mut pool = LargeBuffers::default();
        let take = |pool: &mut LargeBuffers| {
            let (mut big, size) = pool.take(1 << 20);
            big.resize(1 << 20, 3);
            let body = big.split().freeze();
            pool.give_back(big, size);
            body
        };
        let older = take(&mut pool);
        let newer = take(&mut pool);
        let newer_at = newer.as_ptr();
        assert_ne!(older.as_ptr(), newer_at);
        drop(older);
        drop(newer);
        assert_eq!(take(&mut pool).as_ptr(), newer_at);
    }

    #[test]
    fn the_pool_keeps_at_most_its_count_and_its_bytes() {
        let mut pool = LargeBuffers::default();
        // Messages still held: every take allocates afresh.
        let mut held = Vec::new();
        for _ in 0..LARGE_POOL + 8 {
            let (mut big, size) = pool.take(64 << 10);
            big.resize(64 << 10, 1);
            held.push(big.split().freeze());
            pool.give_back(big, size);
            assert!(pool.pool.len() <= LARGE_POOL);
        }
        assert_eq!(pool.pool.len(), LARGE_POOL);
        for _ in 0..8 {
            let (mut big, size) = pool.take(8 << 20);
            big.resize(8 << 20, 1);
            held.push(big.split().freeze());
            pool.give_back(big, size);
            assert!(pool.bytes <= LARGE_POOL_BYTES, "{} bytes kept", pool.bytes);
        }
        let kept: usize = pool.pool.iter().map(|(_, size)| size).sum();
        assert_eq!(kept, pool.bytes);
    }
}
