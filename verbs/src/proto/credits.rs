//! Credit-based flow control over pre-posted receive buffers.
//!
//! Every message on a queue pair (and every RDMA write with immediate) consumes one receive
//! buffer the peer posted. The sender may only send while it holds a credit for one; the
//! receiver re-posts buffers and returns their credits, piggybacked on every message it sends
//! or, when it has nothing to send, in an explicit credit message. One credit is kept in
//! reserve for those credit messages so that two sides out of credits can always unblock each
//! other; a receiver whose inbox is full withholds the credits of data buffers (back-pressure)
//! and releases them when the application reads again.

use crate::error::VerbsError;

/// What a credit is spent on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Application data (eager messages, requests-to-send, their final writes) and protocol
    /// control (clear-to-send): may not dip into the reserve.
    Normal,
    /// An explicit credit message: may use the reserve.
    CreditReturn,
}

/// Credits for one direction of one queue pair, as seen from one side: what it may send to
/// the peer, and what it owes the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credits {
    depth: u32,
    available: u32,
    reserve: u32,
    unreported: u32,
    withheld: u32,
    threshold: u32,
}

impl Credits {
    /// Credits for a peer that pre-posted `peer_depth` receive buffers (at least 4).
    pub fn new(peer_depth: u32) -> Self {
        assert!(peer_depth >= 4, "receive depth must be at least 4");
        Credits {
            depth: peer_depth,
            available: peer_depth,
            reserve: 1,
            unreported: 0,
            withheld: 0,
            // At least 2: a credit message costs the receiver one buffer, whose credit alone must
            // not trigger a credit message back (that would ping-pong for ever).
            threshold: (peer_depth / 4).max(2),
        }
    }

    /// Credits this side may spend now.
    pub fn available(&self) -> u32 {
        self.available
    }

    /// Spends `n` credits if the class allows it.
    pub fn try_take(&mut self, class: Class, n: u32) -> bool {
        let floor = match class {
            Class::Normal => self.reserve,
            Class::CreditReturn => 0,
        };
        if self.available >= n + floor {
            self.available -= n;
            true
        } else {
            false
        }
    }

    /// The peer returned `n` credits. More than the peer's buffers this side has used is a
    /// protocol error (the peer's count is wrong, or it is not psnet): taken as given, it
    /// would let this side overrun the peer's receive buffers, and a peer repeating it
    /// would overflow the count.
    pub fn granted(&mut self, n: u16) -> Result<(), VerbsError> {
        match self.available.checked_add(u32::from(n)) {
            Some(available) if available <= self.depth => {
                self.available = available;
                Ok(())
            }
            _ => Err(VerbsError::Protocol(format!(
                "the peer returned {n} credits, but only {} of its {} receive buffers were used",
                self.depth - self.available,
                self.depth
            ))),
        }
    }

    /// One of this side's receive buffers was consumed and posted again; its credit is owed to
    /// the peer now, or later if `withhold` (the inbox is full).
    pub fn slot_reposted(&mut self, withhold: bool) {
        if withhold {
            self.withheld += 1;
        } else {
            self.unreported += 1;
        }
    }

    /// The inbox has room again: withheld credits become owed.
    pub fn release_withheld(&mut self) {
        self.unreported += std::mem::take(&mut self.withheld);
    }

    /// Takes the credits to piggyback on an outgoing message.
    pub fn take_report(&mut self) -> u16 {
        let n = self.unreported.min(u16::MAX as u32);
        self.unreported -= n;
        n as u16
    }

    /// Whether enough credits are owed to send an explicit credit message.
    pub fn wants_credit_message(&self) -> bool {
        self.unreported >= self.threshold
    }

    /// Credits owed to the peer (reported later).
    pub fn owed(&self) -> u32 {
        self.unreported + self.withheld
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    /// One side of a simulated link: its credits towards the peer and the messages in flight
    /// to the peer (each carrying a credit report).
    struct Side {
        credits: Credits,
        in_flight: VecDeque<u16>,
    }

    #[derive(Clone, Copy, Debug)]
    enum Op {
        Send(bool),
        Deliver(bool, bool),
        Release(bool),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            any::<bool>().prop_map(Op::Send),
            (any::<bool>(), any::<bool>()).prop_map(|(s, w)| Op::Deliver(s, w)),
            any::<bool>().prop_map(Op::Release),
        ]
    }

