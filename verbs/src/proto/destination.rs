//! Where a large message's bytes go in the receiver: one registered host buffer (a
//! clear-to-send, an offer), or that buffer with one segment's range carved out into other
//! memory the receiver's NIC writes (a clear-to-send that places: GPU memory registered for
//! GPUDirect). Plain arithmetic, checked against the sender's own view of the message before
//! any write is posted: a peer's wrong or hostile answer fails the link, never a write
//! outside what it named.

use super::wire::{Cts, PlacedCts};

/// A clear-to-send that names memory the message cannot be written to.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DestinationError {
    /// The buffer offered for the whole message is smaller than it.
    #[error("{offered} bytes offered, {needed} needed")]
    OfferTooSmall {
        /// Its size.
        offered: u64,
        /// The message's size.
        needed: u64,
    },
    /// The host buffer is smaller than the bytes that go to it.
    #[error("{offered} bytes of host buffer offered, {needed} needed")]
    TooSmall {
        /// Its size.
        offered: u64,
        /// The bytes that go to it.
        needed: u64,
    },
    /// The placed range reaches past the message.
    #[error("placed range {at}+{len} leaves the message of {total} bytes")]
    PastMessage {
        /// Where it starts.
        at: u64,
        /// Its length.
        len: u64,
        /// The message's length.
        total: u64,
    },
    /// The placed range starts or ends inside a segment.
    #[error("placed range {at}..{end} does not fall on the message's segments")]
    NotOnSegments {
        /// Where it starts.
        at: u64,
        /// Where it ends.
        end: u64,
    },
    /// A buffer whose end is no address.
    #[error("a buffer of {len} bytes at {addr:#x} runs past the address space")]
    PastAddressSpace {
        /// Its address.
        addr: u64,
        /// Its length.
        len: u64,
    },
}

/// The receiver's memory for one large message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Destination {
    host: Cts,
    /// The placed range: where it starts in the message, and its memory.
    placed: Option<(u64, Cts)>,
}

impl Destination {
    /// All of the message into `host`, which must hold `total` bytes.
    pub fn whole(host: Cts, total: u64) -> Result<Destination, DestinationError> {
        if host.len < total {
            return Err(DestinationError::OfferTooSmall {
                offered: host.len,
                needed: total,
            });
        }
        addressable(host)?;
        Ok(Destination { host, placed: None })
    }

    /// The message's bytes `cts.at..cts.at + cts.to.len` into `cts.to`, the rest into
    /// `cts.host`. The message has `total` bytes in gather entries of `entry_lens`; the range
    /// must start and end where entries do (a whole segment: the writes are never split inside
    /// an entry), and the host buffer must hold the rest.
    pub fn placed(
        cts: PlacedCts,
        total: u64,
        entry_lens: impl IntoIterator<Item = u64>,
    ) -> Result<Destination, DestinationError> {
        let len = cts.to.len;
        let end = cts.at.checked_add(len).filter(|&end| end <= total).ok_or(
            DestinationError::PastMessage {
                at: cts.at,
                len,
                total,
            },
        )?;
        if cts.host.len < total - len {
            return Err(DestinationError::TooSmall {
                offered: cts.host.len,
                needed: total - len,
            });
        }
        let (mut starts_ok, mut ends_ok, mut off) = (cts.at == 0, end == 0, 0u64);
        for l in entry_lens {
            off += l;
            starts_ok |= off == cts.at;
            ends_ok |= off == end;
        }
        if !(starts_ok && ends_ok) {
            return Err(DestinationError::NotOnSegments { at: cts.at, end });
        }
        addressable(cts.host)?;
        addressable(cts.to)?;
        Ok(Destination {
            host: cts.host,
            placed: Some((cts.at, cts.to)),
        })
    }

    /// The message offsets at which a write must end: the placed range's edges.
    pub fn edges(&self) -> Option<(u64, u64)> {
        self.placed.map(|(at, to)| (at, at + to.len))
    }

    /// Where message byte `off` goes: `(rkey, address)`; the bytes after it up to the next
    /// edge ([`Destination::edges`]) follow contiguously.
    pub fn locate(&self, off: u64) -> (u32, u64) {
        match self.placed {
            Some((at, to)) if off >= at && off < at + to.len => (to.rkey, to.addr + (off - at)),
            Some((at, to)) if off >= at => (self.host.rkey, self.host.addr + (off - to.len)),
            _ => (self.host.rkey, self.host.addr + off),
        }
    }
}

