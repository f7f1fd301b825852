//! The conformance suite: behaviour every [`Transport`] must show, written once.
//!
//! A transport crate runs it from a test target with
//! [`conformance_tests!`](crate::conformance_tests), giving a [`TransportFactory`] that builds
//! endpoints listening on loopback. Every case is bounded by [`CASE_TIMEOUT`], so a transport
//! that hangs fails instead of stalling the test run.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::{
    Admission, Binding, Event, Identity, Incoming, NodeId, OutMessage, Proof, Refusal, Segment,
    Transport, TransportError,
};

mod device;
mod placement;
pub use device::{
    a_failing_device_copy_fails_only_that_send, device_segments_arrive_as_host_bytes,
};
pub use placement::{
    a_failing_placement_loses_only_that_segment, placed_segments_land_in_device_memory,
};

/// Longest time one case may take before it counts as hung.
pub const CASE_TIMEOUT: Duration = Duration::from_secs(120);

/// Builds endpoints of the transport under test.
pub trait TransportFactory: Send + Sync + 'static {
    /// The transport type.
    type T: Transport;
    /// A new endpoint with id `id`, listening and ready.
    fn create(&self, id: NodeId) -> impl Future<Output = Result<Self::T, TransportError>> + Send;

    /// Why the suite cannot run here (e.g. no RDMA device); the cases then print the reason
    /// and pass without running.
    fn skip_reason(&self) -> Option<String> {
        None
    }
}

/// Generates one `#[tokio::test]` per conformance case for the factory expression `$factory`.
#[macro_export]
macro_rules! conformance_tests {
    ($factory:expr) => {
        $crate::conformance_tests!(@cases $factory;
            ordering_both_directions,
            large_and_empty_segments,
            many_peers,
            peer_dying_fails_only_that_peer,
            back_pressure_blocks_instead_of_buffering,
            connect_and_send_errors_name_the_peer,
            simultaneous_connect_keeps_one_connection,
            reconnect_after_loss,
            disconnect_then_reconnect_reports_no_loss,
            registered_buffers,
            shutdown_closes_everything,
            last_messages_before_shutdown_arrive_before_the_loss,
            admission_refuses_unproven_claims,
            redial_of_a_gone_peer_fails_at_once,
            device_segments_arrive_as_host_bytes,
            a_failing_device_copy_fails_only_that_send,
            placed_segments_land_in_device_memory,
            a_failing_placement_loses_only_that_segment,
        );
    };
    (@cases $factory:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let factory = $factory;
                if let Some(why) =
                    $crate::conformance::TransportFactory::skip_reason(&factory)
                {
                    eprintln!("SKIPPED {}: {why}", stringify!($case));
                    return;
                }
                $crate::conformance::run_case(
                    stringify!($case),
                    $crate::conformance::$case(&factory),
                )
                .await;
            }
        )*
    };
}

/// Runs one case under [`CASE_TIMEOUT`].
pub async fn run_case(name: &str, case: impl Future<Output = ()>) {
    if tokio::time::timeout(CASE_TIMEOUT, case).await.is_err() {
        panic!("conformance case {name} hung for {CASE_TIMEOUT:?}");
    }
}

pub(crate) async fn endpoint<F: TransportFactory>(f: &F, id: u64) -> Arc<F::T> {
    Arc::new(
        f.create(NodeId(id))
            .await
            .unwrap_or_else(|e| panic!("create endpoint {id}: {e}")),
    )
}

pub(crate) async fn link<T: Transport>(a: &T, b: &T) {
    a.connect(b.local_id(), b.listen_addr())
        .await
        .unwrap_or_else(|e| panic!("connect {} -> {}: {e}", a.local_id(), b.local_id()));
}

/// The next message, skipping connection events.
pub(crate) async fn next_message<T: Transport>(t: &T) -> Incoming {
    loop {
        match t.recv().await.expect("recv") {
            Event::Message(m) => return m,
            Event::PeerConnected { .. } => continue,
            Event::PeerLost { peer, reason } => panic!("unexpected loss of {peer}: {reason}"),
        }
    }
}

