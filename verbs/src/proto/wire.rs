//! The header every message on a queue pair starts with, and its codec.
//!
//! Layout (little endian):
//! - all kinds: `kind u8 | version u8 | credits u16 | seq u32` (8 bytes);
//! - [`Kind::Eager`], [`Kind::Rts`] and [`Kind::Direct`]: then `meta_len u32 | nseg u16 |
//!   flags u16`, then `nseg` segment lengths as `u64`; an eager message then carries the
//!   metadata and the segments' bytes, a request-to-send carries the metadata only if
//!   [`RTS_META_INLINE`] is set, a direct message always carries the metadata;
//! - [`Kind::Cts`] and [`Kind::Offer`]: then `addr u64 | rkey u32 | len u64` (a buffer of the
//!   receiver's);
//! - [`Kind::CtsPlaced`]: a clear-to-send as above (the host buffer), then `at u64 | addr u64
//!   | rkey u32 | len u64`: the message's bytes `at..at + len` go to that memory (a segment the
//!   receiver places in device memory its NIC can write), the rest to the host buffer in order;
//! - [`Kind::Credit`]: nothing more.
//!
//! `credits` returns receive buffers to the peer (piggybacked on every message). `seq` names a
//! rendezvous, so that a clear-to-send and the final write-with-immediate match one request;
//! in an offer and in the direct message that uses it, `seq` is the offer's id.

use psnet_transport::Limits;

pub use crate::error::wire::{WireError, VERSION};

/// Bytes of the common header.
pub const BASE_LEN: usize = 8;
/// Bytes of the eager / request-to-send header before the segment lengths.
pub const DATA_HEADER_LEN: usize = BASE_LEN + 8;
/// Bytes of a clear-to-send.
pub const CTS_LEN: usize = BASE_LEN + 20;
/// Bytes of a clear-to-send that places a segment.
pub const CTS_PLACED_LEN: usize = CTS_LEN + 28;
/// Request-to-send flag: the metadata follows the header instead of being written remotely.
pub const RTS_META_INLINE: u16 = 1;

/// What a message on the queue pair is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A whole message, copied into the receiver's pre-posted buffer.
    Eager = 1,
    /// Request to send a large message; the receiver answers with [`Kind::Cts`].
    Rts = 2,
    /// Clear to send: where the sender may write the message.
    Cts = 3,
    /// Returns receive buffers only.
    Credit = 4,
    /// A buffer offered in advance: the peer may write one message of up to its length into
    /// it without asking ([`crate::proto::offers`]).
    Offer = 5,
    /// A message whose segments were just written into an offered buffer; carries the header
    /// and the metadata.
    Direct = 6,
    /// Clear to send, with one segment's bytes going to other memory of the receiver (device
    /// memory its NIC writes): [`PlacedCts`].
    CtsPlaced = 7,
}

/// The common header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Base {
    /// Message kind.
    pub kind: Kind,
    /// Receive buffers the sender has made available again since its last report.
    pub credits: u16,
    /// Rendezvous sequence number (0 for other kinds).
    pub seq: u32,
}

/// Header of an eager message or a request-to-send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataHeader {
    /// Length of the metadata block.
    pub meta_len: u32,
    /// Flags ([`RTS_META_INLINE`]).
    pub flags: u16,
    /// Length of each segment.
    pub seg_lens: Vec<u64>,
}

impl DataHeader {
    /// Bytes the header takes on the wire (after [`Base`]).
    pub fn encoded_len(nseg: usize) -> usize {
        DATA_HEADER_LEN + 8 * nseg
    }

    /// Metadata plus segments.
    pub fn payload_len(&self) -> u64 {
        self.meta_len as u64 + self.seg_lens.iter().sum::<u64>()
    }
}

/// A clear-to-send: the receiver's registered buffer for rendezvous `seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cts {
    /// Buffer address in the receiver.
    pub addr: u64,
    /// Its remote key.
    pub rkey: u32,
    /// Its usable length.
    pub len: u64,
}

/// A clear-to-send that places a segment: the message's bytes `at..at + to.len` go to `to`,
/// the others, in order, to `host`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlacedCts {
    /// The receiver's host buffer for the bytes before and after the placed range.
    pub host: Cts,
    /// Where the placed range starts in the message's bytes.
    pub at: u64,
    /// The memory the placed range is written to (its length is the range's).
    pub to: Cts,
}

/// Writes the common header into `out[..BASE_LEN]`.
pub fn put_base(out: &mut [u8], base: Base) {
    out[0] = base.kind as u8;
    out[1] = VERSION;
    out[2..4].copy_from_slice(&base.credits.to_le_bytes());
    out[4..8].copy_from_slice(&base.seq.to_le_bytes());
}

