//! The kv store's protocol, free of I/O: node ids and groups, the message codec, and the
//! state machines of the scheduler, the servers and `PS_RESEND`'s acknowledged delivery.
//! Drivers in the parent module only move the bytes these types produce and consume.

pub mod admission;
pub mod ids;
pub mod msg;
pub mod packed;
pub mod pulled;
pub mod recovery;
pub mod resend;
pub mod scheduler;
pub mod server;
pub mod sum;
pub mod worker;

/// A wait for the next message at least this long means nothing was queued for this node:
/// a peer's silence counts only up to such a moment (a node working through a backlog has
/// the scheduler's answers queued behind it; that is not the scheduler's silence).
pub const CAUGHT_UP_WAIT: std::time::Duration = std::time::Duration::from_millis(2);
