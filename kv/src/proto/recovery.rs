//! Recovery credentials: a lost server's rank goes back only to the process that holds its
//! checkpoint directory.
//!
//! A server with `PSNET_CHECKPOINT_DIR` draws a random credential once it has its rank, keeps
//! it beside its shard files (`server-<rank>.credential`, readable only by the job's user),
//! and sends the scheduler a commitment to it ([`commitment`], in
//! [`Msg::RecoveryKey`](super::msg::Msg::RecoveryKey)). A restarted server registers with
//! the credential it finds there; the scheduler gives it the lost rank only if the
//! credential matches that rank's commitment ([`Credentials::take`]). A credential serves
//! once: the rejoined server draws a new one and commits to it again, so a credential seen
//! on the wire is worth nothing afterwards. Anyone else who registers as a server while a
//! rank is held (a stranger, or a member of the job holding the job's secret) is refused,
//! with a log line at the scheduler.

use std::collections::BTreeMap;

use psnet_transport::NodeId;
use sha2::{Digest, Sha256};

/// Bytes of a credential and of its commitment.
pub const CREDENTIAL_LEN: usize = 32;

/// What distinguishes these hashes from any other SHA-256 of 32 bytes.
const DOMAIN: &[u8] = b"psnet kv recovery credential v1";

/// A fresh random credential from the operating system.
pub fn fresh() -> [u8; CREDENTIAL_LEN] {
    super::admission::random_bytes()
}

/// The commitment the scheduler keeps for `credential`.
pub fn commitment(credential: &[u8; CREDENTIAL_LEN]) -> [u8; CREDENTIAL_LEN] {
    let mut h = Sha256::new();
    h.update(DOMAIN);
    h.update(credential);
    h.finalize().into()
}

/// The scheduler's commitments, by server id.
#[derive(Debug, Default)]
pub struct Credentials {
    commits: BTreeMap<NodeId, [u8; CREDENTIAL_LEN]>,
}

/// Why a rejoin was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The registration carried no credential.
    NoCredential,
    /// None of the held ranks committed to this credential.
    Mismatch,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::NoCredential => f.write_str(
                "it shows no recovery credential (a lost server's rank goes back only to a \
                 server restarted over that server's PSNET_CHECKPOINT_DIR)",
            ),
            Refusal::Mismatch => f.write_str(
                "its recovery credential is not the one the lost server committed to (a \
                 lost server's rank goes back only to a server restarted over that server's \
                 PSNET_CHECKPOINT_DIR)",
            ),
        }
    }
}

impl Credentials {
    /// `server` committed to a credential (a later commitment replaces an earlier one).
    pub fn commit(&mut self, server: NodeId, commit: [u8; CREDENTIAL_LEN]) {
        self.commits.insert(server, commit);
    }

    /// Whether `server` has committed.
    pub fn has(&self, server: NodeId) -> bool {
        self.commits.contains_key(&server)
    }

    /// Which of `held` (wishing `wished`, if any) `credential` proves, and consumes that
    /// commitment: a credential serves once.
    pub fn take(
        &mut self,
        held: impl IntoIterator<Item = NodeId>,
        wished: Option<NodeId>,
        credential: Option<&[u8; CREDENTIAL_LEN]>,
    ) -> Result<NodeId, Refusal> {
        let credential = credential.ok_or(Refusal::NoCredential)?;
        let commit = commitment(credential);
        let id = held
            .into_iter()
            .filter(|id| wished.is_none_or(|w| w == *id))
            .find(|id| self.commits.get(id) == Some(&commit))
            .ok_or(Refusal::Mismatch)?;
        self.commits.remove(&id);
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_credential_proves_only_its_own_rank_and_only_once() {
        let (a, b) = (NodeId(8), NodeId(10));
        let (ca, cb) = (fresh(), fresh());
        assert_ne!(ca, cb, "fresh credentials differ");
        let mut creds = Credentials::default();
        creds.commit(a, commitment(&ca));
        creds.commit(b, commitment(&cb));
        assert_eq!(creds.take([a, b], None, None), Err(Refusal::NoCredential));
        assert_eq!(
            creds.take([a, b], None, Some(&fresh())),
            Err(Refusal::Mismatch)
        );
        // b's credential does not take a's rank, whatever is wished.
        assert_eq!(creds.take([a], None, Some(&cb)), Err(Refusal::Mismatch));
        assert_eq!(
            creds.take([a, b], Some(a), Some(&cb)),
            Err(Refusal::Mismatch)
        );
        assert_eq!(creds.take([a, b], None, Some(&cb)), Ok(b));
        // Used: a replay is refused until b commits again.
        assert_eq!(creds.take([b], None, Some(&cb)), Err(Refusal::Mismatch));
        assert!(!creds.has(b) && creds.has(a));
        assert_eq!(creds.take([a, b], Some(a), Some(&ca)), Ok(a));
    }
}
