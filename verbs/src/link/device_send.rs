//! Messages with device (GPU) segments. A segment registered with this link's NIC
//! (GPUDirect: dma-buf or nvidia-peermem) is read by the NIC in place, through the rendezvous
//! path. Any other device segment of a large message is staged: copied out of the device in
//! chunks into a registered host buffer, each chunk written to the peer as soon as it has
//! landed, while the next one is copied (the request-to-send goes out after the first chunk,
//! so the round trip overlaps the copies too). In a message small enough to go eager, device
//! segments are copied to the host whole and sent as host bytes.

use psnet_transport::device::{copy_all, DeviceBytes, DevicePath, StagingBuf, DEFAULT_STAGE_CHUNK};
use psnet_transport::{DeviceError, OutMessage, Segment, TransportError};
use smallvec::SmallVec;

use super::rendezvous::Part;
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
        if !eager {
            return self.send_staged(msg, header_len, registrar).await;
        }
        let peer = self.peer;
        let mut copies: SmallVec<[Option<Vec<u8>>; 4]> = SmallVec::new();
        for seg in msg.segments {
            let Some(device) = seg.device_bytes() else {
                copies.push(None);
                continue;
            };
            self.device_paths
                .note("rdma", peer, device.ordinal(), DevicePath::Copied);
            let host = copy_all(device)
                .await
                .map_err(|source| TransportError::Device { peer, source })?;
            copies.push(Some(host));
        }
        let segments: SmallVec<[Segment<'_>; 4]> = msg
            .segments
            .iter()
            .zip(&copies)
            .map(|(seg, copy)| copy.as_deref().map_or(*seg, Segment::new))
            .collect();
        self.send_eager(OutMessage::new(msg.meta, &segments), header_len)
            .await
    }

    /// Sends large message `msg`: device segments the NIC reads in place as they are, the
    /// others staged (see the module's documentation). A region whose first chunk cannot be
    /// read fails the send with the link intact; a copy failing later fails the link (the
    /// peer waits for bytes that will not come).
    async fn send_staged(
        &self,
        msg: OutMessage<'_>,
        header_len: usize,
        registrar: &Registrar,
    ) -> Result<(), TransportError> {
        let peer = self.peer;
        let mut staged: SmallVec<[Option<Staging<'_>>; 4]> = SmallVec::new();
        for seg in msg.segments {
            let Some(device) = seg.device_bytes() else {
                staged.push(None);
                continue;
            };
            if direct_lkey(seg, registrar).is_some() {
                self.device_paths
                    .note("rdma", peer, device.ordinal(), DevicePath::Direct);
                staged.push(None);
                continue;
            }
            self.device_paths
                .note("rdma", peer, device.ordinal(), DevicePath::Staged);
            let mut staging = Staging::new(device, DEFAULT_STAGE_CHUNK);
            staging
                .copy_next()
                .await
                .map_err(|source| TransportError::Device { peer, source })?;
            staged.push(Some(staging));
        }
        let parts: SmallVec<[Part<'_>; 4]> = staged
            .iter()
            .map(|s| match s {
                Some(s) => Part::Staged {
                    host: &s.host,
                    chunk: s.chunk,
                },
                None => Part::Own,
            })
            .collect();
        let mut large = self.gather_parts(&msg, header_len, &parts, registrar)?;
        drop(parts);
        let starts: SmallVec<[usize; 4]> = (0..staged.len()).map(|i| large.start_of(i)).collect();
        let entries = large.entries();
        large.set_ready(in_place(&staged, &starts, entries));
        let started = self.start_large(&msg, header_len, large, false).await?;
        for i in 0..staged.len() {
            while let Some(staging) = staged[i].as_mut().filter(|s| !s.is_done()) {
                if let Err(source) = staging.copy_next().await {
                    self.fail(&format!(
                        "a staged send stopped half-way: copying GPU {} memory out failed: {}",
                        source.ordinal, source.reason
                    ));
                    drop(started);
                    return Err(TransportError::Device { peer, source });
                }
                self.large_ready(&started, in_place(&staged, &starts, entries));
            }
        }
        self.finish_large(started).await
    }
}

/// Gather entries in place: those before the first staged chunk not yet copied (`starts`:
/// the entry each segment starts at; a staged segment's entries are its chunks).
fn in_place(staged: &[Option<Staging<'_>>], starts: &[usize], entries: usize) -> usize {
    staged
        .iter()
        .zip(starts)
        .find_map(|(s, &start)| {
            s.as_ref()
                .filter(|s| !s.is_done())
                .map(|s| start + s.chunks_copied())
        })
        .unwrap_or(entries)
}

/// A device segment copied out into a host buffer (registered for the send), chunk by chunk,
/// through one staging buffer the region hands out (page-locked for CUDA).
struct Staging<'a> {
    src: &'a dyn DeviceBytes,
    host: Vec<u8>,
    chunk: usize,
    copied: usize,
    buf: Option<StagingBuf>,
}

impl<'a> Staging<'a> {
    fn new(src: &'a dyn DeviceBytes, chunk: usize) -> Self {
        Staging {
            src,
            host: vec![0; src.len()],
            chunk: chunk.max(1),
            copied: 0,
            buf: None,
        }
    }

    fn is_done(&self) -> bool {
        self.copied == self.host.len()
    }

    /// Chunks copied so far (the last may be shorter).
    fn chunks_copied(&self) -> usize {
        self.copied.div_ceil(self.chunk)
    }

    /// Copies the next chunk into the host buffer. The NIC may be reading the chunks before
    /// it meanwhile: they are never written again.
    async fn copy_next(&mut self) -> Result<(), DeviceError> {
        let n = self.chunk.min(self.host.len() - self.copied);
        if n == 0 {
            return Ok(());
        }
        let buf = match self.buf.take() {
            Some(buf) => buf,
            None => self.src.staging(self.chunk.min(self.host.len()))?,
        };
        let buf = self.src.copy_to_host(self.copied, n, buf).await?;
        self.host[self.copied..self.copied + n].copy_from_slice(&buf[..n]);
        self.copied += n;
        self.buf = Some(buf);
        Ok(())
    }
}

/// The local key under which the NIC reads a device segment in place: the segment must be
/// registered with this transport's protection domain.
pub(super) fn direct_lkey(seg: &Segment<'_>, registrar: &Registrar) -> Option<u32> {
    seg.device_bytes()?.nic()?;
    registrar.own_lkey(seg.region()?)
}
