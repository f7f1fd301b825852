//! psnet's configuration.
//!
//! - [`env`]: every environment variable psnet reads, declared once with its default and
//!   meaning (printable with `psnet-perf --print-env`), and typed readers whose errors name the
//!   variable.
//! - [`interface`]: which address this node uses, from `DMLC_NODE_HOST` / `DMLC_INTERFACE`
//!   with ps-lite's rules.
//! - [`logging`]: `PS_VERBOSE` mapped onto `tracing`.
//! - [`TransportPref`]: what `PSNET_TRANSPORT` asks for.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod env;
pub mod interface;
pub mod logging;
mod pref;

pub use env::{ConfigError, EnvVar};
pub use interface::{Interface, NodeAddress};
pub use pref::TransportPref;
