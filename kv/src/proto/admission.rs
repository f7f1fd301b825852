//! Who may connect to a node of a kv job: every node draws a random token of its own and
//! proves the id it claims with it; an id the job never assigned, or a known id with the
//! wrong token, is refused by the transport before any message is read.
//!
//! A token never leaves its node except inside its hellos, which a job secret seals. The
//! node registers a commitment to it ([`commitment`]: a hash of the token), and the
//! scheduler's table carries only commitments, which check a presented token without giving
//! the means to present it. So a member of the job cannot claim another member's id, nor
//! the scheduler's (before, every `Assign` carried every token, so any member could speak as
//! any other, send `Shutdown` as the scheduler or `init` as worker 0), and a member that is
//! also on the network path reads no token in the tables either (before, the scheduler drew
//! the tokens and sent each node its own in its `Assign`, tagged but in clear).
//!
//! Registration is the one door without a token: the scheduler lets in provisional ids (a
//! node that has not been assigned yet), and only ever takes `Register` from them. Servers
//! and workers refuse provisional ids, and the scheduler too once every node is assigned.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use psnet_transport::{Admission, NodeId, Proof, PROOF_LEN};
use sha2::{Digest, Sha256};

use super::ids::{self, describe};
use super::msg::NodeInfo;

/// The commitment other nodes keep for `token`: the first bytes of a SHA-256 of it.
pub fn commitment(token: &Proof) -> Proof {
    let mut h = Sha256::new();
    h.update(b"psnet kv node token v1");
    h.update(token.0);
    let digest = h.finalize();
    let mut c = [0u8; PROOF_LEN];
    c.copy_from_slice(&digest[..PROOF_LEN]);
    Proof(c)
}

/// The admission policy of one node of a kv job.
pub struct JobAdmission {
    /// This node's id and token, presented when it dials.
    own: Mutex<Option<(NodeId, Proof)>>,
    /// Every known node's commitment.
    commits: Mutex<HashMap<NodeId, Proof>>,
    registrations: AtomicBool,
    /// A node waiting for its assignment: it takes no connection but the scheduler's.
    joining: bool,
}

impl JobAdmission {
    /// The scheduler's policy: registrations (provisional ids) are let in, assigned ids must
    /// prove themselves. `own` is the scheduler's token.
    pub fn scheduler(own: Proof) -> Self {
        JobAdmission {
            own: Mutex::new(Some((ids::SCHEDULER, own))),
            commits: Mutex::new(HashMap::from([(ids::SCHEDULER, commitment(&own))])),
            registrations: AtomicBool::new(true),
            joining: false,
        }
    }

    /// A server's or worker's policy before its assignment: it knows nobody's token, so it
    /// takes no claim of any id but the scheduler's, which it dials itself. (Before, a
    /// process claiming to be server 0 was believed by a worker that had no table yet, and
    /// kept as server 0 afterwards.) Replaced by [`Self::member`] once the table arrives;
    /// the connection to the scheduler is then made again and checked.
    pub fn joining() -> Self {
        JobAdmission {
            own: Mutex::new(None),
            commits: Mutex::new(HashMap::new()),
            registrations: AtomicBool::new(false),
            joining: true,
        }
    }

    /// A server's or worker's policy, from its assignment: `own` is the token it drew and
    /// registered a commitment to, `nodes` the table it received (commitments only).
    pub fn member(id: NodeId, own: Proof, nodes: &[NodeInfo]) -> Self {
        let admission = JobAdmission {
            own: Mutex::new(Some((id, own))),
            commits: Mutex::new(HashMap::new()),
            registrations: AtomicBool::new(false),
            joining: false,
        };
        admission.learn(nodes);
        admission
    }

    /// Adds (or replaces) the commitments of `nodes` (a table, or a `Rejoined`
    /// announcement).
    pub fn learn(&self, nodes: &[NodeInfo]) {
        let mut commits = lock(&self.commits);
        for n in nodes {
            commits.insert(n.id, n.commit);
        }
    }

    /// Stops letting in provisional ids: once every node is assigned, nobody registers.
    pub fn close_registrations(&self) {
        self.set_registrations(false);
    }

    /// Lets provisional ids in (registrations) or not: the scheduler opens them again
    /// while a lost server's rank is held for it to rejoin.
    pub fn set_registrations(&self, open: bool) {
        self.registrations.store(open, Ordering::Release);
    }
}

/// Single inserts and lookups: a poisoned lock's data is still consistent.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Admission for JobAdmission {
    fn proof(&self, local: NodeId) -> Option<Proof> {
        let own = *lock(&self.own);
        own.filter(|(id, _)| *id == local).map(|(_, token)| token)
    }

    fn admit(&self, peer: NodeId, proof: Option<&Proof>) -> Result<(), String> {
        if self.joining {
            return if peer == ids::SCHEDULER {
                Ok(())
            } else {
                Err(format!(
                    "this node has no assignment yet: it takes no connection but the \
                     scheduler's, and {} is not it",
                    describe(peer)
                ))
            };
        }
        if ids::is_provisional(peer) {
            return if self.registrations.load(Ordering::Acquire) {
                Ok(())
            } else {
                Err(format!(
                    "{peer} has no assigned id, and registrations are closed"
                ))
            };
        }
        let commits = lock(&self.commits);
        let Some(commit) = commits.get(&peer) else {
            return Err(format!("{} was never assigned in this job", describe(peer)));
        };
        match proof {
            None => Err(format!("{} came without its job token", describe(peer))),
            Some(p) if !commitment(p).matches(commit) => {
                Err(format!("{} came with a wrong job token", describe(peer)))
            }
            Some(_) => Ok(()),
        }
    }
}

