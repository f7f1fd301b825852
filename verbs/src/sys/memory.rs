//! Registered memory: memory plus its registration ([`Region`]), a registration split into
//! buffers whose ownership passes between the CPU and the NIC ([`Slab`], [`Slot`]), buffers
//! handed to the application ([`into_bytes`]), and registrations of memory this crate does
//! not own.
//!
//! Every raw access to memory the NIC reads or writes is here. The rules:
//! - a registration is dropped before the memory it covers is freed (the NIC then fails an
//!   access instead of reaching freed memory);
//! - a [`Slot`] is the CPU's right to one buffer of a [`Slab`]: there is one per idle buffer,
//!   posting it hands the buffer to the NIC, and only the completion of that work request
//!   gives it back.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use bytes::Bytes;
use psnet_transport::{RegionKey, RegisteredBuf};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::AccessFlags;

use super::verbs::{split_wr_id, WorkCompletion, WrKind};
use crate::error::VerbsError;

/// Access rights of every registration: local writes (receives) and remote writes
/// (rendezvous into this side's buffers).
pub fn access() -> AccessFlags {
    AccessFlags::LocalWrite | AccessFlags::RemoteWrite
}

/// Registers `len` bytes at `ptr` with `pd`.
///
/// # Safety
/// `[ptr, ptr + max(len, 1))` is allocated now and stays allocated for as long as the
/// registration is named by a work request or its remote key is known to a peer.
pub(super) unsafe fn register(
    pd: &Arc<ProtectionDomain>,
    ptr: *const u8,
    len: usize,
) -> Result<Arc<MemoryRegion>, VerbsError> {
    // A zero-length registration is refused by providers; register one byte instead of none
    // (only ever used for empty buffers that the NIC never touches).
    let len = len.max(1);
    // SAFETY: forwarded from the caller.
    unsafe { pd.reg_mr(ptr as usize, len, access()) }.map_err(|e| {
        VerbsError::os(
            "ibv_reg_mr",
            format!("memory registration of {len} bytes failed (is RLIMIT_MEMLOCK high enough?)"),
            &e,
        )
    })
}

/// Registers memory this crate borrows (an application's send buffer), for RDMA writes
/// reading it. The registration may outlive the borrow (the registration cache keeps it):
/// it pins the pages it covers, so it never reaches other memory, and nothing reads through
/// it but the writes of a send that borrows the bytes again ([`super::verbs::Gather`]); its
/// remote key is never given to a peer.
pub(crate) fn register_borrowed(
    pd: &Arc<ProtectionDomain>,
    bytes: &[u8],
) -> Result<Arc<MemoryRegion>, VerbsError> {
    // SAFETY: `bytes` is allocated now; later the registration is used only as stated above.
    unsafe { register(pd, bytes.as_ptr(), bytes.len()) }
}

/// `len` zeroed bytes registered with `pd`, as a [`RegisteredBuf`] keyed by `key(lkey)`: the
/// buffer owns both and drops the registration first.
pub(crate) fn alloc_registered(
    pd: &Arc<ProtectionDomain>,
    len: usize,
    key: impl FnOnce(u32) -> RegionKey,
) -> Result<RegisteredBuf, VerbsError> {
    let mut data = vec![0u8; len].into_boxed_slice();
    // SAFETY: the registration is stored in the RegisteredBuf next to the memory and is
    // dropped before it (RegisteredBuf's Drop); its remote key is never given to a peer.
    let mr = unsafe { register(pd, data.as_mut_ptr(), len) }?;
    let key = key(mr.lkey());
    Ok(RegisteredBuf::with_registration(data, key, mr))
}

/// Heap memory, freed when dropped; raw, so that the NIC's and the CPU's accesses through its
/// address need no Rust reference to it.
struct Memory {
    ptr: NonNull<u8>,
    len: usize,
}

impl Memory {
    fn zeroed(len: usize) -> Memory {
        let boxed = vec![0u8; len].into_boxed_slice();
        let len = boxed.len();
        let ptr = NonNull::new(Box::into_raw(boxed).cast::<u8>()).expect("a box is not null");
        Memory { ptr, len }
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `len` came from `Box::into_raw` of a `Box<[u8]>` in `zeroed`, and
        // the memory is freed only here, once.
        drop(unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            ))
        });
    }
}

/// Heap memory and its registration, dropped in that order (registration first).
pub struct Region {
    mr: Arc<MemoryRegion>,
    len: usize,
    memory: Memory,
}

// SAFETY: the region owns its memory; the pointer is only its address, and every access
// through it is one of this module's, under the rules stated at each.
unsafe impl Send for Region {}
// SAFETY: as above; shared access only reads, and only where nothing writes (see `bytes`).
unsafe impl Sync for Region {}

