//! GPU memory as a message segment (feature `cuda`): a [`CudaBytes`] view sent over the TCP
//! transport on 127.0.0.1 arrives as the same bytes, through the staged pipeline, beside host
//! segments; a view of a typed buffer carries its bytes. Without a GPU the tests say why they
//! skipped.
#![cfg(feature = "cuda")]

use psnet_compression::cuda::{device_count, CudaStager};
use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_transport::device::DeviceBytes;
use psnet_transport::{Event, Incoming, NodeId, OutMessage, Segment, Transport};

fn stager(test: &str) -> Option<CudaStager> {
    if let Err(e) = device_count() {
        eprintln!("{test}: skipped: {e}");
        return None;
    }
    Some(CudaStager::new(0).expect("a stager on device 0"))
}

async fn pair() -> (TcpTransport, TcpTransport) {
    let config = || TcpConfig {
        bind: "127.0.0.1:0".parse().expect("address"),
        ..TcpConfig::default()
    };
    let a = TcpTransport::bind(NodeId(1), config())
        .await
        .expect("bind a");
    let b = TcpTransport::bind(NodeId(2), config())
        .await
        .expect("bind b");
    a.connect(b.local_id(), b.listen_addr())
        .await
        .expect("connect");
    (a, b)
}

async fn next_message(t: &TcpTransport) -> Incoming {
    loop {
        match t.recv().await.expect("recv") {
            Event::Message(m) => return m,
            Event::PeerConnected { .. } => continue,
            Event::PeerLost { peer, reason } => panic!("lost {peer}: {reason}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_bytes_cross_tcp_unchanged() {
    let Some(stager) = stager("gpu_bytes_cross_tcp_unchanged") else {
        return;
    };
    let (a, b) = pair().await;
    // Several staging chunks, and a short last one.
    let host: Vec<u8> = (0..(5usize << 20) + 3)
        .map(|i| (i * 13 + i / 997) as u8)
        .collect();
    let device = stager.stream().clone_htod(&host).expect("upload");
    let view = device.as_view();
    let bytes = stager.bytes(&view);
    assert_eq!(bytes.len(), host.len());
    let tail = [1u8, 2, 3];
    let segs = [
        Segment::new(&tail),
        Segment::device(&bytes),
        Segment::new(&[]),
    ];
    for round in 0..3u8 {
        a.send(b.local_id(), OutMessage::new(&[round], &segs))
            .await
            .expect("send from the GPU");
    }
    for round in 0..3u8 {
        let m = next_message(&b).await;
        assert_eq!(&m.meta[..], &[round]);
        assert_eq!(&m.segments[0][..], &tail);
        assert!(m.segments[1] == host, "GPU bytes changed on the way");
        assert!(m.segments[2].is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typed_view_carries_its_bytes() {
    let Some(stager) = stager("a_typed_view_carries_its_bytes") else {
        return;
    };
    let (a, b) = pair().await;
    let values: Vec<f32> = (0..300_001).map(|i| i as f32 * 0.5 - 7.0).collect();
    let device = stager.stream().clone_htod(&values).expect("upload");
    let view = device.slice(1..);
    let bytes = stager.bytes(&view);
    a.send(
        b.local_id(),
        OutMessage::new(&[], &[Segment::device(&bytes)]),
    )
    .await
    .expect("send");
    let m = next_message(&b).await;
    let got: Vec<f32> = m.segments[0]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    assert_eq!(got, values[1..]);
}
