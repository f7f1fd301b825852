use std::collections::BTreeSet;

use super::*;
use proptest::prelude::*;

const T: Duration = Duration::from_millis(100);
const A: NodeId = NodeId(8);
const B: NodeId = NodeId(9);

fn resender() -> Resender {
    Resender::new(ResendConfig::new(T))
}

fn msg(i: u64) -> Bytes {
    Bytes::copy_from_slice(&i.to_le_bytes())
}

fn id_of(t: &Transmit) -> u64 {
    u64::from_le_bytes(t.meta[..8].try_into().unwrap())
}

fn drain(r: &mut Resender, now: Instant) -> Vec<Transmit> {
    std::iter::from_fn(|| r.poll_transmit(now)).collect()
}

#[test]
fn sequence_numbers_window_and_acks() {
    let now = Instant::now();
    let mut r = resender();
    for i in 1..=3 {
        let t = r.send(B, msg(i), None, now).unwrap();
        assert_eq!((t.seq, t.ack, t.resend), (Some(i), 1, false));
    }
    // Other peers count on their own.
    assert_eq!(r.send(A, msg(0), None, now).unwrap().seq, Some(1));
    assert_eq!(r.unacked(B), 3);
    assert_eq!(r.handle_ack(B, 3), 2);
    assert_eq!(r.unacked(B), 1);
    // Acknowledging what was never sent is ignored; acknowledging again frees nothing.
    assert_eq!(r.handle_ack(B, 99), 0);
    assert_eq!(r.handle_ack(B, 2), 0);
    assert_eq!(r.handle_ack(B, 4), 1);
    assert_eq!(r.handle_ack(NodeId(77), 4), 0);
    assert_eq!(r.stats().sent, 4);
}

#[test]
fn the_window_is_bounded_in_messages_and_bytes() {
    let now = Instant::now();
    let mut r = Resender::new(ResendConfig {
        window: 2,
        window_bytes: 100,
        ..ResendConfig::new(T)
    });
    r.send(B, msg(1), None, now).unwrap();
    r.send(B, msg(2), None, now).unwrap();
    assert_eq!(r.send(B, msg(3), None, now), Err(SendError::Full));
    r.handle_ack(B, 3);
    // One message always fits, whatever its size; a second one must fit the byte bound.
    let big = Bytes::from(vec![0u8; 1000]);
    r.send(B, msg(3), Some(big.clone()), now).unwrap();
    assert_eq!(r.send(B, msg(4), None, now), Err(SendError::Full));
    r.handle_ack(B, 4);
    r.send(B, msg(4), Some(Bytes::from(vec![0u8; 80])), now)
        .unwrap();
    assert_eq!(
        r.send(B, msg(5), Some(Bytes::from(vec![0u8; 20])), now),
        Err(SendError::Full)
    );
}

#[test]
fn duplicates_and_reordering_are_recognized_in_constant_memory() {
    let now = Instant::now();
    let mut r = resender();
    // Every number of a whole window in reverse order: all new, then all duplicates.
    for seq in (1..=WINDOW as u64).rev() {
        assert_eq!(
            r.handle_incoming(A, seq, 8, now),
            Delivery::Deliver,
            "{seq}"
        );
    }
    for seq in 1..=WINDOW as u64 {
        assert_eq!(r.handle_incoming(A, seq, 8, now), Delivery::Duplicate);
    }
    assert_eq!(r.peers[&A].received.base, WINDOW as u64 + 1);
    // A hole: numbers above it are remembered by the bitmap, up to a window beyond it.
    let base = WINDOW as u64 + 1;
    assert_eq!(r.handle_incoming(A, base + 5, 8, now), Delivery::Deliver);
    assert_eq!(r.handle_incoming(A, base + 5, 8, now), Delivery::Duplicate);
    assert_eq!(
        r.handle_incoming(A, base + WINDOW as u64, 8, now),
        Delivery::OutOfWindow
    );
    assert_eq!(
        r.handle_incoming(A, base + WINDOW as u64 - 1, 8, now),
        Delivery::Deliver
    );
    for seq in base..base + 5 {
        assert_eq!(r.handle_incoming(A, seq, 8, now), Delivery::Deliver);
    }
    assert_eq!(r.peers[&A].received.base, base + 6);
    let s = r.stats();
    assert_eq!(
        (s.delivered, s.duplicates, s.out_of_window),
        (WINDOW as u64 + 7, WINDOW as u64 + 1, 1)
    );
    assert!(std::mem::size_of::<Received>() <= 8 + WINDOW / 8);
}

