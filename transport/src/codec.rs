//! The wire format of psnet messages, version 2. Plain functions over byte slices: no I/O.
//!
//! A frame is a fixed 12-byte prefix, one little-endian `u64` length per segment, the metadata
//! block, then the segments back to back:
//!
//! ```text
//! offset  size  field
//! 0       2     magic "PN"
//! 2       1     version (2)
//! 3       1     kind (0 data, 1 hello, 2 hello-ack, 3 hello-reject, 4..8 shared memory,
//!               9..11 authentication, 12 close, 13..15 the same-host queue)
//! 4       2     segment count n (u16 LE)
//! 6       2     flags: bit 0 sealed (a data frame's body encrypted, see below); the
//!               other bits reserved, 0
//! 8       4     metadata length (u32 LE)
//! 12      8n    segment lengths (u64 LE each)
//! ...           metadata, then segment 0, segment 1, ...
//! ```
//!
//! A sealed frame's metadata and segments are encrypted under its connection's session keys
//! ([`crate::session`], `PSNET_ENCRYPT`); its header is not. Only data frames are sealed,
//! and only on connections with a session: the session tag covers the flag, so the path
//! can neither set nor clear it.
//!
//! Every length is checked against [`Limits`] before a caller allocates for it, and any
//! malformed prefix is a [`CodecError`], never a panic.

use bytes::{Buf, Bytes, BytesMut};
use smallvec::SmallVec;

use crate::admission::{Proof, PROOF_LEN};
use crate::le::LeReader;
use crate::message::OutMessage;
use crate::node::NodeId;

/// The two magic bytes that open every frame.
pub const MAGIC: [u8; 2] = *b"PN";
/// The wire version this build speaks: a peer speaking another is refused at its first frame
/// with an error naming both. 2: the same-host queue's frames (`QueueOffer` and its answers);
/// a build without them would fail on them later, mid-connection.
pub const VERSION: u8 = 2;
/// Size of the fixed prefix.
pub const PREFIX_LEN: usize = 12;
/// Bytes per segment length.
const SEG_LEN_BYTES: usize = 8;
/// The flag of a sealed frame (bytes 6..8 of the prefix).
const FLAG_SEALED: u16 = 1;

/// Inline capacity of an encoded header: room for the prefix and 14 segment lengths.
pub type HeaderBuf = SmallVec<[u8; 128]>;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// An application message.
    Data = 0,
    /// Connection opening: the dialler's node id.
    Hello = 1,
    /// The acceptor agrees; carries its node id.
    HelloAck = 2,
    /// The acceptor refuses (e.g. a simultaneous connect it wins); carries a reason.
    HelloReject = 3,
    /// Same-host bulk path: the sender offers a shared-memory ring (size, cookie, path).
    ShmOffer = 4,
    /// The receiver mapped the offered ring.
    ShmAccept = 5,
    /// The receiver cannot map it (another host); plain frames go on.
    ShmReject = 6,
    /// An application message whose segments sit in the ring; one descriptor segment.
    ShmData = 7,
    /// Ring regions the receiver is done with: (offset, length) pairs.
    ShmFree = 8,
    /// Shared-secret exchange, dialler's opening: version and nonce ([`crate::auth`]).
    AuthHello = 9,
    /// Shared-secret exchange, the acceptor's nonce and MAC.
    AuthChallenge = 10,
    /// Shared-secret exchange, the dialler's MAC.
    AuthProof = 11,
    /// The sender is closing the connection because of what it received; carries why (a
    /// frame over its limits, a malformed frame), so that the peer's error says it.
    Close = 12,
    /// Same-host message queue: the sender offers a queue and its wake-up eventfd (size,
    /// cookie, token, socket name, as `ShmOffer`).
    QueueOffer = 13,
    /// The receiver mapped the offered queue: from the sender's next message on, every
    /// message goes through it.
    QueueAccept = 14,
    /// The receiver cannot map it; the socket carries everything.
    QueueReject = 15,
}

impl FrameKind {
    fn from_u8(v: u8) -> Result<Self, CodecError> {
        match v {
            0 => Ok(FrameKind::Data),
            1 => Ok(FrameKind::Hello),
            2 => Ok(FrameKind::HelloAck),
            3 => Ok(FrameKind::HelloReject),
            4 => Ok(FrameKind::ShmOffer),
            5 => Ok(FrameKind::ShmAccept),
            6 => Ok(FrameKind::ShmReject),
            7 => Ok(FrameKind::ShmData),
            8 => Ok(FrameKind::ShmFree),
            9 => Ok(FrameKind::AuthHello),
            10 => Ok(FrameKind::AuthChallenge),
            11 => Ok(FrameKind::AuthProof),
            12 => Ok(FrameKind::Close),
            13 => Ok(FrameKind::QueueOffer),
            14 => Ok(FrameKind::QueueAccept),
            15 => Ok(FrameKind::QueueReject),
            other => Err(CodecError::UnknownKind(other)),
        }
    }
}

