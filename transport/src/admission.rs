//! Who may connect: the proof of identity a node presents in its hello, and the policy that
//! decides on the hellos a node receives.
//!
//! A transport on its own believes the node id a hello claims. A job that knows its members
//! (the kv scheduler issues every node a token) installs an [`Admission`] with
//! [`Transport::set_admission`](crate::Transport::set_admission): from then on each hello
//! carries the sender's [`Proof`], hellos that fail the policy are refused with its reason,
//! and only a connection that proves its id may take the place of a live one.

use std::fmt;

use crate::node::NodeId;

/// Bytes of a [`Proof`].
pub const PROOF_LEN: usize = 16;

/// A secret token that proves a node id within one job.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Proof(pub [u8; PROOF_LEN]);

impl Proof {
    /// Compares in time independent of where the bytes differ, so that a peer probing the
    /// acceptor cannot learn a token byte by byte.
    pub fn matches(&self, other: &Proof) -> bool {
        self.0
            .iter()
            .zip(other.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl fmt::Debug for Proof {
    // Tokens are secrets: never print them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Proof(..)")
    }
}

/// The admission policy of one node.
pub trait Admission: Send + Sync + 'static {
    /// The proof this node presents in its hellos while its id is `local` (`None`: none).
    fn proof(&self, local: NodeId) -> Option<Proof>;

    /// Whether a connection that claims to be `peer`, with `proof`, is let in; the error is
    /// the reason sent back to the dialler and logged with its address.
    fn admit(&self, peer: NodeId, proof: Option<&Proof>) -> Result<(), String>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_match_only_themselves_and_never_print() {
        let a = Proof([7; PROOF_LEN]);
        let mut b = a;
        assert!(a.matches(&b));
        b.0[PROOF_LEN - 1] ^= 1;
        assert!(!a.matches(&b));
        assert_eq!(format!("{a:?}"), "Proof(..)");
    }
}
