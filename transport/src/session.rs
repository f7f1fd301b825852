//! Authenticated sessions: what every frame of a connection carries once the two ends proved
//! the job's secret to each other ([`crate::auth`]).
//!
//! The exchange leaves both ends with a [`SessionBase`] nobody else knows: an HMAC under the
//! job's secret of the exchange and of an X25519 shared secret of two fresh keys. From it each direction of the connection gets keys of
//! its own, so a frame cannot be reflected back to its sender:
//!
//! - the opening keys protect the hello and its answer. Their bodies carry the nodes' proofs,
//!   so they are sealed (encrypted and authenticated) and never cross the wire in clear;
//! - once both hellos are through, the keys are derived again with both node ids mixed in
//!   ([`Session::bound`]): every later frame is bound to the two nodes it is between.
//!
//! Every frame after the opening ends in a [`TAG_LEN`]-byte tag, a keyed BLAKE3 of the frame's
//! sequence number in its direction, its header, metadata and segments. The sequence number is
//! not sent: each end counts, so a frame altered, dropped, replayed or reordered on the path
//! fails its tag, and the connection ends naming the peer. The job is identified by its secret:
//! jobs that must not accept each other's nodes use different secrets.
//!
//! With `PSNET_ENCRYPT=1` a sender also seals its data frames ([`Sealer::encrypting`]): their
//! metadata and segments are encrypted with ChaCha20 under a key of their own per direction,
//! with the frame's sequence number as nonce, and the tag is taken over what crosses the wire
//! (encrypt-then-MAC, an AEAD). The header says the frame is sealed, and the tag covers the
//! header, so the path can neither strip the encryption nor add it. A receiver opens what
//! arrives sealed whatever its own setting.
//!
//! What the tag does not cover is said in RELIABILITY.md: the bytes of the same-host
//! shared-memory paths (no network path to be on), and the in-process network.
//!
//! Plain functions and state over byte slices: transports move the bytes.

use std::fmt;

use chacha20::cipher::{KeyIvInit, StreamCipher, StreamCipherSeek};
use chacha20::ChaCha20;
use hmac::Mac;

use crate::auth::HmacSha256;
use crate::codec::{self, CodecError};
use crate::message::OutMessage;
use crate::node::NodeId;
use crate::FrameKind;
use crate::Limits;

/// Bytes of a frame's tag.
pub const TAG_LEN: usize = 16;

const BASE_LEN: usize = 32;

/// The secret two ends of one connection share after the exchange. Never printed.
#[derive(Clone)]
#[cfg_attr(test, derive(PartialEq, Eq))]
pub struct SessionBase([u8; BASE_LEN]);

impl SessionBase {
    pub(crate) fn from_mac(mac: HmacSha256) -> Self {
        SessionBase(mac.finalize().into_bytes().into())
    }

    /// A base from raw bytes, for tests and in-process transports.
    pub fn from_bytes(bytes: [u8; BASE_LEN]) -> Self {
        SessionBase(bytes)
    }

    /// The bytes hello proofs are bound to ([`crate::admission::Binding`]).
    pub(crate) fn material(&self) -> &[u8; BASE_LEN] {
        &self.0
    }
}

impl fmt::Debug for SessionBase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionBase(..)")
    }
}

/// Which end of the connection this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The end that dialled.
    Dialler,
    /// The end that accepted.
    Acceptor,
}

/// A frame that fails its tag.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "frame {seq} of this connection fails its session tag: it was altered, replayed, \
     reordered or dropped on the path, or the sender does not hold this session's key"
)]
pub struct TagMismatch {
    /// The frame's sequence number in its direction.
    pub seq: u64,
}

/// One direction's keys and the number of the next frame.
struct Direction {
    mac_key: [u8; 32],
    /// Seals handshake bodies (BLAKE3's keyed output stream).
    enc_key: [u8; 32],
    /// Seals data frames (ChaCha20).
    data_key: [u8; 32],
    seq: u64,
}

impl Direction {
    fn derive(stage: &str, from: Role, material: &[u8]) -> Self {
        let way = match from {
            Role::Dialler => "dialler to acceptor",
            Role::Acceptor => "acceptor to dialler",
        };
        Direction {
            mac_key: blake3::derive_key(
                &format!("psnet 2026-11 session {stage} mac {way}"),
                material,
            ),
            enc_key: blake3::derive_key(
                &format!("psnet 2026-11 session {stage} cipher {way}"),
                material,
            ),
            data_key: blake3::derive_key(
                &format!("psnet 2026-11 session {stage} data cipher {way}"),
                material,
            ),
            seq: 0,
        }
    }

