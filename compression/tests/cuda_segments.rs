//! GPU memory as a message segment (feature `cuda`): a [`CudaBytes`] view sent over the TCP
//! transport on 127.0.0.1 arrives as the same bytes, through the staged pipeline, beside host
//! segments; a view of a typed buffer carries its bytes; received bytes are placed in GPU
//! memory ([`CudaLanding`]). Without a GPU the tests say why they skipped.
#![cfg(feature = "cuda")]

use psnet_compression::cuda::{device_count, CudaLanding, CudaLandings, CudaStager};
use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_transport::device::DeviceBytes;
use psnet_transport::{Event, Incoming, NodeId, OutMessage, Placement, Placer, Segment, Transport};

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

/// Places every message's first segment in the landing it holds (one per message).
struct IntoLandings(std::sync::Mutex<Vec<std::sync::Arc<CudaLanding>>>);

impl Placer for IntoLandings {
    fn place(&self, _: NodeId, _: &[u8], _: &[u64]) -> Option<Placement> {
        let landing = self.0.lock().unwrap().pop()?;
        Some(Placement {
            segment: 0,
            dest: landing,
        })
    }
}

/// Bytes sent from the host and from GPU memory are placed in GPU memory on arrival: read
/// off the socket in chunks, each copied to the device while the next is read (shared
/// memory off), or copied from the same-host ring (the default); the landing holds them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn received_bytes_are_placed_in_gpu_memory() {
    let Some(stager) = stager("received_bytes_are_placed_in_gpu_memory") else {
        return;
    };
    let landings = CudaLandings::new(0).expect("landings on device 0");
    let host: Vec<u8> = (0..(3usize << 20) + 5)
        .map(|i| (i * 7 + i / 1009) as u8)
        .collect();
    let device = stager.stream().clone_htod(&host).expect("upload");
    let view = device.as_view();
    for shm in [false, true] {
        let config = || {
            let mut c = TcpConfig::new("127.0.0.1:0".parse().expect("address"));
            if !shm {
                c.shm_ring = 0;
                c.shm_queue = 0;
            }
            c.gpu_stage_chunk = 256 << 10;
            c
        };
        let a = TcpTransport::bind(NodeId(1), config()).await.expect("bind");
        let b = TcpTransport::bind(NodeId(2), config()).await.expect("bind");
        let slots: Vec<_> = (0..2)
            .map(|_| landings.take(host.len()).expect("a landing"))
            .collect();
        let placer = std::sync::Arc::new(IntoLandings(std::sync::Mutex::new(slots.clone())));
        assert!(b.set_placer(placer), "TCP places");
        a.connect(b.local_id(), b.listen_addr())
            .await
            .expect("connect");
        let from_gpu = stager.bytes(&view);
        for seg in [Segment::new(&host), Segment::device(&from_gpu)] {
            a.send(b.local_id(), OutMessage::new(b"x", &[seg]))
                .await
                .expect("send");
        }
        for _ in 0..2 {
            let m = next_message(&b).await;
            let placed = m.placed.expect("placed");
            assert_eq!(placed.result, Ok(()), "shm {shm}");
            assert!(m.segments[0].is_empty());
        }
        for landing in &slots {
            let back = stager
                .stream()
                .clone_dtoh(&landing.view().expect("a view"))
                .expect("download");
            assert!(back == host, "placed bytes differ (shm {shm})");
        }
    }
}
