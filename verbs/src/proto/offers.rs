//! Standing offers: receive buffers that a receiver hands its peer before the peer asks.
//!
//! After a large message lands, the receiver offers the sender a fresh buffer of that size. The
//! next message that fits (the same key pushed again, or the same key's pull answered again)
//! is written straight into it: RDMA writes of the segments, then one small [`Kind::Direct`]
//! message naming the offer. There is no request-to-send / clear-to-send round trip, so a
//! repeated message costs one trip instead of three.
//!
//! Why reusing a remote buffer this way is safe:
//! - an offer id names one buffer. The receiver keeps the buffer in its [`Offered`] book from
//!   the moment it is offered until the direct message naming the id arrives; only then is it
//!   handed to the application. It refuses a direct message for an id it does not hold.
//! - the sender removes an offer from its [`Offers`] when it uses it, so each offer is written
//!   at most once.
//! - on a reliable-connected queue pair, writes are placed in the receiver's memory before a
//!   send posted after them is delivered, so the buffer is whole when the direct message
//!   arrives.
//! - an id is given out again only after its buffer was redeemed, when the sender no longer
//!   holds it.
//!
//! The receiver bounds what it offers (bytes per peer, offers per size) and never takes an
//! offer back: an unused offer is released with the link.
//!
//! [`Kind::Direct`]: crate::proto::wire::Kind::Direct

use std::collections::HashMap;

use crate::error::VerbsError;

/// Offers of one buffer size a receiver keeps outstanding to one peer.
pub const PER_CLASS: u32 = 4;
/// Offers a sender keeps from one peer; more is a protocol error.
pub const MAX_HELD: usize = 1024;

/// The receiver's book of buffers offered to one peer and not yet written.
pub struct Offered<R> {
    live: HashMap<u32, (u64, R)>,
    per_class: HashMap<u64, u32>,
    bytes: u64,
    budget: u64,
    next_id: u32,
}

impl<R> Offered<R> {
    /// A book offering at most `budget` bytes at once (0: never offers).
    pub fn new(budget: u64) -> Self {
        Offered {
            live: HashMap::new(),
            per_class: HashMap::new(),
            bytes: 0,
            budget,
            next_id: 0,
        }
    }

    /// Whether one more buffer of `class` bytes may be offered now.
    pub fn wants(&self, class: u64) -> bool {
        class > 0
            && self.per_class.get(&class).copied().unwrap_or(0) < PER_CLASS
            && self.bytes.saturating_add(class) <= self.budget
    }

    /// Records `buf` (of `class` bytes) as offered; returns the id to send with it.
    pub fn offer(&mut self, class: u64, buf: R) -> u32 {
        let id = loop {
            let id = self.next_id;
            self.next_id = self.next_id.wrapping_add(1);
            if !self.live.contains_key(&id) {
                break id;
            }
        };
        self.live.insert(id, (class, buf));
        *self.per_class.entry(class).or_default() += 1;
        self.bytes += class;
        id
    }

    /// The peer wrote into offer `id`: its size class and buffer, now the receiver's again;
    /// `None` if no such offer is outstanding.
    pub fn redeem(&mut self, id: u32) -> Option<(u64, R)> {
        let (class, buf) = self.live.remove(&id)?;
        self.bytes -= class;
        if let Some(n) = self.per_class.get_mut(&class) {
            *n -= 1;
            if *n == 0 {
                self.per_class.remove(&class);
            }
        }
        Some((class, buf))
    }

    /// Bytes offered and not yet written.
    pub fn outstanding_bytes(&self) -> u64 {
        self.bytes
    }

    /// Offers outstanding.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Whether no offer is outstanding.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }
}

/// A buffer of the peer's that this side may write one message into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteBuf {
    /// The offer's id, named in the direct message.
    pub id: u32,
    /// Address in the peer.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Usable length.
    pub len: u64,
}

/// The sender's offers from one peer, not yet used.
#[derive(Default)]
pub struct Offers {
    held: Vec<RemoteBuf>,
}

impl Offers {
    /// Keeps an offer the peer made.
    pub fn add(&mut self, buf: RemoteBuf) -> Result<(), VerbsError> {
        if self.held.len() >= MAX_HELD {
            return Err(VerbsError::Protocol(format!(
                "peer offered more than {MAX_HELD} buffers"
            )));
        }
        if self.held.iter().any(|b| b.id == buf.id) {
            return Err(VerbsError::Protocol(format!(
                "peer offered buffer {} twice",
                buf.id
            )));
        }
        self.held.push(buf);
        Ok(())
    }

    /// The smallest offer holding `len` bytes, if any (left in place).
    pub fn fitting(&self, len: u64) -> Option<RemoteBuf> {
        self.held
            .iter()
            .filter(|b| b.len >= len)
            .min_by_key(|b| b.len)
            .copied()
    }

    /// Uses offer `id`: it is gone from here, never written twice.
    pub fn take(&mut self, id: u32) -> Option<RemoteBuf> {
        let at = self.held.iter().position(|b| b.id == id)?;
        Some(self.held.swap_remove(at))
    }

    /// Offers held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{HashSet, VecDeque};