/// Bounds applied to every frame before anything is allocated for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest metadata block.
    pub max_meta: u32,
    /// Most segments.
    pub max_segments: u16,
    /// Largest total of metadata and segments.
    pub max_message: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_meta: 1 << 20,
            max_segments: 1024,
            max_message: 1 << 30,
        }
    }
}

/// A frame that breaks the format or the limits.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The frame does not start with "PN": not a psnet peer, or the stream lost sync.
    #[error("bad magic {0:02x?}: not a psnet frame")]
    BadMagic([u8; 2]),
    /// The peer speaks another wire version.
    #[error("unsupported wire version {0} (this build speaks {VERSION})")]
    UnsupportedVersion(u8),
    /// Unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// A device segment where only host bytes can go (a whole frame encoded at once).
    #[error("a device-memory segment cannot be encoded into one host buffer; copy it first")]
    DeviceSegment,
    /// Reserved bits set.
    #[error("reserved header flags {0:#06x}, must be 0")]
    Reserved(u16),
    /// A frame of a kind that is never sealed says it is.
    #[error("a {0:?} frame is never sealed (only data frames are)")]
    SealedKind(FrameKind),
    /// A sealed frame where only frames in clear may come (before a session has keys).
    #[error("a sealed (encrypted) frame where only frames in clear are expected")]
    SealedHere,
    /// Metadata larger than allowed.
    #[error("metadata of {len} bytes exceeds the limit of {limit}")]
    MetaTooLarge {
        /// Announced length.
        len: u64,
        /// The limit.
        limit: u32,
    },
    /// More segments than allowed.
    #[error("{count} segments exceed the limit of {limit}")]
    TooManySegments {
        /// Announced count.
        count: usize,
        /// The limit.
        limit: u16,
    },
    /// Message larger than allowed.
    #[error("message of {len} bytes exceeds the limit of {limit} (PSNET_MAX_MESSAGE)")]
    MessageTooLarge {
        /// Announced total (saturated at `u64::MAX`).
        len: u64,
        /// The limit.
        limit: u64,
    },
    /// A handshake frame whose body has the wrong shape.
    #[error("malformed handshake frame: {0}")]
    BadHandshake(&'static str),
}

/// A decoded frame header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the frame carries.
    pub kind: FrameKind,
    /// Metadata length.
    pub meta_len: u32,
    /// Segment lengths.
    pub seg_lens: SmallVec<[u64; 8]>,
    /// The body is encrypted under the connection's session keys (data frames only).
    pub sealed: bool,
}

impl FrameHeader {
    /// The header for `msg`, checked against `limits`.
    pub fn for_message(
        kind: FrameKind,
        msg: &OutMessage<'_>,
        limits: &Limits,
    ) -> Result<Self, CodecError> {
        let seg_lens = msg.segments.iter().map(|s| s.len() as u64).collect();
        let header = FrameHeader {
            kind,
            meta_len: u32::try_from(msg.meta.len()).map_err(|_| CodecError::MetaTooLarge {
                len: msg.meta.len() as u64,
                limit: limits.max_meta,
            })?,
            seg_lens,
            sealed: false,
        };
        header.check(limits)?;
        Ok(header)
    }

    fn check(&self, limits: &Limits) -> Result<(), CodecError> {
        if self.meta_len > limits.max_meta {
            return Err(CodecError::MetaTooLarge {
                len: self.meta_len.into(),
                limit: limits.max_meta,
            });
        }
        if self.seg_lens.len() > usize::from(limits.max_segments) {
            return Err(CodecError::TooManySegments {
                count: self.seg_lens.len(),
                limit: limits.max_segments,
            });
        }
        let total = self.body_len();
        if total > limits.max_message {
            return Err(CodecError::MessageTooLarge {
                len: total,
                limit: limits.max_message,
            });
        }
        Ok(())
    }

    /// Bytes of metadata plus segments that follow the header (saturating).
    pub fn body_len(&self) -> u64 {
        self.seg_lens
            .iter()
            .fold(u64::from(self.meta_len), |acc, &l| acc.saturating_add(l))
    }