#[test]
fn resends_follow_ps_lite_timing_then_give_up_naming_the_limit() {
    let t0 = Instant::now();
    let mut r = resender();
    r.send(B, msg(1), Some(msg(2)), t0).unwrap();
    assert_eq!(r.poll_timeout(), Some(t0 + T));
    r.handle_timeout(t0 + T - Duration::from_millis(1));
    assert!(drain(&mut r, t0 + T).is_empty());
    for k in 1..=MAX_RETRIES {
        let at = t0 + T * k;
        r.handle_timeout(at);
        let out = drain(&mut r, at);
        assert_eq!(out.len(), 1, "resend {k}");
        assert_eq!((out[0].seq, out[0].resend), (Some(1), true));
        assert_eq!(out[0].value, Some(msg(2)));
        assert_eq!(r.poll_timeout(), Some(t0 + T * (k + 1)));
    }
    assert_eq!(r.poll_event(), None);
    let end = t0 + T * (MAX_RETRIES + 1);
    r.handle_timeout(end);
    let gave_up = r.poll_event().expect("given up");
    assert_eq!(gave_up.peer, B);
    assert!(
        gave_up.reason.contains("PS_RESEND_TIMEOUT=100 ms"),
        "{}",
        gave_up.reason
    );
    assert!(gave_up.reason.contains("10 resends"), "{}", gave_up.reason);
    assert_eq!(r.unacked(B), 0);
    assert!(r.failure(B).is_some());
    assert!(matches!(
        r.send(B, msg(3), None, end),
        Err(SendError::Failed(_))
    ));
    assert_eq!(r.poll_timeout(), None);
    assert_eq!(r.stats().resent, u64::from(MAX_RETRIES));
    assert_eq!(r.stats().gave_up, 1);
}

#[test]
fn a_late_timer_resends_once_and_catches_up() {
    let t0 = Instant::now();
    let mut r = resender();
    r.send(B, msg(1), None, t0).unwrap();
    r.handle_timeout(t0 + T * 5 + Duration::from_millis(1));
    assert_eq!(drain(&mut r, t0 + T * 5).len(), 1);
    assert_eq!(r.poll_timeout(), Some(t0 + T * 6));
}

#[test]
fn a_reconnection_resends_everything_unacknowledged_in_order() {
    let t0 = Instant::now();
    let mut r = resender();
    for i in 1..=4 {
        r.send(B, msg(i), None, t0).unwrap();
    }
    r.handle_ack(B, 2);
    assert!(r.handle_peer_lost(B, "reset", t0));
    assert!(!r.handle_peer_lost(B, "reset again", t0), "already down");
    assert!(r.is_down(B));
    // Nothing goes out while down, not even due resends.
    r.handle_timeout(t0 + T);
    assert!(drain(&mut r, t0 + T).is_empty());
    r.handle_peer_connected(B);
    assert!(!r.is_down(B));
    let out = drain(&mut r, t0 + T);
    let seqs: Vec<_> = out.iter().map(|t| t.seq.unwrap()).collect();
    assert_eq!(seqs, vec![2, 3, 4]);
    assert!(out.iter().all(|t| t.resend));
    // Acknowledged before its turn: not resent.
    r.handle_peer_connected(B);
    r.handle_ack(B, 4);
    let out = drain(&mut r, t0 + T);
    assert_eq!(out.iter().map(|t| t.seq).collect::<Vec<_>>(), vec![Some(4)]);
}

#[test]
fn a_connection_that_stays_lost_gives_the_peer_up() {
    let t0 = Instant::now();
    let mut r = resender();
    assert!(r.handle_peer_lost(A, "closed by the peer", t0));
    let limit = T * (MAX_RETRIES + 1);
    assert_eq!(r.poll_timeout(), Some(t0 + limit));
    r.handle_timeout(t0 + limit - Duration::from_millis(1));
    assert_eq!(r.poll_event(), None);
    r.handle_timeout(t0 + limit);
    let g = r.poll_event().unwrap();
    assert_eq!(g.peer, A);
    assert!(g.reason.contains("closed by the peer"), "{}", g.reason);
    assert!(g.reason.contains("not re-established"), "{}", g.reason);
    // Given up once; a lost connection afterwards changes nothing.
    assert!(!r.handle_peer_lost(A, "again", t0 + limit));
    r.fail_peer(A, "twice".into());
    assert_eq!(r.poll_event(), None);
}

