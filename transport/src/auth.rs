//! Proving knowledge of the job's shared secret (`PSNET_SECRET` / `PSNET_SECRET_FILE`) when a
//! connection opens, before either side says who it is.
//!
//! Three messages, each a handshake frame, precede the hello:
//!
//! 1. dialler → acceptor, [`FrameKind::AuthHello`](crate::FrameKind::AuthHello): version, the
//!    dialler's fresh nonce `nd` and a fresh X25519 public key `pd`;
//! 2. acceptor → dialler, [`FrameKind::AuthChallenge`](crate::FrameKind::AuthChallenge): the
//!    acceptor's fresh nonce `na`, its fresh X25519 public key `pa`, and
//!    `HMAC-SHA256(secret, "psnet-auth-v2 acceptor" ‖ nd ‖ na ‖ pd ‖ pa)`;
//! 3. dialler → acceptor, [`FrameKind::AuthProof`](crate::FrameKind::AuthProof):
//!    `HMAC-SHA256(secret, "psnet-auth-v2 dialler" ‖ nd ‖ na ‖ pd ‖ pa)`.
//!
//! Each side proves the secret over both nonces and both public keys, so a recorded exchange
//! is worth nothing on another connection, nobody without the secret can put in keys of its
//! own, and the labels differ by role, so an acceptor's answer cannot be reflected back to it
//! as a dialler's proof. MACs are compared in constant time. The dialler may send its hello
//! right behind its proof; the acceptor reads nothing of it until the proof checks out.
//!
//! The exchange also leaves both ends a session secret (`session_base`), from which
//! [`crate::session`] derives the keys that tag (and seal) every later frame: an HMAC under the
//! job's secret of the transcript and of the X25519 shared secret of the two fresh keys. So a
//! process that holds the job's secret but only watches the connection (another member of
//! the job on the path) cannot derive the session's keys: it would need one of the two
//! private keys, which never leave their ends. One that sits in the middle and runs an
//! exchange with each end can; that is the limit of a shared secret. What it cannot do is
//! speak as either end: each hello's proof of its node id is bound to the session it was made
//! on ([`crate::Binding`]), so a proof it reads on one connection fails on the other.
//!
//! This module only computes and checks messages; transports move them.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use x25519_dalek::{PublicKey, StaticSecret};

use crate::session::SessionBase;

/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of an X25519 public key.
pub const KEY_LEN: usize = 32;
/// Bytes of a MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;
/// Version of the exchange, the first byte of the dialler's message. 2: fresh X25519 keys.
pub const AUTH_VERSION: u8 = 2;
/// Bytes of the dialler's first message: version, nonce and public key.
pub const HELLO_LEN: usize = 1 + NONCE_LEN + KEY_LEN;
/// Bytes of the acceptor's challenge: its nonce, its public key and its MAC.
pub const CHALLENGE_LEN: usize = NONCE_LEN + KEY_LEN + MAC_LEN;
/// Bytes of the dialler's proof.
pub const PROOF_MSG_LEN: usize = MAC_LEN;
/// Longest secret accepted: a secret is a password or a key, not a file's worth of data.
pub const MAX_SECRET_LEN: usize = 4096;

const ACCEPTOR_LABEL: &[u8] = b"psnet-auth-v2 acceptor";
const DIALLER_LABEL: &[u8] = b"psnet-auth-v2 dialler";
const SESSION_LABEL: &[u8] = b"psnet-auth-v2 session";

pub(crate) type HmacSha256 = Hmac<Sha256>;

/// Why an acceptor with a secret refuses a dialler that opened without one.
pub const REFUSE_NO_PROOF: &str = "this job requires its shared secret (PSNET_SECRET or \
     PSNET_SECRET_FILE) and the connection presented none";
/// Why an acceptor without a secret refuses a dialler that opened with one.
pub const REFUSE_UNEXPECTED_PROOF: &str = "the dialler proves a shared secret but this node \
     has none: every node of a job must set the same PSNET_SECRET or PSNET_SECRET_FILE";

