use std::fmt;

/// The identity of a node (process) in a psnet job.
///
/// The kv store uses ps-lite's numbering (scheduler 1, server rank r is `8 + 2r`, worker rank r
/// is `9 + 2r`); the transport only needs ids to be unique among connected peers.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct NodeId(pub u64);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node {}", self.0)
    }
}

impl From<u64> for NodeId {
    fn from(id: u64) -> Self {
        NodeId(id)
    }
}
