//! Who may connect to a node of a kv job: the scheduler issues every node a random token with
//! its id, every node learns the tokens of the job from its assignment, and from then on a
//! connection must prove the id it claims. An id the job never assigned, or a known id with
//! the wrong token, is refused by the transport before any message is read.
//!
//! Registration is the one door without a token: the scheduler lets in provisional ids (a
//! node that has not been assigned yet), and only ever takes `Register` from them. Servers
//! and workers refuse provisional ids, and the scheduler too once every node is assigned.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use psnet_transport::{Admission, NodeId, Proof};

use super::ids::{self, describe};
use super::msg::NodeInfo;

/// The admission policy of one node of a kv job.
pub struct JobAdmission {
    tokens: Mutex<HashMap<NodeId, Proof>>,
    registrations: AtomicBool,
}

impl JobAdmission {
    /// The scheduler's policy: registrations (provisional ids) are let in, assigned ids must
    /// prove themselves. `own` is the scheduler's token.
    pub fn scheduler(own: Proof) -> Self {
        JobAdmission {
            tokens: Mutex::new(HashMap::from([(ids::SCHEDULER, own)])),
            registrations: AtomicBool::new(true),
        }
    }

    /// A server's or worker's policy, from the nodes of its assignment.
    pub fn member(nodes: &[NodeInfo]) -> Self {
        let admission = JobAdmission {
            tokens: Mutex::new(HashMap::new()),
            registrations: AtomicBool::new(false),
        };
        admission.learn(nodes);
        admission
    }

    /// Adds (or replaces) the tokens of `nodes`.
    pub fn learn(&self, nodes: &[NodeInfo]) {
        let mut tokens = self.lock();
        for n in nodes {
            tokens.insert(n.id, n.token);
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

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<NodeId, Proof>> {
        // Single inserts and lookups: a poisoned map is still consistent.
        self.tokens.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Admission for JobAdmission {
    fn proof(&self, local: NodeId) -> Option<Proof> {
        self.lock().get(&local).copied()
    }

    fn admit(&self, peer: NodeId, proof: Option<&Proof>) -> Result<(), String> {
        if ids::is_provisional(peer) {
            return if self.registrations.load(Ordering::Acquire) {
                Ok(())
            } else {
                Err(format!(
                    "{peer} has no assigned id, and registrations are closed"
                ))
            };
        }
        let tokens = self.lock();
        let Some(token) = tokens.get(&peer) else {
            return Err(format!("{} was never assigned in this job", describe(peer)));
        };
        match proof {
            None => Err(format!("{} came without its job token", describe(peer))),
            Some(p) if !p.matches(token) => {
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

    fn info(id: NodeId, token: u8) -> NodeInfo {
        NodeInfo {
            id,
            role: Role::Worker,
            rank: 0,
            addr: "127.0.0.1:1".parse().unwrap(),
            token: Proof([token; psnet_transport::PROOF_LEN]),
        }
    }

    #[test]
    fn members_admit_only_assigned_ids_with_their_token() {
        let w0 = node_id(Role::Worker, 0);
        let a = JobAdmission::member(&[info(SCHEDULER, 1), info(w0, 2)]);
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
    fn the_scheduler_takes_registrations_and_learns_tokens() {
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
