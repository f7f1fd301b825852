use std::io;
use std::net::SocketAddr;

use crate::codec::CodecError;
use crate::node::NodeId;

/// Errors of transport operations. Every error caused by one peer names it, and fails only what
/// was going to or coming from that peer.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// No connection to the peer exists (never connected, or lost).
    #[error("{peer}: not connected")]
    NotConnected {
        /// The peer.
        peer: NodeId,
    },
    /// Connecting to the peer failed (after retries until the connect timeout).
    #[error("{peer} at {addr}: connect failed: {source}")]
    Connect {
        /// The peer.
        peer: NodeId,
        /// The address dialled.
        addr: SocketAddr,
        /// The last I/O error.
        source: io::Error,
    },
    /// The handshake with the peer failed (version mismatch, duplicate node id, wrong peer).
    #[error("{peer}: handshake failed: {reason}")]
    Handshake {
        /// The peer.
        peer: NodeId,
        /// What went wrong.
        reason: String,
    },
    /// The connection to the peer broke while sending or receiving.
    #[error("{peer}: connection lost: {reason}")]
    PeerLost {
        /// The peer.
        peer: NodeId,
        /// What happened (I/O error, peer closed, malformed frame).
        reason: String,
    },
    /// The message exceeds a limit of this transport; nothing was sent.
    #[error("message to {peer} rejected: {source}")]
    Invalid {
        /// The peer it was meant for.
        peer: NodeId,
        /// The limit it broke.
        source: CodecError,
    },
    /// Device memory in the message could not be read (a failed copy out of the GPU). When the
    /// failure came after part of the message was written, the connection to the peer was
    /// closed (the peer sees it lost: a half-written message cannot be finished).
    #[error("message to {peer}: {source}")]
    Device {
        /// The peer it was meant for.
        peer: NodeId,
        /// The device's error.
        source: crate::device::DeviceError,
    },
    /// Binding the listening socket failed.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        source: io::Error,
    },
    /// This transport is not available here (no device, library missing, not built in).
    #[error("transport unavailable: {0}")]
    Unavailable(String),
    /// The transport has been shut down.
    #[error("transport is shut down")]
    Closed,
}

impl TransportError {
    /// The peer this error concerns, if it concerns one.
    pub fn peer(&self) -> Option<NodeId> {
        match self {
            TransportError::NotConnected { peer }
            | TransportError::Connect { peer, .. }
            | TransportError::Handshake { peer, .. }
            | TransportError::PeerLost { peer, .. }
            | TransportError::Invalid { peer, .. }
            | TransportError::Device { peer, .. } => Some(*peer),
            TransportError::Bind { .. }
            | TransportError::Unavailable(_)
            | TransportError::Closed => None,
        }
    }
}