/// The next `PeerLost`, skipping other events.
async fn next_loss<T: Transport>(t: &T) -> NodeId {
    loop {
        if let Event::PeerLost { peer, .. } = t.recv().await.expect("recv") {
            return peer;
        }
    }
}

pub(crate) fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(31).wrapping_add(seed) as u8)
        .collect()
}

pub(crate) async fn send_seq<T: Transport>(t: &T, to: NodeId, seq: u64, payload: &[u8]) {
    let meta = seq.to_le_bytes();
    let segs = [Segment::new(payload)];
    t.send(to, OutMessage::new(&meta, &segs))
        .await
        .unwrap_or_else(|e| panic!("send #{seq} to {to}: {e}"));
}

pub(crate) fn seq_of(m: &Incoming) -> u64 {
    u64::from_le_bytes(m.meta[..8].try_into().expect("8-byte sequence number"))
}

/// Messages of varied sizes in both directions at once arrive complete and in order.
pub async fn ordering_both_directions<F: TransportFactory>(f: &F) {
    let a = endpoint(f, 1).await;
    let b = endpoint(f, 2).await;
    link(&*a, &*b).await;
    const N: u64 = 2000;
    let size = |i: u64| ((i * 7919) % 70_000) as usize;
    let mut tasks = Vec::new();
    for (from, to) in [(a.clone(), b.clone()), (b.clone(), a.clone())] {
        tasks.push(tokio::spawn(async move {
            let to_id = to.local_id();
            for i in 0..N {
                send_seq(&*from, to_id, i, &pattern(size(i), i)).await;
            }
        }));
    }
    for (rx, from) in [(&b, a.local_id()), (&a, b.local_id())] {
        for i in 0..N {
            let m = next_message(&**rx).await;
            assert_eq!(m.peer, from);
            assert_eq!(seq_of(&m), i, "out of order");
            assert_eq!(m.segments.len(), 1);
            assert_eq!(&m.segments[0][..], &pattern(size(i), i)[..], "payload #{i}");
        }
    }
    for t in tasks {
        t.await.expect("sender");
    }
}

/// Empty metadata, empty segments and a 32 MiB segment survive intact.
pub async fn large_and_empty_segments<F: TransportFactory>(f: &F) {
    let a = endpoint(f, 1).await;
    let b = endpoint(f, 2).await;
    link(&*a, &*b).await;
    let big = pattern(32 << 20, 5);
    let one = [9u8];
    let segs = [
        Segment::new(&[]),
        Segment::new(&one),
        Segment::new(&big),
        Segment::new(&[]),
    ];
    a.send(b.local_id(), OutMessage::new(&[], &segs))
        .await
        .expect("send large");
    a.send(b.local_id(), OutMessage::new(&[], &[]))
        .await
        .expect("send empty");
    let m = next_message(&*b).await;
    assert!(m.meta.is_empty());
    let lens: Vec<usize> = m.segments.iter().map(|s| s.len()).collect();
    assert_eq!(lens, [0, 1, 32 << 20, 0]);
    assert_eq!(m.segments[1][0], 9);
    assert!(m.segments[2] == big[..], "32 MiB segment corrupted");
    let m = next_message(&*b).await;
    assert!(m.meta.is_empty() && m.segments.is_empty());
}

/// Eight peers talk to one hub at once; each peer's messages stay in order and every reply
/// reaches the right peer.
pub async fn many_peers<F: TransportFactory>(f: &F) {
    const PEERS: u64 = 8;
    const N: u64 = 200;
    let hub = endpoint(f, 100).await;
    let mut tasks = Vec::new();
    for p in 0..PEERS {
        let peer = endpoint(f, p + 1).await;
        link(&*peer, &*hub).await;
        let hub_id = hub.local_id();
        tasks.push(tokio::spawn(async move {
            for i in 0..N {
                send_seq(&*peer, hub_id, i, &pattern(100 + p as usize, i)).await;
            }
            let reply = next_message(&*peer).await;
            assert_eq!(reply.peer, hub_id);
            assert_eq!(
                seq_of(&reply),
                peer.local_id().0,
                "reply went to the wrong peer"
            );
            peer
        }));
    }
    let mut next: HashMap<NodeId, u64> = HashMap::new();
    for _ in 0..PEERS * N {
        let m = next_message(&*hub).await;
        let expected = next.entry(m.peer).or_insert(0);
        assert_eq!(seq_of(&m), *expected, "{} out of order", m.peer);
        *expected += 1;
    }
    assert_eq!(next.len(), PEERS as usize);
    for p in 1..=PEERS {
        send_seq(&*hub, NodeId(p), p, b"").await;
    }
    for t in tasks {
        t.await.expect("peer task");
    }
}