/// A fresh random token from the operating system.
pub fn random_token() -> Proof {
    let mut bytes = [0u8; psnet_transport::PROOF_LEN];
    // The system's random source failing is beyond recovery for a job that must not be
    // joinable by guessing: fall back to the clock and address-space layout rather than
    // zeros, and say so.
    if let Err(e) = getrandom::fill(&mut bytes) {
        tracing::error!(error = %e, "no system randomness: job tokens are guessable");
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
            ^ (&bytes as *const _ as usize as u128);
        bytes.copy_from_slice(&seed.to_le_bytes());
    }
    Proof(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::ids::{node_id, provisional_id, Role, SCHEDULER};

    #[test]
    fn a_node_without_its_assignment_takes_only_the_scheduler() {
        let a = JobAdmission::joining();
        assert!(a.admit(SCHEDULER, None).is_ok());
        for id in [node_id(Role::Server, 0), node_id(Role::Worker, 1)] {
            let err = a.admit(id, Some(&Proof([1; 16]))).unwrap_err();
            assert!(err.contains("no assignment yet"), "{err}");
        }
        let prov = provisional_id("127.0.0.1:5".parse().unwrap());
        assert!(a.admit(prov, None).is_err());
        assert_eq!(a.proof(SCHEDULER), None);
    }

    /// The second hardening round's findings: every member held every token, so worker 1
    /// could speak as worker 0 or as the scheduler; and each node's token crossed the wire in
    /// its assignment. A member now knows only its own token, which it drew itself.
    #[test]
    fn a_member_knows_only_its_own_token_and_the_table_carries_none() {
        let (w0, w1) = (node_id(Role::Worker, 0), node_id(Role::Worker, 1));
        let table = [info(SCHEDULER, 1), info(w0, 2), info(w1, 3)];
        for n in &table {
            assert!(
                !(1..=3).any(|t| n.commit == Proof([t; 16])),
                "a table entry carries a token"
            );
        }
        let a = JobAdmission::member(w1, Proof([3; 16]), &table);
        assert_eq!(a.proof(w1), Some(Proof([3; 16])));
        assert_eq!(a.proof(w0), None, "cannot present another's id");
        assert_eq!(a.proof(SCHEDULER), None);
        // What it received for the scheduler and worker 0 does not pass as their tokens.
        for (id, n) in [(SCHEDULER, 0), (w0, 1)] {
            assert!(a.admit(id, Some(&table[n].commit)).is_err());
        }
        // Their real tokens do.
        assert!(a.admit(SCHEDULER, Some(&Proof([1; 16]))).is_ok());
        assert!(a.admit(w0, Some(&Proof([2; 16]))).is_ok());
    }

    /// A table entry for a node whose token is `[token; 16]`.
    fn info(id: NodeId, token: u8) -> NodeInfo {
        NodeInfo {
            id,
            role: Role::Worker,
            rank: 0,
            addr: "127.0.0.1:1".parse().unwrap(),
            commit: commitment(&Proof([token; psnet_transport::PROOF_LEN])),
        }
    }

    #[test]
    fn members_admit_only_assigned_ids_with_their_token() {
        let w0 = node_id(Role::Worker, 0);
        let a = JobAdmission::member(w0, Proof([2; 16]), &[info(SCHEDULER, 1), info(w0, 2)]);
        assert_eq!(a.proof(w0), Some(Proof([2; 16])));
        assert!(a.admit(w0, Some(&Proof([2; 16]))).is_ok());
        let wrong = a.admit(w0, Some(&Proof([3; 16]))).unwrap_err();
        assert!(wrong.contains("wrong job token"), "{wrong}");
        assert!(a.admit(w0, None).unwrap_err().contains("without"));
        let unknown = node_id(Role::Worker, 5);
        let err = a.admit(unknown, Some(&Proof([2; 16]))).unwrap_err();
        assert!(err.contains("never assigned"), "{err}");
        let prov = provisional_id("127.0.0.1:5".parse().unwrap());
        assert!(a.admit(prov, None).is_err());
    }

    #[test]
    fn the_scheduler_takes_registrations_and_learns_commitments() {
        let s = JobAdmission::scheduler(Proof([9; 16]));
        let prov = provisional_id("127.0.0.1:5".parse().unwrap());
        assert!(s.admit(prov, None).is_ok());
        assert_eq!(s.proof(SCHEDULER), Some(Proof([9; 16])));
        let w0 = node_id(Role::Worker, 0);
        assert!(s.admit(w0, Some(&Proof([4; 16]))).is_err());
        s.learn(&[info(w0, 4)]);
        assert!(s.admit(w0, Some(&Proof([4; 16]))).is_ok());
        s.close_registrations();
        assert!(s
            .admit(prov, None)
            .unwrap_err()
            .contains("registrations are closed"));
    }

    #[test]
    fn random_tokens_differ() {
        assert_ne!(random_token(), random_token());
    }
}
