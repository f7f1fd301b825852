//! [`Registrar`]: registration of plain user memory for rendezvous sends, through the
//! registration cache ([`RegCache`]) when `PSNET_RDMA_REG_CACHE` enables it. Shared by the
//! transport (which builds it) and the links (whose sends use it).

use std::sync::{Arc, Mutex};

use psnet_transport::RegionKey;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use crate::error::VerbsError;
use crate::regcache::RegCache;
use crate::sys;

/// Registers plain user memory for rendezvous sends, through the cache when enabled, and
/// recognises buffers this transport handed out.
pub struct Registrar {
    pub(crate) pd: Arc<ProtectionDomain>,
    pub(crate) tag: u32,
    pub(crate) cache: Option<Mutex<RegCache<Arc<MemoryRegion>>>>,
}

impl Registrar {
    /// The local key of a buffer from this transport's [`Transport::alloc_registered`].
    ///
    /// [`Transport::alloc_registered`]: psnet_transport::Transport::alloc_registered
    pub fn own_lkey(&self, key: RegionKey) -> Option<u32> {
        ((key.0 >> 32) as u32 == self.tag).then_some(key.0 as u32)
    }

    /// A registration covering `bytes`.
    pub fn register(&self, bytes: &[u8]) -> Result<Arc<MemoryRegion>, VerbsError> {
        // The registration is held by the send until the write completes (or by the cache,
        // whose stale-entry hazard is documented and opt-in), and the NIC only reads through
        // it while the send borrows `bytes`.
        let register = || sys::memory::register_borrowed(&self.pd, bytes);
        match &self.cache {
            Some(cache) => cache
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_register(bytes.as_ptr() as usize, bytes.len(), register),
            None => register(),
        }
    }

    /// Drops cached registrations overlapping `[addr, addr + len)`; call before freeing a
    /// buffer that was sent while `PSNET_RDMA_REG_CACHE` is on.
    pub fn invalidate(&self, addr: usize, len: usize) -> usize {
        match &self.cache {
            Some(cache) => cache
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .invalidate(addr, len),
            None => 0,
        }
    }
}
