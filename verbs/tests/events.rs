//! The device's asynchronous events over real verbs: the RDMA port going down fails every peer
//! at once with the event named, and the transport works again once the port is back.
//!
//! It takes the guest's RDMA interface (`RXE_NETDEV`) down and up, so the Soft-RoCE guest runs
//! it after every other check; elsewhere it prints SKIPPED with the reason.

mod common;

use psnet_config::env::harness_var;
use std::process::Command;
use std::time::{Duration, Instant};

use psnet_transport::{Event, NodeId, OutMessage, Segment, Transport};
use psnet_verbs::VerbsTransport;

/// Brings the interface back up when dropped, even if the test fails half-way.
struct Restore<'a>(&'a str);

impl Drop for Restore<'_> {
    fn drop(&mut self) {
        set_link(self.0, "up");
    }
}

fn set_link(netdev: &str, state: &str) {
    let status = Command::new("ip")
        .args(["link", "set", "dev", netdev, state])
        .status()
        .expect("run ip");
    assert!(
        status.success(),
        "ip link set dev {netdev} {state}: {status}"
    );
}

async fn next_loss(t: &VerbsTransport) -> (NodeId, String) {
    loop {
        match t.recv().await.expect("recv") {
            Event::PeerLost { peer, reason } => return (peer, reason),
            Event::Message(m) => panic!("unexpected message from {}", m.peer),
            Event::PeerConnected { .. } => {}
        }
    }
}

async fn ping(a: &VerbsTransport, b: &VerbsTransport, text: &[u8]) {
    a.send(
        b.local_id(),
        OutMessage::new(text, &[Segment::new(&[7u8; 100])]),
    )
    .await
    .expect("send");
    assert_eq!(common::next_message(b).await.meta.to_vec(), text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_port_going_down_fails_every_peer_at_once_and_the_transport_recovers() {
    let factory = common::VerbsFactory::from_env();
    if let Some(why) = psnet_transport::conformance::TransportFactory::skip_reason(&factory) {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let (Some(netdev), Some(spec)) = (harness_var("RXE_NETDEV"), factory.spec()) else {
        eprintln!("SKIPPED: RXE_NETDEV unset (the guest names the interface it may take down)");
        return;
    };
    let device = spec.device.clone();
    let a = VerbsTransport::bind(NodeId(1), factory.config())
        .await
        .expect("a");
    let b = VerbsTransport::bind(NodeId(2), factory.config())
        .await
        .expect("b");
    a.connect(b.local_id(), b.listen_addr())
        .await
        .expect("connect");
    ping(&a, &b, b"before").await;

    let restore = Restore(&netdev);
    set_link(&netdev, "down");
    let down_at = Instant::now();
    for (t, peer) in [(&a, b.local_id()), (&b, a.local_id())] {
        let (lost, reason) = tokio::time::timeout(Duration::from_secs(10), next_loss(t))
            .await
            .expect("no peer-lost event within 10 s of the port going down");
        assert_eq!(lost, peer);
        assert!(
            reason.contains("IBV_EVENT_PORT_ERR") && reason.contains(&device),
            "the loss should name the device and the event: {reason}"
        );
    }
    eprintln!(
        "both sides lost their peer {:?} after the port went down",
        down_at.elapsed()
    );
    drop(restore);

    // Once the port is active again, the same transports connect and talk again. (On
    // Soft-RoCE, rdma_cm's messages are lost from then on, in fresh processes too, while
    // queue pairs work: the default `PSNET_RDMA_CONNECT=auto` falls back to the socket
    // handshake after 6 s, which is what this reconnect goes through there.)
    let state = format!("/sys/class/infiniband/{device}/ports/{}/state", spec.port);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&state).is_ok_and(|s| s.contains("ACTIVE")) {
        assert!(
            Instant::now() < deadline,
            "{state} did not become ACTIVE again"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut last_error = String::new();
    while Instant::now() < deadline {
        match a.connect(b.local_id(), b.listen_addr()).await {
            Ok(()) => {
                tokio::time::timeout(Duration::from_secs(20), ping(&a, &b, b"after"))
                    .await
                    .expect("no message after reconnecting");
                return;
            }
            Err(e) => last_error = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("could not reconnect after the port came back: {last_error}");
}