#[test]
fn acknowledgements_wait_a_quarter_timeout_unless_urgent_or_piggybacked() {
    let t0 = Instant::now();
    let mut r = resender();
    assert_eq!(r.handle_incoming(A, 1, 10, t0), Delivery::Deliver);
    assert!(r.take_wake());
    assert!(drain(&mut r, t0 + T / 4 - Duration::from_millis(1)).is_empty());
    assert_eq!(r.poll_timeout(), Some(t0 + T / 4));
    let out = drain(&mut r, t0 + T / 4);
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].seq, out[0].ack, out[0].meta.len()), (None, 2, 0));
    assert_eq!(r.poll_timeout(), None);
    // Piggybacked on a message: nothing owed afterwards.
    r.handle_incoming(A, 2, 10, t0);
    let t = r.send(A, msg(9), None, t0).unwrap();
    assert_eq!(t.ack, 3);
    assert!(drain(&mut r, t0 + T).iter().all(|t| t.seq.is_some()));
    // A duplicate is answered at once.
    r.handle_ack(A, 2);
    r.handle_incoming(A, 1, 10, t0);
    assert_eq!(drain(&mut r, t0).len(), 1);
    // So are many deliveries, or many bytes.
    for seq in 3..3 + u64::from(ACK_EVERY) {
        r.handle_incoming(A, seq, 1, t0);
    }
    assert_eq!(drain(&mut r, t0)[0].ack, 3 + u64::from(ACK_EVERY));
    r.handle_incoming(A, 3 + u64::from(ACK_EVERY), ACK_BYTES, t0);
    assert_eq!(drain(&mut r, t0).len(), 1);
    assert_eq!(r.stats().acks_sent, 4);
}

#[derive(Clone, Debug)]
enum Op {
    /// `from_a`: A sends to B, else B to A.
    Send(bool),
    /// Delivers the packet at `pick` (modulo) of a direction; `keep` leaves a copy (duplication).
    Deliver {
        to_b: bool,
        pick: usize,
        keep: bool,
    },
    /// The connection breaks: what is in flight is lost.
    Drop,
    Reconnect,
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => any::<bool>().prop_map(Op::Send),
        8 => (any::<bool>(), any::<usize>(), proptest::bool::weighted(0.2))
            .prop_map(|(to_b, pick, keep)| Op::Deliver { to_b, pick, keep }),
        1 => Just(Op::Drop),
        1 => Just(Op::Reconnect),
        2 => (1u64..50).prop_map(Op::Advance),
    ]
}

/// Two nodes and the network between them.
struct Sim {
    now: Instant,
    elapsed: Duration,
    up: bool,
    nodes: [Resender; 2],
    /// In flight towards node 0 (A) and node 1 (B).
    flight: [Vec<Transmit>; 2],
    next_id: u64,
    sent: [BTreeSet<u64>; 2],
    delivered: [BTreeSet<u64>; 2],
}

const IDS: [NodeId; 2] = [A, B];

impl Sim {
    fn new(window: usize) -> Self {
        let config = ResendConfig {
            window,
            ..ResendConfig::new(T)
        };
        Sim {
            now: Instant::now(),
            elapsed: Duration::ZERO,
            up: true,
            nodes: [Resender::new(config), Resender::new(config)],
            flight: [Vec::new(), Vec::new()],
            next_id: 0,
            sent: [BTreeSet::new(), BTreeSet::new()],
            delivered: [BTreeSet::new(), BTreeSet::new()],
        }
    }

    /// What a driver does with a transmit: onto the wire if connected, else lost.
    fn put(&mut self, from: usize, t: Transmit) {
        if self.up {
            self.flight[1 - from].push(t);
        } else {
            self.nodes[from].handle_peer_lost(IDS[1 - from], "not connected", self.now);
        }
    }

    fn flush(&mut self) {
        for from in 0..2 {
            while let Some(t) = self.nodes[from].poll_transmit(self.now) {
                self.put(from, t);
            }
        }
    }

