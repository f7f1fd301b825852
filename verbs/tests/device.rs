//! Device segments over real verbs: a region registered with the NIC (as GPUDirect registers
//! GPU memory) is read by the NIC in place, with no copy; an unregistered one, or one small
//! enough to go eager, is copied out first. Registered host memory stands in for the GPU: the
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
