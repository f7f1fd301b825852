//! Who may connect to a node of a kv job: every node draws an identity of its own (an
//! Ed25519 key) and proves the id it claims with it; an id the job never assigned, or a
//! known id without its identity's proof, is refused by the transport before any message is
//! read.
//!
//! A node registers the public half of its identity, and the scheduler's table carries only
//! public halves: they check a proof without giving the means to make one. So a member of
//! the job cannot claim another member's id, nor the scheduler's (before the second
//! hardening round, every `Assign` carried every token, so any member could speak as any
//! other, send `Shutdown` as the scheduler or `init` as worker 0).
//!
//! A proof is a signature over the connection's binding ([`psnet_transport::Binding`]). With
//! a job secret, the binding comes from the connection's session, which only its two ends
//! know. Before, a hello carried a bearer token: a member of the job in the middle of a
//! connection (it holds the job's secret, so it can run an exchange with each end) read a
//! node's token from the hello it was sent and presented it to the other end as that node.
//! Now what it reads is a signature over its own session with that node, which the other
//! end, on another session, refuses.
//!
//! Registration is the one door without a proof: the scheduler lets in provisional ids (a
//! node that has not been assigned yet), and only ever takes `Register` from them. Servers
//! and workers refuse provisional ids, and the scheduler too once every node is assigned.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use psnet_transport::session::Role;
use psnet_transport::{Admission, Binding, Identity, NodeId, Proof, PublicIdentity, Refusal};
use sha2::{Digest, Sha256};

use super::ids::{self, describe};
use super::msg::NodeInfo;

/// The admission policy of one node of a kv job.
pub struct JobAdmission {
    /// This node's id and identity, proved when it dials and answers.
    own: Mutex<Option<(NodeId, Arc<Identity>)>>,
    /// Every known node's public identity.
    known: Mutex<HashMap<NodeId, PublicIdentity>>,
    registrations: AtomicBool,
    /// A node waiting for its assignment: it takes no connection but the scheduler's.
    joining: bool,
}

impl JobAdmission {
    /// The scheduler's policy: registrations (provisional ids) are let in, assigned ids must
    /// prove themselves. `own` is the scheduler's identity.
    pub fn scheduler(own: Identity) -> Self {
        let public = own.public();
        JobAdmission {
            own: Mutex::new(Some((ids::SCHEDULER, Arc::new(own)))),
            known: Mutex::new(HashMap::from([(ids::SCHEDULER, public)])),
            registrations: AtomicBool::new(true),
            joining: false,
        }
    }

    /// A server's or worker's policy before its assignment: it knows nobody's identity, so
    /// it takes no claim of any id but the scheduler's, which it dials itself. (Before, a
    /// process claiming to be server 0 was believed by a worker that had no table yet, and
    /// kept as server 0 afterwards.) Replaced by [`Self::member`] once the table arrives;
    /// the connection to the scheduler is then made again and checked.
    pub fn joining() -> Self {
        JobAdmission {
            own: Mutex::new(None),
            known: Mutex::new(HashMap::new()),
            registrations: AtomicBool::new(false),
            joining: true,
        }
    }

    /// A server's or worker's policy, from its assignment: `own` is the identity it drew and
    /// registered the public half of, `nodes` the table it received.
    pub fn member(id: NodeId, own: Identity, nodes: &[NodeInfo]) -> Self {
        let admission = JobAdmission {
            own: Mutex::new(Some((id, Arc::new(own)))),
            known: Mutex::new(HashMap::new()),
            registrations: AtomicBool::new(false),
            joining: false,
        };
        admission.learn(nodes);
        admission
    }

