use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use psnet_transport::placement::SimulatedLanding;
use psnet_transport::Placer;

use super::*;

const TAG: u32 = 0x5a5a;

/// Memory the NIC could write: 4096 bytes at 0x10000, under remote key 77.
#[derive(Default)]
struct Target {
    busy: AtomicBool,
    landed: AtomicUsize,
}

impl NicTarget for Target {
    fn span(&self) -> (u64, usize) {
        (0x10000, 4096)
    }
    fn rkey(&self) -> u32 {
        77
    }
    fn claim(&self) -> bool {
        !self.busy.swap(true, Ordering::SeqCst)
    }
    fn release(&self) {
        self.busy.store(false, Ordering::SeqCst);
    }
    fn landed(&self) -> Result<(), String> {
        self.landed.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// A destination that names whatever NIC registration it is given.
#[derive(Debug)]
struct Dest {
    len: usize,
    nic: Option<NicRegion>,
}

impl DeviceDest for Dest {
    fn len(&self) -> usize {
        self.len
    }
    fn ordinal(&self) -> u32 {
        3
    }
    fn nic(&self) -> Option<NicRegion> {
        self.nic
    }
    fn staging(&self, len: usize) -> Result<StagingBuf, DeviceError> {
        Ok(Box::new(vec![0u8; len]))
    }
    fn copy_from_host(
        &self,
        _: usize,
        _: usize,
        buf: StagingBuf,
    ) -> psnet_transport::device::CopyFuture<'_> {
        Box::pin(async move { Ok(buf) })
    }
}

/// Places segment 1 into the destination it holds, if any.
struct Second(Mutex<Option<Arc<dyn DeviceDest>>>, AtomicUsize);

impl Placer for Second {
    fn place(&self, _: NodeId, _: &[u8], _: &[u64]) -> Option<Placement> {
        self.1.fetch_add(1, Ordering::SeqCst);
        let dest = self.0.lock().unwrap().clone()?;
        Some(Placement { segment: 1, dest })
    }
}

fn landings() -> (Landings, Arc<Second>) {
    let placing = ReceivePlacing::new("test", 1024);
    let placer = Arc::new(Second(Mutex::new(None), AtomicUsize::new(0)));
    placing.set_placer(placer.clone());
    (Landings::new(placing, TAG), placer)
}

fn with_dest(placer: &Second, len: usize, nic: Option<NicRegion>) {
    *placer.0.lock().unwrap() = Some(Arc::new(Dest { len, nic }));
}

fn nic(lkey: u32, addr: u64) -> Option<NicRegion> {
    Some(NicRegion {
        key: RegionKey((u64::from(TAG) << 32) | u64::from(lkey)),
        addr,
    })
}

const LENS: [u64; 3] = [100, 1000, 10];

#[test]
fn the_placer_is_not_asked_early_while_nothing_can_take_a_write() {
    let (l, placer) = landings();
    with_dest(&placer, 1000, nic(9, 0x10000));
    assert!(matches!(
        l.decide(NodeId(1), b"m", &LENS),
        Decision::NotAsked
    ));
    assert_eq!(placer.1.load(Ordering::SeqCst), 0);
}

#[test]
fn only_live_memory_of_the_table_that_covers_the_segment_is_written_by_the_nic() {
    let (l, placer) = landings();
    let target = Arc::new(Target::default());
    let weak: Weak<dyn NicTarget> = Arc::downgrade(&target) as Weak<Target>;
    let region = l.accept(9, weak);
    assert_eq!(region, nic(9, 0x10000).unwrap());
    let copy = |l: &Landings| match l.decide(NodeId(1), b"m", &LENS) {
        Decision::Copy(p) => p.is_some(),
        Decision::NotAsked => panic!("not asked"),
        Decision::Nic(_) => panic!("the NIC would write it"),
    };
    // No placement; memory without a registration; another transport's key; a key not
    // in the table; a range leaving the registration; a length other than the segment's.
    *placer.0.lock().unwrap() = None;
    assert!(!copy(&l));
    with_dest(&placer, 1000, None);
    assert!(copy(&l));
    let mut foreign = nic(9, 0x10000);
    foreign.as_mut().unwrap().key.0 ^= 1 << 40;
    with_dest(&placer, 1000, foreign);
    assert!(copy(&l));
    with_dest(&placer, 1000, nic(8, 0x10000));
    assert!(copy(&l));
    with_dest(&placer, 1000, nic(9, 0x10000 + 3097));
    assert!(copy(&l));
    with_dest(&placer, 1000, nic(9, 0xf000));
    assert!(copy(&l));
    with_dest(&placer, 1000, nic(9, u64::MAX - 10));
    assert!(copy(&l));
    with_dest(&placer, 999, nic(9, 0x10000));
    assert!(copy(&l));

    // Inside it: the NIC writes there, under its key, while nothing else claims it.
    with_dest(&placer, 1000, nic(9, 0x10000 + 3096));
    let Decision::Nic(placed) = l.decide(NodeId(1), b"m", &LENS) else {
        panic!("a NIC placement");
    };
    assert_eq!(
        (placed.segment, placed.len, placed.addr, placed.rkey),
        (1, 1000, 0x10000 + 3096, 77)
    );
    assert!(copy(&l), "claimed twice");
    placed.landed().unwrap();
    assert_eq!(target.landed.load(Ordering::SeqCst), 1);
    drop(placed);
    assert!(matches!(l.decide(NodeId(1), b"m", &LENS), Decision::Nic(_)));

    // Memory dropped: copied in instead.
    drop(target);
    assert!(copy(&l));
}

#[test]
fn a_panicking_placer_leaves_the_message_in_host_memory() {
    struct Panics;
    impl Placer for Panics {
        fn place(&self, _: NodeId, _: &[u8], _: &[u64]) -> Option<Placement> {
            panic!("a placer bug")
        }
    }
    let placing = ReceivePlacing::new("test", 1024);
    placing.set_placer(Arc::new(Panics));
    let l = Landings::new(placing, TAG);
    let target = Arc::new(Target::default());
    l.accept(9, Arc::downgrade(&target) as Weak<Target>);
    assert!(matches!(
        l.decide(NodeId(1), b"m", &LENS),
        Decision::Copy(None)
    ));
}

#[test]
fn memory_dropped_before_its_write_landed_is_reported_and_not_kept() {
    let (l, placer) = landings();
    let target = Arc::new(Target::default());
    l.accept(9, Arc::downgrade(&target) as Weak<Target>);
    with_dest(&placer, 1000, nic(9, 0x10000));
    let Decision::Nic(placed) = l.decide(NodeId(1), b"m", &LENS) else {
        panic!("a NIC placement");
    };
    // The receive does not keep the memory alive: its owner's drop ends it.
    drop(target);
    let err = placed.landed().expect_err("the memory is gone");
    assert_eq!(err.ordinal, 3);
    assert!(err.reason.contains("dropped"), "{err}");
}

#[test]
fn an_empty_segment_is_never_written_by_the_nic() {
    let (l, placer) = landings();
    let target = Arc::new(Target::default());
    l.accept(9, Arc::downgrade(&target) as Weak<Target>);
    with_dest(&placer, 0, nic(9, 0x10000));
    assert!(matches!(
        l.decide(NodeId(1), b"m", &[5, 0]),
        Decision::Copy(Some(_))
    ));
    // A simulated landing, which has no registration: copied.
    *placer.0.lock().unwrap() = Some(Arc::new(SimulatedLanding::new(1000, 0)));
    assert!(matches!(
        l.decide(NodeId(1), b"m", &LENS),
        Decision::Copy(Some(_))
    ));
}
