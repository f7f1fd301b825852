use std::net::SocketAddr;

use bytes::Bytes;
use smallvec::SmallVec;

use crate::device::DeviceBytes;
use crate::memory::{RegionKey, RegisteredBuf};
use crate::node::NodeId;
use crate::placement::Placed;

/// One data segment of an outgoing message, borrowed from the caller until the send completes:
/// host bytes, or device memory (see [`crate::device`]) that the transport sends zero-copy or
/// stages through host buffers. The receiver gets host bytes either way, unless it places the
/// segment in device memory as it arrives ([`crate::placement`]).
#[derive(Clone, Copy, Debug)]
pub struct Segment<'a> {
    data: Data<'a>,
    region: Option<RegionKey>,
}

#[derive(Clone, Copy, Debug)]
enum Data<'a> {
    Host(&'a [u8]),
    Device(&'a dyn DeviceBytes),
}

impl<'a> Segment<'a> {
    /// A segment of plain memory.
    pub fn new(bytes: &'a [u8]) -> Self {
        Segment {
            data: Data::Host(bytes),
            region: None,
        }
    }

    /// A segment inside a registered buffer (zero-copy on RDMA).
    pub fn registered(buf: &'a RegisteredBuf, range: std::ops::Range<usize>) -> Self {
        Segment {
            data: Data::Host(&buf[range]),
            region: buf.is_registered().then(|| buf.key()),
        }
    }

    /// A segment of device memory.
    pub fn device(region: &'a dyn DeviceBytes) -> Self {
        Segment {
            data: Data::Device(region),
            region: region.nic().map(|n| n.key),
        }
    }

    /// The host bytes to send; None for device memory.
    pub fn host(&self) -> Option<&'a [u8]> {
        match self.data {
            Data::Host(bytes) => Some(bytes),
            Data::Device(_) => None,
        }
    }

    /// The device memory to send; None for host bytes.
    pub fn device_bytes(&self) -> Option<&'a dyn DeviceBytes> {
        match self.data {
            Data::Host(_) => None,
            Data::Device(region) => Some(region),
        }
    }

    /// The registration covering the bytes, if any (for device memory: its NIC registration).
    pub fn region(&self) -> Option<RegionKey> {
        self.region
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self.data {
            Data::Host(bytes) => bytes.len(),
            Data::Device(region) => region.len(),
        }
    }

    /// Whether the segment is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<'a> From<&'a [u8]> for Segment<'a> {
    fn from(bytes: &'a [u8]) -> Self {
        Segment::new(bytes)
    }
}

impl<'a> From<&'a Bytes> for Segment<'a> {
    fn from(bytes: &'a Bytes) -> Self {
        Segment::new(bytes)
    }
}

impl<'a> From<&'a Vec<u8>> for Segment<'a> {
    fn from(bytes: &'a Vec<u8>) -> Self {
        Segment::new(bytes)
    }
}

/// An outgoing message: a small metadata block (the kv store's command, keys' layout, ...)
/// and data segments, all borrowed until the send completes.
#[derive(Clone, Copy, Debug)]
pub struct OutMessage<'a> {
    /// Metadata, at most [`crate::Capabilities::max_meta`] bytes.
    pub meta: &'a [u8],
    /// Data segments, at most [`crate::Capabilities::max_segments`]; empty segments are allowed
    /// and arrive as empty segments.
    pub segments: &'a [Segment<'a>],
    /// Carries a secret (a credential): a transport with a session seals it (encrypted and
    /// tagged) even where data frames are only tagged (`PSNET_ENCRYPT` off). See
    /// [`Self::confidential`].
    pub confidential: bool,
}

impl<'a> OutMessage<'a> {
    /// A message of metadata and segments.
    pub fn new(meta: &'a [u8], segments: &'a [Segment<'a>]) -> Self {
        OutMessage {
            meta,
            segments,
            confidential: false,
        }
    }

    /// The message carries a secret: over TCP with a job secret its frame is sealed whatever
    /// `PSNET_ENCRYPT` says. Without a job secret there is no session key and it goes in
    /// clear, as everything does in an open job; the same-host paths have no network path to
    /// be on; RDMA's queue pairs carry no session (RELIABILITY.md).
    pub fn confidential(mut self) -> Self {
        self.confidential = true;
        self
    }

    /// Metadata plus all segments, in bytes.
    pub fn total_len(&self) -> u64 {
        self.meta.len() as u64 + self.segments.iter().map(|s| s.len() as u64).sum::<u64>()
    }

    /// Whether a segment is device memory.
    pub fn has_device(&self) -> bool {
        self.segments.iter().any(|s| s.device_bytes().is_some())
    }
}

/// A received message. Segments are views into the transport's receive buffer (no copy on TCP).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Incoming {
    /// The sender.
    pub peer: NodeId,
    /// The metadata block.
    pub meta: Bytes,
    /// The data segments, in the order they were sent. A segment written into device memory
    /// (see [`placed`](Self::placed)) is empty here.
    pub segments: SmallVec<[Bytes; 4]>,
    /// The segment a [`Placer`](crate::Placer) put into device memory, and how that went;
    /// None when every segment is in host memory.
    pub placed: Option<Placed>,
}

/// What [`crate::Transport::recv`] hands out.
#[derive(Debug)]
pub enum Event {
    /// A message from a peer. Messages from one peer arrive in the order they were sent.
    Message(Incoming),
    /// A connection with `peer` was established (by either side).
    PeerConnected {
        /// The peer.
        peer: NodeId,
        /// Its address as seen from here.
        addr: SocketAddr,
    },
    /// The connection with `peer` ended; sends to it fail until it is connected again.
    PeerLost {
        /// The peer.
        peer: NodeId,
        /// Why, for the log and the user.
        reason: String,
    },
}
