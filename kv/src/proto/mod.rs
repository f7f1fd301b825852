//! The kv store's protocol, free of I/O: node ids and groups, the message codec, and the
//! state machines of the scheduler, the servers and `PS_RESEND`'s acknowledged delivery.
//! Drivers in the parent module only move the bytes these types produce and consume.

pub mod admission;
pub mod ids;
pub mod msg;
pub mod resend;
pub mod scheduler;
pub mod server;
pub mod sum;
pub mod worker;
