//! Cases for received segments placed into device memory ([`crate::placement`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::{endpoint, link, next_message, pattern, send_seq, seq_of, TransportFactory};
use crate::device::{DeviceBytes, SimulatedDevice};
use crate::placement::{Placed, Placement, Placer, SimulatedLanding};
use crate::{NodeId, OutMessage, Segment, Transport};

/// Per metadata: which segment goes where.
type Table = HashMap<Vec<u8>, (usize, Arc<SimulatedLanding>)>;
/// Who asked, about which metadata, with which segment lengths.
type Asked = Vec<(NodeId, Vec<u8>, Vec<u64>)>;

/// Places segment `i` of a message whose metadata is a key of its table, and records every
/// question it was asked.
#[derive(Default)]
struct TablePlacer {
    table: Mutex<Table>,
    asked: Mutex<Asked>,
}

impl TablePlacer {
    fn put(&self, meta: &[u8], segment: usize, landing: SimulatedLanding) -> Arc<SimulatedLanding> {
        let landing = Arc::new(landing);
        self.table
            .lock()
            .unwrap()
            .insert(meta.to_vec(), (segment, landing.clone()));
        landing
    }

    fn asked_about(&self, meta: &[u8]) -> Option<Vec<u64>> {
        let asked = self.asked.lock().unwrap();
        asked
            .iter()
            .find(|(_, m, _)| m == meta)
            .map(|(_, _, lens)| lens.clone())
    }
}

impl Placer for TablePlacer {
    fn place(&self, peer: NodeId, meta: &[u8], seg_lens: &[u64]) -> Option<Placement> {
        self.asked
            .lock()
            .unwrap()
            .push((peer, meta.to_vec(), seg_lens.to_vec()));
        let (segment, dest) = self.table.lock().unwrap().get(meta)?.clone();
        Some(Placement { segment, dest })
    }
}

/// Segments a placer names land in its device memory, whatever their size (one staging
/// chunk or several, sent from host or from device memory), arriving empty with `placed`
/// set; the message's other segments, and messages it leaves alone or places with the wrong
/// length, arrive as host bytes, all in send order. A transport that cannot place says so and
/// delivers host bytes.
pub async fn placed_segments_land_in_device_memory<F: TransportFactory>(f: &F) {
    let a = endpoint(f, 1).await;
    let b = endpoint(f, 2).await;
    let placer = Arc::new(TablePlacer::default());
    let places = b.set_placer(placer.clone());
    link(&*a, &*b).await;
    let big = pattern((3 << 20) + 5, 41);
    let medium = pattern(70 << 10, 42);
    let head = pattern(10, 43);
    let from_gpu = SimulatedDevice::new(pattern((1 << 20) + 9, 44), 2);
    let wrong = pattern(4096, 45);
    let landing_big = placer.put(b"big", 1, SimulatedLanding::new(big.len(), 0));
    let landing_gpu = placer.put(b"gpu", 0, SimulatedLanding::new(from_gpu.len(), 1));
    let landing_wrong = placer.put(b"wrong", 0, SimulatedLanding::new(wrong.len() + 1, 0));
    let segs = [
        Segment::new(&head),
        Segment::new(&big),
        Segment::new(&[]),
        Segment::new(&medium),
    ];
    a.send(b.local_id(), OutMessage::new(b"big", &segs))
        .await
        .expect("send big");
    let segs = [Segment::device(&from_gpu)];
    a.send(b.local_id(), OutMessage::new(b"gpu", &segs))
        .await
        .expect("send from device memory");
    let segs = [Segment::new(&wrong)];
    a.send(b.local_id(), OutMessage::new(b"wrong", &segs))
        .await
        .expect("send wrong");
    send_seq(&*a, b.local_id(), 9, &medium).await;

    let m = next_message(&*b).await;
    assert_eq!(&m.meta[..], b"big");
    assert_eq!(&m.segments[0][..], &head[..]);
    assert!(m.segments[2].is_empty());
    assert!(
        m.segments[3] == medium,
        "a host segment beside a placed one corrupted"
    );
    if !places {
        eprintln!("this transport does not place segments: they arrive as host bytes");
        assert_eq!(m.placed, None);
        assert!(m.segments[1] == big, "unplaced segment corrupted");
        return;
    }
    assert_eq!(
        m.placed,
        Some(Placed {
            segment: 1,
            len: big.len() as u64,
            result: Ok(())
        })
    );
    assert!(m.segments[1].is_empty(), "a placed segment arrives empty");
    assert!(landing_big.bytes() == big, "placed bytes corrupted");
    assert_eq!(
        placer.asked_about(b"big"),
        Some(vec![10, big.len() as u64, 0, medium.len() as u64]),
        "the placer sees the segments' lengths"
    );

    let m = next_message(&*b).await;
    assert_eq!(&m.meta[..], b"gpu");
    assert_eq!(m.placed.as_ref().map(|p| p.result.clone()), Some(Ok(())));
    assert!(
        landing_gpu.bytes() == from_gpu.bytes(),
        "device-to-device bytes corrupted"
    );

    let m = next_message(&*b).await;
    assert_eq!(&m.meta[..], b"wrong");
    assert_eq!(
        m.placed, None,
        "a placement of the wrong length is not used"
    );
    assert_eq!(&m.segments[0][..], &wrong[..]);
    assert_eq!(landing_wrong.copies(), 0);

    let m = next_message(&*b).await;
    assert_eq!(seq_of(&m), 9);
    assert_eq!(
        m.placed, None,
        "a message the placer leaves alone stays in host memory"
    );
    assert!(m.segments[0] == medium);
}

/// A device copy that fails while a segment is placed is reported with its message (the
/// error names the device); the connection stays in step, so the next messages, placed or
/// not, arrive whole.
pub async fn a_failing_placement_loses_only_that_segment<F: TransportFactory>(f: &F) {
    let a = endpoint(f, 1).await;
    let b = endpoint(f, 2).await;
    let placer = Arc::new(TablePlacer::default());
    if !b.set_placer(placer.clone()) {
        eprintln!("this transport does not place segments");
        return;
    }
    link(&*a, &*b).await;
    let data = pattern((2 << 20) + 77, 51);
    placer.put(
        b"fails",
        0,
        SimulatedLanding::new(data.len(), 6).failing_from((1 << 20) + 3),
    );
    let fine = placer.put(b"fine", 0, SimulatedLanding::new(data.len(), 6));
    for meta in [&b"fails"[..], b"fine"] {
        let segs = [Segment::new(&data)];
        a.send(b.local_id(), OutMessage::new(meta, &segs))
            .await
            .expect("send");
    }
    send_seq(&*a, b.local_id(), 3, b"after").await;

    let m = next_message(&*b).await;
    assert_eq!(&m.meta[..], b"fails");
    let Some(Placed {
        segment: 0,
        result: Err(e),
        ..
    }) = m.placed
    else {
        panic!("expected a failed placement, got {:?}", m.placed);
    };
    assert_eq!(e.ordinal, 6);
    assert!(e.reason.contains("injected"), "{e}");
    let m = next_message(&*b).await;
    assert_eq!(&m.meta[..], b"fine");
    assert_eq!(m.placed.map(|p| p.result), Some(Ok(())));
    assert!(fine.bytes() == data);
    let m = next_message(&*b).await;
    assert_eq!(seq_of(&m), 3);
    assert_eq!(&m.segments[0][..], b"after");
}
