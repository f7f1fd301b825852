//! psnet's collectives: allreduce, reduce-scatter, allgather, broadcast, reduce and barrier
//! among n ranks, over any transport of psnet's contract (TCP, the same-host shared-memory
//! path, RDMA, the in-memory network of the tests).
//!
//! - [`Communicator::join`] forms the ranks from a root address; each call then runs on
//!   every rank, in the same order everywhere.
//! - Algorithms are plain state (`plan/`): a pipelined ring for large buffers, recursive
//!   doubling for small allreduces, binomial trees for broadcast and reduce, dissemination for
//!   the barrier. Every reduction happens in a fixed order: the same inputs give the same
//!   bits on every rank and in every run.
//! - Any rank that is lost, disagrees about the call, or sends garbage fails the call on
//!   every rank that waits for it, naming that rank; a failed communicator stays failed.
//!
//! Elements: f32, f64, f16, bf16 (from the `half` crate), i32, i64, u8; reductions: sum,
//! prod, min, max, and avg for floating-point types.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod admission;
mod blocking;
mod calls;
mod comm;
mod compressed;
mod config;
mod cpus;
mod drive;
mod element;
mod error;
mod exchange;
#[cfg(feature = "cuda")]
mod gpu;
mod join;
mod liveness;
mod mailbox;
mod order;
mod owned;
mod p2p;
mod payload;
mod peers;
mod pieces;
mod rescaled;
mod scratch;
// Used by calls on the device; tested without a GPU.
#[cfg(any(feature = "cuda", test))]
mod placing;
mod plan;
mod wire;

pub use blocking::{BlockingCommunicator, Handle};
pub use comm::{node_of, Communicator};
pub use compressed::CompressedScheme;
pub use config::{Algo, Config};
pub use element::{DType, Element, ReduceOp};
pub use error::CollectiveError;
#[cfg(feature = "cuda")]
pub use gpu::GpuStage;
pub use half::{bf16, f16};
pub use p2p::P2pTicket;
