//! psnet's configuration.
//!
//! - [`env`]: every environment variable psnet reads, declared once with its default and
//!   meaning (printable with `psnet-perf --print-env`), and typed readers whose errors name the
//!   variable.
//! - [`interface`]: which address this node uses, from `DMLC_NODE_HOST` / `DMLC_INTERFACE`
//!   with ps-lite's rules.
//! - [`rank`]: this process's rank from psnet's, torchrun's, an MPI's, Slurm's or a batch
//!   system's variables, for the launcher and the collectives alike.
//! - [`logging`]: `PS_VERBOSE` mapped onto `tracing`.
//! - [`TransportPref`]: what `PSNET_TRANSPORT` asks for.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod env;
pub mod interface;
pub mod logging;
mod pref;
pub mod rank;

pub use env::{ConfigError, EnvVar};
pub use interface::{Interface, NodeAddress};
pub use pref::TransportPref;