impl Region {
    /// `len` zeroed bytes, registered.
    pub fn new(pd: &Arc<ProtectionDomain>, len: usize) -> Result<Region, VerbsError> {
        let memory = Memory::zeroed(len.max(1));
        // SAFETY: the memory is owned by the region and freed after the registration is
        // dropped (field order).
        let mr = unsafe { register(pd, memory.ptr.as_ptr(), len)? };
        Ok(Region { mr, len, memory })
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.memory.ptr.as_ptr() as u64
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
    /// Nothing writes these bytes while the slice lives: no work request of this side uses
    /// them, and no peer writes them any more.
    unsafe fn bytes(&self, at: usize, len: usize) -> &[u8] {
        assert!(at + len <= self.len, "region range out of bounds");
        // SAFETY: in bounds (checked); the caller guarantees that nothing writes meanwhile.
        unsafe { std::slice::from_raw_parts(self.memory.ptr.as_ptr().add(at), len) }
    }

    /// The bytes `[at, at + len)`, for writing.
    ///
    /// # Safety
    /// The caller has the range to itself while the slice lives: no work request uses it and
    /// no other slice of it exists.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self, at: usize, len: usize) -> &mut [u8] {
        assert!(at + len <= self.len, "region range out of bounds");
        // SAFETY: in bounds (checked); exclusivity is the caller's guarantee.
        unsafe { std::slice::from_raw_parts_mut(self.memory.ptr.as_ptr().add(at), len) }
    }
}

/// The CPU's right to one idle buffer of a [`Slab`]: no work request uses the buffer. Not
/// `Clone`; made only by [`Slab::new`] (one per buffer) and by [`Slab::completed`].
#[derive(Debug)]
pub(crate) struct Slot {
    slab: u64,
    index: u32,
}

/// Tells slabs apart, so that a slot is never used with another slab's buffers.
static NEXT_SLAB: AtomicU64 = AtomicU64::new(1);

/// One registration split into fixed-size buffers for one kind of work request of one link:
/// a link's receive buffers, or its send buffers (never one registration per small buffer).
pub(crate) struct Slab {
    region: Arc<Region>,
    id: u64,
    link: u32,
    kind: WrKind,
    slot_size: usize,
    /// Per buffer: lent to a work request (its slot is with the NIC).
    lent: Box<[AtomicBool]>,
}

impl Slab {
    /// `slots` buffers of `slot_size` bytes for `kind` work requests of link `link`, and the
    /// slot of each (all idle), in buffer order.
    pub(crate) fn new(
        pd: &Arc<ProtectionDomain>,
        slots: u32,
        slot_size: usize,
        link: u32,
        kind: WrKind,
    ) -> Result<(Slab, Vec<Slot>), VerbsError> {
        let region = Arc::new(Region::new(pd, slots as usize * slot_size)?);
        let id = NEXT_SLAB.fetch_add(1, Ordering::Relaxed);
        let slab = Slab {
            region,
            id,
            link,
            kind,
            slot_size,
            lent: (0..slots).map(|_| AtomicBool::new(false)).collect(),
        };
        let free = (0..slots).map(|index| Slot { slab: id, index }).collect();
        Ok((slab, free))
    }

    /// Bytes per buffer.
    pub(crate) fn slot_size(&self) -> usize {
        self.slot_size
    }

    /// The link whose work requests use the buffers.
    pub(super) fn link(&self) -> u32 {
        self.link
    }

    /// The kind of work request that uses the buffers.
    pub(super) fn kind(&self) -> WrKind {
        self.kind
    }

    /// The registration and memory of every buffer.
    pub(super) fn region(&self) -> &Arc<Region> {
        &self.region
    }

    fn offset(&self, slot: &Slot) -> usize {
        assert_eq!(slot.slab, self.id, "a slot of another slab");
        slot.index as usize * self.slot_size
    }

    /// The first `len` bytes (at most a buffer) of `slot`'s buffer, for reading what a
    /// receive left there.
    pub(crate) fn read<'a>(&'a self, slot: &'a Slot, len: usize) -> &'a [u8] {
        let at = self.offset(slot);
        let len = len.min(self.slot_size);
        // SAFETY: the slot is idle (no work request writes its buffer) and cannot be posted
        // while this slice borrows it; no peer writes receive buffers but through receives.
        unsafe { self.region.bytes(at, len) }
    }

    /// `slot`'s whole buffer, for filling before a send.
    pub(crate) fn fill<'a>(&'a self, slot: &'a mut Slot) -> &'a mut [u8] {
        let at = self.offset(slot);
        // SAFETY: the slot is idle and unique to its buffer, and this slice borrows it
        // exclusively: no work request and no other slice reaches the buffer meanwhile.
        unsafe { self.region.bytes_mut(at, self.slot_size) }
    }

    /// Lends `slot`'s buffer to a work request about to be posted: its address, key and
    /// index.
    pub(super) fn lend(&self, slot: Slot) -> (u64, u32, u32) {
        let at = self.offset(&slot);
        let was_lent = self.lent[slot.index as usize].swap(true, Ordering::AcqRel);
        assert!(!was_lent, "an idle slot's buffer is not lent");
        (
            self.region.addr() + at as u64,
            self.region.lkey(),
            slot.index,
        )
    }

    /// Takes back buffer `index`, lent to a work request that could not be posted.
    pub(super) fn unlend(&self, index: u32) -> Slot {
        let was_lent = self.lent[index as usize].swap(false, Ordering::AcqRel);
        assert!(was_lent, "only a lent buffer comes back");
        Slot {
            slab: self.id,
            index,
        }
    }

