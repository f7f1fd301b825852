//! Who may connect: the proof of identity a node presents in its hello, and the policy that
//! decides on the hellos a node receives.
//!
//! A transport on its own believes the node id a hello claims. A job that knows its members
//! (the kv scheduler's table, a communicator's join) installs an [`Admission`] with
//! [`Transport::set_admission`](crate::Transport::set_admission): from then on each hello
//! carries the sender's [`Proof`], hellos that fail the policy are refused with its reason,
//! and only a connection that proves its id may take the place of a live one.
//!
//! A proof is bound to the connection it opens ([`Binding`]): with a job secret, to the
//! session both ends derived from their exchange ([`crate::auth`]), which is different on
//! every connection and known only to its two ends. So a proof read on one connection is
//! worth nothing on another. That matters against a member of the job that sits in the middle
//! of a connection: it holds the job's secret, so it can run an exchange with each end and
//! read both hellos, but it cannot turn one end's proof into a proof for the other
//! connection. The proof itself is either
//!
//! - a signature under the sender's own [`Identity`], checked against the
//!   [`PublicIdentity`] the job's table lists for its id: nobody else can make it, the other
//!   members included (the kv store); or
//! - a MAC under a key every member shares ([`Proof::shared`]): any member can make it for
//!   any member's id, a non-member cannot (a communicator's ranks).
//!
//! Without a secret there is no session: the binding is the same on every connection, and a
//! proof seen on the path can be presented again (an open job).

use std::fmt;

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};

use crate::node::NodeId;
use crate::session::{Role, SessionBase};

/// Bytes of a [`Proof`]: an Ed25519 signature, or a MAC of the same length.
pub const PROOF_LEN: usize = 64;
/// Bytes of a [`PublicIdentity`].
pub const IDENTITY_LEN: usize = 32;

/// What a hello presents to prove its node id on one connection.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Proof(pub [u8; PROOF_LEN]);

impl Proof {
    /// Compares in time independent of where the bytes differ, so that a peer probing the
    /// acceptor cannot learn a proof byte by byte.
    pub fn matches(&self, other: &Proof) -> bool {
        self.0
            .iter()
            .zip(other.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }

    /// The proof of `signer` on the connection of `binding` under a key every member shares:
    /// a keyed BLAKE3 of both. Only a holder of `key` makes it; every holder can make it for
    /// every id.
    pub fn shared(key: &[u8], signer: NodeId, binding: &Binding) -> Proof {
        let key = blake3::derive_key("psnet 2026-11 shared hello proof key", key);
        let mut hasher = blake3::Hasher::new_keyed(&key);
        hasher.update(&binding.key);
        hasher.update(&signer.0.to_le_bytes());
        let mut out = [0u8; PROOF_LEN];
        hasher.finalize_xof().fill(&mut out);
        Proof(out)
    }
}

impl fmt::Debug for Proof {
    // Proofs are credentials on an open job: never print them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Proof(..)")
    }
}

/// What a hello's proof is bound to: one connection, and which end of it sends the hello.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    key: [u8; 32],
    sender: Role,
}

impl Binding {
    /// The binding of the hello that the `sender` end of a connection sends: from the
    /// connection's session where the job has a secret (`session`), else the same for every
    /// connection (an open job).
    pub fn new(session: Option<&SessionBase>, sender: Role) -> Self {
        let context = match sender {
            Role::Dialler => "psnet 2026-11 hello binding dialler",
            Role::Acceptor => "psnet 2026-11 hello binding acceptor",
        };
        Binding {
            key: blake3::derive_key(context, session.map_or(&[0u8; 32], |s| s.material())),
            sender,
        }
    }

    /// Which end of the connection sends the hello bound to this: to the node checking it,
    /// [`Role::Acceptor`] says the peer answered a dial of this node's own, [`Role::Dialler`]
    /// that the peer dialled in.
    pub fn sender(&self) -> Role {
        self.sender
    }
}

impl fmt::Debug for Binding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Binding(..)")
    }
}

/// What a signature covers: a label, the connection and the id claimed.
fn signed_message(signer: NodeId, binding: &Binding) -> [u8; 60] {
    const LABEL: &[u8; 20] = b"psnet hello proof v1";
    let mut m = [0u8; 60];
    m[..20].copy_from_slice(LABEL);
    m[20..52].copy_from_slice(&binding.key);
    m[52..].copy_from_slice(&signer.0.to_le_bytes());
    m
}

/// A node's own identity: an Ed25519 key it draws for itself at start. Only its public half
/// ([`Self::public`]) leaves the node. Never printed.
pub struct Identity(SigningKey);

impl Identity {
    /// The identity of a given seed (tests, which need the same keys every run).
    pub fn from_seed(seed: [u8; 32]) -> Self {
        Identity(SigningKey::from_bytes(&seed))
    }

    /// What the job's table lists for this node.
    pub fn public(&self) -> PublicIdentity {
        PublicIdentity(self.0.verifying_key().to_bytes())
    }

    /// The proof that this node is `signer` on the connection of `binding`.
    pub fn prove(&self, signer: NodeId, binding: &Binding) -> Proof {
        Proof(self.0.sign(&signed_message(signer, binding)).to_bytes())
    }
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Identity({:?})", self.public())
    }
}

/// The public half of a node's [`Identity`], as the job's table lists it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PublicIdentity(pub [u8; IDENTITY_LEN]);

