//! Who may connect once a communicator is formed: its members, proving it with the job's
//! secret. Rank 0 draws the secret and sends it with the table; every rank then installs this
//! policy on its transport, so a process that was not in the table — or one that claims a
//! member's id without the secret — is refused before anything it sends is read, and a live
//! member's connection is never swapped for an unproven one.
//!
//! A refused claim to a member's id is also noted in the mailbox, failing the communicator's
//! calls: the process that claims it may be the rank's own, and the member in the table one
//! that took its rank first (a squatter, or a second process given the same rank).

use std::sync::Arc;

use psnet_transport::{Admission, NodeId, Proof, PROOF_LEN};

use crate::mailbox::Mailbox;

/// The members' ids and the job's secret.
pub(crate) struct Members {
    nodes: Vec<NodeId>,
    secret: Proof,
    /// While the members still connect to each other, a rank presents the secret but lets
    /// everyone in: a peer that has not received the table yet cannot prove itself.
    strict: bool,
    /// Where refused claims to a member's id are noted.
    claims: Option<Arc<Mailbox>>,
}

impl Members {
    /// Presents the secret and lets everyone in (while connecting).
    pub(crate) fn presenting(nodes: Vec<NodeId>, secret: Proof) -> Self {
        Members {
            nodes,
            secret,
            strict: false,
            claims: None,
        }
    }

    /// Presents the secret and lets in only members that present it; a claim to a member's
    /// id without it is noted in `claims`.
    pub(crate) fn checking(nodes: Vec<NodeId>, secret: Proof, claims: Arc<Mailbox>) -> Self {
        Members {
            nodes,
            secret,
            strict: true,
            claims: Some(claims),
        }
    }
}

impl Admission for Members {
    fn proof(&self, local: NodeId) -> Option<Proof> {
        self.nodes.contains(&local).then_some(self.secret)
    }

    fn admit(&self, peer: NodeId, proof: Option<&Proof>) -> Result<(), String> {
        if !self.strict {
            return Ok(());
        }
        if !self.nodes.contains(&peer) {
            return Err(format!("{peer} is no rank of this communicator"));
        }
        let refused = match proof {
            Some(p) if p.matches(&self.secret) => return Ok(()),
            Some(_) => format!("{peer} came with a wrong job secret"),
            None => format!("{peer} came without the job secret"),
        };
        if let Some(mailbox) = &self.claims {
            mailbox.note_claim(peer, refused.clone());
        }
        Err(refused)
    }
}

/// A new job secret from the operating system's random source.
pub(crate) fn new_secret() -> Result<Proof, String> {
    let mut bytes = [0u8; PROOF_LEN];
    getrandom::fill(&mut bytes).map_err(|e| format!("no random source for the job secret: {e}"))?;
    Ok(Proof(bytes))
}

/// The secret as text for the table (hex), and back.
pub(crate) fn to_hex(p: &Proof) -> String {
    p.0.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn from_hex(text: &str) -> Option<Proof> {
    if text.len() != 2 * PROOF_LEN || !text.is_ascii() {
        return None;
    }
    let mut bytes = [0u8; PROOF_LEN];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(Proof(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_members_with_the_secret_get_in() {
        let secret = new_secret().unwrap();
        let mailbox = Arc::new(Mailbox::new(0));
        let members = Members::checking(vec![NodeId(1), NodeId(2)], secret, mailbox.clone());
        assert_eq!(
            Members::presenting(vec![NodeId(1)], secret).admit(NodeId(5), None),
            Ok(())
        );
        assert_eq!(members.admit(NodeId(2), Some(&secret)), Ok(()));
        assert!(members
            .admit(NodeId(3), Some(&secret))
            .unwrap_err()
            .contains("no rank"));
        // A stranger is only refused; a claim to a member's id is also noted, the first kept.
        assert!(mailbox.lock().claimed.is_none());
        assert!(members
            .admit(NodeId(1), None)
            .unwrap_err()
            .contains("without"));
        let mut wrong = secret;
        wrong.0[0] ^= 1;
        assert!(members
            .admit(NodeId(1), Some(&wrong))
            .unwrap_err()
            .contains("wrong"));
        let claimed = mailbox.lock().claimed.clone();
        assert!(
            matches!(&claimed, Some((NodeId(1), why)) if why.contains("without")),
            "{claimed:?}"
        );
        assert_eq!(members.proof(NodeId(1)), Some(secret));
        assert_eq!(members.proof(NodeId(9)), None);
        assert_eq!(from_hex(&to_hex(&secret)), Some(secret));
        assert_eq!(from_hex("zz"), None);
    }
}
