//! What can go wrong in a collective. Once an operation fails, the communicator is failed:
//! every later operation reports the same error at once (as NCCL's communicators abort).

use psnet_transport::NodeId;

/// A collective's error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CollectiveError {
    /// A rank's connection was lost (its process died, or the network between us failed).
    #[error("rank {rank} ({node}) was lost: {reason}")]
    RankLost {
        /// The lost rank.
        rank: usize,
        /// Its node id.
        node: NodeId,
        /// Why, as the transport said.
        reason: String,
    },
    /// Another rank called a different collective, or the same one with another type, length,
    /// reduction or root.
    #[error("rank {rank} called {theirs} where this rank called {ours}")]
    Mismatch {
        /// The rank that disagrees.
        rank: usize,
        /// This rank's call.
        ours: String,
        /// Theirs.
        theirs: String,
    },
    /// Another rank failed and told the others why.
    #[error("rank {rank} aborted the communicator: {reason}")]
    Aborted {
        /// The rank that failed first.
        rank: usize,
        /// Its error.
        reason: String,
    },
    /// A process claimed a rank of this communicator without its secret after the
    /// communicator was formed: either two processes were given that rank, or the member in
    /// the table took it before the rank's own process joined.
    #[error("another process claimed rank {rank} ({node}) after the communicator was formed ({detail}): two processes were given rank {rank}, or one took it before the rank's own process joined")]
    Claimed {
        /// The rank claimed.
        rank: usize,
        /// Its node id.
        node: NodeId,
        /// Why the claim was refused.
        detail: String,
    },
    /// The call's arguments are wrong (buffer lengths, root, an average of integers, ...).
    #[error("{0}")]
    Invalid(String),
    /// A rank sent a message this rank cannot take.
    #[error("rank {rank} sent a malformed message: {detail}")]
    Protocol {
        /// The sender.
        rank: usize,
        /// What was wrong.
        detail: String,
    },
    /// Forming the communicator failed (a rank never joined, settings disagree, ...).
    #[error("joining the communicator: {0}")]
    Join(String),
    /// The transport failed outside any one peer (shut down, cannot connect).
    #[error("transport: {0}")]
    Transport(String),
    /// A call's future was dropped before it finished (the other ranks were waiting for it).
    #[error("cancelled: {0}")]
    Cancelled(String),
    /// A call did not finish in time: the ranks it still waited for are named.
    #[error("{call} did not finish within {waited:?}: still waiting for ranks {ranks:?} (PSNET_COLL_TIMEOUT)")]
    Timeout {
        /// The call.
        call: String,
        /// How long it waited.
        waited: std::time::Duration,
        /// The ranks it still waited for.
        ranks: Vec<usize>,
    },
}
