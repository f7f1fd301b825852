//! An in-memory network that implements psnet's [`Transport`](psnet_transport::Transport)
//! contract, for testing whole jobs in one process.
//!
//! - [`MemNet`] is the network: endpoints bind to it ([`MemNet::bind`]) and reach each other by
//!   node id and (made-up) address, as they would over TCP. It passes the conformance suite.
//! - Time is tokio's clock: on a runtime started paused (`start_paused`, tokio's `test-util`)
//!   delays, timeouts and heartbeats run in simulated time, so a job that would take minutes
//!   runs in milliseconds and timing faults are reproducible.
//! - Faults come from a seed ([`Faults`]): per-message delays, connections reset at random
//!   (in-flight data lost, both sides told), and on command a node that dies
//!   ([`MemNet::kill`]) or freezes ([`MemNet::freeze`]). The same seed and the same sequence
//!   of sends give the same faults.
//!
//! - Links, optionally ([`MemNetConfig::hosts`], [`LinkModel`]): endpoints on hosts whose
//!   uplinks, downlinks and local paths have a rate and a latency, shared max-min fairly by
//!   the connections crossing them, so a whole job's simulated time is what those links
//!   allow. tokio's timers tick in milliseconds: model a network `k` times slower (and its
//!   latencies `k` times longer) and divide the times by `k` where messages take less.
//!
//! Messages to one peer stay in order; a receiver's messages become visible in the order
//! they were sent to it (with links: as they land, one peer's in order), each no earlier than
//! its delay allows. A receiver that does not read
//! stalls its senders once [`MemNetConfig::inbox_bytes`] are queued for it.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod endpoint;
mod faults;
mod links;
mod net;
mod wires;

pub use endpoint::MemTransport;
pub use faults::Faults;
pub use links::{HostLinks, InvalidLink, Link, LinkModel, MessageId};
pub use net::{MemNet, MemNetConfig, Traffic};
