//! The in-memory network with hosts and links (`MemNetConfig::hosts`), in simulated time:
//! messages land when their bytes have crossed, as the link model computes.

use std::time::Duration;

use psnet_memnet::{HostLinks, Link, MemNet, MemNetConfig, MemTransport};
use psnet_transport::{Event, NodeId, OutMessage, Segment, Transport};
use tokio::time::Instant;

/// 1,000,000 bytes a second, 1 ms of latency each way between hosts; a local path ten
/// times as fast with none.
fn net(hosts: usize) -> MemNet {
    let link = Link::new(1e6, Duration::from_millis(1)).unwrap();
    let local = Link::new(1e7, Duration::ZERO).unwrap();
    MemNet::new(MemNetConfig {
        hosts: vec![HostLinks::symmetric(link, local); hosts],
        ..MemNetConfig::default()
    })
}

async fn connect(a: &MemTransport, b: &MemTransport) {
    a.connect(b.local_id(), b.listen_addr())
        .await
        .expect("connect");
}

/// Sends `len` bytes tagged `tag` to `to`.
async fn send(t: &MemTransport, to: &MemTransport, tag: u8, len: usize) {
    let data = vec![tag; len];
    let segs = [Segment::new(&data)];
    t.send(to.local_id(), OutMessage::new(&[tag], &segs))
        .await
        .expect("send");
}

/// The next message's tag and sender, and when it came.
async fn next(t: &MemTransport) -> (u8, NodeId, Instant) {
    loop {
        match t.recv().await.expect("recv") {
            Event::Message(m) => return (m.meta[0], m.peer, Instant::now()),
            Event::PeerLost { peer, reason } => panic!("{peer} lost: {reason}"),
            Event::PeerConnected { .. } => {}
        }
    }
}

/// Whether `got` is `want` within a millisecond (headers add a few bytes, times round up).
fn about(got: Duration, want: Duration) -> bool {
    got.abs_diff(want) <= Duration::from_millis(1)
}

#[tokio::test(start_paused = true)]
async fn a_message_lands_when_its_bytes_have_crossed_plus_the_latency() {
    let net = net(2);
    let (a, b) = (net.bind_on(0, NodeId(1)), net.bind_on(1, NodeId(2)));
    connect(&a, &b).await;
    let start = Instant::now();
    send(&a, &b, 7, 1_000_000).await;
    let (tag, from, at) = next(&b).await;
    assert_eq!((tag, from), (7, NodeId(1)));
    let took = at - start;
    assert!(about(took, Duration::from_millis(1002)), "{took:?}");
}

#[tokio::test(start_paused = true)]
async fn two_senders_on_one_host_share_its_uplink() {
    let net = net(2);
    let (a1, a2) = (net.bind_on(0, NodeId(1)), net.bind_on(0, NodeId(2)));
    let (b1, b2) = (net.bind_on(1, NodeId(3)), net.bind_on(1, NodeId(4)));
    connect(&a1, &b1).await;
    connect(&a2, &b2).await;
    let start = Instant::now();
    send(&a1, &b1, 1, 500_000).await;
    send(&a2, &b2, 2, 500_000).await;
    let (r1, r2) = tokio::join!(next(&b1), next(&b2));
    for (_, _, at) in [r1, r2] {
        assert!(
            about(at - start, Duration::from_millis(1002)),
            "{:?}",
            at - start
        );
    }
}

#[tokio::test(start_paused = true)]
async fn endpoints_of_one_host_talk_over_its_local_path() {
    let net = net(2);
    let (a, b) = (net.bind_on(0, NodeId(1)), net.bind_on(0, NodeId(2)));
    connect(&a, &b).await;
    let start = Instant::now();
    send(&a, &b, 1, 1_000_000).await;
    let (_, _, at) = next(&b).await;
    assert!(
        about(at - start, Duration::from_millis(100)),
        "{:?}",
        at - start
    );
}

#[tokio::test(start_paused = true)]
async fn a_short_message_from_one_peer_passes_a_long_one_from_another_but_not_its_own() {
    let net = net(3);
    let (a, b, c) = (
        net.bind_on(0, NodeId(1)),
        net.bind_on(1, NodeId(2)),
        net.bind_on(2, NodeId(3)),
    );
    connect(&a, &c).await;
    connect(&b, &c).await;
    send(&a, &c, 1, 400_000).await;
    send(&a, &c, 2, 10).await;
    send(&b, &c, 3, 10).await;
    let mut got = Vec::new();
    for _ in 0..3 {
        let (tag, ..) = next(&c).await;
        got.push(tag);
    }
    assert_eq!(
        got,
        [3, 1, 2],
        "b's short message first, a's two in their order"
    );
}

#[tokio::test(start_paused = true)]
async fn without_hosts_messages_land_at_once_in_the_order_sent() {
    let net = MemNet::reliable();
    let (a, b, c) = (
        net.bind(NodeId(1)),
        net.bind(NodeId(2)),
        net.bind(NodeId(3)),
    );
    connect(&a, &c).await;
    connect(&b, &c).await;
    let start = Instant::now();
    send(&a, &c, 1, 1_000_000).await;
    send(&b, &c, 2, 10).await;
    let (first, ..) = next(&c).await;
    let (second, _, at) = next(&c).await;
    assert_eq!((first, second), (1, 2));
    assert_eq!(at, start, "no time passes without links");
}

#[tokio::test(start_paused = true)]
async fn a_connection_carries_both_ways_at_once() {
    let net = net(2);
    let (a, b) = (net.bind_on(0, NodeId(1)), net.bind_on(1, NodeId(2)));
    connect(&a, &b).await;
    let start = Instant::now();
    send(&a, &b, 1, 1_000_000).await;
    send(&b, &a, 2, 10).await;
    let (_, _, answer) = next(&a).await;
    assert!(
        about(answer - start, Duration::from_millis(2)),
        "{:?}",
        answer - start
    );
    let (_, _, big) = next(&b).await;
    assert!(
        about(big - start, Duration::from_millis(1002)),
        "{:?}",
        big - start
    );
}

#[tokio::test(start_paused = true)]
async fn hosts_have_addresses_of_their_own_and_traffic_is_counted() {
    let net = net(2);
    let (a, b, c) = (
        net.bind_on(0, NodeId(1)),
        net.bind_on(1, NodeId(2)),
        net.bind_on(1, NodeId(3)),
    );
    assert_ne!(a.listen_addr().ip(), b.listen_addr().ip());
    assert_eq!(b.listen_addr().ip(), c.listen_addr().ip());
    connect(&a, &b).await;
    send(&a, &b, 1, 1000).await;
    send(&a, &b, 2, 1000).await;
    next(&b).await;
    let (sent, got) = (a.traffic(), b.traffic());
    assert_eq!(sent.sent_messages, 2);
    assert!(sent.sent_bytes >= 2000, "{sent:?}");
    assert_eq!(got.received_messages, 1, "one taken so far");
    assert_eq!(got.received_bytes * 2, sent.sent_bytes);
}
