//! psnet's transport contract.
//!
//! One interface, several implementations: the kv store and the collectives talk to a
//! [`Transport`] and never learn whether TCP (`psnet-fallback-tcp`) or RDMA (`psnet-verbs`)
//! moves their bytes. This crate holds only plain types and the wire codec, with no I/O, so
//! that every rule about frames can be tested without a network.
//!
//! - [`Transport`]: connect to a peer by node id and address, send a message (a small metadata
//!   block plus data segments borrowed from the caller until sent), receive [`Event`]s.
//! - [`codec`]: the versioned, little-endian frame format; every length is bounded by
//!   [`Limits`] before anything is allocated, malformed input is an error, never a panic.
//! - [`TransportError`]: errors are per peer and carry its [`NodeId`].
//! - [`RegisteredBuf`]: memory the transport may hand to the NIC without copying (plain memory on
//!   TCP, a memory registration on RDMA).
//! - [`le`]: bounded little-endian reading and writing for every wire format.
//! - [`Admission`]: who may connect, and the [`Proof`] of identity a node's hello carries,
//!   bound to its connection ([`Binding`]) and signed with the node's own [`Identity`].
//! - [`auth`]: the shared-secret exchange (HMAC-SHA256 over both sides' nonces) that opens
//!   every connection of a job with `PSNET_SECRET`.
//! - [`device`]: GPU memory in messages ([`DeviceBytes`]), staged through host buffers in a
//!   pipeline of chunks where the NIC cannot read it.
//! - [`placement`]: the receive side: a [`Placer`] names device memory for a segment when its
//!   message's metadata arrives, and the transport writes the segment there as it comes.
//! - `conformance` (feature `conformance`): the suite every transport runs in its tests.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod admission;
pub mod auth;
mod caps;
pub mod codec;
#[cfg(feature = "conformance")]
pub mod conformance;
mod contract;
pub mod device;
mod error;
pub mod le;
mod memory;
mod message;
mod node;
pub mod placement;
pub mod session;

pub use admission::{
    Admission, Binding, Identity, Proof, PublicIdentity, Refusal, IDENTITY_LEN, PROOF_LEN,
};
pub use caps::Capabilities;
pub use codec::{CodecError, FrameKind, Limits};
pub use contract::Transport;
pub use device::{DeviceBytes, DeviceError};
pub use error::TransportError;
pub use memory::{RegionKey, RegisteredBuf};
pub use message::{Event, Incoming, OutMessage, Segment};
pub use node::NodeId;
pub use placement::{DeviceDest, Placed, Placement, Placer};
