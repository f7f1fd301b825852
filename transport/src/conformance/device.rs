//! Cases for device (GPU) memory in sent messages ([`crate::device`]).

use super::{endpoint, link, next_message, pattern, send_seq, seq_of, TransportFactory};
use crate::device::SimulatedDevice;
use std::time::Duration;

use crate::{Event, OutMessage, Segment, Transport};

/// Device memory (simulated) mixed with host segments arrives as the same bytes, in order
/// with host messages, small (eager on RDMA) and over several staging chunks.
pub async fn device_segments_arrive_as_host_bytes<F: TransportFactory>(f: &F) {
    let a = endpoint(f, 1).await;
    let b = endpoint(f, 2).await;
    link(&*a, &*b).await;
    let big = SimulatedDevice::new(pattern((5 << 20) + 3, 11), 0);
    let small = SimulatedDevice::new(pattern(100, 12), 1);
    let empty = SimulatedDevice::new(Vec::new(), 0);
    let host = pattern(10, 13);
    let segs = [
        Segment::new(&host),
        Segment::device(&big),
        Segment::device(&empty),
        Segment::device(&small),
        Segment::new(&[]),
    ];
    a.send(b.local_id(), OutMessage::new(b"dev", &segs))
        .await
        .expect("send device segments");
    let only = [Segment::device(&small)];
    a.send(b.local_id(), OutMessage::new(b"small", &only))
        .await
        .expect("send a small device message");
    send_seq(&*a, b.local_id(), 7, b"after").await;
    let m = next_message(&*b).await;
    assert_eq!(&m.meta[..], b"dev");
    let lens: Vec<usize> = m.segments.iter().map(|s| s.len()).collect();
    assert_eq!(lens, [10, (5 << 20) + 3, 0, 100, 0]);
    assert_eq!(&m.segments[0][..], &host[..]);
    assert!(
        m.segments[1] == big.bytes(),
        "staged device segment corrupted"
    );
    assert_eq!(&m.segments[3][..], small.bytes());
    let m = next_message(&*b).await;
    assert_eq!(&m.meta[..], b"small");
    assert_eq!(&m.segments[0][..], small.bytes());
    let m = next_message(&*b).await;
    assert_eq!(
        seq_of(&m),
        7,
        "a host message after device ones arrives after them"
    );
    assert!(big.copies() >= 1 && small.copies() >= 2);
}

/// A device copy that fails fails its send with an error naming the peer and the device; the
/// peer never receives a partial message. A region that cannot be read at all leaves the
/// connection as it was; after a failure half-way the pair can go on talking (reconnecting if
/// the transport had to drop a half-written message).
pub async fn a_failing_device_copy_fails_only_that_send<F: TransportFactory>(f: &F) {
    let a = endpoint(f, 1).await;
    let b = endpoint(f, 2).await;
    link(&*a, &*b).await;
    // A region that cannot be read at all: the send fails before anything leaves, and the
    // connection stays.
    let unreadable = SimulatedDevice::new(pattern(4 << 20, 22), 5).failing_from(0);
    let segs = [Segment::device(&unreadable)];
    let err = a
        .send(b.local_id(), OutMessage::new(b"unreadable", &segs))
        .await
        .expect_err("the first copy fails");
    assert!(err.to_string().contains("GPU 5"), "{err}");
    send_seq(&*a, b.local_id(), 3, b"still connected").await;
    let m = next_message(&*b).await;
    assert_eq!(
        seq_of(&m),
        3,
        "the message after a refused one arrives first"
    );
    // A region that fails half-way: the transport may have to drop the connection.
    let broken = SimulatedDevice::new(pattern(4 << 20, 21), 5).failing_from(3 << 20);
    let segs = [Segment::device(&broken)];
    let err = a
        .send(b.local_id(), OutMessage::new(b"broken", &segs))
        .await
        .expect_err("the copy fails");
    assert_eq!(err.peer(), Some(b.local_id()), "{err}");
    assert!(err.to_string().contains("GPU 5"), "{err}");
    // The pair recovers: a host message arrives whole, and nothing of the failed one.
    a.connect(b.local_id(), b.listen_addr())
        .await
        .expect("connect again");
    loop {
        match a.send(b.local_id(), OutMessage::new(b"next", &[])).await {
            Ok(()) => break,
            // The loss of the old connection may show here first: connect again.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                a.connect(b.local_id(), b.listen_addr())
                    .await
                    .expect("reconnect");
            }
        }
    }
    loop {
        match b.recv().await.expect("recv") {
            Event::Message(m) => {
                assert_eq!(&m.meta[..], b"next", "only the later message arrives");
                break;
            }
            Event::PeerConnected { .. } | Event::PeerLost { .. } => continue,
        }
    }
}