/// Refuses a buffer whose end would not be an address (so that no write's address wraps).
fn addressable(buf: Cts) -> Result<(), DestinationError> {
    buf.addr
        .checked_add(buf.len)
        .map(|_| ())
        .ok_or(DestinationError::PastAddressSpace {
            addr: buf.addr,
            len: buf.len,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cts(addr: u64, rkey: u32, len: u64) -> Cts {
        Cts { addr, rkey, len }
    }

    #[test]
    fn a_whole_buffer_must_hold_the_message() {
        assert!(Destination::whole(cts(0x1000, 1, 99), 100).is_err());
        let d = Destination::whole(cts(0x1000, 1, 100), 100).unwrap();
        assert_eq!(d.edges(), None);
        assert_eq!(d.locate(0), (1, 0x1000));
        assert_eq!(d.locate(99), (1, 0x1000 + 99));
    }

    #[test]
    fn a_placed_range_is_a_whole_segment_of_the_message() {
        let lens = [10u64, 30, 5];
        let placed = |at, len, host_len| PlacedCts {
            host: cts(0x1000, 1, host_len),
            at,
            to: cts(0x9000, 2, len),
        };
        let d = Destination::placed(placed(10, 30, 15), 45, lens).unwrap();
        assert_eq!(d.edges(), Some((10, 40)));
        assert_eq!(d.locate(0), (1, 0x1000));
        assert_eq!(d.locate(10), (2, 0x9000));
        assert_eq!(d.locate(39), (2, 0x9000 + 29));
        assert_eq!(d.locate(40), (1, 0x1000 + 10));
        // Inside an entry, past the message, overflowing, or a host buffer too short.
        assert!(Destination::placed(placed(5, 30, 15), 45, lens).is_err());
        assert!(Destination::placed(placed(10, 20, 25), 45, lens).is_err());
        assert!(Destination::placed(placed(40, 30, 15), 45, lens).is_err());
        assert!(Destination::placed(placed(u64::MAX, 2, 45), 45, lens).is_err());
        assert!(Destination::placed(placed(10, 30, 14), 45, lens).is_err());
        // Buffers whose end is past the address space.
        let wraps = PlacedCts {
            to: cts(u64::MAX - 10, 2, 30),
            ..placed(10, 30, 15)
        };
        assert!(Destination::placed(wraps, 45, lens).is_err());
        let wraps = PlacedCts {
            host: cts(u64::MAX - 10, 1, 15),
            ..placed(10, 30, 15)
        };
        assert!(Destination::placed(wraps, 45, lens).is_err());
        assert!(Destination::whole(cts(u64::MAX, 1, 2), 2).is_err());
        // The first and the last segment.
        assert!(Destination::placed(placed(0, 10, 35), 45, lens).is_ok());
        assert!(Destination::placed(placed(40, 5, 40), 45, lens).is_ok());
    }

    proptest! {
        /// Every byte of the message has exactly one place: the host bytes fill the host
        /// buffer in order without a gap or an overlap, the placed ones fill the placed memory.
        #[test]
        fn every_byte_has_one_place(lens in proptest::collection::vec(0u64..50, 1..8),
                                    pick: prop::sample::Index) {
            let total: u64 = lens.iter().sum();
            let seg = pick.index(lens.len());
            let at: u64 = lens[..seg].iter().sum();
            let len = lens[seg];
            let d = Destination::placed(
                PlacedCts { host: cts(1 << 20, 1, total - len), at, to: cts(1 << 40, 2, len) },
                total,
                lens.iter().copied(),
            ).unwrap();
            let mut host = vec![0u32; (total - len) as usize];
            let mut dev = vec![0u32; len as usize];
            for off in 0..total {
                match d.locate(off) {
                    (1, a) => host[(a - (1 << 20)) as usize] += 1,
                    (2, a) => dev[(a - (1 << 40)) as usize] += 1,
                    other => prop_assert!(false, "unexpected {other:?}"),
                }
            }
            prop_assert!(host.iter().chain(&dev).all(|&n| n == 1));
        }
    }
}
