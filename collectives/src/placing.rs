//! Received pieces of calls on the device, placed in device memory by the transport as they
//! arrive (see `psnet_transport::placement`; with feature `cuda`, in a `CudaLanding`).
//!
//! A call that reduces on the device arms itself here before it runs: from then on, every
//! piece that arrives for it gets device memory of its length from the call's
//! [`LandingSource`], which the transport fills
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
/// Placed pieces by sender and tag.
type Landed<L> = HashMap<(NodeId, u64), Arc<L>>;

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
    placed: Mutex<Landed<S::Landing>>,
}

impl<S: LandingSource> CallLandings<S> {
    /// The landing the piece from `from` with `tag` was placed in, taken (each is read once).
    pub(crate) fn take(&self, from: NodeId, tag: u64) -> Option<Arc<S::Landing>> {
        lock(&self.placed).remove(&(from, tag))
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
    ) -> Option<Armed<S>> {
        let places = *self
            .installed
            .get_or_init(|| transport.set_placer(self.clone()));
        if !places {
            return None;
        }
        let call = Arc::new(CallLandings {
            source,
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
        // No device memory to be had: the piece comes as host bytes instead.
        let landing = match call.source.take(usize::try_from(len).ok()?) {
            Ok(landing) => landing,
            Err(e) => {
                tracing::debug!(error = %e, "no device memory to place a received piece in");
                return None;
            }
        };
        lock(&call.placed).insert((peer, header.tag), landing.clone());
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