    fn arrive(&mut self, to: usize, t: Transmit) -> Result<(), TestCaseError> {
        let from = IDS[1 - to];
        let node = &mut self.nodes[to];
        node.handle_ack(from, t.ack);
        if let Some(seq) = t.seq {
            let len = t.meta.len();
            if node.handle_incoming(from, seq, len, self.now) == Delivery::Deliver {
                let id = id_of(&t);
                prop_assert!(
                    self.delivered[to].insert(id),
                    "message {} delivered twice",
                    id
                );
            }
        }
        Ok(())
    }

    fn apply(&mut self, op: Op) -> Result<(), TestCaseError> {
        match op {
            Op::Send(from_a) => {
                let from = usize::from(!from_a);
                let id = self.next_id;
                match self.nodes[from].send(IDS[1 - from], msg(id), None, self.now) {
                    Ok(t) => {
                        self.next_id += 1;
                        self.sent[1 - from].insert(id);
                        self.put(from, t);
                    }
                    Err(SendError::Full) => {}
                    Err(e) => return Err(TestCaseError::fail(format!("{e:?}"))),
                }
            }
            Op::Deliver { to_b, pick, keep } => {
                let to = usize::from(to_b);
                if !self.flight[to].is_empty() {
                    let i = pick % self.flight[to].len();
                    let t = if keep {
                        self.flight[to][i].clone()
                    } else {
                        self.flight[to].remove(i)
                    };
                    self.arrive(to, t)?;
                }
            }
            Op::Drop => {
                if self.up {
                    self.up = false;
                    self.flight = [Vec::new(), Vec::new()];
                    for n in 0..2 {
                        self.nodes[n].handle_peer_lost(IDS[1 - n], "reset", self.now);
                    }
                }
            }
            Op::Reconnect => self.reconnect(),
            Op::Advance(ms) => {
                // Stay well inside the give-up limit: the network here always recovers.
                let step = Duration::from_millis(ms);
                if self.elapsed + step <= T * 7 {
                    self.elapsed += step;
                    self.now += step;
                    for n in &mut self.nodes {
                        n.handle_timeout(self.now);
                    }
                }
            }
        }
        self.flush();
        Ok(())
    }

    fn reconnect(&mut self) {
        if !self.up {
            self.up = true;
            for n in 0..2 {
                self.nodes[n].handle_peer_connected(IDS[1 - n]);
            }
        }
    }

    /// The network heals and delivers everything in order; time passes until all is settled.
    fn settle(&mut self) -> Result<(), TestCaseError> {
        self.reconnect();
        self.flush();
        for _ in 0..20 {
            for to in 0..2 {
                for t in std::mem::take(&mut self.flight[to]) {
                    self.arrive(to, t)?;
                }
            }
            self.flush();
            let idle = self.flight.iter().all(Vec::is_empty)
                && self.nodes[0].unacked(B) == 0
                && self.nodes[1].unacked(A) == 0;
            if idle {
                return Ok(());
            }
            self.now += T / 4;
            for n in &mut self.nodes {
                n.handle_timeout(self.now);
            }
            self.flush();
        }
        Err(TestCaseError::fail("did not settle"))
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Loss at connection breaks, duplication and reordering, both directions at once:
    /// every message is delivered exactly once and nobody is given up.
    #[test]
    fn every_message_is_delivered_exactly_once(
        window in 2usize..40,
        ops in proptest::collection::vec(op(), 1..300),
    ) {
        let mut sim = Sim::new(window);
        for op in ops {
            sim.apply(op)?;
        }
        sim.settle()?;
        for n in 0..2 {
            prop_assert_eq!(&sim.delivered[n], &sim.sent[n]);
            prop_assert_eq!(sim.nodes[n].poll_event(), None);
        }
    }

    /// Whatever arrives in whatever order, a number is delivered at most once, and the
    /// receiving state never grows.
    #[test]
    fn arbitrary_arrivals_deliver_each_number_at_most_once(
        seqs in proptest::collection::vec(1u64..3000, 0..500),
    ) {
        let now = Instant::now();
        let mut r = resender();
        let mut seen = BTreeSet::new();
        for seq in seqs {
            match r.handle_incoming(A, seq, 1, now) {
                Delivery::Deliver => prop_assert!(seen.insert(seq)),
                Delivery::Duplicate => prop_assert!(seen.contains(&seq)),
                Delivery::OutOfWindow => prop_assert!(!seen.contains(&seq)),
            }
            let base = r.peers[&A].received.base;
            prop_assert!((1..base).all(|s| seen.contains(&s)));
        }
    }
}
