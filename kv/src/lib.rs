//! psnet's parameter-server key-value store, with MXNet's kvstore semantics.
//!
//! A job has one scheduler, `DMLC_NUM_SERVER` servers and `DMLC_NUM_WORKER` workers; each
//! process learns its role from `DMLC_ROLE` and finds the scheduler at `DMLC_PS_ROOT_URI` /
//! `DMLC_PS_ROOT_PORT` (or gets the same settings from code through [`KvConfig`]).
//!
//! - Workers call [`Worker`]'s `init`, `push`, `pull`, `pushpull`, `barrier`,
//!   `set_optimizer`, `set_gradient_compression`, `set_mode`.
//! - Keys below `MXNET_KVSTORE_BIGARRAY_BOUND` elements live on one server, bigger ones are
//!   split over all servers ([`placement`]).
//! - Servers run `dist_sync` rounds (summed in worker-rank order, bit-reproducible) or
//!   `dist_async` updates, with server-side optimizers ([`updater`]).
//! - A node that dies never causes a silent hang: operations waiting on it fail with an error
//!   naming it (connection loss at once, a frozen node after `PS_HEARTBEAT_TIMEOUT`).
//! - `PS_RESEND=1` (timeout `PS_RESEND_TIMEOUT` ms): acknowledged delivery with per-peer
//!   sequence numbers; a dropped connection is re-established and what it lost resent, and
//!   duplicates are dropped, so a push is applied exactly once. A peer is declared gone only
//!   after the retry limit ([`proto::resend`]).
//! - `PSNET_CHECKPOINT_DIR`: servers keep their shard durably (snapshot and journal, every
//!   acknowledged update written before its acknowledgement); [`checkpoint::load_shard`]
//!   rebuilds it ([`checkpoint`]); a server restarted with its rank rejoins the running job
//!   from it (`PSNET_RECOVERY_TIMEOUT`), and workers send again what it had not answered.
//!
//! The protocol lives in [`proto`] as plain state machines without I/O; [`Scheduler`],
//! [`run_server`] and [`Worker`] only move bytes, over any
//! [`Transport`](psnet_transport::Transport) they are handed: this crate never chooses or
//! builds one (the `psnet` crate does that from the environment, and tests hand in the
//! in-memory transport).
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod blocking;
mod bootstrap;
pub mod checkpoint;
mod clock;
pub mod config;
mod error;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod placement;
pub mod proto;
mod reliable;
mod scheduler;
mod server;
pub mod updater;
pub mod value;
mod wire;
mod worker;

pub use config::KvConfig;
pub use error::{KvError, EXIT_FAILED, EXIT_PEER_FAILED};
pub use proto::ids::Role;
pub use proto::pulled::KvCompression;
pub use proto::server::Mode;
pub use scheduler::Scheduler;
pub use server::run_server;
pub use value::{bf16, f16, Dtype, Value};
pub use worker::Worker;