    /// Adds (or replaces) the public identities of `nodes` (a table, or a `Rejoined`
    /// announcement).
    pub fn learn(&self, nodes: &[NodeInfo]) {
        let mut known = lock(&self.known);
        for n in nodes {
            known.insert(n.id, n.identity);
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
    fn proof(&self, local: NodeId, binding: &Binding) -> Option<Proof> {
        let own = lock(&self.own).clone();
        own.filter(|(id, _)| *id == local)
            .map(|(id, identity)| identity.prove(id, binding))
    }

    fn admit(&self, peer: NodeId, proof: Option<&Proof>, binding: &Binding) -> Result<(), Refusal> {
        if self.joining {
            return if peer == ids::SCHEDULER && binding.sender() == Role::Acceptor {
                Ok(())
            } else if peer == ids::SCHEDULER {
                // The scheduler never dials a node before its assignment, and this node
                // cannot check a scheduler's proof yet: a process dialling in under the
                // scheduler's id would otherwise replace the connection to the real one and
                // hand this node a table of its own.
                Err(Refusal::NotMember(
                    "this node has no assignment yet: it dialled the scheduler itself, and \
                     takes no connection that says it comes from the scheduler"
                        .to_string(),
                ))
            } else {
                Err(Refusal::NotYet(format!(
                    "this node has no assignment yet: it takes no connection but the \
                     scheduler's, and {} is not it",
                    describe(peer)
                )))
            };
        }
        if ids::is_provisional(peer) {
            return if self.registrations.load(Ordering::Acquire) {
                Ok(())
            } else {
                Err(Refusal::NotMember(format!(
                    "{peer} has no assigned id, and registrations are closed"
                )))
            };
        }
        let Some(public) = lock(&self.known).get(&peer).copied() else {
            return Err(Refusal::NotMember(format!(
                "{} was never assigned in this job",
                describe(peer)
            )));
        };
        match proof {
            None => Err(Refusal::NoProof(format!(
                "{} came without the proof of its id",
                describe(peer)
            ))),
            Some(p) if !public.verify(peer, binding, p) => Err(Refusal::WrongProof(format!(
                "{} came with a proof that is not its identity's on this connection (another \
                 node's, or one made for another connection)",
                describe(peer)
            ))),
            Some(_) => Ok(()),
        }
    }
}

/// `N` fresh random bytes from the operating system.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    // The system's random source failing is beyond recovery for a job that must not be
    // joinable by guessing: fall back to the clock and address-space layout rather than
    // zeros, and say so.
    if let Err(e) = getrandom::fill(&mut bytes) {
        tracing::error!(error = %e, "no system randomness: job identities are guessable");
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
            ^ (&bytes as *const _ as usize as u128);
        for (i, chunk) in bytes.chunks_mut(32).enumerate() {
            let block = Sha256::new()
                .chain_update(seed.to_le_bytes())
                .chain_update(i.to_le_bytes())
                .finalize();
            chunk.copy_from_slice(&block[..chunk.len()]);
        }
    }
    bytes
}

/// A fresh identity for this node.
pub fn random_identity() -> Identity {
    Identity::from_seed(random_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::ids::{node_id, provisional_id, Role, SCHEDULER};
    use psnet_transport::session::{Role as End, SessionBase};

    fn identity(n: u8) -> Identity {
        Identity::from_seed([n; 32])
    }

    fn binding(seed: u8) -> Binding {
        Binding::new(Some(&SessionBase::from_bytes([seed; 32])), End::Dialler)
    }

    /// A table entry for a node whose identity is `identity(n)`.
    fn info(id: NodeId, n: u8) -> NodeInfo {
        NodeInfo {
            id,
            role: Role::Worker,
            rank: 0,
            addr: "127.0.0.1:1".parse().unwrap(),
            identity: identity(n).public(),
        }
    }

    #[test]
    fn a_node_without_its_assignment_takes_only_the_scheduler() {
        let a = JobAdmission::joining();
        let here = binding(1);
        // The scheduler answering this node's dial is taken; one dialling in is not.
        let answered = Binding::new(Some(&SessionBase::from_bytes([1; 32])), End::Acceptor);
        assert!(a.admit(SCHEDULER, None, &answered).is_ok());
        let err = a.admit(SCHEDULER, None, &here).unwrap_err();
        assert!(
            matches!(&err, Refusal::NotMember(m) if m.contains("dialled the scheduler itself")),
            "{err}"
        );
        for id in [node_id(Role::Server, 0), node_id(Role::Worker, 1)] {
            let proof = identity(1).prove(id, &here);
            let err = a.admit(id, Some(&proof), &here).unwrap_err();
            assert!(
                matches!(&err, Refusal::NotYet(m) if m.contains("no assignment yet")),
                "{err}"
            );
        }
        let prov = provisional_id("127.0.0.1:5".parse().unwrap());
        assert!(a.admit(prov, None, &here).is_err());
        assert_eq!(a.proof(SCHEDULER, &here), None);
    }

    /// A member proves only its own id, and what the table says of the others proves
    /// nothing.
    #[test]
    fn a_member_proves_only_its_own_id() {
        let (w0, w1) = (node_id(Role::Worker, 0), node_id(Role::Worker, 1));
        let here = binding(1);
        let table = [info(SCHEDULER, 1), info(w0, 2), info(w1, 3)];
        let a = JobAdmission::member(w1, identity(3), &table);
        assert!(identity(3)
            .public()
            .verify(w1, &here, &a.proof(w1, &here).unwrap()));
        assert_eq!(a.proof(w0, &here), None, "cannot present another's id");
        assert_eq!(a.proof(SCHEDULER, &here), None);
        // Worker 1 signing as the scheduler or as worker 0 is refused by the others.
        let other = JobAdmission::member(w0, identity(2), &table);
        for id in [SCHEDULER, w0] {
            let forged = identity(3).prove(id, &here);
            assert!(other.admit(id, Some(&forged), &here).is_err());
        }
        assert!(other
            .admit(SCHEDULER, Some(&identity(1).prove(SCHEDULER, &here)), &here)
            .is_ok());
    }

    /// The member in the middle: it holds a session with worker 0 and another with worker 1.
    /// Worker 0's proof from its hello on the first passes there and nowhere else.
    #[test]
    fn a_proof_read_on_one_connection_is_refused_on_another() {
        let (w0, w1) = (node_id(Role::Worker, 0), node_id(Role::Worker, 1));
        let table = [info(SCHEDULER, 1), info(w0, 2), info(w1, 3)];
        let worker0 = JobAdmission::member(w0, identity(2), &table);
        let worker1 = JobAdmission::member(w1, identity(3), &table);
        let (with_w0, with_w1) = (binding(7), binding(8));
        let read = worker0.proof(w0, &with_w0).unwrap();
        assert!(worker1.admit(w0, Some(&read), &with_w0).is_ok());
        let err = worker1.admit(w0, Some(&read), &with_w1).unwrap_err();
        assert!(
            matches!(&err, Refusal::WrongProof(m) if m.contains("made for another connection")),
            "{err}"
        );
    }

    #[test]
    fn members_admit_only_assigned_ids_with_their_proof() {
        let w0 = node_id(Role::Worker, 0);
        let here = binding(2);
        let a = JobAdmission::member(w0, identity(2), &[info(SCHEDULER, 1), info(w0, 2)]);
        assert!(a.admit(w0, a.proof(w0, &here).as_ref(), &here).is_ok());
        let wrong = a
            .admit(w0, Some(&identity(3).prove(w0, &here)), &here)
            .unwrap_err();
        assert!(
            matches!(&wrong, Refusal::WrongProof(m) if m.contains("not its identity's")),
            "{wrong}"
        );
        assert!(matches!(
            a.admit(w0, None, &here),
            Err(Refusal::NoProof(m)) if m.contains("without")
        ));
        let unknown = node_id(Role::Worker, 5);
        let err = a
            .admit(unknown, Some(&identity(2).prove(unknown, &here)), &here)
            .unwrap_err();
        assert!(
            matches!(&err, Refusal::NotMember(m) if m.contains("never assigned")),
            "{err}"
        );
        let prov = provisional_id("127.0.0.1:5".parse().unwrap());
        assert!(a.admit(prov, None, &here).is_err());
    }

    #[test]
    fn the_scheduler_takes_registrations_and_learns_identities() {
        let here = binding(3);
        let s = JobAdmission::scheduler(identity(9));
        let prov = provisional_id("127.0.0.1:5".parse().unwrap());
        assert!(s.admit(prov, None, &here).is_ok());
        assert!(identity(9)
            .public()
            .verify(SCHEDULER, &here, &s.proof(SCHEDULER, &here).unwrap()));
        let w0 = node_id(Role::Worker, 0);
        let proof = identity(4).prove(w0, &here);
        assert!(s.admit(w0, Some(&proof), &here).is_err());
        s.learn(&[info(w0, 4)]);
        assert!(s.admit(w0, Some(&proof), &here).is_ok());
        s.close_registrations();
        assert!(matches!(
            s.admit(prov, None, &here),
            Err(Refusal::NotMember(m)) if m.contains("registrations are closed")
        ));
    }

    #[test]
    fn random_identities_differ() {
        assert_ne!(random_identity().public(), random_identity().public());
        assert_ne!(random_bytes::<16>(), random_bytes::<16>());
    }
}