    fn send(sides: &mut [Side; 2], from: usize, class: Class) -> bool {
        if !sides[from].credits.try_take(class, 1) {
            return false;
        }
        let report = sides[from].credits.take_report();
        sides[from].in_flight.push_back(report);
        true
    }

    fn deliver(sides: &mut [Side; 2], to: usize, withhold: bool) {
        let from = 1 - to;
        if let Some(report) = sides[from].in_flight.pop_front() {
            sides[to].credits.granted(report).unwrap();
            sides[to].credits.slot_reposted(withhold);
            if sides[to].credits.wants_credit_message() {
                send(sides, to, Class::CreditReturn);
            }
        }
    }

    /// Buffers of `to` that `from` holds credits for, plus what is in flight or owed, always
    /// add up to the depth: no credit is created or lost.
    fn conserved(sides: &[Side; 2], from: usize, depth: u32) -> bool {
        let to = 1 - from;
        let reports_in_flight: u32 = sides[to].in_flight.iter().map(|&r| r as u32).sum();
        sides[from].credits.available()
            + sides[from].in_flight.len() as u32
            + sides[to].credits.owed()
            + reports_in_flight
            == depth
    }

    proptest! {
        #[test]
        fn credits_are_conserved_and_never_deadlock(depth in 4u32..64,
                                                    ops in proptest::collection::vec(op(), 0..400)) {
            let mut sides = [
                Side { credits: Credits::new(depth), in_flight: VecDeque::new() },
                Side { credits: Credits::new(depth), in_flight: VecDeque::new() },
            ];
            for op in ops {
                match op {
                    Op::Send(s) => { send(&mut sides, s as usize, Class::Normal); }
                    Op::Deliver(s, w) => deliver(&mut sides, s as usize, w),
                    Op::Release(s) => {
                        let s = s as usize;
                        sides[s].credits.release_withheld();
                        if sides[s].credits.wants_credit_message() {
                            send(&mut sides, s, Class::CreditReturn);
                        }
                    }
                }
                prop_assert!(conserved(&sides, 0, depth) && conserved(&sides, 1, depth));
            }
            // Quiesce: both applications read (release), everything in flight is delivered.
            for _ in 0..4 * depth {
                for s in 0..2 {
                    sides[s].credits.release_withheld();
                    if sides[s].credits.wants_credit_message() {
                        send(&mut sides, s, Class::CreditReturn);
                    }
                    deliver(&mut sides, s, false);
                }
            }
            for s in 0..2 {
                prop_assert!(sides[s].in_flight.is_empty());
                // Once quiet, each side can send again: nothing is stuck in the other's books.
                prop_assert!(sides[s].credits.try_take(Class::Normal, 1),
                    "side {s} starved: {:?} / peer {:?}", sides[s].credits, sides[1 - s].credits);
            }
        }
    }

    #[test]
    fn reserve_is_for_credit_messages_only() {
        let mut c = Credits::new(4);
        assert!(c.try_take(Class::Normal, 3));
        assert!(!c.try_take(Class::Normal, 1));
        assert!(c.try_take(Class::CreditReturn, 1));
        assert!(!c.try_take(Class::CreditReturn, 1));
        c.granted(2).unwrap();
        assert!(c.try_take(Class::Normal, 1));
    }

    /// A peer cannot return more credits than it has buffers, however often it repeats the
    /// largest report (which used to overflow the count: a panic with overflow checks).
    #[test]
    fn credits_beyond_the_peers_buffers_are_a_protocol_error() {
        let mut c = Credits::new(4);
        assert!(matches!(c.granted(1), Err(VerbsError::Protocol(_))));
        assert_eq!(c.available(), 4);
        assert!(c.try_take(Class::Normal, 2));
        let err = c.granted(3).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the peer returned 3 credits, but only 2 of its 4 receive buffers were used"
        );
        assert_eq!(c.available(), 2);
        c.granted(2).unwrap();
        assert_eq!(c.available(), 4);
        let mut c = Credits::new(u32::MAX);
        for _ in 0..3 {
            assert!(c.granted(u16::MAX).is_err());
        }
        assert_eq!(c.available(), u32::MAX);
    }

    #[test]
    fn withheld_credits_wait_for_release() {
        let mut c = Credits::new(8);
        c.slot_reposted(true);
        c.slot_reposted(true);
        assert_eq!(c.take_report(), 0);
        assert!(!c.wants_credit_message());
        c.release_withheld();
        assert!(c.wants_credit_message());
        assert_eq!(c.take_report(), 2);
        assert_eq!(c.owed(), 0);
    }
}
