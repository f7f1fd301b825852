//! Device segments over real verbs: a region registered with the NIC (as GPUDirect registers
//! GPU memory) is read by the NIC in place, with no copy; an unregistered one in a large
//! message is staged (copied out chunk by chunk, each chunk written as it lands); one small
//! enough to go eager is copied out first. Registered host memory stands in for the GPU: the
//! simulated device's own bytes are zeros, so the receiver gets the pattern only if the NIC
//! read the registered memory. Runs where an RDMA device exists (the Soft-RoCE guest); prints
//! SKIPPED with the reason elsewhere.

mod common;

use common::{next_message, pair};

use std::time::Duration;

use psnet_transport::device::{NicRegion, SimulatedDevice};
use psnet_transport::{OutMessage, Segment, Transport};

const CASE_TIMEOUT: Duration = Duration::from_secs(120);

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(131).wrapping_add(seed) as u8)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_device_memory_is_read_in_place() {
    let Some((a, b)) = pair(0).await else {
        return;
    };
    tokio::time::timeout(CASE_TIMEOUT, async {
        let len = 3 << 20;
        let mut buf = a.alloc_registered(len).expect("registered memory");
        buf.copy_from_slice(&pattern(len, 1));
        let nic = NicRegion {
            key: buf.key(),
            addr: buf.as_ptr() as u64,
        };
        // Zeros of its own: only a read of the registered memory gives the pattern.
        let direct = SimulatedDevice::new(vec![0; len], 0).with_nic(nic);
        let host = pattern(100, 2);
        let segs = [Segment::new(&host), Segment::device(&direct)];
        a.send(b.local_id(), OutMessage::new(b"direct", &segs))
            .await
            .expect("send registered device memory");
        let m = next_message(&b).await;
        assert_eq!(&m.meta[..], b"direct");
        assert_eq!(&m.segments[0][..], &host[..]);
        assert!(
            m.segments[1][..] == buf[..],
            "the NIC did not read the registered memory"
        );
        assert_eq!(direct.copies(), 0, "a registered region was copied");

        // Not registered: copied out, then sent.
        let plain = SimulatedDevice::new(pattern(len, 3), 0);
        a.send(
            b.local_id(),
            OutMessage::new(b"plain", &[Segment::device(&plain)]),
        )
        .await
        .expect("send unregistered device memory");
        let m = next_message(&b).await;
        assert!(
            m.segments[0][..] == *plain.bytes(),
            "copied device memory corrupted"
        );
        assert!(plain.copies() > 0);

        // Small enough to go eager: copied even when registered.
        let small = SimulatedDevice::new(pattern(64, 4), 0).with_nic(nic);
        a.send(
            b.local_id(),
            OutMessage::new(b"small", &[Segment::device(&small)]),
        )
        .await
        .expect("send a small device segment");
        let m = next_message(&b).await;
        assert_eq!(&m.segments[0][..], small.bytes());
        assert!(small.copies() > 0);
    })
    .await
    .expect("hung");
}

/// Unregistered regions in large messages are staged: copied out in chunks of 1 MiB into
/// registered memory, each chunk written to the peer once it has landed. Several such messages
/// in flight at once, each with two staged regions (one of a single short chunk), host and
/// empty segments between, arrive whole, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregistered_device_memory_is_staged_chunk_by_chunk() {
    let Some((a, b)) = pair(0).await else {
        return;
    };
    tokio::time::timeout(CASE_TIMEOUT, async {
        let regions: Vec<SimulatedDevice> = (0..4)
            .map(|i| SimulatedDevice::new(pattern((5 << 20) + 333 * i, 10 + i as u64), 0))
            .collect();
        let shorts: Vec<SimulatedDevice> = (0..4)
            .map(|i| SimulatedDevice::new(pattern(10 + i, 20 + i as u64), 1))
            .collect();
        let empty = SimulatedDevice::new(Vec::new(), 0);
        let host = pattern(2000, 8);
        let (a, to) = (&a, b.local_id());
        let send = |i: usize| {
            let (region, short, host, empty) = (&regions[i], &shorts[i], &host, &empty);
            async move {
                let segs = [
                    Segment::new(host),
                    Segment::device(region),
                    Segment::device(empty),
                    Segment::device(short),
                    Segment::new(&[]),
                ];
                let meta = [b'm', b'0' + i as u8];
                a.send(to, OutMessage::new(&meta, &segs)).await
            }
        };
        // Four sends running together on one link.
        let (r0, r1, r2, r3) = tokio::join!(send(0), send(1), send(2), send(3));
        for r in [r0, r1, r2, r3] {
            r.expect("a staged send");
        }
        let mut seen = Vec::new();
        for _ in 0..4 {
            let m = next_message(&b).await;
            let i = usize::from(m.meta[1] - b'0');
            seen.push(i);
            let lens: Vec<usize> = m.segments.iter().map(|s| s.len()).collect();
            assert_eq!(
                lens,
                [2000, (5 << 20) + 333 * i, 0, 10 + i, 0],
                "message {i}"
            );
            assert_eq!(&m.segments[0][..], &host[..]);
            assert!(
                m.segments[1][..] == *regions[i].bytes(),
                "staged region {i} corrupted"
            );
            assert_eq!(&m.segments[3][..], shorts[i].bytes());
        }
        seen.sort_unstable();
        assert_eq!(seen, [0, 1, 2, 3], "every message once");
        for (i, region) in regions.iter().enumerate() {
            // One copy per chunk of 1 MiB, each exactly once.
            assert_eq!(
                region.copies(),
                region.bytes().len().div_ceil(1 << 20),
                "region {i}"
            );
        }
        assert!(shorts.iter().all(|s| s.copies() == 1));
        assert_eq!(empty.copies(), 0);

        // A staged send after them, on a link that keeps working.
        let later = SimulatedDevice::new(pattern(3 << 20, 30), 0);
        a.send(to, OutMessage::new(b"later", &[Segment::device(&later)]))
            .await
            .expect("a later staged send");
        let m = next_message(&b).await;
        assert_eq!(&m.meta[..], b"later");
        assert!(m.segments[0][..] == *later.bytes());
    })
    .await
    .expect("hung");
}

/// A staged region that cannot be copied out half-way fails its send naming the device, and
/// the link with it (the peer was promised bytes that will not come): the peer sees the loss,
/// never a partial message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_copy_failing_half_way_fails_the_link() {
    let Some((a, b)) = pair(0).await else {
        return;
    };
    tokio::time::timeout(CASE_TIMEOUT, async {
        let broken = SimulatedDevice::new(pattern(4 << 20, 40), 6).failing_from(2 << 20);
        let err = a
            .send(
                b.local_id(),
                OutMessage::new(b"broken", &[Segment::device(&broken)]),
            )
            .await
            .expect_err("the copy fails half-way");
        assert!(err.to_string().contains("GPU 6"), "{err}");
        loop {
            match b.recv().await.expect("recv") {
                psnet_transport::Event::PeerLost { peer, .. } => {
                    assert_eq!(peer, a.local_id());
                    break;
                }
                psnet_transport::Event::PeerConnected { .. } => continue,
                psnet_transport::Event::Message(m) => {
                    panic!("a message arrived: {:?}", String::from_utf8_lossy(&m.meta))
                }
            }
        }
    })
    .await
    .expect("hung");
}