/// When a peer dies, only operations involving it fail, with its id; others go on.
pub async fn peer_dying_fails_only_that_peer<F: TransportFactory>(f: &F) {
    let a = endpoint(f, 1).await;
    let b = endpoint(f, 2).await;
    let c = endpoint(f, 3).await;
    link(&*b, &*a).await;
    link(&*c, &*a).await;
    send_seq(&*b, a.local_id(), 0, b"hi").await;
    assert_eq!(next_message(&*a).await.peer, NodeId(2));

    b.shutdown();
    drop(b);
    assert_eq!(next_loss(&*a).await, NodeId(2));
    let err = a
        .send(NodeId(2), OutMessage::new(b"x", &[]))
        .await
        .expect_err("send to a dead peer must fail");
    assert_eq!(
        err.peer(),
        Some(NodeId(2)),
        "error must name the peer: {err}"
    );

    send_seq(&*a, c.local_id(), 1, b"still here").await;
    let m = next_message(&*c).await;
    assert_eq!(seq_of(&m), 1);
    send_seq(&*c, a.local_id(), 2, b"and back").await;
    assert_eq!(seq_of(&next_message(&*a).await), 2);
}

/// A receiver that stops reading stalls its sender instead of letting it buffer without bound;
/// once it reads again, everything arrives in order.
pub async fn back_pressure_blocks_instead_of_buffering<F: TransportFactory>(f: &F) {
    const N: u64 = 1024;
    const SIZE: usize = 1 << 20;
    let a = endpoint(f, 1).await;
    let b = endpoint(f, 2).await;
    link(&*a, &*b).await;
    let sent = Arc::new(AtomicUsize::new(0));
    let sender = {
        let (a, sent, to) = (a.clone(), sent.clone(), b.local_id());
        tokio::spawn(async move {
            let payload = pattern(SIZE, 0);
            for i in 0..N {
                send_seq(&*a, to, i, &payload).await;
                sent.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    // Wait until the sender makes no progress for a while: it must stall before sending all.
    let mut last = usize::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = sent.load(Ordering::SeqCst);
        if now == last {
            break;
        }
        last = now;
        assert!(
            now < N as usize,
            "all {N} MiB were accepted while the receiver read nothing: unbounded buffering"
        );
    }
    for i in 0..N {
        let m = next_message(&*b).await;
        assert_eq!(seq_of(&m), i);
        assert_eq!(m.segments[0].len(), SIZE);
    }
    sender.await.expect("sender");
}

/// Failures to connect and sends to unknown peers are errors naming the peer.
pub async fn connect_and_send_errors_name_the_peer<F: TransportFactory>(f: &F) {
    let a = endpoint(f, 1).await;
    let gone = endpoint(f, 2).await;
    let addr = gone.listen_addr();
    gone.shutdown();
    drop(gone);
    let err = a
        .connect(NodeId(2), addr)
        .await
        .expect_err("connecting to a closed port must fail");
    assert_eq!(err.peer(), Some(NodeId(2)), "{err}");
    let err = a
        .send(NodeId(77), OutMessage::new(b"x", &[]))
        .await
        .expect_err("send to an unknown peer must fail");
    assert_eq!(err.peer(), Some(NodeId(77)), "{err}");
}

/// Both sides dialling each other at once end with one working connection.
pub async fn simultaneous_connect_keeps_one_connection<F: TransportFactory>(f: &F) {
    for round in 0..10u64 {
        let a = endpoint(f, 10 + 2 * round).await;
        let b = endpoint(f, 11 + 2 * round).await;
        let (ra, rb) = tokio::join!(
            a.connect(b.local_id(), b.listen_addr()),
            b.connect(a.local_id(), a.listen_addr())
        );
        ra.expect("a -> b");
        rb.expect("b -> a");
        assert_eq!(a.connected_peers(), vec![b.local_id()]);
        assert_eq!(b.connected_peers(), vec![a.local_id()]);
        for i in 0..20 {
            send_seq(&*a, b.local_id(), i, b"ab").await;
            send_seq(&*b, a.local_id(), i, b"ba").await;
        }
        for i in 0..20 {
            assert_eq!(seq_of(&next_message(&*b).await), i);
            assert_eq!(seq_of(&next_message(&*a).await), i);
        }
    }
}

/// A peer that died and came back (same id, new address) can be reached again.
pub async fn reconnect_after_loss<F: TransportFactory>(f: &F) {
    let a = endpoint(f, 1).await;
    let b = endpoint(f, 2).await;
    link(&*a, &*b).await;
    b.shutdown();
    drop(b);
    assert_eq!(next_loss(&*a).await, NodeId(2));
    let b2 = endpoint(f, 2).await;
    link(&*a, &*b2).await;
    send_seq(&*a, NodeId(2), 7, b"again").await;
    let m = next_message(&*b2).await;
    assert_eq!((m.peer, seq_of(&m)), (NodeId(1), 7));
}

/// Closing a connection on purpose and dialling again (as a node does after it learns its
/// final id) reports no loss on the closing side, and the new connection works.
pub async fn disconnect_then_reconnect_reports_no_loss<F: TransportFactory>(f: &F) {
    let a = endpoint(f, 1).await;
    let b = endpoint(f, 2).await;
    for round in 0..20u64 {
        link(&*a, &*b).await;
        a.disconnect(b.local_id());
        link(&*a, &*b).await;
        send_seq(&*a, b.local_id(), round, b"after").await;
        // `b` may see the old connection end (before the new one replaces it); `a` may not.
        let m = loop {
            match b.recv().await.expect("recv") {
                Event::Message(m) => break m,
                Event::PeerConnected { .. } | Event::PeerLost { .. } => continue,
            }
        };
        assert_eq!(seq_of(&m), round);
        send_seq(&*b, a.local_id(), round, b"back").await;
        let m = next_message(&*a).await;
        assert_eq!(seq_of(&m), round, "no PeerLost may precede the answer");
    }
}

/// Data sent from a transport-allocated buffer arrives intact.
pub async fn registered_buffers<F: TransportFactory>(f: &F) {
    let a = endpoint(f, 1).await;
    let b = endpoint(f, 2).await;
    link(&*a, &*b).await;
    let mut buf = a.alloc_registered(1 << 20).expect("alloc_registered");
    buf.copy_from_slice(&pattern(1 << 20, 3));
    let segs = [
        Segment::registered(&buf, 0..1000),
        Segment::registered(&buf, 1000..(1 << 20)),
    ];
    a.send(b.local_id(), OutMessage::new(b"reg", &segs))
        .await
        .expect("send registered");
    let m = next_message(&*b).await;
    assert_eq!(&m.meta[..], b"reg");
    assert_eq!(&m.segments[0][..], &buf[..1000]);
    assert_eq!(&m.segments[1][..], &buf[1000..]);
}

/// After shutdown, receiving and sending fail with `Closed`, and peers see the loss.
pub async fn shutdown_closes_everything<F: TransportFactory>(f: &F) {
    let a = endpoint(f, 1).await;
    let b = endpoint(f, 2).await;
    link(&*a, &*b).await;
    a.shutdown();
    assert!(matches!(a.recv().await, Err(TransportError::Closed)));
    assert!(a
        .send(b.local_id(), OutMessage::new(b"x", &[]))
        .await
        .is_err());
    assert_eq!(next_loss(&*b).await, NodeId(1));
}

/// Messages whose `send` completed before the sender shut down all arrive, in order, before
/// the receiver learns of the loss: a node's last word (a job's shutdown order) is never
/// overtaken by its own disconnection. Several rounds, since the race is one of timing.
pub async fn last_messages_before_shutdown_arrive_before_the_loss<F: TransportFactory>(f: &F) {
    const ROUNDS: u64 = 8;
    let sizes = [0usize, 8, 100, 4096, 70_000, 1 << 20, 16];
    for round in 0..ROUNDS {
        let a = endpoint(f, 1 + 2 * round).await;
        let b = endpoint(f, 2 + 2 * round).await;
        link(&*b, &*a).await;
        for (i, &size) in sizes.iter().enumerate() {
            send_seq(&*b, a.local_id(), i as u64, &pattern(size, i as u64)).await;
        }
        b.shutdown();
        drop(b);
        for (i, &size) in sizes.iter().enumerate() {
            let m = loop {
                match a.recv().await.expect("recv") {
                    Event::Message(m) => break m,
                    Event::PeerConnected { .. } => continue,
                    Event::PeerLost { peer, reason } => panic!(
                        "round {round}: {peer} reported lost ({reason}) before its message #{i} of {} arrived",
                        sizes.len()
                    ),
                }
            };
            assert_eq!(seq_of(&m), i as u64, "round {round}: out of order");
            let payload = m.segments.first().map(|s| &s[..]).unwrap_or_default();
            assert_eq!(
                payload,
                &pattern(size, i as u64)[..],
                "round {round}: payload #{i}"
            );
        }
        assert_eq!(next_loss(&*a).await, NodeId(2 + 2 * round));
        a.shutdown();
    }
}

/// Nodes 1 to 3, node n proving its id with the identity of seed `[n; 32]`.
struct Table;

impl Table {
    fn identity(node: NodeId) -> Option<Identity> {
        (1..=3)
            .contains(&node.0)
            .then(|| Identity::from_seed([node.0 as u8; 32]))
    }
}

impl Admission for Table {
    fn proof(&self, local: NodeId, binding: &Binding) -> Option<Proof> {
        Self::identity(local).map(|i| i.prove(local, binding))
    }

    fn admit(&self, peer: NodeId, proof: Option<&Proof>, binding: &Binding) -> Result<(), Refusal> {
        match (Self::identity(peer), proof) {
            (Some(id), Some(got)) if id.public().verify(peer, binding, got) => Ok(()),
            (None, _) => Err(Refusal::NotMember(format!("{peer} is not a member"))),
            (Some(_), None) => Err(Refusal::NoProof(format!("{peer} did not prove its id"))),
            _ => Err(Refusal::WrongProof(format!("{peer} did not prove its id"))),
        }
    }
}

/// With an admission policy installed, a claim without the id's proof is refused, whether the
/// id is unknown or that of a live peer, and the live connection goes on untouched.
pub async fn admission_refuses_unproven_claims<F: TransportFactory>(f: &F) {
    let a = endpoint(f, 1).await;
    let b = endpoint(f, 2).await;
    a.set_admission(Arc::new(Table));
    b.set_admission(Arc::new(Table));
    link(&*b, &*a).await;
    // Node 2's live id, claimed without its proof; then an id that is no member.
    for claim in [2, 7] {
        let rogue = endpoint(f, claim).await;
        let refused = rogue.connect(NodeId(1), a.listen_addr()).await;
        assert!(refused.is_err(), "{claim} was let in without a proof");
    }
    send_seq(&*b, NodeId(1), 5, b"still here").await;
    let m = next_message(&*a).await;
    assert_eq!((m.peer, seq_of(&m)), (NodeId(2), 5));
}

/// A peer whose process is gone (nobody listens at its address) fails a redial at once, well
/// before the connect timeout that `connect` keeps retrying for.
pub async fn redial_of_a_gone_peer_fails_at_once<F: TransportFactory>(f: &F) {
    let a = endpoint(f, 1).await;
    let b = endpoint(f, 2).await;
    link(&*a, &*b).await;
    let addr = b.listen_addr();
    b.shutdown();
    drop(b);
    assert_eq!(next_loss(&*a).await, NodeId(2));
    let started = std::time::Instant::now();
    let redial = tokio::time::timeout(Duration::from_secs(20), a.redial(NodeId(2), addr)).await;
    assert!(
        matches!(redial, Ok(Err(_))),
        "a redial of a gone peer must fail, and soon: {redial:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
}
