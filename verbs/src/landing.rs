//! Zero-copy receive: a segment the receiver places (`Transport::set_placer`) is written by the
//! peer's NIC straight into memory registered with this transport's NIC, instead of landing in
//! a pooled host buffer and being copied there.
//!
//! When a request-to-send arrives with its metadata, the link asks the placer where the
//! message goes ([`Landings::decide`]). If the answer's destination reports a NIC registration
//! ([`DeviceDest::nic`]) that this transport made itself, that still lives, and that covers the
//! destination, the clear-to-send names that memory for the segment's bytes and the pooled
//! buffer for the rest ([`crate::proto::wire::PlacedCts`]). Once the write lands, the memory is
//! made visible to its readers (a GPU flushes GPUDirect writes) and the message is delivered
//! with the segment empty and [`psnet_transport::Incoming::placed`] set.
//!
//! A registration is trusted only from the transport's own table ([`NicTarget`]s added by
//! [`crate::VerbsTransport::host_landing`] and, feature `cuda`, `accept_writes`): a
//! destination is a safe trait object, and a wrong key or address from it must never let a
//! peer write into another registration (the receive pools, the eager buffers). Every other
//! answer is kept and carried out by copying once the message has landed, so the placer is
//! asked once per message either way ([`Asked`]).
//!
//! Messages written into a buffer offered in advance skip the request-to-send: one the NIC
//! could have written in place is copied in, and its size is not offered again, so the next
//! one of that size asks. A placed rendezvous asks for no offer of its size either, so a
//! stream of placed messages keeps taking this path.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use psnet_transport::device::{DeviceError, NicRegion, StagingBuf};
use psnet_transport::placement::ReceivePlacing;
use psnet_transport::{DeviceDest, Incoming, NodeId, Placement, RegionKey};

use crate::error::VerbsError;
use crate::sys::memory::LandingMemory;

/// Memory registered with this transport's NIC that a peer may write a placed segment into.
pub(crate) trait NicTarget: Send + Sync {
    /// The first byte's address as the NIC names it, and the length.
    fn span(&self) -> (u64, usize);

    /// The remote key a peer writes with.
    fn rkey(&self) -> u32;

    /// Claims the memory for one peer's write; false if it cannot take one now.
    fn claim(&self) -> bool {
        true
    }

    /// Ends a claim: the write landed, or the receive ended without it.
    fn release(&self) {}

    /// Called once a peer's write into the memory has landed, before the message is
    /// delivered: makes the write visible to the memory's readers (GPU kernels).
    fn landed(&self) -> Result<(), String>;
}

/// Whether the placer was asked about a message before its data arrived, and what it said.
pub(crate) enum Asked {
    /// Not asked: `recv` asks when the message arrives.
    No,
    /// Asked; `Some` is a placement to carry out by copying, the message having landed in
    /// host memory.
    Answered(Option<Placement>),
}

/// A message ready for delivery, and what the placer said about it.
pub(crate) struct Arrival {
    /// The message.
    pub msg: Incoming,
    /// The placer's early answer.
    pub asked: Asked,
}

impl Arrival {
    /// A message the placer was not asked about.
    pub fn plain(msg: Incoming) -> Self {
        Arrival {
            msg,
            asked: Asked::No,
        }
    }
}

/// A placement the NIC carries out: what the clear-to-send names, held until the write lands.
pub(crate) struct NicPlacement {
    /// The segment's index in the message.
    pub segment: usize,
    /// Its length in bytes.
    pub len: u64,
    /// Where the peer writes it, and with which key.
    pub addr: u64,
    pub rkey: u32,
    /// The destination, kept alive until the write lands.
    pub dest: Arc<dyn DeviceDest>,
    claim: Claim,
}

impl NicPlacement {
    /// The placer's answer this carries out, to carry out by copying instead.
    pub fn placement(&self) -> Placement {
        Placement {
            segment: self.segment,
            dest: self.dest.clone(),
        }
    }

    /// Makes the landed write visible to the memory's readers.
    pub fn landed(&self) -> Result<(), DeviceError> {
        let target =
            self.claim.target.upgrade().ok_or_else(|| {
                "the memory was dropped before the write into it landed".to_string()
            });
        target
            .and_then(|t| t.landed())
            .map_err(|reason| DeviceError {
                ordinal: self.dest.ordinal(),
                reason,
            })
    }
}

