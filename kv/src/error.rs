//! The kv store's errors. Every error caused by another node names it.

use psnet_config::ConfigError;
use psnet_transport::TransportError;

/// What can go wrong in a kv operation.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// Bad configuration (names the variable).
    #[error("configuration: {0}")]
    Config(#[from] ConfigError),
    /// The transport could not be chosen or built (by whoever binds it, e.g. the `psnet`
    /// facade).
    #[error("transport: {0}")]
    Setup(Box<dyn std::error::Error + Send + Sync>),
    /// A transport operation failed.
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
    /// Joining the job failed.
    #[error("bootstrap: {0}")]
    Bootstrap(String),
    /// A server refused or failed the request.
    #[error("{node} failed the request: {reason}")]
    Remote {
        /// The server, e.g. `server 0 (node 8)`.
        node: String,
        /// Its reason.
        reason: String,
    },
    /// A node the operation depends on is gone.
    #[error("{node} is gone: {reason}")]
    NodeLost {
        /// The node.
        node: String,
        /// What was seen.
        reason: String,
    },
    /// A barrier cannot complete.
    #[error("barrier failed: {0}")]
    Barrier(String),
    /// The key was never initialized on this worker.
    #[error("key {0} is not initialized (call init first)")]
    UnknownKey(u64),
    /// The values do not match the key's size.
    #[error("key {key}: {got} values given, the key has {expected}")]
    SizeMismatch {
        /// The key.
        key: u64,
        /// Its size.
        expected: usize,
        /// What was given.
        got: usize,
    },
    /// Invalid arguments.
    #[error("{0}")]
    Invalid(String),
    /// A peer sent something this build does not understand.
    #[error("protocol error from {node}: {reason}")]
    Protocol {
        /// The peer.
        node: String,
        /// What was wrong.
        reason: String,
    },
    /// The job is shutting down.
    #[error("the job is shutting down")]
    Shutdown,
}