    /// The next frame's tag, and its cipher if it is `sealed`.
    fn next_frame(&mut self, sealed: bool) -> FrameMac {
        let seq = self.seq;
        self.seq += 1;
        let mut hasher = blake3::Hasher::new_keyed(&self.mac_key);
        hasher.update(&seq.to_le_bytes());
        // A key per direction and a frame number that never repeats in it: every nonce is
        // used once. Frames are at most 1 GiB, far below ChaCha20's 256 GiB per nonce.
        let cipher = sealed.then(|| BodyCipher::new(self.data_key, seq));
        FrameMac {
            hasher,
            seq,
            cipher,
        }
    }

    /// XORs `bytes` with frame `seq`'s keystream (BLAKE3's keyed output stream).
    fn apply_keystream(&self, seq: u64, bytes: &mut [u8]) {
        let mut stream = blake3::Hasher::new_keyed(&self.enc_key);
        stream.update(&seq.to_le_bytes());
        let mut reader = stream.finalize_xof();
        let mut block = [0u8; 64];
        for chunk in bytes.chunks_mut(block.len()) {
            reader.fill(&mut block[..chunk.len()]);
            for (b, k) in chunk.iter_mut().zip(block.iter()) {
                *b ^= k;
            }
        }
    }
}

/// The keys of one connection end: a [`Sealer`] for what it sends, an [`Opener`] for what
/// it receives.
pub struct Session;

impl Session {
    /// The keys for the hello and its answer, before either end knows who the other is.
    pub fn opening(base: &SessionBase, role: Role) -> (Sealer, Opener) {
        Self::pair("opening", role, &base.0)
    }

    /// The keys for every frame after the hellos, bound to both node ids.
    pub fn bound(
        base: &SessionBase,
        role: Role,
        dialler: NodeId,
        acceptor: NodeId,
    ) -> (Sealer, Opener) {
        let mut material = Vec::with_capacity(BASE_LEN + 16);
        material.extend_from_slice(&base.0);
        material.extend_from_slice(&dialler.0.to_le_bytes());
        material.extend_from_slice(&acceptor.0.to_le_bytes());
        Self::pair("bound", role, &material)
    }

    /// The keys of a channel that runs beside the connection of `base` between the same two
    /// nodes (an RDMA queue pair beside its TCP control connection), named `name` by both
    /// ends: the same name gives both ends the same keys, and different names unrelated
    /// ones. `role` says which end this is: the two ends must take opposite roles.
    pub fn channel(base: &SessionBase, role: Role, name: &str) -> (Sealer, Opener) {
        Self::pair(&format!("channel {name}"), role, &base.0)
    }

    fn pair(stage: &str, role: Role, material: &[u8]) -> (Sealer, Opener) {
        let other = match role {
            Role::Dialler => Role::Acceptor,
            Role::Acceptor => Role::Dialler,
        };
        (
            Sealer(Direction::derive(stage, role, material), false),
            Opener(Direction::derive(stage, other, material)),
        )
    }
}

/// The tag of one frame being computed (sending) or checked (receiving): feed it the frame's
/// bytes in order, as they cross the wire. A sealed frame also carries its cipher: its body
/// goes through [`Self::seal`] (sending) or [`Self::open`] (receiving) instead.
pub struct FrameMac {
    hasher: blake3::Hasher,
    seq: u64,
    cipher: Option<BodyCipher>,
}

/// A sealed frame's cipher, and what it takes to start it again (ChaCha20's state is not
/// cloned: a peek starts a second one at the same place).
struct BodyCipher {
    stream: ChaCha20,
    key: [u8; 32],
    nonce: [u8; 12],
    /// Body bytes through the stream so far.
    at: u64,
}

impl BodyCipher {
    fn new(key: [u8; 32], seq: u64) -> Self {
        let mut nonce = [0u8; 12];
        nonce[..8].copy_from_slice(&seq.to_le_bytes());
        BodyCipher {
            stream: ChaCha20::new(&key.into(), &nonce.into()),
            key,
            nonce,
            at: 0,
        }
    }

    fn apply(&mut self, bytes: &mut [u8]) {
        self.stream.apply_keystream(bytes);
        self.at += bytes.len() as u64;
    }

    fn peek(&self, bytes: &mut [u8]) {
        let mut again = ChaCha20::new(&self.key.into(), &self.nonce.into());
        again.seek(self.at);
        again.apply_keystream(bytes);
    }
}

impl FrameMac {
    /// The next bytes of the frame, as they cross the wire (a header, or a body that is not
    /// sealed).
    pub fn update(&mut self, bytes: &[u8]) {
        // BLAKE3 hashes large inputs several blocks at a time with SIMD; feed large
        // segments whole.
        self.hasher.update(bytes);
    }

    /// Whether the frame's body is encrypted.
    pub fn is_sealed(&self) -> bool {
        self.cipher.is_some()
    }

    /// Sending: encrypts the next body bytes in place (if the frame is sealed) and tags
    /// them as they will cross the wire.
    pub fn seal(&mut self, bytes: &mut [u8]) {
        if let Some(cipher) = self.cipher.as_mut() {
            cipher.apply(bytes);
        }
        self.hasher.update(bytes);
    }

