//! The placer's choices, over the in-memory transport with simulated device memory.

use std::sync::atomic::{AtomicUsize, Ordering};

use psnet_memnet::{MemNet, MemNetConfig, MemTransport};
use psnet_transport::placement::SimulatedLanding;
use psnet_transport::{Event, Incoming, OutMessage, Segment};

use super::*;
use crate::element::{DType, ReduceOp};
use crate::wire::{Call, Coll};

/// Simulated device memory, failing every take once `limit` were handed out.
#[derive(Default)]
struct Source {
    taken: AtomicUsize,
    limit: Option<usize>,
}

impl LandingSource for Source {
    type Landing = SimulatedLanding;

    fn take(&self, len: usize) -> Result<Arc<SimulatedLanding>, String> {
        let n = self.taken.fetch_add(1, Ordering::Relaxed);
        if self.limit.is_some_and(|limit| n >= limit) {
            return Err("out of device memory".into());
        }
        Ok(Arc::new(SimulatedLanding::new(len, 0)))
    }
}

const CALL: Call = Call {
    coll: Coll::Allreduce,
    dtype: DType::F32,
    op: ReduceOp::Sum,
    count: 64,
    root: 0,
};

fn header(kind: Kind, comm: u32, seq: u64, tag: u64) -> [u8; crate::wire::HEADER_LEN] {
    Header {
        kind,
        comm,
        seq,
        tag,
        call: CALL,
    }
    .encode()
}

async fn pair() -> (MemTransport, MemTransport) {
    let net = MemNet::reliable();
    let a = net.bind(NodeId(1));
    let b = net.bind(NodeId(2));
    a.connect(b.local_id(), b.listen_addr())
        .await
        .expect("connect");
    (a, b)
}

async fn send(a: &MemTransport, meta: &[u8], segments: &[&[u8]]) {
    let segs: Vec<Segment<'_>> = segments.iter().map(|s| Segment::new(s)).collect();
    a.send(NodeId(2), OutMessage::new(meta, &segs))
        .await
        .expect("send");
}

async fn next_message(t: &MemTransport) -> Incoming {
    loop {
        if let Event::Message(m) = t.recv().await.expect("recv") {
            return m;
        }
    }
}

#[tokio::test]
async fn pieces_of_an_armed_call_are_placed_and_found_by_sender_and_tag() {
    let (a, b) = pair().await;
    let placing = Arc::new(Placing::<Source>::default());
    let expected = [11, 12, 13, 14]
        .map(|tag| ((NodeId(1), tag), 256))
        .into_iter()
        .collect();
    let source = Arc::new(Source::default());
    let armed = placing
        .arm(&b, 7, 3, source.clone(), expected)
        .expect("memnet places");
    let piece: Vec<u8> = (0..256).map(|i| i as u8).collect();
    send(&a, &header(Kind::Data, 7, 3, 11), &[&piece]).await;
    // Not this call: another call number, another communicator, not a piece, two segments,
    // an empty piece, a tag the plan does not receive, a piece of another length, the same
    // piece again.
    send(&a, &header(Kind::Data, 7, 4, 11), &[&piece]).await;
    send(&a, &header(Kind::Data, 8, 3, 11), &[&piece]).await;
    send(&a, &header(Kind::Abort, 7, 3, 11), &[b"why"]).await;
    send(&a, &header(Kind::Data, 7, 3, 12), &[&piece, &piece]).await;
    send(&a, &header(Kind::Data, 7, 3, 13), &[b""]).await;
    send(&a, &header(Kind::Data, 7, 3, 99), &[&piece]).await;
    send(&a, &header(Kind::Data, 7, 3, 14), &[&piece[..255]]).await;
    send(&a, &header(Kind::Data, 7, 3, 11), &[&[7u8; 256]]).await;

    let m = next_message(&b).await;
    let placed = m.placed.expect("placed");
    assert_eq!((placed.segment, placed.len), (0, 256));
    assert_eq!(placed.result, Ok(()));
    let landing = armed
        .call
        .take(NodeId(1), 11)
        .expect("found by sender and tag");
    assert_eq!(landing.bytes(), piece);
    assert!(armed.call.take(NodeId(1), 11).is_none(), "taken once");
    for _ in 0..8 {
        let m = next_message(&b).await;
        assert_eq!(m.placed, None, "{:?} placed", Header::decode(&m.meta));
    }
    assert_eq!(
        source.taken.load(Ordering::Relaxed),
        1,
        "device memory only for the expected piece"
    );
}

#[tokio::test]
async fn a_disarmed_call_and_a_source_out_of_memory_leave_pieces_in_host_memory() {
    let (a, b) = pair().await;
    let placing = Arc::new(Placing::<Source>::default());
    let source = Arc::new(Source {
        limit: Some(1),
        ..Source::default()
    });
    let expected = (1..=3).map(|tag| ((NodeId(1), tag), 64)).collect();
    let armed = placing
        .arm(&b, 1, 1, source, expected)
        .expect("memnet places");
    let piece = [5u8; 64];
    send(&a, &header(Kind::Data, 1, 1, 1), &[&piece]).await;
    send(&a, &header(Kind::Data, 1, 1, 2), &[&piece]).await;
    let m = next_message(&b).await;
    assert!(m.placed.is_some());
    let m = next_message(&b).await;
    assert_eq!(m.placed, None, "no device memory: host bytes");
    assert_eq!(&m.segments[0][..], &piece[..]);
    drop(armed);
    send(&a, &header(Kind::Data, 1, 1, 3), &[&piece]).await;
    let m = next_message(&b).await;
    assert_eq!(
        m.placed, None,
        "a disarmed call's pieces stay in host memory"
    );
}

/// A transport that cannot place: arming says so, and nothing is armed.
#[tokio::test]
async fn a_transport_that_does_not_place_arms_nothing() {
    let net = MemNet::new(MemNetConfig {
        places: false,
        ..MemNetConfig::default()
    });
    let t = net.bind(NodeId(1));
    let placing = Arc::new(Placing::<Source>::default());
    for seq in 0..3 {
        assert!(placing
            .arm(&t, 1, seq, Arc::new(Source::default()), Expected::new())
            .is_none());
    }
    assert!(lock(&placing.calls).is_empty());
}