/// A claimed target, released when the receive ends however it ends. Held weakly: the
/// transport never keeps memory registered (nor, for a GPU region, the promise that its
/// memory is allocated) past its owner's last reference. Memory dropped while a peer's write
/// is on its way is deregistered first, so that write fails (and its link with it) instead of
/// landing.
struct Claim {
    target: Weak<dyn NicTarget>,
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Some(target) = self.target.upgrade() {
            target.release();
        }
    }
}

/// What the link does with an arriving large message.
pub(crate) enum Decision {
    /// The placer was not asked (nothing of this transport can take a NIC's write).
    NotAsked,
    /// Asked; no NIC placement: carry out this answer (if any) by copying.
    Copy(Option<Placement>),
    /// The NIC writes the segment.
    Nic(NicPlacement),
}

/// The placer, and the memory this transport registered for peers' writes.
pub(crate) struct Landings {
    /// The placer and what `recv` needs to place by copying.
    pub placing: ReceivePlacing,
    tag: u32,
    targets: Mutex<HashMap<u32, Weak<dyn NicTarget>>>,
}

impl Landings {
    /// For a transport whose registration keys carry `tag`.
    pub fn new(placing: ReceivePlacing, tag: u32) -> Self {
        Landings {
            placing,
            tag,
            targets: Mutex::new(HashMap::new()),
        }
    }

    /// The tag in this transport's registration keys.
    pub fn tag(&self) -> u32 {
        self.tag
    }

    fn targets(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Weak<dyn NicTarget>>> {
        self.targets.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Accepts peers' writes into `target`, registered under `lkey`: the key that destinations
    /// naming it carry ([`Landings::key`]).
    pub fn accept(&self, lkey: u32, target: Weak<dyn NicTarget>) -> NicRegion {
        let mut targets = self.targets();
        targets.retain(|_, t| t.strong_count() > 0);
        let addr = target.upgrade().map_or(0, |t| t.span().0);
        targets.insert(lkey, target);
        NicRegion {
            key: self.key(lkey),
            addr,
        }
    }

    /// The registration key of local key `lkey` in this transport.
    pub fn key(&self, lkey: u32) -> RegionKey {
        RegionKey((u64::from(self.tag) << 32) | u64::from(lkey))
    }

    /// Asks the placer, if anything of this transport can take a NIC's write, where the
    /// message from `peer` with `meta` and segments of `seg_lens` goes.
    pub fn decide(&self, peer: NodeId, meta: &[u8], seg_lens: &[u64]) -> Decision {
        if self.targets().is_empty() {
            return Decision::NotAsked;
        }
        let Some(placer) = self.placing.placer() else {
            return Decision::NotAsked;
        };
        // The placer and its destinations are the application's code, run here on the
        // completion poller: a panic in them must not stop every link's progress.
        let asked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let p = placer.place(peer, meta, seg_lens)?;
            Some(match self.resolve(&p, seg_lens) {
                Some(nic) => Decision::Nic(nic),
                None => Decision::Copy(Some(p)),
            })
        }));
        match asked {
            Ok(Some(decision)) => decision,
            Ok(None) => Decision::Copy(None),
            Err(_) => {
                tracing::error!(%peer, "the placer (or its destination) panicked; the message \
                    stays in host memory");
                Decision::Copy(None)
            }
        }
    }

    /// The NIC placement of `p`, if its destination is memory of this transport's table that
    /// still lives, covers it, and can take a write now.
    fn resolve(&self, p: &Placement, seg_lens: &[u64]) -> Option<NicPlacement> {
        // The destination's length is asked once: a trait object may answer differently
        // each time, and the segment's length from the request is what the writes use.
        let len = *seg_lens.get(p.segment)?;
        if len == 0 || p.dest.len() as u64 != len {
            return None;
        }
        let nic = p.dest.nic()?;
        if (nic.key.0 >> 32) as u32 != self.tag {
            return None;
        }
        let target = self.targets().get(&(nic.key.0 as u32))?.upgrade()?;
        let (start, size) = target.span();
        let within = nic
            .addr
            .checked_sub(start)
            .and_then(|off| off.checked_add(len))
            .is_some_and(|end| end <= size as u64);
        if !within || !target.claim() {
            return None;
        }
        Some(NicPlacement {
            segment: p.segment,
            len,
            addr: nic.addr,
            rkey: target.rkey(),
            dest: p.dest.clone(),
            claim: Claim {
                target: Arc::downgrade(&target),
            },
        })
    }
}

