//! Chooses this node's address and transport, and builds the transport.
//!
//! The kv store and the collectives are written against
//! [`Transport`](psnet_transport::Transport); this crate is where a process decides which one
//! it gets:
//! - the address from `DMLC_NODE_HOST` / `DMLC_INTERFACE` ([`psnet_config::interface`]);
//! - the transport from `PSNET_TRANSPORT` and whether an RDMA device is bound to that
//!   interface ([`decide`]);
//! - [`AnyTransport`], one type for whichever was chosen.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod any;
mod decide;
mod endpoint;

pub use any::AnyTransport;
pub use decide::{decide, Decision, TransportKind, TransportPref};
pub use endpoint::{
    bind, bind_from_env, tcp_config_from_env, verbs_config_from_env, SelectError, Selection,
};
