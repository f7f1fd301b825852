//! Messages with device (GPU) segments. A segment registered with this link's NIC
//! (GPUDirect: dma-buf or nvidia-peermem) is read by the NIC in place, through the rendezvous
//! path; any other device segment, and every one in a message small enough to go eager, is
//! copied to the host first and sent as host bytes.

use psnet_transport::device::{copy_all, DevicePath};
use psnet_transport::{OutMessage, Segment, TransportError};
use smallvec::SmallVec;

use super::Link;
use crate::registrar::Registrar;

impl Link {
    /// Sends `msg`, which has device segments (see the module's documentation).
    pub(super) async fn send_with_device(
        &self,
        msg: OutMessage<'_>,
        header_len: usize,
        eager: bool,
        registrar: &Registrar,
    ) -> Result<(), TransportError> {
        let peer = self.peer;
        let mut copies: SmallVec<[Option<Vec<u8>>; 4]> = SmallVec::new();
        for seg in msg.segments {
            let Some(device) = seg.device_bytes() else {
                copies.push(None);
                continue;
            };
            let direct = !eager && direct_lkey(seg, registrar).is_some();
            let path = if direct {
                DevicePath::Direct
            } else {
                DevicePath::Copied
            };
            self.device_paths.note("rdma", peer, device.ordinal(), path);
            copies.push(if direct {
                None
            } else {
                let host = copy_all(device)
                    .await
                    .map_err(|source| TransportError::Device { peer, source })?;
                Some(host)
            });
        }
        let segments: SmallVec<[Segment<'_>; 4]> = msg
            .segments
            .iter()
            .zip(&copies)
            .map(|(seg, copy)| copy.as_deref().map_or(*seg, Segment::new))
            .collect();
        let msg = OutMessage::new(msg.meta, &segments);
        if eager {
            self.send_eager(msg, header_len).await
        } else {
            self.send_rendezvous(msg, header_len, registrar).await
        }
    }
}

/// The local key under which the NIC reads a device segment in place: the segment must be
/// registered with this transport's protection domain.
pub(super) fn direct_lkey(seg: &Segment<'_>, registrar: &Registrar) -> Option<u32> {
    seg.device_bytes()?.nic()?;
    registrar.own_lkey(seg.region()?)
}