/// Host memory registered with this transport's NIC that a placed segment is written into by
/// the peer's NIC with no copy ([`crate::VerbsTransport::host_landing`]): for a receiver that
/// wants a large segment in a buffer of its own. It is a [`DeviceDest`] of ordinal
/// [`HostLanding::ORDINAL`]; where a transport cannot let its NIC write it, the segment is
/// copied in. Its bytes can be read and written only while no peer's write is on its way.
pub struct HostLanding {
    memory: LandingMemory,
    region: NicRegion,
}

impl std::fmt::Debug for HostLanding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostLanding")
            .field("len", &self.memory.len())
            .field("addr", &format_args!("{:#x}", self.memory.addr()))
            .finish()
    }
}

impl HostLanding {
    /// The ordinal a host landing reports: no device.
    pub const ORDINAL: u32 = u32::MAX;

    /// Registers `len` zeroed bytes with `landings`' NIC (through `pd`) and accepts writes
    /// into them.
    pub(crate) fn new(
        pd: &Arc<sideway::ibverbs::protection_domain::ProtectionDomain>,
        len: usize,
        landings: &Landings,
    ) -> Result<Arc<HostLanding>, VerbsError> {
        let memory = LandingMemory::new(pd, len)?;
        let lkey = memory.lkey();
        let region = NicRegion {
            key: landings.key(lkey),
            addr: memory.addr(),
        };
        let landing = Arc::new(HostLanding { memory, region });
        let weak: Weak<dyn NicTarget> = Arc::downgrade(&landing) as Weak<HostLanding>;
        landings.accept(lkey, weak);
        Ok(landing)
    }

    /// A copy of the bytes; None while a peer's write into them is on its way.
    pub fn to_vec(&self) -> Option<Vec<u8>> {
        let mut out = vec![0; self.memory.len()];
        self.memory.read(0, &mut out).then_some(out)
    }

    /// Writes `src` at byte `at`; false while a peer's write is on its way, or out of range.
    pub fn write(&self, at: usize, src: &[u8]) -> bool {
        self.memory.write(at, src)
    }
}

impl NicTarget for HostLanding {
    fn span(&self) -> (u64, usize) {
        (self.memory.addr(), self.memory.len())
    }

    fn rkey(&self) -> u32 {
        self.memory.rkey()
    }

    fn claim(&self) -> bool {
        self.memory.lend()
    }

    fn release(&self) {
        self.memory.take_back();
    }

    fn landed(&self) -> Result<(), String> {
        // The CPU sees the NIC's writes once the write-with-immediate has completed.
        Ok(())
    }
}

impl DeviceDest for HostLanding {
    fn len(&self) -> usize {
        self.memory.len()
    }

    fn ordinal(&self) -> u32 {
        Self::ORDINAL
    }

    fn nic(&self) -> Option<NicRegion> {
        Some(self.region)
    }

    fn staging(&self, len: usize) -> Result<StagingBuf, DeviceError> {
        Ok(Box::new(vec![0u8; len]))
    }

    fn copy_from_host(
        &self,
        offset: usize,
        len: usize,
        buf: StagingBuf,
    ) -> psnet_transport::device::CopyFuture<'_> {
        Box::pin(async move {
            let written = buf
                .get(..len)
                .is_some_and(|src| self.memory.write(offset, src));
            if written {
                Ok(buf)
            } else {
                Err(DeviceError {
                    ordinal: Self::ORDINAL,
                    reason: format!(
                        "host landing of {} bytes: cannot write {len} bytes at {offset} (out of \
                         range, or a peer's write is on its way)",
                        self.memory.len()
                    ),
                })
            }
        })
    }
}

/// GPU memory registered with the NIC on a direct path (dma-buf or nvidia-peermem): a peer's
/// NIC writes it in place, and the write is flushed to the GPU before the message is
/// delivered.
#[cfg(feature = "cuda")]
impl NicTarget for crate::gpu::GpuRegion {
    fn span(&self) -> (u64, usize) {
        (self.addr(), self.len())
    }

    fn rkey(&self) -> u32 {
        crate::gpu::GpuRegion::rkey(self)
    }

    fn landed(&self) -> Result<(), String> {
        self.flush_nic_writes().map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests;