    /// Whether an encoded header (at least its prefix) says its frame is sealed.
    pub fn is_sealed_encoded(header: &[u8]) -> bool {
        header.len() >= PREFIX_LEN && u16::from_le_bytes([header[6], header[7]]) & FLAG_SEALED != 0
    }

    /// Size of the encoded header.
    pub fn encoded_len(&self) -> usize {
        PREFIX_LEN + SEG_LEN_BYTES * self.seg_lens.len()
    }

    /// Appends the encoded header to `out`.
    pub fn encode_into(&self, out: &mut HeaderBuf) {
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(self.kind as u8);
        // `check` bounds the count by a u16 limit.
        out.extend_from_slice(&(self.seg_lens.len() as u16).to_le_bytes());
        let flags = if self.sealed { FLAG_SEALED } else { 0 };
        out.extend_from_slice(&flags.to_le_bytes());
        out.extend_from_slice(&self.meta_len.to_le_bytes());
        for len in &self.seg_lens {
            out.extend_from_slice(&len.to_le_bytes());
        }
    }

    /// Parses a header at the start of `buf`.
    ///
    /// `Ok(None)` means more bytes are needed; `Ok(Some((header, n)))` means the header took `n`
    /// bytes. The header is checked against `limits`, so the caller may allocate
    /// [`FrameHeader::body_len`] bytes afterwards.
    pub fn decode(buf: &[u8], limits: &Limits) -> Result<Option<(Self, usize)>, CodecError> {
        // Check the magic as soon as two bytes exist, so a stray stream fails fast.
        if buf.len() >= 2 && buf[..2] != MAGIC {
            return Err(CodecError::BadMagic([buf[0], buf[1]]));
        }
        if buf.len() < PREFIX_LEN {
            return Ok(None);
        }
        if buf[2] != VERSION {
            return Err(CodecError::UnsupportedVersion(buf[2]));
        }
        let kind = FrameKind::from_u8(buf[3])?;
        let count = usize::from(u16::from_le_bytes([buf[4], buf[5]]));
        let flags = u16::from_le_bytes([buf[6], buf[7]]);
        if flags & !FLAG_SEALED != 0 {
            return Err(CodecError::Reserved(flags & !FLAG_SEALED));
        }
        let sealed = flags & FLAG_SEALED != 0;
        if sealed && kind != FrameKind::Data {
            return Err(CodecError::SealedKind(kind));
        }
        let meta_len = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]);
        if meta_len > limits.max_meta {
            return Err(CodecError::MetaTooLarge {
                len: meta_len.into(),
                limit: limits.max_meta,
            });
        }
        if count > usize::from(limits.max_segments) {
            return Err(CodecError::TooManySegments {
                count,
                limit: limits.max_segments,
            });
        }
        let header_len = PREFIX_LEN + SEG_LEN_BYTES * count;
        if buf.len() < header_len {
            return Ok(None);
        }
        let seg_lens = buf[PREFIX_LEN..header_len]
            .chunks_exact(SEG_LEN_BYTES)
            .map(|c| {
                let mut b = [0u8; SEG_LEN_BYTES];
                b.copy_from_slice(c);
                u64::from_le_bytes(b)
            })
            .collect();
        let header = FrameHeader {
            kind,
            meta_len,
            seg_lens,
            sealed,
        };
        header.check(limits)?;
        Ok(Some((header, header_len)))
    }

    /// Cuts a body of exactly [`FrameHeader::body_len`] bytes into metadata and segments,
    /// without copying.
    ///
    /// # Panics
    /// Never for a body of the right length; a wrong length is a caller bug and is reported by
    /// a debug assertion, the segments then being cut short.
    pub fn split_body(&self, mut body: Bytes) -> Frame {
        debug_assert_eq!(body.len() as u64, self.body_len());
        let take = |body: &mut Bytes, n: u64| {
            let n = usize::try_from(n).unwrap_or(usize::MAX).min(body.len());
            body.split_to(n)
        };
        let meta = take(&mut body, self.meta_len.into());
        let segments = self.seg_lens.iter().map(|&l| take(&mut body, l)).collect();
        Frame {
            kind: self.kind,
            meta,
            segments,
        }
    }
}

/// A whole decoded frame; metadata and segments share one buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// What the frame carries.
    pub kind: FrameKind,
    /// The metadata block.
    pub meta: Bytes,
    /// The segments.
    pub segments: SmallVec<[Bytes; 4]>,
}

