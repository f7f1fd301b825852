//! A bounded cache of memory registrations for user buffers, keyed by (address, length).
//!
//! Registering memory pins it and costs tens of microseconds per megabyte on real NICs, so a
//! buffer sent again and again (a model's gradient array) should be registered once. The
//! hazard is the one every RDMA library has: if the application frees the buffer and new
//! memory later appears at the same address, a cached registration still points at the old
//! pages. Hence the cache is opt-in (`PSNET_RDMA_REG_CACHE`), bounded, and offers
//! [`RegCache::invalidate`] for an application to call before it frees a buffer it sent.

use std::collections::HashMap;

/// A bounded LRU cache of registrations `R` (e.g. `Arc<MemoryRegion>`).
pub struct RegCache<R> {
    entries: HashMap<(usize, usize), (R, u64)>,
    max_entries: usize,
    max_bytes: usize,
    bytes: usize,
    clock: u64,
}

impl<R: Clone> RegCache<R> {
    /// A cache of at most `max_entries` registrations covering at most `max_bytes`.
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        RegCache {
            entries: HashMap::new(),
            max_entries,
            max_bytes,
            bytes: 0,
            clock: 0,
        }
    }

    /// The registration of `[addr, addr + len)`, made with `register` on a miss. Buffers
    /// larger than the byte bound are registered but not cached.
    pub fn get_or_register<E>(
        &mut self,
        addr: usize,
        len: usize,
        register: impl FnOnce() -> Result<R, E>,
    ) -> Result<R, E> {
        self.clock += 1;
        if let Some((reg, used)) = self.entries.get_mut(&(addr, len)) {
            *used = self.clock;
            return Ok(reg.clone());
        }
        let reg = register()?;
        if self.max_entries == 0 || len > self.max_bytes {
            return Ok(reg);
        }
        while self.entries.len() >= self.max_entries || self.bytes + len > self.max_bytes {
            if !self.evict_oldest() {
                break;
            }
        }
        self.entries.insert((addr, len), (reg.clone(), self.clock));
        self.bytes += len;
        Ok(reg)
    }

    fn evict_oldest(&mut self) -> bool {
        let Some(&key) = self
            .entries
            .iter()
            .min_by_key(|(_, (_, used))| *used)
            .map(|(k, _)| k)
        else {
            return false;
        };
        self.entries.remove(&key);
        self.bytes -= key.1;
        true
    }

    /// Drops every registration overlapping `[addr, addr + len)`; returns how many.
    pub fn invalidate(&mut self, addr: usize, len: usize) -> usize {
        let end = addr.saturating_add(len);
        let before = self.entries.len();
        let mut freed = 0;
        self.entries.retain(|&(a, l), _| {
            let overlaps = a < end && addr < a.saturating_add(l);
            if overlaps {
                freed += l;
            }
            !overlaps
        });
        self.bytes -= freed;
        before - self.entries.len()
    }

    /// Registrations held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none are held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes covered by the registrations held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::cell::Cell;

    #[test]
    fn hits_reuse_and_misses_register() {
        let made = Cell::new(0);
        let mut c = RegCache::new(4, 1 << 20);
        let reg = |c: &mut RegCache<u32>, a, l| {
            c.get_or_register(a, l, || {
                made.set(made.get() + 1);
                Ok::<_, ()>(made.get())
            })
            .unwrap()
        };
        assert_eq!(reg(&mut c, 0x1000, 100), 1);
        assert_eq!(reg(&mut c, 0x1000, 100), 1);
        // Same address, other length: another registration.
        assert_eq!(reg(&mut c, 0x1000, 200), 2);
        assert_eq!(c.len(), 2);
        assert_eq!(c.invalidate(0x1050, 1), 2);
        assert_eq!(reg(&mut c, 0x1000, 100), 3);
        assert_eq!(c.bytes(), 100);
    }

    #[test]
    fn registration_errors_are_not_cached() {
        let mut c: RegCache<u32> = RegCache::new(4, 1 << 20);
        assert_eq!(c.get_or_register(1, 1, || Err("no")), Err("no"));
        assert!(c.is_empty());
    }

    #[test]
    fn least_recently_used_goes_first() {
        let mut c = RegCache::new(2, 1 << 20);
        let r = |c: &mut RegCache<usize>, a: usize| c.get_or_register(a, 8, || Ok::<_, ()>(a));
        r(&mut c, 1).unwrap();
        r(&mut c, 2).unwrap();
        r(&mut c, 1).unwrap();
        r(&mut c, 3).unwrap();
        let mut miss = false;
        c.get_or_register(2, 8, || {
            miss = true;
            Ok::<_, ()>(2)
        })
        .unwrap();
        assert!(miss, "entry 2 was the least recently used and must be gone");
    }

    proptest! {
        /// Whatever the sequence, the bounds hold and the byte count matches the entries.
        #[test]
        fn bounds_hold(max_entries in 0usize..6, max_bytes in 1usize..5000,
                       ops in proptest::collection::vec((any::<bool>(), 0usize..20, 1usize..2000), 0..200)) {
            let mut c = RegCache::new(max_entries, max_bytes);
            for (insert, slot, len) in ops {
                let addr = slot * 1000;
                if insert {
                    let got = c.get_or_register(addr, len, || Ok::<_, ()>((addr, len))).unwrap();
                    prop_assert_eq!(got, (addr, len));
                } else {
                    c.invalidate(addr, len);
                    prop_assert!(c.entries.keys().all(|&(a, l)| a + l <= addr || addr + len <= a));
                }
                prop_assert!(c.len() <= max_entries);
                prop_assert!(c.bytes() <= max_bytes);
                prop_assert_eq!(c.bytes(), c.entries.keys().map(|k| k.1).sum::<usize>());
            }
        }
    }
}
