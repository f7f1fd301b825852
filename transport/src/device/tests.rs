use std::sync::{Arc, Mutex};

use proptest::prelude::*;

use super::*;

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
}

/// Collects what it is given, yielding `yields` times inside each write.
struct Collect {
    out: Vec<u8>,
    yields: usize,
    log: Arc<Mutex<Vec<String>>>,
    writes: usize,
}

impl Collect {
    fn new(yields: usize, log: Arc<Mutex<Vec<String>>>) -> Self {
        Collect {
            out: Vec::new(),
            yields,
            log,
            writes: 0,
        }
    }
}

impl ChunkSink for Collect {
    async fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        let k = self.writes;
        self.writes += 1;
        self.log.lock().unwrap().push(format!("write {k} start"));
        for _ in 0..self.yields {
            yield_once().await;
        }
        self.out.extend_from_slice(bytes);
        self.log.lock().unwrap().push(format!("write {k} end"));
        Ok(())
    }
}

/// A simulated device that logs when each copy starts and ends.
#[derive(Debug)]
struct Logged {
    inner: SimulatedDevice,
    chunk: usize,
    log: Arc<Mutex<Vec<String>>>,
}

impl DeviceBytes for Logged {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn ordinal(&self) -> u32 {
        self.inner.ordinal()
    }
    fn staging(&self, len: usize) -> Result<StagingBuf, DeviceError> {
        self.inner.staging(len)
    }
    fn copy_to_host(&self, offset: usize, len: usize, buf: StagingBuf) -> CopyFuture<'_> {
        let k = offset / self.chunk;
        Box::pin(async move {
            self.log.lock().unwrap().push(format!("copy {k} start"));
            let r = self.inner.copy_to_host(offset, len, buf).await;
            self.log.lock().unwrap().push(format!("copy {k} end"));
            r
        })
    }
}

fn block_on<F: Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime")
        .block_on(f)
}

fn position(log: &[String], what: &str) -> usize {
    log.iter()
        .position(|l| l == what)
        .unwrap_or_else(|| panic!("{what} not in {log:?}"))
}

#[test]
fn each_chunk_is_copied_while_the_one_before_is_written() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let chunk = 100;
    let src = Logged {
        inner: SimulatedDevice::new(pattern(450), 0),
        chunk,
        log: log.clone(),
    };
    let mut sink = Collect::new(3, log.clone());
    block_on(stream_to_sink(&src, chunk, &mut sink)).expect("stream");
    assert_eq!(sink.out, src.inner.bytes());
    let log = log.lock().unwrap().clone();
    assert_eq!(src.inner.copies(), 5);
    for k in 0..4 {
        // Copy k+1 starts before write k ends, and write k+1 waits for copy k+1.
        assert!(
            position(&log, &format!("copy {} start", k + 1))
                < position(&log, &format!("write {k} end")),
            "copy {} did not overlap write {k}: {log:?}",
            k + 1
        );
        assert!(
            position(&log, &format!("copy {} end", k + 1))
                < position(&log, &format!("write {} start", k + 1)),
            "write {} before its copy: {log:?}",
            k + 1
        );
    }
}

#[test]
fn a_device_error_stops_the_stream_after_the_chunks_before_it() {
    let src = SimulatedDevice::new(pattern(1000), 3).failing_from(450);
    let mut sink = Collect::new(1, Arc::default());
    let err = block_on(stream_to_sink(&src, 100, &mut sink)).expect_err("copy fails");
    match err {
        StreamError::Device(e) => {
            assert_eq!(e.ordinal, 3);
            assert!(e.reason.contains("injected"), "{e}");
        }
        other => panic!("expected a device error, got {other}"),
    }
    // Chunks 0..=3 were copied; chunk 4 (bytes 400..500) failed while chunk 3 was written.
    assert_eq!(sink.out, &src.bytes()[..400]);
}

#[test]
fn a_sink_error_is_returned() {
    struct Broken;
    impl ChunkSink for Broken {
        async fn write(&mut self, _: &[u8]) -> io::Result<()> {
            Err(io::Error::new(io::ErrorKind::BrokenPipe, "gone"))
        }
    }
    let src = SimulatedDevice::new(pattern(300), 0);
    let err = block_on(stream_to_sink(&src, 100, &mut Broken)).expect_err("sink fails");
    assert!(matches!(err, StreamError::Io(e) if e.kind() == io::ErrorKind::BrokenPipe));
}

#[test]
fn the_path_is_noted_once_per_peer_device_and_path() {
    let log = PathLog::default();
    assert!(log.note("tcp", NodeId(1), 0, DevicePath::Staged));
    assert!(!log.note("tcp", NodeId(1), 0, DevicePath::Staged));
    assert!(log.note("tcp", NodeId(2), 0, DevicePath::Staged));
    assert!(log.note("tcp", NodeId(1), 1, DevicePath::Staged));
    assert!(log.note("tcp", NodeId(1), 0, DevicePath::Direct));
}

#[test]
fn a_copy_past_the_region_is_an_error() {
    let src = SimulatedDevice::new(pattern(10), 2);
    let Err(err) = block_on(src.copy_to_host(8, 4, Box::new(vec![0u8; 4]))) else {
        panic!("a copy past the end succeeded");
    };
    assert!(err.to_string().contains("past the region"), "{err}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn streamed_bytes_are_the_region(len in 0usize..5000, chunk in 1usize..1500, yields in 0usize..3) {
        let src = SimulatedDevice::new(pattern(len), 0);
        let mut sink = Collect::new(yields, Arc::default());
        block_on(stream_to_sink(&src, chunk, &mut sink)).expect("stream");
        prop_assert_eq!(&sink.out[..], src.bytes());
        prop_assert_eq!(src.copies(), len.div_ceil(chunk.min(len.max(1))));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn copied_whole_is_the_region(len in 0usize..(3 * DEFAULT_STAGE_CHUNK)) {
        let src = SimulatedDevice::new(pattern(len), 0);
        prop_assert_eq!(block_on(copy_all(&src)).expect("copy"), src.bytes());
    }
}

#[test]
fn a_slice_copies_its_own_bytes_and_nothing_past_them() {
    let nic = NicRegion {
        key: RegionKey(3),
        addr: 0x1000,
    };
    let whole = SimulatedDevice::new(pattern(1000), 4).with_nic(nic);
    assert!(DeviceSlice::new(&whole, 900..1001).is_none());
    let part = DeviceSlice::new(&whole, 100..350).expect("inside");
    assert_eq!(part.len(), 250);
    assert_eq!(part.ordinal(), 4);
    assert_eq!(
        part.nic().map(|n| (n.key, n.addr)),
        Some((RegionKey(3), 0x1000 + 100))
    );
    let mut sink = Collect::new(1, Arc::default());
    block_on(stream_to_sink(&part, 64, &mut sink)).expect("stream");
    assert_eq!(sink.out, &whole.bytes()[100..350]);
    let Err(err) = block_on(part.copy_to_host(245, 10, Box::new(vec![0u8; 10]))) else {
        panic!("a copy past the slice succeeded");
    };
    assert!(err.to_string().contains("past the slice"), "{err}");
}