/// The job's shared secret. Never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// A secret of these bytes: not empty, at most [`MAX_SECRET_LEN`] bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, AuthError> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Err(AuthError::BadSecret("the secret is empty".into()));
        }
        if bytes.len() > MAX_SECRET_LEN {
            return Err(AuthError::BadSecret(format!(
                "the secret is {} bytes; at most {MAX_SECRET_LEN} are accepted",
                bytes.len()
            )));
        }
        Ok(Secret(bytes))
    }

    /// The HMAC under the secret of `label` and the exchange's transcript.
    fn mac(&self, label: &[u8], transcript: &Transcript) -> HmacSha256 {
        // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
        let mut mac = match HmacSha256::new_from_slice(&self.0) {
            Ok(m) => m,
            Err(_) => unreachable!("HMAC accepts keys of every length"),
        };
        mac.update(label);
        mac.update(&transcript.dialler_nonce);
        mac.update(&transcript.acceptor_nonce);
        mac.update(&transcript.dialler_key);
        mac.update(&transcript.acceptor_key);
        mac
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Why an authentication exchange failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The secret itself is unusable.
    #[error("{0}")]
    BadSecret(String),
    /// A message had the wrong size or version: not a psnet peer, or another version.
    #[error("malformed authentication message: {0}")]
    Malformed(String),
    /// The other side's MAC does not check out: it does not know this job's secret.
    #[error("the {0} does not know this job's secret (PSNET_SECRET / PSNET_SECRET_FILE differ)")]
    WrongSecret(&'static str),
    /// No random source for a nonce.
    #[error("no random source for an authentication nonce: {0}")]
    NoRandom(String),
    /// The dialler proves no secret to a node of a job that has one.
    #[error("{}", REFUSE_NO_PROOF)]
    NoProof,
    /// The dialler proves a secret to a node of a job that has none.
    #[error("{}", REFUSE_UNEXPECTED_PROOF)]
    UnexpectedProof,
}

/// A fresh random nonce from the operating system.
pub fn fresh_nonce() -> Result<[u8; NONCE_LEN], AuthError> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|e| AuthError::NoRandom(e.to_string()))?;
    Ok(nonce)
}

/// What one end draws afresh for every exchange: its nonce and its X25519 private key.
pub struct Fresh {
    nonce: [u8; NONCE_LEN],
    key: StaticSecret,
}

impl Fresh {
    /// A nonce and a key from the operating system's random source.
    pub fn draw() -> Result<Self, AuthError> {
        Ok(Self::from_bytes(fresh_nonce()?, fresh_nonce()?))
    }

    /// From given bytes (tests, which replay exchanges).
    pub fn from_bytes(nonce: [u8; NONCE_LEN], key: [u8; 32]) -> Self {
        Fresh {
            nonce,
            key: StaticSecret::from(key),
        }
    }

    fn public(&self) -> [u8; KEY_LEN] {
        PublicKey::from(&self.key).to_bytes()
    }

    /// The shared secret with `their` public key; a key of small order (which would make
    /// it a constant anybody knows) is refused.
    fn agree(&self, their: [u8; KEY_LEN]) -> Result<[u8; 32], AuthError> {
        let shared = self.key.diffie_hellman(&PublicKey::from(their));
        if !shared.was_contributory() {
            return Err(AuthError::Malformed(
                "the peer's X25519 key is of small order".into(),
            ));
        }
        Ok(shared.to_bytes())
    }
}

/// What both MACs and the session secret cover.
struct Transcript {
    dialler_nonce: [u8; NONCE_LEN],
    acceptor_nonce: [u8; NONCE_LEN],
    dialler_key: [u8; KEY_LEN],
    acceptor_key: [u8; KEY_LEN],
}

impl Transcript {
    fn session(&self, secret: &Secret, shared: &[u8; 32]) -> SessionBase {
        let mut mac = secret.mac(SESSION_LABEL, self);
        mac.update(shared);
        SessionBase::from_mac(mac)
    }
}

fn split<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[..N]);
    out
}