    /// The slot whose work request `wc` completed (successfully or not), if it is one of this
    /// slab's: the NIC is done with its buffer.
    pub(crate) fn completed(&self, wc: &WorkCompletion) -> Option<Slot> {
        let (link, kind, index) = split_wr_id(wc.wr_id());
        if link != self.link || kind != Some(self.kind) {
            return None;
        }
        let lent = self.lent.get(index as usize)?;
        lent.swap(false, Ordering::AcqRel).then_some(Slot {
            slab: self.id,
            index,
        })
    }
}

/// Where a region handed to the application goes back when its last `Bytes` is dropped.
pub(crate) trait Reclaim: Send + Sync {
    /// Takes `region` back.
    fn reclaim(&self, region: Region);
}

/// Hands the first `len` bytes of `region` to the application; the region goes back to
/// `home` (if it still exists) when the last clone of the returned `Bytes` is dropped.
///
/// The region is one that a peer wrote by RDMA (a rendezvous buffer, an offered one): this
/// is where sys trusts the protocol, which only calls it once that write is placed (its
/// immediate arrived, or the direct message that follows it on the same queue pair) and
/// offers the region to no one until `home` has it back. A peer that writes a buffer again
/// anyway, with a key it was given, changes bytes the application holds: no local check
/// can stop a remote writer holding a valid key.
pub(crate) fn into_bytes(region: Region, len: usize, home: Weak<dyn Reclaim>) -> Bytes {
    assert!(len <= region.len());
    Bytes::from_owner(Lent {
        region: Some(region),
        home,
    })
    .slice(..len)
}

struct Lent {
    region: Option<Region>,
    home: Weak<dyn Reclaim>,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        let region = self.region.as_ref().expect("region until drop");
        // SAFETY: `into_bytes`' contract: the peer's write was placed before the region was
        // wrapped, no work request of this side uses it, and it is offered to no one until
        // this owner is dropped.
        unsafe { region.bytes(0, region.len()) }
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let (Some(region), Some(home)) = (self.region.take(), self.home.upgrade()) {
            home.reclaim(region);
        }
    }
}

/// Registered memory that a peer writes by RDMA while it is lent to it, and the CPU reads and
/// writes only while it is not: the memory behind a host landing (a received segment the
/// NIC writes straight into memory the receiver keeps).
pub struct LandingMemory {
    region: Region,
    /// Whether a peer was given the memory for a write that has not landed yet. CPU accesses
    /// hold this lock, so lending waits for one under way and none starts while lent.
    lent: std::sync::Mutex<bool>,
}

impl LandingMemory {
    /// `len` zeroed bytes, registered with `pd` for remote writes.
    pub fn new(pd: &Arc<ProtectionDomain>, len: usize) -> Result<LandingMemory, VerbsError> {
        Ok(LandingMemory {
            region: Region::new(pd, len)?,
            lent: std::sync::Mutex::new(false),
        })
    }

    /// The first byte's address, as the NIC names it.
    pub fn addr(&self) -> u64 {
        self.region.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.len()
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.region.lkey()
    }

    /// Remote key, given to a peer with the memory.
    pub fn rkey(&self) -> u32 {
        self.region.rkey()
    }

    fn lent(&self) -> std::sync::MutexGuard<'_, bool> {
        self.lent.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lends the memory to one peer's write; false if it is lent already, or if the CPU is
    /// reading or writing it right now (lending runs on the completion poller, which must
    /// not wait for a copy).
    pub fn lend(&self) -> bool {
        let mut lent = match self.lent.try_lock() {
            Ok(lent) => lent,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        !std::mem::replace(&mut *lent, true)
    }

    /// Takes the memory back: the write landed, or the receive ended without it (its link
    /// failed: the queue pair, moved to error first, accepts no more writes).
    pub fn take_back(&self) {
        *self.lent() = false;
    }

    /// Copies bytes `at..at + out.len()` into `out`; false while lent or out of range.
    pub fn read(&self, at: usize, out: &mut [u8]) -> bool {
        let lent = self.lent();
        if *lent || at.checked_add(out.len()).is_none_or(|end| end > self.len()) {
            return false;
        }
        // SAFETY: in range (checked); not lent, so no write of a peer is expected, and CPU
        // accesses are serialised by the lock held here. A peer that writes with a key it
        // was given earlier anyway changes the bytes read (see `into_bytes`).
        out.copy_from_slice(unsafe { self.region.bytes(at, out.len()) });
        true
    }

    /// Copies `src` into bytes `at..at + src.len()`; false while lent or out of range.
    pub fn write(&self, at: usize, src: &[u8]) -> bool {
        let lent = self.lent();
        if *lent || at.checked_add(src.len()).is_none_or(|end| end > self.len()) {
            return false;
        }
        // SAFETY: in range (checked); the lock held here makes this the only CPU access, and
        // the memory is not lent, so no work request of this side uses it.
        unsafe { self.region.bytes_mut(at, src.len()) }.copy_from_slice(src);
        true
    }
}
