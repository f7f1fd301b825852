//! Proving knowledge of the job's shared secret (`PSNET_SECRET` / `PSNET_SECRET_FILE`) when a
//! connection opens, before either side says who it is.
//!
//! Three messages, each a handshake frame, precede the hello:
//!
//! 1. dialler → acceptor, [`FrameKind::AuthHello`](crate::FrameKind::AuthHello): version and
//!    the dialler's fresh nonce `nd`;
//! 2. acceptor → dialler, [`FrameKind::AuthChallenge`](crate::FrameKind::AuthChallenge): the
//!    acceptor's fresh nonce `na` and `HMAC-SHA256(secret, "psnet-auth-v1 acceptor" ‖ nd ‖ na)`;
//! 3. dialler → acceptor, [`FrameKind::AuthProof`](crate::FrameKind::AuthProof):
//!    `HMAC-SHA256(secret, "psnet-auth-v1 dialler" ‖ nd ‖ na)`.
//!
//! Each side proves the secret over both nonces, so a recorded exchange is worth nothing on
//! another connection, and the labels differ by role, so an acceptor's answer cannot be
//! reflected back to it as a dialler's proof. MACs are compared in constant time. The dialler
//! may send its hello right behind its proof; the acceptor reads nothing of it until the proof
//! checks out. The exchange also leaves both ends a session secret nobody else knows
//! (`session_base`), from which [`crate::session`] derives the keys that tag every later frame.
//! This module only computes and checks messages; transports move them.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::session::SessionBase;

/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;
/// Version of the exchange, the first byte of the dialler's message.
pub const AUTH_VERSION: u8 = 1;
/// Bytes of the dialler's first message: version and nonce.
pub const HELLO_LEN: usize = 1 + NONCE_LEN;
/// Bytes of the acceptor's challenge: its nonce and its MAC.
pub const CHALLENGE_LEN: usize = NONCE_LEN + MAC_LEN;
/// Bytes of the dialler's proof.
pub const PROOF_MSG_LEN: usize = MAC_LEN;
/// Longest secret accepted: a secret is a password or a key, not a file's worth of data.
pub const MAX_SECRET_LEN: usize = 4096;

const ACCEPTOR_LABEL: &[u8] = b"psnet-auth-v1 acceptor";
const DIALLER_LABEL: &[u8] = b"psnet-auth-v1 dialler";
const SESSION_LABEL: &[u8] = b"psnet-auth-v1 session";

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

    fn mac(&self, label: &[u8], dialler_nonce: &[u8], acceptor_nonce: &[u8]) -> HmacSha256 {
        // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
        let mut mac = match HmacSha256::new_from_slice(&self.0) {
            Ok(m) => m,
            Err(_) => unreachable!("HMAC accepts keys of every length"),
        };
        mac.update(label);
        mac.update(dialler_nonce);
        mac.update(acceptor_nonce);
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
}

/// A fresh random nonce from the operating system.
pub fn fresh_nonce() -> Result<[u8; NONCE_LEN], AuthError> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|e| AuthError::NoRandom(e.to_string()))?;
    Ok(nonce)
}

/// The whole exchange between a dialler holding `dialler` and an acceptor holding `acceptor`,
/// for transports whose two ends live in one process (the in-memory network): the same
/// messages and checks as on a wire, with fresh nonces. The error is the refusal's reason.
pub fn exchange_in_process(
    dialler: Option<&Secret>,
    acceptor: Option<&Secret>,
) -> Result<(), String> {
    match (dialler, acceptor) {
        (None, None) => Ok(()),
        (None, Some(_)) => Err(REFUSE_NO_PROOF.into()),
        (Some(_), None) => Err(REFUSE_UNEXPECTED_PROOF.into()),
        (Some(d), Some(a)) => {
            let run = || -> Result<(), AuthError> {
                let (dialler, hello) = Dialler::start(d, fresh_nonce()?);
                let (acceptor, challenge) = Acceptor::handle_hello(a, &hello, fresh_nonce()?)?;
                acceptor.handle_proof(&dialler.handle_challenge(&challenge)?)
            };
            run().map_err(|e| e.to_string())
        }
    }
}

/// The dialler's side of one exchange.
pub struct Dialler {
    secret: Secret,
    nonce: [u8; NONCE_LEN],
}

impl Dialler {
    /// Starts an exchange with `nonce` (fresh for every connection: [`fresh_nonce`]); returns
    /// the first message to send.
    pub fn start(secret: &Secret, nonce: [u8; NONCE_LEN]) -> (Self, [u8; HELLO_LEN]) {
        let mut hello = [0u8; HELLO_LEN];
        hello[0] = AUTH_VERSION;
        hello[1..].copy_from_slice(&nonce);
        (
            Dialler {
                secret: secret.clone(),
                nonce,
            },
            hello,
        )
    }

    /// Checks the acceptor's challenge; returns the proof to send back.
    pub fn handle_challenge(&self, challenge: &[u8]) -> Result<[u8; PROOF_MSG_LEN], AuthError> {
        if challenge.len() != CHALLENGE_LEN {
            return Err(AuthError::Malformed(format!(
                "a challenge has {CHALLENGE_LEN} bytes, this one {}",
                challenge.len()
            )));
        }
        let (their_nonce, their_mac) = challenge.split_at(NONCE_LEN);
        self.secret
            .mac(ACCEPTOR_LABEL, &self.nonce, their_nonce)
            .verify_slice(their_mac)
            .map_err(|_| AuthError::WrongSecret("acceptor"))?;
        let proof = self
            .secret
            .mac(DIALLER_LABEL, &self.nonce, their_nonce)
            .finalize()
            .into_bytes();
        Ok(proof.into())
    }