/// The whole exchange between a dialler holding `dialler` and an acceptor holding `acceptor`,
/// for transports whose two ends live in one process (the in-memory network): the same
/// messages and checks as on a wire, with fresh nonces. Returns the connection's session
/// (`None` for an open job); the error is the refusal's reason.
pub fn exchange_in_process(
    dialler: Option<&Secret>,
    acceptor: Option<&Secret>,
) -> Result<Option<SessionBase>, AuthError> {
    match (dialler, acceptor) {
        (None, None) => Ok(None),
        (None, Some(_)) => Err(AuthError::NoProof),
        (Some(_), None) => Err(AuthError::UnexpectedProof),
        (Some(d), Some(a)) => {
            let (dialler, hello) = Dialler::start(d, Fresh::draw()?);
            let (acceptor, challenge) = Acceptor::handle_hello(a, &hello, Fresh::draw()?)?;
            acceptor.handle_proof(&dialler.handle_challenge(&challenge)?.0)?;
            Ok(Some(acceptor.session_base()))
        }
    }
}

/// The dialler's side of one exchange.
pub struct Dialler {
    secret: Secret,
    fresh: Fresh,
}

impl Dialler {
    /// Starts an exchange with `fresh` (drawn for every connection: [`Fresh::draw`]); returns
    /// the first message to send.
    pub fn start(secret: &Secret, fresh: Fresh) -> (Self, [u8; HELLO_LEN]) {
        let mut hello = [0u8; HELLO_LEN];
        hello[0] = AUTH_VERSION;
        hello[1..1 + NONCE_LEN].copy_from_slice(&fresh.nonce);
        hello[1 + NONCE_LEN..].copy_from_slice(&fresh.public());
        (
            Dialler {
                secret: secret.clone(),
                fresh,
            },
            hello,
        )
    }

    /// Checks the acceptor's challenge; returns the proof to send back and the connection's
    /// session secret, known only to the two ends of this exchange (see [`crate::session`]).
    pub fn handle_challenge(
        &self,
        challenge: &[u8],
    ) -> Result<([u8; PROOF_MSG_LEN], SessionBase), AuthError> {
        if challenge.len() != CHALLENGE_LEN {
            return Err(AuthError::Malformed(format!(
                "a challenge has {CHALLENGE_LEN} bytes, this one {}",
                challenge.len()
            )));
        }
        let transcript = Transcript {
            dialler_nonce: self.fresh.nonce,
            acceptor_nonce: split(challenge),
            dialler_key: self.fresh.public(),
            acceptor_key: split(&challenge[NONCE_LEN..]),
        };
        self.secret
            .mac(ACCEPTOR_LABEL, &transcript)
            .verify_slice(&challenge[NONCE_LEN + KEY_LEN..])
            .map_err(|_| AuthError::WrongSecret("acceptor"))?;
        let shared = self.fresh.agree(transcript.acceptor_key)?;
        let proof = self
            .secret
            .mac(DIALLER_LABEL, &transcript)
            .finalize()
            .into_bytes();
        Ok((proof.into(), transcript.session(&self.secret, &shared)))
    }
}

/// The acceptor's side of one exchange, between its challenge and the dialler's proof.
pub struct Acceptor {
    secret: Secret,
    transcript: Transcript,
    shared: [u8; 32],
}

impl Acceptor {
    /// Reads the dialler's first message; with `fresh` (drawn for every connection:
    /// [`Fresh::draw`]) returns the challenge to send.
    pub fn handle_hello(
        secret: &Secret,
        hello: &[u8],
        fresh: Fresh,
    ) -> Result<(Self, [u8; CHALLENGE_LEN]), AuthError> {
        if hello.len() != HELLO_LEN {
            return Err(AuthError::Malformed(format!(
                "an authentication hello has {HELLO_LEN} bytes, this one {}",
                hello.len()
            )));
        }
        if hello[0] != AUTH_VERSION {
            return Err(AuthError::Malformed(format!(
                "authentication version {} (this node speaks {AUTH_VERSION})",
                hello[0]
            )));
        }
        let transcript = Transcript {
            dialler_nonce: split(&hello[1..]),
            acceptor_nonce: fresh.nonce,
            dialler_key: split(&hello[1 + NONCE_LEN..]),
            acceptor_key: fresh.public(),
        };
        let shared = fresh.agree(transcript.dialler_key)?;
        let mac = secret
            .mac(ACCEPTOR_LABEL, &transcript)
            .finalize()
            .into_bytes();
        let mut challenge = [0u8; CHALLENGE_LEN];
        challenge[..NONCE_LEN].copy_from_slice(&transcript.acceptor_nonce);
        challenge[NONCE_LEN..NONCE_LEN + KEY_LEN].copy_from_slice(&transcript.acceptor_key);
        challenge[NONCE_LEN + KEY_LEN..].copy_from_slice(&mac);
        Ok((
            Acceptor {
                secret: secret.clone(),
                transcript,
                shared,
            },
            challenge,
        ))
    }

