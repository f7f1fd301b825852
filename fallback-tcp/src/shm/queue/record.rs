//! What a queue record is, how one is read and checked, and what can be wrong with a queue.

use bytes::Bytes;
use psnet_transport::le::LeReader;
use psnet_transport::Limits;
use smallvec::SmallVec;

/// What is wrong with a queue: the peer wrote something a working sender or receiver never
/// writes, or a record does not fit. The connection cannot go on with it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum QueueError {
    /// A record larger than the queue can ever hold.
    #[error("a record of {len} bytes is larger than the queue takes")]
    RecordTooLarge {
        /// Its size.
        len: usize,
    },
    /// The other side's counter says something impossible.
    #[error("the {0} queue counter is corrupt")]
    CorruptCounter(&'static str),
    /// Fewer bytes than a record header are published.
    #[error("a truncated record in the queue")]
    Truncated,
    /// A record's length runs past what the sender published.
    #[error("a queue record of {len} bytes runs past the published ones")]
    PastPublished {
        /// The length its header claims.
        len: usize,
    },
    /// A record of a kind no sender writes.
    #[error("unknown queue record kind {0}")]
    UnknownKind(u32),
    /// A record that lies outside the mapped area.
    #[error("a queue record outside the area")]
    OutsideArea,
    /// A record whose body does not parse.
    #[error("{0}")]
    Malformed(&'static str),
    /// A ring record claiming more metadata than it holds or the limits allow.
    #[error("a ring record with {meta_len} bytes of metadata")]
    RingMeta {
        /// The metadata length claimed.
        meta_len: usize,
    },
    /// An inline message's metadata beyond the limit.
    #[error("an inline message with {meta_len} bytes of metadata exceeds the limit of {limit}")]
    MetaTooLarge {
        /// The metadata length claimed.
        meta_len: usize,
        /// The limit.
        limit: u32,
    },
    /// An inline message with more segments than the limit.
    #[error("an inline message of {count} segments exceeds the limit of {limit}")]
    TooManySegments {
        /// The segments claimed.
        count: usize,
        /// The limit.
        limit: u16,
    },
    /// An inline message beyond the message limit.
    #[error("an inline message of {len} bytes exceeds the limit of {limit} (PSNET_MAX_MESSAGE)")]
    MessageTooLarge {
        /// Its size.
        len: usize,
        /// The limit.
        limit: u64,
    },
    /// The release area is not mapped.
    #[error("the release area is not mapped")]
    ReleasesUnmapped,
    /// The peer's count of released regions is impossible.
    #[error("the peer's release counter is corrupt")]
    CorruptReleases,
}

/// What a record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum Kind {
    /// Fills the area's end; skipped.
    Pad = 1,
    /// The first record: how many data frames the sender wrote to the socket before it.
    Start = 2,
    /// A whole message: `meta_len u32, count u32, count x length u64`, the metadata, then
    /// the segments.
    Inline = 3,
    /// A message in the ring: `meta_len u32`, the metadata, then the ring descriptor.
    Ring = 4,
    /// The next message comes through the socket.
    Socket = 5,
}

impl Kind {
    pub(super) fn from_u32(v: u32) -> Option<Kind> {
        Some(match v {
            1 => Kind::Pad,
            2 => Kind::Start,
            3 => Kind::Inline,
            4 => Kind::Ring,
            5 => Kind::Socket,
            _ => return None,
        })
    }
}

/// One record, read and checked.
#[derive(Debug)]
pub(crate) enum Record {
    /// Data frames the sender wrote to the socket before its first record.
    Start(u64),
    /// A message copied out of the queue.
    Inline {
        /// Its metadata.
        meta: Bytes,
        /// Its segments.
        segments: SmallVec<[Bytes; 4]>,
    },
    /// A message in the ring.
    Ring {
        /// Its metadata.
        meta: Bytes,
        /// The ring descriptor of its segments.
        descriptor: Bytes,
    },
    /// The next message is the next data frame on the socket.
    Socket,
}

pub(super) fn parse(kind: Kind, payload: Bytes, limits: &Limits) -> Result<Record, QueueError> {
    match kind {
        Kind::Start => {
            let b: [u8; 8] = payload[..]
                .try_into()
                .map_err(|_| QueueError::Malformed("a malformed start record"))?;
            Ok(Record::Start(u64::from_le_bytes(b)))
        }
        Kind::Socket if payload.is_empty() => Ok(Record::Socket),
        Kind::Socket => Err(QueueError::Malformed("a socket marker with a body")),
        Kind::Ring => {
            let meta_len = LeReader::new(&payload)
                .u32()
                .map_err(|_| QueueError::Malformed("a short ring record"))?
                as usize;
            if meta_len > limits.max_meta as usize || 4 + meta_len > payload.len() {
                return Err(QueueError::RingMeta { meta_len });
            }
            Ok(Record::Ring {
                meta: payload.slice(4..4 + meta_len),
                descriptor: payload.slice(4 + meta_len..),
            })
        }
        Kind::Inline => parse_inline(payload, limits),
        Kind::Pad => unreachable!("padding is skipped before parsing"),
    }
}

fn parse_inline(payload: Bytes, limits: &Limits) -> Result<Record, QueueError> {
    let short = |_| QueueError::Malformed("a short inline record");
    let mut r = LeReader::new(&payload);
    let meta_len = r.u32().map_err(short)? as usize;
    let count = r.u32().map_err(short)? as usize;
    // The same bounds as a frame on the socket: the queue is no way around them.
    if meta_len > limits.max_meta as usize {
        return Err(QueueError::MetaTooLarge {
            meta_len,
            limit: limits.max_meta,
        });
    }
    if count > usize::from(limits.max_segments) {
        return Err(QueueError::TooManySegments {
            count,
            limit: limits.max_segments,
        });
    }
    let mut lens: SmallVec<[usize; 4]> = SmallVec::new();
    for _ in 0..count {
        lens.push(usize::try_from(r.u64().map_err(short)?).unwrap_or(usize::MAX));
    }
    let body = r.remaining();
    let total = lens
        .iter()
        .try_fold(meta_len, |a, &l| a.checked_add(l))
        .filter(|&t| t == body);
    if total.is_none() {
        return Err(QueueError::Malformed(
            "an inline record's lengths do not add up",
        ));
    }
    if (body - meta_len) as u64 > limits.max_message {
        return Err(QueueError::MessageTooLarge {
            len: body - meta_len,
            limit: limits.max_message,
        });
    }
    let start = payload.len() - body;
    let all = payload;
    let meta = all.slice(start..start + meta_len);
    let mut at = start + meta_len;
    let segments = lens
        .into_iter()
        .map(|l| {
            let s = all.slice(at..at + l);
            at += l;
            s
        })
        .collect();
    Ok(Record::Inline { meta, segments })
}

/// The first part of an inline record: metadata length, segment count and lengths.
pub(crate) fn inline_header(meta: &[u8], segments: &[&[u8]]) -> SmallVec<[u8; 64]> {
    let mut h = SmallVec::new();
    h.extend_from_slice(&(meta.len() as u32).to_le_bytes());
    h.extend_from_slice(&(segments.len() as u32).to_le_bytes());
    for s in segments {
        h.extend_from_slice(&(s.len() as u64).to_le_bytes());
    }
    h
}