    /// Receiving: tags the next body bytes as they crossed the wire, then decrypts them in
    /// place (if the frame is sealed). Nothing decrypted may be used before
    /// [`Self::check`] passes.
    pub fn open(&mut self, bytes: &mut [u8]) {
        self.hasher.update(bytes);
        if let Some(cipher) = self.cipher.as_mut() {
            cipher.apply(bytes);
        }
    }

    /// Receiving: the next body bytes decrypted into a copy, without taking them (they go
    /// through [`Self::open`] afterwards): a receiver reads a sealed frame's metadata to
    /// decide where its segments go.
    pub fn peek(&self, bytes: &[u8]) -> Vec<u8> {
        let mut plain = bytes.to_vec();
        if let Some(cipher) = self.cipher.as_ref() {
            cipher.peek(&mut plain);
        }
        plain
    }

    /// The frame's sequence number.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The tag to send after the frame.
    pub fn tag(&self) -> [u8; TAG_LEN] {
        let mut tag = [0u8; TAG_LEN];
        tag.copy_from_slice(&self.hasher.finalize().as_bytes()[..TAG_LEN]);
        tag
    }

    /// Checks the tag received after the frame, in time independent of where it differs.
    pub fn check(&self, tag: &[u8]) -> Result<(), TagMismatch> {
        let ours = self.tag();
        let same = tag.len() == TAG_LEN
            && ours.iter().zip(tag).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
        if same {
            Ok(())
        } else {
            Err(TagMismatch { seq: self.seq })
        }
    }
}

/// What one end sends: numbers its frames and tags them, and with [`Self::encrypting`]
/// seals its data frames.
pub struct Sealer(Direction, bool);

impl Sealer {
    /// Seals data frames too (`PSNET_ENCRYPT=1`), or not.
    pub fn encrypting(mut self, on: bool) -> Self {
        self.1 = on;
        self
    }

    /// Whether data frames are sealed.
    pub fn encrypts(&self) -> bool {
        self.1
    }

    /// Starts the next frame's tag; a `sealed` frame's body is encrypted too (its header
    /// says so: [`crate::codec::FrameHeader::sealed`]).
    pub fn frame(&mut self, sealed: bool) -> FrameMac {
        self.0.next_frame(sealed)
    }

    /// The tag of the next message of a channel that carries whole messages (each with its
    /// own tag: [`Opener::check_message`] at the other end), numbered like frames.
    pub fn tag_message(&mut self, bytes: &[u8]) -> [u8; TAG_LEN] {
        let mut mac = self.frame(false);
        mac.update(bytes);
        mac.tag()
    }

    /// A whole handshake frame of `kind` whose body is `plain` encrypted, then its tag: the
    /// bytes to write.
    pub fn seal_handshake(&mut self, kind: FrameKind, plain: &[u8]) -> Result<Vec<u8>, CodecError> {
        let mut mac = self.frame(false);
        let mut body = plain.to_vec();
        self.0.apply_keystream(mac.seq, &mut body);
        let mut bytes =
            codec::encode_frame(kind, &OutMessage::new(&body, &[]), &HANDSHAKE)?.to_vec();
        mac.update(&bytes);
        bytes.extend_from_slice(&mac.tag());
        Ok(bytes)
    }
}

/// What one end receives: checks each frame's tag against its own count.
pub struct Opener(Direction);

impl Opener {
    /// Starts checking the next frame, whose header says whether it is `sealed`.
    pub fn frame(&mut self, sealed: bool) -> FrameMac {
        self.0.next_frame(sealed)
    }

    /// Checks the next message of a channel that carries whole messages against its `tag`
    /// ([`Sealer::tag_message`]): one altered, dropped, replayed or reordered fails.
    pub fn check_message(&mut self, bytes: &[u8], tag: &[u8]) -> Result<(), TagMismatch> {
        let mut mac = self.frame(false);
        mac.update(bytes);
        mac.check(tag)
    }

    /// Checks a sealed handshake frame (`kind` and encrypted `body`, as decoded) against its
    /// `tag`; returns the body in clear.
    pub fn open_handshake(
        &mut self,
        kind: FrameKind,
        body: &[u8],
        tag: &[u8],
    ) -> Result<Vec<u8>, TagMismatch> {
        let mut mac = self.frame(false);
        let seq = mac.seq;
        // Frames are canonical (reserved bits zero, no segments), so the bytes that were
        // tagged are the ones re-encoded here.
        let bytes = codec::encode_frame(kind, &OutMessage::new(body, &[]), &HANDSHAKE)
            .map_err(|_| TagMismatch { seq })?;
        mac.update(&bytes);
        mac.check(tag)?;
        let mut plain = body.to_vec();
        self.0.apply_keystream(seq, &mut plain);
        Ok(plain)
    }
}

/// Handshake frames are small.
const HANDSHAKE: Limits = Limits {
    max_meta: 1024,
    max_segments: 0,
    max_message: 1024,
};

#[cfg(test)]
mod tests;