    #[test]
    fn the_budget_and_the_per_size_bound_limit_offers() {
        let mut book = Offered::new(10 << 20);
        for _ in 0..PER_CLASS {
            assert!(book.wants(1 << 20));
            book.offer(1 << 20, ());
        }
        assert!(!book.wants(1 << 20), "per-size bound");
        assert!(book.wants(4 << 20));
        book.offer(4 << 20, ());
        assert!(!book.wants(4 << 20), "8 + 4 MiB is above the 10 MiB budget");
        assert!(
            !Offered::<()>::new(0).wants(4096),
            "a zero budget never offers"
        );
        assert!(!book.wants(0));
    }

    #[test]
    fn an_offer_is_redeemed_once_and_its_id_is_fresh_while_live() {
        let mut book = Offered::new(u64::MAX);
        let a = book.offer(4096, "a");
        let b = book.offer(4096, "b");
        assert_ne!(a, b);
        assert_eq!(book.redeem(a), Some((4096, "a")));
        assert_eq!(book.redeem(a), None, "written twice");
        assert_eq!(book.outstanding_bytes(), 4096);
        // Ids wrap, skipping live ones.
        book.next_id = b;
        let c = book.offer(4096, "c");
        assert_ne!(c, b);
    }

    #[test]
    fn the_sender_refuses_duplicates_and_floods_and_picks_the_smallest_fit() {
        let buf = |id, len| RemoteBuf {
            id,
            addr: 0,
            rkey: 0,
            len,
        };
        let mut offers = Offers::default();
        offers.add(buf(1, 8 << 20)).unwrap();
        offers.add(buf(2, 1 << 20)).unwrap();
        assert!(offers.add(buf(2, 1 << 20)).is_err());
        assert_eq!(offers.fitting(100).map(|b| b.id), Some(2));
        assert_eq!(offers.fitting(2 << 20).map(|b| b.id), Some(1));
        assert_eq!(offers.fitting(9 << 20), None);
        assert_eq!(offers.take(2).map(|b| b.id), Some(2));
        assert_eq!(offers.take(2), None);
        let mut id = 3;
        while offers.len() < MAX_HELD {
            offers.add(buf(id, 4096)).unwrap();
            id += 1;
        }
        assert!(offers.add(buf(id, 4096)).is_err(), "a peer flooding offers");
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// The receiver offers a buffer of class `classes[i]` if it may.
        Offer(usize),
        /// The oldest offer in flight reaches the sender.
        DeliverOffer,
        /// The sender sends `len` bytes, directly if an offer fits.
        Send(u64),
        /// The oldest direct message reaches the receiver.
        DeliverDirect,
    }

    const CLASSES: [u64; 3] = [4096, 1 << 20, 4 << 20];

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..CLASSES.len()).prop_map(Op::Offer),
            Just(Op::DeliverOffer),
            (1u64..5 << 20).prop_map(Op::Send),
            Just(Op::DeliverDirect),
        ]
    }

    proptest! {
        /// Whatever the interleaving: every direct write lands in a buffer that is offered,
        /// big enough and written by nobody else; no buffer is written twice; the receiver
        /// stays within its bounds.
        #[test]
        fn reuse_is_safe(ops in proptest::collection::vec(op(), 1..300), budget in 0u64..32 << 20) {
            let mut book: Offered<u64> = Offered::new(budget);
            let mut offers = Offers::default();
            let mut offers_in_flight = VecDeque::new();
            let mut directs_in_flight: VecDeque<(u32, u64)> = VecDeque::new();
            let mut next_buffer = 0u64;
            let mut written = HashSet::new();
            for op in ops {
                match op {
                    Op::Offer(i) => {
                        let class = CLASSES[i];
                        if book.wants(class) {
                            let id = book.offer(class, next_buffer);
                            next_buffer += 1;
                            offers_in_flight.push_back(RemoteBuf { id, addr: 0, rkey: 0, len: class });
                        }
                    }
                    Op::DeliverOffer => {
                        if let Some(buf) = offers_in_flight.pop_front() {
                            prop_assert!(offers.add(buf).is_ok());
                        }
                    }
                    Op::Send(len) => {
                        if let Some(fit) = offers.fitting(len) {
                            let used = offers.take(fit.id).unwrap();
                            prop_assert!(used.len >= len);
                            directs_in_flight.push_back((used.id, len));
                        }
                    }
                    Op::DeliverDirect => {
                        if let Some((id, len)) = directs_in_flight.pop_front() {
                            let (class, buffer) = book.redeem(id).expect("direct write into an offered buffer");
                            prop_assert!(class >= len);
                            prop_assert!(written.insert(buffer), "buffer written twice");
                        }
                    }
                }
                prop_assert!(book.outstanding_bytes() <= budget);
                // Every id the sender holds or is about to use is live at the receiver, once.
                let mut ids = HashSet::new();
                let held = offers.held.iter().map(|b| b.id);
                let flying = offers_in_flight.iter().map(|b| b.id);
                let used = directs_in_flight.iter().map(|&(id, _)| id);
                for id in held.chain(flying).chain(used) {
                    prop_assert!(ids.insert(id), "id {} named twice", id);
                    prop_assert!(book.live.contains_key(&id));
                }
                prop_assert_eq!(ids.len(), book.len());
            }
        }
    }
}
