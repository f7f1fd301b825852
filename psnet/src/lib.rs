//! psnet: a communication backend for distributed deep learning.
//!
//! This is the one crate a program names. It re-exports the public API of psnet's parts and
//! holds what turns a process's environment into a bound transport:
//!
//! - [`bind`] / [`Selection`]: the address from `DMLC_NODE_HOST` / `DMLC_INTERFACE`, RDMA or
//!   TCP from `PSNET_TRANSPORT` and the devices found, built as an [`AnyTransport`];
//! - [`kv`]: the parameter server (MXNet's kvstore semantics) on that transport:
//!   [`kv::launch_from_env`], [`kv::join`], [`kv::KvStore`];
//! - [`collectives`]: allreduce, reduce-scatter, allgather, broadcast, reduce and barrier
//!   among ranks named by psnet's, torchrun's, mpirun's or Slurm's variables:
//!   [`collectives::join_from_env`];
//! - [`logging::init`]: `PS_VERBOSE` mapped onto `tracing`.
//!
//! The protocol crates underneath (`psnet-kv`, `psnet-collectives`) are generic over
//! the [`Transport`] contract and never choose one themselves; tests hand them the in-memory
//! transport.
//!
//! ```no_run
//! # async fn example() -> Result<(), psnet::kv::KvError> {
//! let config = psnet::kv::launch_from_env()?; // servers and the scheduler never return
//! let kv = psnet::kv::join(&config).await?;
//! let mut weights = vec![0.0f32; 10];
//! kv.init(&[0], &[&weights]).await?;
//! kv.pushpull(0, &[1.0; 10], &mut weights).await?;
//! kv.finalize().await
//! # }
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod collectives;
pub mod kv;

pub use psnet_compression as compression;
pub use psnet_config as config;
pub use psnet_config::logging;
pub use psnet_select::{
    bind, bind_from_env, decide, AnyTransport, Decision, SelectError, Selection, TransportKind,
    TransportPref,
};
pub use psnet_transport as transport;
pub use psnet_transport::{
    Capabilities, Event, Incoming, NodeId, OutMessage, RegisteredBuf, Segment, Transport,
    TransportError,
};

/// The README's Rust example, compiled by `cargo test` (as a doctest) so that it keeps up
/// with the API.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeExample;