/// Writes an eager / request-to-send header; returns the bytes written.
pub fn put_data_header(
    out: &mut [u8],
    base: Base,
    meta_len: u32,
    flags: u16,
    seg_lens: impl ExactSizeIterator<Item = u64>,
) -> usize {
    put_base(out, base);
    let nseg = seg_lens.len();
    out[8..12].copy_from_slice(&meta_len.to_le_bytes());
    out[12..14].copy_from_slice(&(nseg as u16).to_le_bytes());
    out[14..16].copy_from_slice(&flags.to_le_bytes());
    let mut at = DATA_HEADER_LEN;
    for len in seg_lens {
        out[at..at + 8].copy_from_slice(&len.to_le_bytes());
        at += 8;
    }
    at
}

/// Writes a clear-to-send or an offer (`base.kind` says which); returns the bytes written.
pub fn put_cts(out: &mut [u8], base: Base, cts: Cts) -> usize {
    put_base(out, base);
    out[8..16].copy_from_slice(&cts.addr.to_le_bytes());
    out[16..20].copy_from_slice(&cts.rkey.to_le_bytes());
    out[20..28].copy_from_slice(&cts.len.to_le_bytes());
    CTS_LEN
}

/// Writes a clear-to-send that places a segment; returns the bytes written.
pub fn put_placed_cts(out: &mut [u8], base: Base, cts: PlacedCts) -> usize {
    put_cts(out, base, cts.host);
    out[28..36].copy_from_slice(&cts.at.to_le_bytes());
    out[36..44].copy_from_slice(&cts.to.addr.to_le_bytes());
    out[44..48].copy_from_slice(&cts.to.rkey.to_le_bytes());
    out[48..56].copy_from_slice(&cts.to.len.to_le_bytes());
    CTS_PLACED_LEN
}

