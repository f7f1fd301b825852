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
    /// The server asked was restarted and rejoined the job before it answered: the request
    /// must be sent again (the kv calls do so themselves; no call returns this). `retry`:
    /// for a push, the number to send in [`PushFlags::retry`](crate::proto::msg::PushFlags).
    #[error("{node} restarted before it answered: the request is sent again")]
    Rejoined {
        /// The server.
        node: String,
        /// A push's place among this worker's pushes of its key (None: not a push).
        retry: Option<u64>,
    },
    /// A server checkpoint (snapshot or journal) could not be written or read: names the
    /// file, or what is wrong with its contents.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// The job is shutting down.
    #[error("the job is shutting down")]
    Shutdown,
    /// A GPU buffer could not be used: no usable device (`NoCudaDevice`, saying why) or a
    /// failed CUDA call (feature `cuda`).
    #[error("GPU: {0}")]
    Gpu(psnet_compression::CompressionError),
}

/// Exit status of a process that failed on its own account (bad input, its own fault).
pub const EXIT_FAILED: u8 = 1;
/// Exit status of a process that stopped because another process of the job failed: a
/// launcher blames the process that exited otherwise (see `psnet-launch`).
pub const EXIT_PEER_FAILED: u8 = 2;

impl KvError {
    /// Whether this process fails because another node of the job did (lost, stopped, or
    /// leaving on an error of its own), rather than for a reason of its own.
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, KvError::NodeLost { .. } | KvError::Barrier(_))
    }

    /// The exit status a process ending with this error reports: [`EXIT_PEER_FAILED`] when
    /// another node is to blame, [`EXIT_FAILED`] otherwise.
    pub fn exit_code(&self) -> u8 {
        if self.is_peer_failure() {
            EXIT_PEER_FAILED
        } else {
            EXIT_FAILED
        }
    }
}
