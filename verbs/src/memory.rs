//! Registered memory: regions (memory plus its registration), the per-link slab of eager
//! buffers, the pool of rendezvous receive buffers, and buffers handed to applications.
//!
//! Every `unsafe` access to memory the NIC reads or writes is here, with the protocol fact
//! that makes it sound.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::AccessFlags;

use crate::error::VerbsError;

/// Access rights of every registration: local writes (receives) and remote writes
/// (rendezvous into this side's buffers).
pub fn access() -> AccessFlags {
    AccessFlags::LocalWrite | AccessFlags::RemoteWrite
}

/// Registers `len` bytes at `ptr` with `pd`.
///
/// # Safety
/// The memory must stay allocated for as long as the returned registration lives.
pub unsafe fn register(
    pd: &Arc<ProtectionDomain>,
    ptr: *const u8,
    len: usize,
) -> Result<Arc<MemoryRegion>, VerbsError> {
    // A zero-length registration is refused by providers; register one byte instead of none
    // (only ever used for empty buffers that the NIC never touches).
    let len = len.max(1);
    // SAFETY: the caller keeps the memory allocated while the registration lives.
    unsafe { pd.reg_mr(ptr as usize, len, access()) }.map_err(|e| {
        VerbsError::os(
            "ibv_reg_mr",
            format!("memory registration of {len} bytes failed (is RLIMIT_MEMLOCK high enough?)"),
            &e,
        )
    })
}

/// Heap memory and its registration, dropped in that order (registration first).
pub struct Region {
    mr: Arc<MemoryRegion>,
    ptr: *mut u8,
    len: usize,
    _memory: Box<[u8]>,
}

// SAFETY: the region owns its memory; the raw pointer is only an address into it, and access
// through it follows the ownership rules stated at each use.
unsafe impl Send for Region {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for Region {}

impl Region {
    /// `len` zeroed bytes, registered.
    pub fn new(pd: &Arc<ProtectionDomain>, len: usize) -> Result<Region, VerbsError> {
        let mut memory = vec![0u8; len.max(1)].into_boxed_slice();
        let ptr = memory.as_mut_ptr();
        // SAFETY: `memory` is kept in the region and outlives `mr` (field order).
        let mr = unsafe { register(pd, ptr, len)? };
        Ok(Region {
            mr,
            ptr,
            len,
            _memory: memory,
        })
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// The bytes `[at, at + len)`, for reading.
    ///
    /// # Safety
    /// No work request may be writing these bytes (the NIC's write completed and the range is
    /// not posted again until the returned slice is gone).
    pub unsafe fn bytes(&self, at: usize, len: usize) -> &[u8] {
        assert!(at + len <= self.len, "region range out of bounds");
        // SAFETY: in bounds (checked); the caller guarantees no concurrent DMA write.
        unsafe { std::slice::from_raw_parts(self.ptr.add(at), len) }
    }

    /// The bytes `[at, at + len)`, for writing.
    ///
    /// # Safety
    /// The caller owns the range exclusively: no work request uses it and no other slice of
    /// it exists until it is posted.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, at: usize, len: usize) -> &mut [u8] {
        assert!(at + len <= self.len, "region range out of bounds");
        // SAFETY: in bounds (checked); exclusivity is the caller's guarantee.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), len) }
    }
}

/// One registration split into fixed-size buffers: a link's receive buffers and send buffers
/// (never one registration per small buffer).
pub struct Slab {
    region: Region,
    slot_size: usize,
    slots: u32,
}

impl Slab {
    /// `slots` buffers of `slot_size` bytes.
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        slots: u32,
        slot_size: usize,
    ) -> Result<Slab, VerbsError> {
        Ok(Slab {
            region: Region::new(pd, slots as usize * slot_size)?,
            slot_size,
            slots,
        })
    }

    /// Bytes per buffer.
    pub fn slot_size(&self) -> usize {
        self.slot_size
    }

    /// Number of buffers.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Address of buffer `i`.
    pub fn addr(&self, i: u32) -> u64 {
        self.region.addr() + i as u64 * self.slot_size as u64
    }

    /// Local key of every buffer.
    pub fn lkey(&self) -> u32 {
        self.region.lkey()
    }

    /// The first `len` bytes of buffer `i`.
    ///
    /// # Safety
    /// As [`Region::bytes`]: the buffer's receive completed and it is not re-posted meanwhile.
    pub unsafe fn read(&self, i: u32, len: usize) -> &[u8] {
        let len = len.min(self.slot_size);
        // SAFETY: forwarded from the caller.
        unsafe { self.region.bytes(i as usize * self.slot_size, len) }
    }

    /// Buffer `i`, for filling before a send.
    ///
    /// # Safety
    /// As [`Region::bytes_mut`]: the buffer is free (its last send completed) and owned by
    /// the caller until posted.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn write(&self, i: u32) -> &mut [u8] {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.region
                .bytes_mut(i as usize * self.slot_size, self.slot_size)
        }
    }
}

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
    /// the pool when the last clone of the returned `Bytes` is dropped.
    ///
    /// # Safety
    /// The sender's write into `region` has completed (its immediate arrived), and no work
    /// request refers to the region any more.
    pub unsafe fn into_bytes(self: &Arc<Self>, region: Region, len: usize) -> Bytes {
        assert!(len <= region.len());
        Bytes::from_owner(Pooled {
            region: Some(region),
            pool: Arc::downgrade(self),
        })
        .slice(..len)
    }
}

struct Pooled {
    region: Option<Region>,
    pool: Weak<RecvPool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        let region = self.region.as_ref().expect("region until drop");
        // SAFETY: `into_bytes`' contract: the NIC finished writing before the region was
        // wrapped, and it is offered to no sender until this owner is dropped.
        unsafe { region.bytes(0, region.len()) }
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let (Some(region), Some(pool)) = (self.region.take(), self.pool.upgrade()) {
            pool.give_back(region);
        }
    }
}