/// Takes one whole frame off the front of `buf`, if `buf` holds one.
///
/// The frame's bytes are split off without copying. On error `buf` is left as it was. For
/// frames in clear (handshakes, tests): a sealed frame is an error, since what it holds
/// must be opened under its session's keys, which only a connection's reader has.
pub fn decode_frame(buf: &mut BytesMut, limits: &Limits) -> Result<Option<Frame>, CodecError> {
    let Some((header, header_len)) = FrameHeader::decode(buf, limits)? else {
        return Ok(None);
    };
    if header.sealed {
        return Err(CodecError::SealedHere);
    }
    // `check` bounded body_len by max_message, which a usize holds on 64-bit targets; on
    // narrower ones an oversize body simply never completes here.
    let body_len = usize::try_from(header.body_len()).unwrap_or(usize::MAX);
    if buf.len() - header_len < body_len {
        return Ok(None);
    }
    buf.advance(header_len);
    let body = buf.split_to(body_len).freeze();
    Ok(Some(header.split_body(body)))
}

/// Encodes a whole frame into one vector (for handshakes and tests; the data path writes the
/// header and the caller's segments with one vectored write instead).
pub fn encode_frame(
    kind: FrameKind,
    msg: &OutMessage<'_>,
    limits: &Limits,
) -> Result<Vec<u8>, CodecError> {
    let header = FrameHeader::for_message(kind, msg, limits)?;
    let mut head = HeaderBuf::new();
    header.encode_into(&mut head);
    let mut out = Vec::with_capacity(head.len() + msg.total_len() as usize);
    out.extend_from_slice(&head);
    out.extend_from_slice(msg.meta);
    for seg in msg.segments {
        match seg.host() {
            Some(bytes) => out.extend_from_slice(bytes),
            None => return Err(CodecError::DeviceSegment),
        }
    }
    Ok(out)
}

/// What a node moves its data over, announced in the hello: a node on RDMA (whose TCP
/// connection carries only the queue-pair handshake) and a node on TCP refuse each other at
/// once, with a reason naming both, instead of misreading each other's messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DataPath {
    /// Data frames on this TCP connection (psnet's TCP transport).
    #[default]
    Tcp = 0,
    /// RDMA queue pairs; the TCP connection is their control channel.
    Rdma = 1,
}

impl DataPath {
    /// Lower-case name, as `PSNET_TRANSPORT` spells it.
    pub fn name(self) -> &'static str {
        match self {
            DataPath::Tcp => "tcp",
            DataPath::Rdma => "rdma",
        }
    }
}

/// Bytes of a `Hello` or `HelloAck` body without a proof of identity.
pub const HELLO_LEN: usize = 9;
/// Bytes of a `Hello` or `HelloAck` body that carries a [`Proof`].
pub const HELLO_PROOF_LEN: usize = HELLO_LEN + PROOF_LEN;

/// The body of a `Hello` or `HelloAck`: the sender's node id and data path.
pub fn encode_hello(id: NodeId, path: DataPath) -> [u8; HELLO_LEN] {
    let mut out = [0u8; HELLO_LEN];
    out[..8].copy_from_slice(&id.0.to_le_bytes());
    out[8] = path as u8;
    out
}

/// The body of a `Hello` or `HelloAck`, with the sender's proof of its id when it has one.
pub fn encode_hello_proved(id: NodeId, path: DataPath, proof: Option<&Proof>) -> Vec<u8> {
    let mut out = encode_hello(id, path).to_vec();
    if let Some(p) = proof {
        out.extend_from_slice(&p.0);
    }
    out
}

/// A parsed `Hello` or `HelloAck` body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The id the sender claims.
    pub id: NodeId,
    /// The data path it moves bulk bytes over.
    pub path: DataPath,
    /// Its proof of `id`, if it sent one.
    pub proof: Option<Proof>,
}

/// Parses the body of a `Hello` or `HelloAck` (with or without a proof).
pub fn decode_hello(meta: &[u8]) -> Result<Hello, CodecError> {
    if meta.len() != HELLO_LEN && meta.len() != HELLO_PROOF_LEN {
        return Err(CodecError::BadHandshake(
            "hello body must be 9 bytes, or 73 with a proof",
        ));
    }
    let mut r = LeReader::new(meta);
    let short = |_| CodecError::BadHandshake("hello body must be 9 bytes, or 73 with a proof");
    let id = NodeId(r.u64().map_err(short)?);
    let path = match r.u8().map_err(short)? {
        0 => DataPath::Tcp,
        1 => DataPath::Rdma,
        _ => return Err(CodecError::BadHandshake("unknown data path in hello")),
    };
    let proof = match r.remaining() {
        0 => None,
        _ => Some(Proof(r.array().map_err(short)?)),
    };
    Ok(Hello { id, path, proof })
}

#[cfg(test)]
mod tests;
