//! Every foreign call of the crate and every `unsafe` block, behind safe types and functions;
//! the rest of the crate is `#![deny(unsafe_code)]`.
//!
//! - [`verbs`]: libibverbs beyond what `sideway` wraps safely: fork support, completion and
//!   asynchronous events, completion polling, and posting work requests ([`verbs::QueuePair`]),
//!   the only place that names memory to the NIC.
//! - [`memory`]: registered memory, and every CPU access to memory the NIC reads or writes.
//! - [`rdmacm`]: librdmacm (the connection manager).
//! - [`os`]: the memory-lock limit, non-blocking descriptors, the page size.
//! - `cuda` and `gpu` (feature `cuda`): the CUDA driver API, and registering GPU memory.
//!
//! What the wrappers guarantee by construction: registrations are dropped before the memory
//! they cover; a queue pair keeps the buffers it posts from registered until it is destroyed;
//! the CPU reaches a pre-posted buffer only through its [`memory::Slot`], which exists only
//! while no work request uses the buffer (posting takes it, the work request's completion
//! gives it back).
//!
//! What they take on trust, each documented where it is relied on:
//! - the memory an RDMA write reads ([`verbs::QueuePair::post_writes`]) stays valid until
//!   the write completes or the link fails: the send that borrows it keeps it;
//! - a peer writes a buffer offered to it once, before the message naming it
//!   ([`memory::into_bytes`]);
//! - the caller of `gpu::register_gpu` keeps the GPU memory allocated (it is `unsafe`).

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(feature = "cuda")]
pub(crate) mod gpu;
pub(crate) mod memory;
pub(crate) mod os;
pub(crate) mod rdmacm;
pub(crate) mod verbs;