    /// Checks the dialler's proof: `Ok` lets the connection go on to its hello.
    pub fn handle_proof(&self, proof: &[u8]) -> Result<(), AuthError> {
        if proof.len() != PROOF_MSG_LEN {
            return Err(AuthError::Malformed(format!(
                "a proof has {PROOF_MSG_LEN} bytes, this one {}",
                proof.len()
            )));
        }
        self.secret
            .mac(DIALLER_LABEL, &self.transcript)
            .verify_slice(proof)
            .map_err(|_| AuthError::WrongSecret("dialler"))
    }

    /// The connection's session secret (the dialler derives the same one), once
    /// [`Self::handle_proof`] accepted the dialler.
    pub fn session_base(&self) -> SessionBase {
        self.transcript.session(&self.secret, &self.shared)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fresh(nonce: u8, key: u8) -> Fresh {
        Fresh::from_bytes([nonce; NONCE_LEN], [key; 32])
    }

    /// The whole exchange; on success, both ends' session secrets.
    fn exchange(
        dialler_secret: &Secret,
        acceptor_secret: &Secret,
        d: Fresh,
        a: Fresh,
    ) -> Result<(SessionBase, SessionBase), AuthError> {
        let (dialler, hello) = Dialler::start(dialler_secret, d);
        let (acceptor, challenge) = Acceptor::handle_hello(acceptor_secret, &hello, a)?;
        let (proof, dialler_base) = dialler.handle_challenge(&challenge)?;
        acceptor.handle_proof(&proof)?;
        Ok((dialler_base, acceptor.session_base()))
    }

    #[test]
    fn the_same_secret_passes_and_a_different_one_is_caught_by_the_dialler() {
        let s = Secret::new("job secret").unwrap();
        let (d, a) = exchange(&s, &s, fresh(1, 3), fresh(2, 4)).unwrap();
        assert_eq!(d, a, "both ends hold the same session secret");
        let other = Secret::new("job secreT").unwrap();
        assert_eq!(
            exchange(&s, &other, fresh(1, 3), fresh(2, 4)).err(),
            Some(AuthError::WrongSecret("acceptor"))
        );
    }

    /// A member of the job on the path knows the secret and sees both nonces and both
    /// public keys: without a private key it cannot get the session secret. Here: the same
    /// secret, nonces and one side's key, and only the other private key differs, and the
    /// session secrets differ.
    #[test]
    fn the_session_secret_needs_a_private_key_not_only_the_secret_and_the_transcript() {
        let s = Secret::new("job secret").unwrap();
        let (one, _) = exchange(&s, &s, fresh(1, 3), fresh(2, 4)).unwrap();
        let (two, _) = exchange(&s, &s, fresh(1, 3), fresh(2, 5)).unwrap();
        assert_ne!(one, two);
    }

    #[test]
    fn a_small_order_key_is_refused() {
        let s = Secret::new("job secret").unwrap();
        let (_, mut hello) = Dialler::start(&s, fresh(1, 3));
        // The identity point: every shared secret with it is zero.
        hello[1 + NONCE_LEN..].copy_from_slice(&[0u8; KEY_LEN]);
        assert!(matches!(
            Acceptor::handle_hello(&s, &hello, fresh(2, 4)),
            Err(AuthError::Malformed(m)) if m.contains("small order")
        ));
    }

    #[test]
    fn a_dialler_without_the_secret_cannot_forge_or_replay_a_proof() {
        let s = Secret::new(vec![9u8; 64]).unwrap();
        let (acceptor, challenge) =
            Acceptor::handle_hello(&s, &Dialler::start(&s, fresh(1, 3)).1, fresh(2, 4)).unwrap();
        // Reflection: the acceptor's own MAC sent back as the dialler's proof.
        assert_eq!(
            acceptor.handle_proof(&challenge[NONCE_LEN + KEY_LEN..]),
            Err(AuthError::WrongSecret("dialler"))
        );
        // Replay: a proof recorded from an honest exchange with another acceptor nonce.
        let (honest, _) = Dialler::start(&s, fresh(1, 3));
        let (_, other_challenge) =
            Acceptor::handle_hello(&s, &Dialler::start(&s, fresh(1, 3)).1, fresh(3, 4)).unwrap();
        let (recorded, _) = honest.handle_challenge(&other_challenge).unwrap();
        assert_eq!(
            acceptor.handle_proof(&recorded),
            Err(AuthError::WrongSecret("dialler"))
        );
        assert!(matches!(
            acceptor.handle_proof(&[0u8; 5]),
            Err(AuthError::Malformed(_))
        ));
    }

    #[test]
    fn bad_secrets_and_malformed_messages_are_errors() {
        assert!(matches!(Secret::new(""), Err(AuthError::BadSecret(_))));
        assert!(matches!(
            Secret::new(vec![1u8; MAX_SECRET_LEN + 1]),
            Err(AuthError::BadSecret(_))
        ));
        let s = Secret::new("x").unwrap();
        assert!(matches!(
            Acceptor::handle_hello(&s, &[AUTH_VERSION; 3], fresh(0, 1)),
            Err(AuthError::Malformed(_))
        ));
        let mut hello = Dialler::start(&s, fresh(0, 1)).1;
        hello[0] = 1;
        assert!(matches!(
            Acceptor::handle_hello(&s, &hello, fresh(0, 2)),
            Err(AuthError::Malformed(_))
        ));
        let (dialler, _) = Dialler::start(&s, fresh(0, 1));
        assert!(matches!(
            dialler.handle_challenge(&[0; CHALLENGE_LEN - 1]),
            Err(AuthError::Malformed(_))
        ));
        assert_eq!(format!("{s:?}"), "Secret(..)");
        assert_ne!(fresh_nonce().unwrap(), fresh_nonce().unwrap());
    }

    proptest! {
        #[test]
        fn only_equal_secrets_pass(
            a in proptest::collection::vec(any::<u8>(), 1..80),
            b in proptest::collection::vec(any::<u8>(), 1..80),
            nd in any::<[u8; 32]>(),
            na in any::<[u8; 32]>(),
            keys in any::<([u8; 32], [u8; 32])>(),
            flip in any::<(usize, u8)>(),
        ) {
            let (sa, sb) = (Secret::new(a.clone()).unwrap(), Secret::new(b.clone()).unwrap());
            let d = || Fresh::from_bytes(nd, keys.0);
            let ac = || Fresh::from_bytes(na, keys.1);
            prop_assert_eq!(exchange(&sa, &sb, d(), ac()).is_ok(), a == b);
            // Any change to a message in flight fails the exchange.
            let (dialler, hello) = Dialler::start(&sa, d());
            let (acceptor, mut challenge) = Acceptor::handle_hello(&sa, &hello, ac()).unwrap();
            let mut proof = dialler.handle_challenge(&challenge).unwrap().0;
            let bit = flip.1 | 1;
            proof[flip.0 % PROOF_MSG_LEN] ^= bit;
            prop_assert!(acceptor.handle_proof(&proof).is_err());
            challenge[flip.0 % CHALLENGE_LEN] ^= bit;
            prop_assert!(dialler.handle_challenge(&challenge).is_err());
            // So does a changed dialler key (its MAC covers it).
            let mut hello = hello;
            hello[1 + NONCE_LEN + flip.0 % KEY_LEN] ^= bit;
            if let Ok((acceptor, challenge)) = Acceptor::handle_hello(&sa, &hello, ac()) {
                let (dialler, _) = Dialler::start(&sa, d());
                prop_assert!(dialler.handle_challenge(&challenge).is_err());
                let _ = acceptor;
            }
        }
    }
}