impl PublicIdentity {
    /// Whether `proof` is this identity's proof of `signer` on the connection of `binding`.
    /// Bytes that are no public key at all check nothing.
    pub fn verify(&self, signer: NodeId, binding: &Binding, proof: &Proof) -> bool {
        let Ok(key) = VerifyingKey::from_bytes(&self.0) else {
            return false;
        };
        key.verify_strict(
            &signed_message(signer, binding),
            &Signature::from_bytes(&proof.0),
        )
        .is_ok()
    }
}

impl fmt::Debug for PublicIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicIdentity(")?;
        for b in &self.0[..6] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

/// The admission policy of one node.
pub trait Admission: Send + Sync + 'static {
    /// The proof this node presents in its hello on the connection of `binding` while its id
    /// is `local` (`None`: none).
    fn proof(&self, local: NodeId, binding: &Binding) -> Option<Proof>;

    /// Whether a connection that claims to be `peer`, with `proof` made for `binding` (the
    /// binding of the peer's hello on this connection), is let in; the refusal's text is sent
    /// back to the dialler and logged with its address.
    fn admit(&self, peer: NodeId, proof: Option<&Proof>, binding: &Binding) -> Result<(), Refusal>;
}

/// Why a connection is not let in. Its text travels back to the dialler, which sees it in
/// [`crate::TransportError::Handshake`]; the kind decides how loudly the refusal is logged.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Not now: this node is still joining and takes no such connection yet. Expected while a
    /// job forms; the dialler may try again.
    #[error("{0}")]
    NotYet(String),
    /// The claimed id is none this node lets in: not a member, never assigned, or a
    /// registration while registrations are closed.
    #[error("{0}")]
    NotMember(String),
    /// The claimed id needs a proof and none came.
    #[error("{0}")]
    NoProof(String),
    /// A proof came that is not the claimed id's on this connection.
    #[error("{0}")]
    WrongProof(String),
}

impl Refusal {
    /// Whether the refusal is part of a job forming, not a sign of a stranger or a fault.
    pub fn is_expected(&self) -> bool {
        matches!(self, Refusal::NotYet(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn binding(seed: u8, sender: Role) -> Binding {
        Binding::new(Some(&SessionBase::from_bytes([seed; 32])), sender)
    }

    #[test]
    fn proofs_match_only_themselves_and_never_print() {
        let a = Proof([7; PROOF_LEN]);
        let mut b = a;
        assert!(a.matches(&b));
        b.0[PROOF_LEN - 1] ^= 1;
        assert!(!a.matches(&b));
        assert_eq!(format!("{a:?}"), "Proof(..)");
        assert!(!format!("{:?}", Identity::from_seed([3; 32])).contains("0303"));
    }

    /// A member in the middle of a connection reads a node's proof from the hello it was
    /// sent on its own connection with that node; the connection it forwards it on has
    /// another session, so another binding.
    #[test]
    fn a_signed_proof_passes_only_for_its_signer_id_connection_and_end() {
        let alice = Identity::from_seed([1; 32]);
        let public = alice.public();
        let id = NodeId(9);
        let here = binding(1, Role::Dialler);
        let proof = alice.prove(id, &here);
        assert!(public.verify(id, &here, &proof));
        assert!(!public.verify(NodeId(11), &here, &proof), "another id");
        assert!(
            !public.verify(id, &binding(2, Role::Dialler), &proof),
            "another connection"
        );
        assert!(
            !public.verify(id, &binding(1, Role::Acceptor), &proof),
            "the other end"
        );
        let mallory = Identity::from_seed([2; 32]);
        assert!(
            !public.verify(id, &here, &mallory.prove(id, &here)),
            "another key"
        );
        assert!(
            !PublicIdentity([0xff; 32]).verify(id, &here, &proof),
            "no key at all"
        );
    }

    #[test]
    fn without_a_session_every_connection_has_the_same_binding() {
        assert_eq!(
            Binding::new(None, Role::Dialler),
            Binding::new(None, Role::Dialler)
        );
        assert_ne!(
            Binding::new(None, Role::Dialler),
            Binding::new(None, Role::Acceptor)
        );
        assert_ne!(Binding::new(None, Role::Dialler), binding(1, Role::Dialler));
    }

    proptest! {
        /// Any bit flipped in a proof, or in the connection it is checked for, fails it.
        #[test]
        fn any_flipped_bit_fails_a_proof(bit in 0usize..(PROOF_LEN * 8), base_bit in 0usize..256, shared in any::<bool>()) {
            let id = NodeId(8);
            let here = binding(5, Role::Acceptor);
            let alice = Identity::from_seed([4; 32]);
            let key = [9u8; 16];
            let proof = if shared { Proof::shared(&key, id, &here) } else { alice.prove(id, &here) };
            let passes = |p: &Proof, b: &Binding| if shared {
                Proof::shared(&key, id, b).matches(p)
            } else {
                alice.public().verify(id, b, p)
            };
            prop_assert!(passes(&proof, &here));
            let mut flipped = proof;
            flipped.0[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(!passes(&flipped, &here));
            let mut other = [5u8; 32];
            other[base_bit / 8] ^= 1 << (base_bit % 8);
            let elsewhere = Binding::new(Some(&SessionBase::from_bytes(other)), Role::Acceptor);
            prop_assert!(!passes(&proof, &elsewhere));
        }
    }
}
