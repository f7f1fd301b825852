//! Received pieces of calls on the device, placed in device memory by the transport as they
//! arrive (see `psnet_transport::placement`; with feature `cuda`, in a `CudaLanding`).
//!
//! A call that reduces on the device arms itself here before it runs, with the pieces its
//! plan receives (sender, tag, length): from then on, each of those pieces that arrives gets
//! device memory of its length from the call's [`LandingSource`], once, which the transport fills
//! chunk by chunk from its staging buffers (over TCP, chunk k crosses PCIe while chunk k+1 is
//! read off the socket). The call's reduction then reads the piece from there: no copy of
//! the whole piece waits until the piece has fully arrived. Pieces that arrived before the
//! call was armed, or over a transport that does not place, come as host bytes and are
//! copied in by the reducer as before.
//!
//! One [`Placing`] serves a transport and every communicator split from the one that
//! formed on it: calls are told apart by communicator and call number.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use psnet_transport::{DeviceDest, NodeId, Placement, Placer, Transport};

use crate::wire::{Header, Kind};

/// Device memory to place pieces in, by length.
pub(crate) trait LandingSource: Send + Sync + 'static {
    /// What it hands out.
    type Landing: DeviceDest + 'static;

    /// `len` bytes of device memory; an error (logged, the piece then comes as host bytes)
    /// where there are none to be had.
    fn take(&self, len: usize) -> Result<Arc<Self::Landing>, String>;
}

/// Armed calls by communicator and call number.
type Calls<S> = HashMap<(u32, u64), Arc<CallLandings<S>>>;
/// Pieces a call expects, by sender and tag: their lengths in bytes.
pub(crate) type Expected = HashMap<(NodeId, u64), usize>;
/// Placed pieces by sender and tag; None once the piece was taken (it is not placed again).
type Landed<L> = HashMap<(NodeId, u64), Option<Arc<L>>>;

/// The calls armed on one transport, and whether it places at all: the transport's
/// [`Placer`].
pub(crate) struct Placing<S: LandingSource> {
    /// Set once this transport was asked to place: whether it does.
    installed: OnceLock<bool>,
    /// Armed calls by communicator and call number.
    calls: Mutex<Calls<S>>,
}

impl<S: LandingSource> Default for Placing<S> {
    fn default() -> Self {
        Placing {
            installed: OnceLock::new(),
            calls: Mutex::default(),
        }
    }
}

/// One armed call's device memory: where its pieces are placed, by sender and tag.
pub(crate) struct CallLandings<S: LandingSource> {
    source: Arc<S>,
    /// The pieces the call's plan receives; only these are placed, each once, so a peer
    /// cannot make this side allocate device memory the call does not need.
    expected: Expected,
    placed: Mutex<Landed<S::Landing>>,
}

impl<S: LandingSource> CallLandings<S> {
    /// The landing the piece from `from` with `tag` was placed in, taken (each is read once).
    pub(crate) fn take(&self, from: NodeId, tag: u64) -> Option<Arc<S::Landing>> {
        lock(&self.placed)
            .get_mut(&(from, tag))
            .and_then(Option::take)
    }
}

/// Disarms its call when dropped: pieces arriving later go to host memory (and are late).
pub(crate) struct Armed<S: LandingSource> {
    placer: Arc<Placing<S>>,
    key: (u32, u64),
    pub(crate) call: Arc<CallLandings<S>>,
}

impl<S: LandingSource> Drop for Armed<S> {
    fn drop(&mut self) {
        lock(&self.placer.calls).remove(&self.key);
    }
}

impl<S: LandingSource> Placing<S> {
    /// Arms call `seq` of communicator `comm` to have its pieces placed in `source`'s
    /// memory; None where `transport` does not place (the pieces then come as host bytes).
    /// The first call installs the placer on the transport.
    pub(crate) fn arm<T: Transport>(
        self: &Arc<Self>,
        transport: &T,
        comm: u32,
        seq: u64,
        source: Arc<S>,
        expected: Expected,
    ) -> Option<Armed<S>> {
        let places = *self
            .installed
            .get_or_init(|| transport.set_placer(self.clone()));
        if !places {
            return None;
        }
        let call = Arc::new(CallLandings {
            source,
            expected,
            placed: Mutex::default(),
        });
        lock(&self.calls).insert((comm, seq), call.clone());
        Some(Armed {
            placer: self.clone(),
            key: (comm, seq),
            call,
        })
    }
}

impl<S: LandingSource> Placer for Placing<S> {
    fn place(&self, peer: NodeId, meta: &[u8], seg_lens: &[u64]) -> Option<Placement> {
        let header = Header::decode(meta).ok()?;
        let &[len] = seg_lens else {
            return None;
        };
        if header.kind != Kind::Data || len == 0 {
            return None;
        }
        let call = lock(&self.calls).get(&(header.comm, header.seq))?.clone();
        let key = (peer, header.tag);
        // Not a piece of the plan, or not of its length: host bytes, which the plan refuses
        // with the reason.
        let len = usize::try_from(len).ok()?;
        if call.expected.get(&key) != Some(&len) {
            return None;
        }
        let mut placed = lock(&call.placed);
        // The same piece twice: the second comes as host bytes (and the plan refuses it); the
        // first keeps its landing.
        let std::collections::hash_map::Entry::Vacant(slot) = placed.entry(key) else {
            return None;
        };
        // No device memory to be had: the piece comes as host bytes instead.
        let landing = match call.source.take(len) {
            Ok(landing) => landing,
            Err(e) => {
                tracing::debug!(error = %e, "no device memory to place a received piece in");
                return None;
            }
        };
        slot.insert(Some(landing.clone()));
        Some(Placement {
            segment: 0,
            dest: landing,
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests;