fn need(buf: &[u8], n: usize) -> Result<(), WireError> {
    if buf.len() < n {
        return Err(WireError::Truncated {
            got: buf.len(),
            need: n,
        });
    }
    Ok(())
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Reads the common header.
pub fn parse_base(buf: &[u8]) -> Result<Base, WireError> {
    need(buf, BASE_LEN)?;
    let kind = match buf[0] {
        1 => Kind::Eager,
        2 => Kind::Rts,
        3 => Kind::Cts,
        4 => Kind::Credit,
        5 => Kind::Offer,
        6 => Kind::Direct,
        7 => Kind::CtsPlaced,
        k => return Err(WireError::UnknownKind(k)),
    };
    if buf[1] != VERSION {
        return Err(WireError::Version(buf[1]));
    }
    Ok(Base {
        kind,
        credits: u16_at(buf, 2),
        seq: u32_at(buf, 4),
    })
}

/// Reads an eager / request-to-send header, checked against `limits` before anything is
/// allocated; returns it and the offset of what follows.
pub fn parse_data_header(buf: &[u8], limits: &Limits) -> Result<(DataHeader, usize), WireError> {
    need(buf, DATA_HEADER_LEN)?;
    let meta_len = u32_at(buf, 8);
    let nseg = u16_at(buf, 12) as usize;
    let flags = u16_at(buf, 14);
    if meta_len > limits.max_meta {
        return Err(WireError::Limit(format!(
            "metadata of {meta_len} bytes (limit {})",
            limits.max_meta
        )));
    }
    if nseg > limits.max_segments as usize {
        return Err(WireError::Limit(format!(
            "{nseg} segments (limit {})",
            limits.max_segments
        )));
    }
    let end = DataHeader::encoded_len(nseg);
    need(buf, end)?;
    let seg_lens: Vec<u64> = (0..nseg)
        .map(|i| u64_at(buf, DATA_HEADER_LEN + 8 * i))
        .collect();
    let within_limit = seg_lens
        .iter()
        .try_fold(meta_len as u64, |acc, &l| acc.checked_add(l))
        .is_some_and(|total| total <= limits.max_message);
    if !within_limit {
        return Err(WireError::Limit(format!(
            "message above {} bytes (segments {seg_lens:?})",
            limits.max_message
        )));
    }
    Ok((
        DataHeader {
            meta_len,
            flags,
            seg_lens,
        },
        end,
    ))
}

/// Reads a clear-to-send or an offer.
pub fn parse_cts(buf: &[u8]) -> Result<Cts, WireError> {
    need(buf, CTS_LEN)?;
    Ok(Cts {
        addr: u64_at(buf, 8),
        rkey: u32_at(buf, 16),
        len: u64_at(buf, 20),
    })
}

/// Reads a clear-to-send that places a segment.
pub fn parse_placed_cts(buf: &[u8]) -> Result<PlacedCts, WireError> {
    need(buf, CTS_PLACED_LEN)?;
    Ok(PlacedCts {
        host: parse_cts(buf)?,
        at: u64_at(buf, 28),
        to: Cts {
            addr: u64_at(buf, 36),
            rkey: u32_at(buf, 44),
            len: u64_at(buf, 48),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn kind_strategy() -> impl Strategy<Value = Kind> {
        prop_oneof![Just(Kind::Eager), Just(Kind::Rts), Just(Kind::Direct)]
    }

    proptest! {
        #[test]
        fn data_header_roundtrips(kind in kind_strategy(), credits: u16, seq: u32,
                                  meta_len in 0u32..4096, flags in 0u16..2,
                                  lens in proptest::collection::vec(0u64..1 << 20, 0..40)) {
            let mut buf = vec![0u8; DataHeader::encoded_len(lens.len())];
            let n = put_data_header(&mut buf, Base { kind, credits, seq }, meta_len, flags,
                                    lens.iter().copied());
            prop_assert_eq!(n, buf.len());
            let base = parse_base(&buf).unwrap();
            prop_assert_eq!(base, Base { kind, credits, seq });
            let (h, end) = parse_data_header(&buf, &Limits::default()).unwrap();
            prop_assert_eq!(end, n);
            prop_assert_eq!(h, DataHeader { meta_len, flags, seg_lens: lens });
        }

        #[test]
        fn cts_roundtrips(offer: bool, credits: u16, seq: u32, addr: u64, rkey: u32, len: u64) {
            let kind = if offer { Kind::Offer } else { Kind::Cts };
            let mut buf = [0u8; CTS_LEN];
            put_cts(&mut buf, Base { kind, credits, seq }, Cts { addr, rkey, len });
            prop_assert_eq!(parse_base(&buf).unwrap(), Base { kind, credits, seq });
            prop_assert_eq!(parse_cts(&buf).unwrap(), Cts { addr, rkey, len });
        }

        #[test]
        fn placed_cts_roundtrips(credits: u16, seq: u32, host in (any::<u64>(), any::<u32>(), any::<u64>()),
                                 at: u64, to in (any::<u64>(), any::<u32>(), any::<u64>())) {
            let cts = PlacedCts {
                host: Cts { addr: host.0, rkey: host.1, len: host.2 },
                at,
                to: Cts { addr: to.0, rkey: to.1, len: to.2 },
            };
            let base = Base { kind: Kind::CtsPlaced, credits, seq };
            let mut buf = [0u8; CTS_PLACED_LEN];
            prop_assert_eq!(put_placed_cts(&mut buf, base, cts), CTS_PLACED_LEN);
            prop_assert_eq!(parse_base(&buf).unwrap(), base);
            prop_assert_eq!(parse_placed_cts(&buf).unwrap(), cts);
            // Cut short anywhere, it is refused.
            for n in 0..CTS_PLACED_LEN {
                prop_assert!(parse_placed_cts(&buf[..n]).is_err());
            }
        }

        /// Any bytes parse to a header or an error, never a panic.
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(base) = parse_base(&bytes) {
                match base.kind {
                    Kind::Eager | Kind::Rts | Kind::Direct => {
                        let _ = parse_data_header(&bytes, &Limits::default());
                    }
                    Kind::Cts | Kind::Offer => { let _ = parse_cts(&bytes); }
                    Kind::CtsPlaced => { let _ = parse_placed_cts(&bytes); }
                    Kind::Credit => {}
                }
            }
        }
    }

    #[test]
    fn limits_are_checked_before_allocating() {
        let limits = Limits {
            max_meta: 100,
            max_segments: 4,
            max_message: 1000,
        };
        let base = Base {
            kind: Kind::Rts,
            credits: 0,
            seq: 1,
        };
        let mut buf = vec![0u8; DataHeader::encoded_len(5)];
        put_data_header(&mut buf, base, 10, 0, [1u64; 5].into_iter());
        assert!(matches!(
            parse_data_header(&buf, &limits),
            Err(WireError::Limit(_))
        ));
        put_data_header(&mut buf, base, 101, 0, [].into_iter());
        assert!(matches!(
            parse_data_header(&buf, &limits),
            Err(WireError::Limit(_))
        ));
        put_data_header(&mut buf, base, 0, 0, [u64::MAX, 2].into_iter());
        assert!(matches!(
            parse_data_header(&buf, &limits),
            Err(WireError::Limit(_))
        ));
        // A segment count claiming more lengths than the bytes hold is truncation.
        let mut short = vec![0u8; DATA_HEADER_LEN];
        put_base(&mut short, base);
        short[12] = 3;
        assert!(matches!(
            parse_data_header(&short, &limits),
            Err(WireError::Truncated { .. })
        ));
        buf[1] = 9;
        assert_eq!(parse_base(&buf), Err(WireError::Version(9)));
        buf[0] = 77;
        assert_eq!(parse_base(&buf), Err(WireError::UnknownKind(77)));
    }
}
