//! Who may connect once a communicator is formed: its members, proving it with the job's
//! secret. Rank 0 draws the secret and sends it with the table; every rank then installs this
//! policy on its transport, so a process that was not in the table — or one that claims a
//! member's id without the secret — is refused before anything it sends is read, and a live
//! member's connection is never swapped for an unproven one.
//!
//! A hello proves the secret without showing it: it carries a MAC under the secret of the
//! connection's binding and the id claimed ([`Proof::shared`]), so a proof read on one
//! connection (with a job secret, a member in the middle can read hellos) passes on no other.
//! Every rank holds the same secret, so a rank can still make the proof of another rank's id.
//!
//! A refused claim to a member's id is also noted in the mailbox, failing the communicator's
//! calls: the process that claims it may be the rank's own, and the member in the table one
//! that took its rank first (a squatter, or a second process given the same rank).

use std::sync::Arc;

use psnet_transport::session::Role;
use psnet_transport::{Admission, Binding, NodeId, Proof, Refusal};

use crate::mailbox::Mailbox;

/// Bytes of a communicator's secret.
pub(crate) const SECRET_LEN: usize = 16;

/// The secret rank 0 draws for a communicator and sends with its table. Never printed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct CommSecret([u8; SECRET_LEN]);

impl std::fmt::Debug for CommSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CommSecret(..)")
    }
}

/// The members' ids and the job's secret.
pub(crate) struct Members {
    nodes: Vec<NodeId>,
    secret: CommSecret,
    /// Where refused claims to a member's id are noted.
    claims: Arc<Mailbox>,
}

impl Members {
    /// Presents the secret and lets in only members that present it; a claim to a member's
    /// id without it is noted in `claims`.
    pub(crate) fn checking(nodes: Vec<NodeId>, secret: CommSecret, claims: Arc<Mailbox>) -> Self {
        Members {
            nodes,
            secret,
            claims,
        }
    }
}

/// The refusal of a rank that has not got the table yet (see [`Joining`]); a dialler that
/// reads it tries again.
pub(crate) const NOT_FORMED: &str = "this rank has not got the communicator's table yet";

/// A rank other than 0 until the table comes: it cannot prove itself to a member that dials
/// it (it has no secret yet), so it refuses the dial, which is tried again, rather than
/// answer without a proof and be refused after its side of the connection is made. Rank 0,
/// which it dials itself, answers it before anyone has a secret.
pub(crate) struct Joining {
    pub(crate) root: NodeId,
}

impl Admission for Joining {
    fn proof(&self, _local: NodeId, _binding: &Binding) -> Option<Proof> {
        None
    }

    fn admit(
        &self,
        peer: NodeId,
        _proof: Option<&Proof>,
        binding: &Binding,
    ) -> Result<(), Refusal> {
        // Rank 0 answering this rank's dial. Rank 0 dialling in is refused too, as not yet:
        // a call of rank 0's may reach this rank before the table has, and rank 0 tries again.
        if peer == self.root && binding.sender() == Role::Acceptor {
            Ok(())
        } else {
            Err(Refusal::NotYet(NOT_FORMED.into()))
        }
    }
}

impl Admission for Members {
    fn proof(&self, local: NodeId, binding: &Binding) -> Option<Proof> {
        self.nodes
            .contains(&local)
            .then(|| Proof::shared(&self.secret.0, local, binding))
    }

    fn admit(&self, peer: NodeId, proof: Option<&Proof>, binding: &Binding) -> Result<(), Refusal> {
        if !self.nodes.contains(&peer) {
            return Err(Refusal::NotMember(format!(
                "{peer} is no rank of this communicator"
            )));
        }
        let refused = match proof {
            Some(p) if p.matches(&Proof::shared(&self.secret.0, peer, binding)) => return Ok(()),
            Some(_) => Refusal::WrongProof(format!("{peer} came with a wrong job secret")),
            None => Refusal::NoProof(format!("{peer} came without the job secret")),
        };
        self.claims.note_claim(peer, refused.to_string());
        Err(refused)
    }
}

/// A new job secret from the operating system's random source.
pub(crate) fn new_secret() -> Result<CommSecret, String> {
    let mut bytes = [0u8; SECRET_LEN];
    getrandom::fill(&mut bytes).map_err(|e| format!("no random source for the job secret: {e}"))?;
    Ok(CommSecret(bytes))
}

/// The secret as text for the table (hex), and back.
pub(crate) fn to_hex(p: &CommSecret) -> String {
    p.0.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn from_hex(text: &str) -> Option<CommSecret> {
    if text.len() != 2 * SECRET_LEN || !text.is_ascii() {
        return None;
    }
    let mut bytes = [0u8; SECRET_LEN];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(CommSecret(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    use psnet_transport::session::SessionBase;

    fn binding(seed: u8) -> Binding {
        Binding::new(Some(&SessionBase::from_bytes([seed; 32])), Role::Dialler)
    }

    #[test]
    fn only_members_with_the_secret_get_in() {
        let secret = new_secret().unwrap();
        let here = binding(1);
        let mailbox = Arc::new(Mailbox::new(0));
        let members = Members::checking(vec![NodeId(1), NodeId(2)], secret, mailbox.clone());
        // Rank 0 only as the answer to this rank's dial (its binding is the acceptor's).
        let joining = Joining { root: NodeId(1) };
        let answer = Binding::new(Some(&SessionBase::from_bytes([1; 32])), Role::Acceptor);
        assert_eq!(joining.admit(NodeId(1), None, &answer), Ok(()));
        let refused = Err(Refusal::NotYet(NOT_FORMED.to_string()));
        assert_eq!(joining.admit(NodeId(1), None, &here), refused);
        assert_eq!(joining.admit(NodeId(2), None, &answer), refused);
        assert_eq!(joining.proof(NodeId(2), &here), None);
        let proof_of = |id| members.proof(id, &here).unwrap();
        assert_eq!(
            members.admit(NodeId(2), Some(&proof_of(NodeId(2))), &here),
            Ok(())
        );
        assert!(members
            .admit(NodeId(3), Some(&proof_of(NodeId(1))), &here)
            .unwrap_err()
            .to_string()
            .contains("no rank"));
        // A stranger is only refused; a claim to a member's id is also noted, the first kept.
        assert!(mailbox.lock().claimed.is_none());
        assert!(members
            .admit(NodeId(1), None, &here)
            .unwrap_err()
            .to_string()
            .contains("without"));
        // Rank 2's proof read on this connection, or rank 1's read on another, does not pass.
        for (proof, on) in [
            (proof_of(NodeId(2)), here),
            (proof_of(NodeId(1)), binding(2)),
        ] {
            assert!(members
                .admit(NodeId(1), Some(&proof), &on)
                .unwrap_err()
                .to_string()
                .contains("wrong"));
        }
        let claimed = mailbox.lock().claimed.clone();
        assert!(
            matches!(&claimed, Some((NodeId(1), why)) if why.contains("without")),
            "{claimed:?}"
        );
        assert_eq!(members.proof(NodeId(9), &here), None);
        assert_eq!(from_hex(&to_hex(&secret)), Some(secret));
        assert_eq!(from_hex("zz"), None);
    }
}
