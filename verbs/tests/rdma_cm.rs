//! Connecting queue pairs through rdma_cm over real verbs: the dialling side chooses how
//! (`PSNET_RDMA_CONNECT`), every node accepts both ways, and a refusal names its reason.
//! Runs where an RDMA device exists (the Soft-RoCE guest); prints SKIPPED with the reason
//! elsewhere.

mod common;

use common::next_message;

use std::time::Duration;

use psnet_transport::{Event, NodeId, OutMessage, Segment, Transport};
use psnet_verbs::{Handshake, VerbsConfig, VerbsTransport};

const CASE_TIMEOUT: Duration = Duration::from_secs(60);

/// A config on the guest's device, or `None` (after printing why) where none exists.
fn config() -> Option<VerbsConfig> {
    let factory = common::VerbsFactory::from_env();
    if let Some(why) = psnet_transport::conformance::TransportFactory::skip_reason(&factory) {
        eprintln!("SKIPPED: {why}");
        return None;
    }
    Some(factory.config())
}

async fn endpoint(id: u64, config: &VerbsConfig, handshake: Handshake) -> VerbsTransport {
    let mut config = config.clone();
    config.handshake = handshake;
    VerbsTransport::bind(NodeId(id), config)
        .await
        .unwrap_or_else(|e| panic!("endpoint {id}: {e}"))
}

/// A small and a large (rendezvous) message from `from` to `to`, checked on arrival.
async fn exchange(from: &VerbsTransport, to: &VerbsTransport) {
    let big: Vec<u8> = (0..300_000u32).map(|i| (i * 7) as u8).collect();
    for (meta, body) in [(&b"small"[..], &b"hello"[..]), (&b"large"[..], &big[..])] {
        from.send(to.local_id(), OutMessage::new(meta, &[Segment::new(body)]))
            .await
            .unwrap_or_else(|e| panic!("send {:?}: {e}", std::str::from_utf8(meta)));
        let m = next_message(to).await;
        assert_eq!(&m.meta[..], meta);
        assert!(m.segments[0][..] == body[..], "{meta:?} corrupted");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dialling_side_chooses_and_every_node_accepts_both() {
    let Some(config) = config() else { return };
    tokio::time::timeout(CASE_TIMEOUT, async {
        let auto = endpoint(1, &config, Handshake::Auto).await;
        // The guest has librdmacm and rdma_ucm: `auto` means rdma_cm there.
        assert_eq!(auto.handshake(), Handshake::RdmaCm);
        let sockets = endpoint(2, &config, Handshake::Socket).await;
        assert_eq!(sockets.handshake(), Handshake::Socket);

        // rdma_cm dials a node that dials over sockets itself: it accepts through rdma_cm.
        auto.connect(sockets.local_id(), sockets.listen_addr())
            .await
            .expect("rdma_cm connect");
        assert_eq!(
            auto.connected_via(sockets.local_id()),
            Some(Handshake::RdmaCm)
        );
        // Its side of the connection came from an rdma_cm connect request.
        assert_eq!(
            sockets.connected_via(auto.local_id()),
            Some(Handshake::RdmaCm)
        );
        exchange(&auto, &sockets).await;
        exchange(&sockets, &auto).await;

        // And the other way round: sockets dial a node that would use rdma_cm.
        let third = endpoint(3, &config, Handshake::Socket).await;
        third
            .connect(auto.local_id(), auto.listen_addr())
            .await
            .expect("socket connect");
        assert_eq!(
            third.connected_via(auto.local_id()),
            Some(Handshake::Socket)
        );
        assert_eq!(
            auto.connected_via(third.local_id()),
            Some(Handshake::Socket)
        );
        exchange(&third, &auto).await;
        exchange(&auto, &third).await;
        assert_eq!(auto.connected_peers(), vec![NodeId(2), NodeId(3)]);
    })
    .await
    .expect("case hung");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_says_why() {
    let Some(config) = config() else { return };
    tokio::time::timeout(CASE_TIMEOUT, async {
        let a = endpoint(1, &config, Handshake::RdmaCm).await;
        let mut other = config.clone();
        other.eager_bytes *= 2;
        let b = endpoint(2, &other, Handshake::RdmaCm).await;
        let err = a
            .connect(b.local_id(), b.listen_addr())
            .await
            .expect_err("buffers of different sizes cannot work together");
        let text = err.to_string();
        assert!(text.contains("PSNET_RDMA_EAGER"), "{text}");
        assert!(text.contains("refused"), "{text}");
        assert_eq!(err.peer(), Some(b.local_id()), "{text}");
        assert!(b.connected_peers().is_empty());
    })
    .await
    .expect("case hung");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_reaches_the_peer_and_a_new_connection_works() {
    let Some(config) = config() else { return };
    tokio::time::timeout(CASE_TIMEOUT, async {
        let a = endpoint(1, &config, Handshake::RdmaCm).await;
        let b = endpoint(2, &config, Handshake::RdmaCm).await;
        for round in 0..5 {
            a.connect(b.local_id(), b.listen_addr())
                .await
                .unwrap_or_else(|e| panic!("connect, round {round}: {e}"));
            exchange(&a, &b).await;
            a.disconnect(b.local_id());
            // `b` hears of it (through rdma_cm or the control connection, whichever is first).
            loop {
                match b.recv().await.expect("recv") {
                    Event::PeerLost { peer, .. } => {
                        assert_eq!(peer, a.local_id());
                        break;
                    }
                    Event::PeerConnected { .. } => continue,
                    Event::Message(m) => panic!("unexpected message {:?}", m.meta),
                }
            }
            assert!(b.connected_peers().is_empty(), "round {round}");
        }
    })
    .await
    .expect("case hung");
}
