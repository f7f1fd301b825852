//! A received piece's bytes as the driver hands them to a buffer: in host memory, or already
//! in device memory, where the transport placed them as they arrived (`placing.rs`).

use bytes::Bytes;
use psnet_transport::{DeviceError, NodeId};

/// A received piece's bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Payload {
    /// In host memory.
    Host(Bytes),
    /// In device memory the call armed for it, found by sender and tag; `result` says whether
    /// the transport's copies there succeeded.
    Placed {
        from: NodeId,
        tag: u64,
        len: usize,
        result: Result<(), DeviceError>,
    },
}

impl Payload {
    /// The piece's length in bytes.
    pub(crate) fn len(&self) -> usize {
        match self {
            Payload::Host(bytes) => bytes.len(),
            Payload::Placed { len, .. } => *len,
        }
    }

    /// The host bytes; None for a placed piece.
    pub(crate) fn host(&self) -> Option<&Bytes> {
        match self {
            Payload::Host(bytes) => Some(bytes),
            Payload::Placed { .. } => None,
        }
    }
}

impl From<Bytes> for Payload {
    fn from(bytes: Bytes) -> Self {
        Payload::Host(bytes)
    }
}
