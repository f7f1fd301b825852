//! Chooses this node's address and transport, and builds the transport.
//!
//! The kv store and the collectives are written against
//! [`Transport`](psnet_transport::Transport); this crate is where a process decides which one
//! it gets:
//! - the address from `DMLC_NODE_HOST` / `DMLC_INTERFACE` ([`psnet_config::interface`]);
//! - the transport from `PSNET_TRANSPORT` and whether an RDMA device is bound to that
//!   interface ([`decide`]);
//! - [`AnyTransport`], one type for whichever was chosen;
//! - the job's shared secret from `PSNET_SECRET` / `PSNET_SECRET_FILE` ([`secret_from_env`]).
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod any;
mod decide;
mod endpoint;
mod secret;

pub use any::AnyTransport;
pub use decide::{decide, Decision, RdmaUnavailable, TransportKind, TransportPref};
pub use endpoint::{
    bind, bind_from_env, tcp_config_from_env, verbs_config_from_env, SelectError, Selection,
};
pub use secret::{read_secret_file, secret_from_env};
