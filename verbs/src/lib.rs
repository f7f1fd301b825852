//! psnet's RDMA transport: the `psnet_transport::Transport` contract over libibverbs
//! reliable-connected queue pairs.
//!
//! - [`discovery`] finds the RDMA device and port bound to a network interface (sysfs), which
//!   is how psnet chooses between RDMA and TCP; [`devices`] lists what libibverbs reports.
//! - [`proto`] holds the protocol as plain types: the header codec, credits, in-order delivery,
//!   and connection set-up (both handshakes as state machines, [`proto::handshake`]).
//! - [`transport::VerbsTransport`] moves bytes: eager sends into pre-posted buffers for small
//!   messages, a rendezvous (request-to-send, clear-to-send, RDMA WRITE WITH IMMEDIATE into a
//!   pooled registered buffer of the receiver, and a segment the receiver places into memory
//!   it registered for that) for large ones.
//! - [`rdmacm`] is librdmacm, which connects the queue pairs (route from the interface's
//!   address, psnet's handshake in the connection exchange's private data); [`control`] holds
//!   that handshake and its socket twin as plain bytes.
//! - `gpu` (feature `cuda`) registers CUDA device memory with the NIC (GPUDirect: dma-buf,
//!   nvidia-peermem, or staging through pinned host memory).
//!
//! Failures are [`VerbsError`]s (the call that failed and its error number, or what the peer
//! did wrong); they reach the transport contract as [`psnet_transport::TransportError`]s.
//!
//! All FFI (libibverbs, librdmacm, the CUDA driver, libc) and the `unsafe` blocks it needs are
//! in one private module, `sys`, behind safe types; the rest of the crate denies `unsafe`
//! code. The one promise a user makes (feature `cuda`: GPU memory stays allocated while the
//! NIC may access it) is `unsafe` [`gpu::DeviceRange::promised`], defined in `sys` and
//! re-exported; registering the range is then safe.
//!
//! The modules form layers, each using only those below it (`tests/layers.rs` checks that the
//! graph has no cycle and that `sys` uses only the bottom layer):
//! 1. plain data and error types, which use nothing above themselves: `error` (with the wire
//!    and GPU errors), `qp` ([`link::QpInfo`]), [`control`] (the handshake codec), [`events`],
//!    and `gpu_path` (the GPUDirect path decision, re-exported by `gpu`);
//! 2. `sys`, the FFI;
//! 3. the safe faces of the FFI and the host: [`rdmacm`], [`cm`], [`discovery`], [`device`],
//!    [`devices`], [`memory`], [`regcache`], the registrar, the settings, `gpu`, and `landing`
//!    (memory peers' NICs write placed segments into: [`HostLanding`], GPU regions);
//! 4. [`proto`], the protocol's state machines (which read rdma_cm's event codes);
//! 5. [`link`], one queue pair and its protocol state;
//! 6. [`transport`], the connections, completion polling and device events, re-exported here.
//!
//! libibverbs is loaded at run time (through `sideway`), so one binary starts everywhere and
//! reports [`psnet_transport::TransportError::Unavailable`] where no device exists.
#![deny(missing_docs)]
// Every foreign call and every `unsafe` block lives in `sys`, behind safe wrappers.
#![deny(unsafe_code)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod cm;
mod config;
pub mod control;
pub mod device;
pub mod devices;
pub mod discovery;
mod error;
pub mod events;
#[cfg(feature = "cuda")]
pub mod gpu;
#[cfg(feature = "cuda")]
mod gpu_path;
mod landing;
pub mod link;
pub mod memory;
pub mod proto;
mod qp;
pub mod rdmacm;
pub mod regcache;
mod registrar;
#[allow(unsafe_code)]
mod sys;
pub mod transport;

pub use device::DeviceSpec;
pub use error::VerbsError;
pub use landing::HostLanding;
pub use transport::{Handshake, VerbsConfig, VerbsTransport};