    /// The connection's session secret, once [`Self::handle_challenge`] accepted `challenge`:
    /// known only to the two ends of this exchange (see [`crate::session`]).
    pub fn session_base(&self, challenge: &[u8]) -> SessionBase {
        let their_nonce = &challenge[..NONCE_LEN.min(challenge.len())];
        SessionBase::from_mac(self.secret.mac(SESSION_LABEL, &self.nonce, their_nonce))
    }
}

/// The acceptor's side of one exchange, between its challenge and the dialler's proof.
pub struct Acceptor {
    secret: Secret,
    dialler_nonce: [u8; NONCE_LEN],
    nonce: [u8; NONCE_LEN],
}

impl Acceptor {
    /// Reads the dialler's first message; with `nonce` (fresh: [`fresh_nonce`]) returns the
    /// challenge to send.
    pub fn handle_hello(
        secret: &Secret,
        hello: &[u8],
        nonce: [u8; NONCE_LEN],
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
        let mut dialler_nonce = [0u8; NONCE_LEN];
        dialler_nonce.copy_from_slice(&hello[1..]);
        let mac = secret
            .mac(ACCEPTOR_LABEL, &dialler_nonce, &nonce)
            .finalize()
            .into_bytes();
        let mut challenge = [0u8; CHALLENGE_LEN];
        challenge[..NONCE_LEN].copy_from_slice(&nonce);
        challenge[NONCE_LEN..].copy_from_slice(&mac);
        Ok((
            Acceptor {
                secret: secret.clone(),
                dialler_nonce,
                nonce,
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
            .mac(DIALLER_LABEL, &self.dialler_nonce, &self.nonce)
            .verify_slice(proof)
            .map_err(|_| AuthError::WrongSecret("dialler"))
    }

    /// The connection's session secret (the dialler derives the same one), once
    /// [`Self::handle_proof`] accepted the dialler.
    pub fn session_base(&self) -> SessionBase {
        SessionBase::from_mac(
            self.secret
                .mac(SESSION_LABEL, &self.dialler_nonce, &self.nonce),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn exchange(
        dialler_secret: &Secret,
        acceptor_secret: &Secret,
        nd: [u8; NONCE_LEN],
        na: [u8; NONCE_LEN],
    ) -> Result<(), AuthError> {
        let (dialler, hello) = Dialler::start(dialler_secret, nd);
        let (acceptor, challenge) = Acceptor::handle_hello(acceptor_secret, &hello, na)?;
        let proof = dialler.handle_challenge(&challenge)?;
        acceptor.handle_proof(&proof)
    }

    #[test]
    fn the_same_secret_passes_and_a_different_one_is_caught_by_the_dialler() {
        let s = Secret::new("job secret").unwrap();
        assert_eq!(exchange(&s, &s, [1; 32], [2; 32]), Ok(()));
        let other = Secret::new("job secreT").unwrap();
        assert_eq!(
            exchange(&s, &other, [1; 32], [2; 32]),
            Err(AuthError::WrongSecret("acceptor"))
        );
    }

    #[test]
    fn a_dialler_without_the_secret_cannot_forge_or_replay_a_proof() {
        let s = Secret::new(vec![9u8; 64]).unwrap();
        let (acceptor, challenge) =
            Acceptor::handle_hello(&s, &Dialler::start(&s, [1; 32]).1, [2; 32]).unwrap();
        // Reflection: the acceptor's own MAC sent back as the dialler's proof.
        assert_eq!(
            acceptor.handle_proof(&challenge[NONCE_LEN..]),
            Err(AuthError::WrongSecret("dialler"))
        );
        // Replay: a proof recorded from an honest exchange with another acceptor nonce.
        let (honest, _) = Dialler::start(&s, [1; 32]);
        let (_, other_challenge) =
            Acceptor::handle_hello(&s, &Dialler::start(&s, [1; 32]).1, [3; 32]).unwrap();
        let recorded = honest.handle_challenge(&other_challenge).unwrap();
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
            Acceptor::handle_hello(&s, &[AUTH_VERSION; 3], [0; 32]),
            Err(AuthError::Malformed(_))
        ));
        let mut hello = Dialler::start(&s, [0; 32]).1;
        hello[0] = 2;
        assert!(matches!(
            Acceptor::handle_hello(&s, &hello, [0; 32]),
            Err(AuthError::Malformed(_))
        ));
        let (dialler, _) = Dialler::start(&s, [0; 32]);
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
            flip in any::<(usize, u8)>(),
        ) {
            let (sa, sb) = (Secret::new(a.clone()).unwrap(), Secret::new(b.clone()).unwrap());
            prop_assert_eq!(exchange(&sa, &sb, nd, na).is_ok(), a == b);
            // Any change to a message in flight fails the exchange.
            let (dialler, hello) = Dialler::start(&sa, nd);
            let (acceptor, mut challenge) = Acceptor::handle_hello(&sa, &hello, na).unwrap();
            let mut proof = dialler.handle_challenge(&challenge).unwrap();
            let bit = flip.1 | 1;
            proof[flip.0 % PROOF_MSG_LEN] ^= bit;
            prop_assert!(acceptor.handle_proof(&proof).is_err());
            challenge[flip.0 % CHALLENGE_LEN] ^= bit;
            prop_assert!(dialler.handle_challenge(&challenge).is_err());
        }
    }
}
