//! Registered memory: regions (memory plus its registration, [`Region`]) and the pool of
//! rendezvous receive buffers. Regions, the per-link slabs of eager buffers and every access
//! to memory the NIC reads or writes are `sys::memory`'s.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use crate::error::VerbsError;
use crate::sys;
use crate::sys::memory::Reclaim;

pub use crate::sys::memory::{access, Region};

/// Registered buffers for rendezvous receives, reused across messages.
///
/// A buffer leaves the pool when a request-to-send arrives, is named in the clear-to-send, is
/// written once by the sender, and is handed to the application as [`Bytes`]. It returns to
/// the pool only when the last of those `Bytes` is dropped, so a buffer is never offered to a
/// sender while anything can still read it, and never written twice for one offer.
pub struct RecvPool {
    pd: Arc<ProtectionDomain>,
    free: Mutex<PoolState>,
    max_cached: usize,
}

struct PoolState {
    by_class: HashMap<usize, Vec<Region>>,
    cached: usize,
}

impl RecvPool {
    /// A pool keeping at most `max_cached` bytes of idle buffers.
    pub fn new(pd: Arc<ProtectionDomain>, max_cached: usize) -> Arc<RecvPool> {
        Arc::new(RecvPool {
            pd,
            free: Mutex::new(PoolState {
                by_class: HashMap::new(),
                cached: 0,
            }),
            max_cached,
        })
    }

    fn class(len: usize) -> usize {
        len.max(4096).checked_next_power_of_two().unwrap_or(len)
    }

    /// A registered buffer of at least `len` bytes.
    pub fn take(&self, len: usize) -> Result<Region, VerbsError> {
        let class = Self::class(len);
        {
            let mut st = self.free.lock().expect("pool lock");
            if let Some(region) = st.by_class.get_mut(&class).and_then(Vec::pop) {
                st.cached -= region.len();
                return Ok(region);
            }
        }
        Region::new(&self.pd, class)
    }

    fn give_back(&self, region: Region) {
        let mut st = self.free.lock().expect("pool lock");
        if st.cached + region.len() <= self.max_cached {
            st.cached += region.len();
            st.by_class.entry(region.len()).or_default().push(region);
        }
    }

    /// Hands the first `len` bytes of `region` to the application; the region comes back to
    /// the pool when the last clone of the returned `Bytes` is dropped. Call once the peer's
    /// write into `region` is placed (its immediate arrived, or the direct message naming it)
    /// and no work request refers to the region any more (see `sys::memory::into_bytes`).
    pub(crate) fn into_bytes(self: &Arc<Self>, region: Region, len: usize) -> Bytes {
        let home: Weak<dyn Reclaim> = Arc::downgrade(self) as Weak<RecvPool>;
        sys::memory::into_bytes(region, len, home)
    }
}

impl Reclaim for RecvPool {
    fn reclaim(&self, region: Region) {
        self.give_back(region);
    }
}
