use std::sync::{Arc, Mutex};

use proptest::prelude::*;

use super::*;
use crate::device::yield_once;
use crate::message::{Event, Incoming};

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 13 + i / 253) as u8).collect()
}

fn block_on<F: Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime")
        .block_on(f)
}

/// Hands out `bytes` in the sizes asked, yielding `yields` times inside each read, logging
/// when each read starts and ends; fails reads past the end like a closed connection.
struct Feed {
    bytes: Vec<u8>,
    at: usize,
    yields: usize,
    reads: usize,
    log: Arc<Mutex<Vec<String>>>,
}

impl Feed {
    fn new(bytes: Vec<u8>, yields: usize, log: Arc<Mutex<Vec<String>>>) -> Self {
        Feed {
            bytes,
            at: 0,
            yields,
            reads: 0,
            log,
        }
    }
}

impl ChunkSource for Feed {
    async fn read<'b>(&'b mut self, buf: &'b mut [u8]) -> io::Result<()> {
        let k = self.reads;
        self.reads += 1;
        self.log.lock().unwrap().push(format!("read {k} start"));
        for _ in 0..self.yields {
            yield_once().await;
        }
        let end = self.at + buf.len();
        if end > self.bytes.len() {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed"));
        }
        buf.copy_from_slice(&self.bytes[self.at..end]);
        self.at = end;
        self.log.lock().unwrap().push(format!("read {k} end"));
        Ok(())
    }
}

/// A simulated landing that logs when each copy starts and ends.
#[derive(Debug)]
struct Logged {
    inner: SimulatedLanding,
    chunk: usize,
    log: Arc<Mutex<Vec<String>>>,
}

impl DeviceDest for Logged {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn ordinal(&self) -> u32 {
        self.inner.ordinal()
    }
    fn staging(&self, len: usize) -> Result<StagingBuf, DeviceError> {
        self.inner.staging(len)
    }
    fn copy_from_host(&self, offset: usize, len: usize, buf: StagingBuf) -> CopyFuture<'_> {
        let k = offset / self.chunk;
        Box::pin(async move {
            self.log.lock().unwrap().push(format!("copy {k} start"));
            let r = self.inner.copy_from_host(offset, len, buf).await;
            self.log.lock().unwrap().push(format!("copy {k} end"));
            r
        })
    }
}

fn position(log: &[String], what: &str) -> usize {
    log.iter()
        .position(|l| l == what)
        .unwrap_or_else(|| panic!("{what} not in {log:?}"))
}

#[test]
fn each_chunk_is_copied_to_the_device_while_the_next_is_read() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let chunk = 100;
    let data = pattern(450);
    let dest = Logged {
        inner: SimulatedLanding::new(450, 0),
        chunk,
        log: log.clone(),
    };
    let mut feed = Feed::new(data.clone(), 3, log.clone());
    block_on(stream_from_source(&dest, dest.len(), chunk, &mut feed))
        .expect("source")
        .expect("device");
    assert_eq!(dest.inner.bytes(), data);
    assert_eq!(dest.inner.copies(), 5);
    let log = log.lock().unwrap().clone();
    for k in 0..4 {
        // Read k+1 starts before copy k ends, and copy k+1 waits for read k+1.
        assert!(
            position(&log, &format!("read {} start", k + 1))
                < position(&log, &format!("copy {k} end")),
            "read {} did not overlap copy {k}: {log:?}",
            k + 1
        );
        assert!(
            position(&log, &format!("read {} end", k + 1))
                < position(&log, &format!("copy {} start", k + 1)),
            "copy {} before its read: {log:?}",
            k + 1
        );
    }
}

#[test]
fn a_device_error_still_reads_every_byte_off_the_source() {
    let data = pattern(1000);
    let mut tail = data.clone();
    tail.extend_from_slice(b"next message");
    let dest = SimulatedLanding::new(1000, 3).failing_from(450);
    let mut feed = Feed::new(tail, 1, Arc::default());
    let err = block_on(stream_from_source(&dest, dest.len(), 100, &mut feed))
        .expect("the source is fine")
        .expect_err("the device fails");
    assert_eq!(err.ordinal, 3);
    assert!(err.reason.contains("injected"), "{err}");
    // The bytes before the failing chunk landed; the source is at the next message.
    assert_eq!(&dest.bytes()[..400], &data[..400]);
    assert_eq!(feed.at, 1000);
}

#[test]
fn a_destination_of_another_length_is_a_device_error_and_the_segment_is_still_read() {
    let mut tail = pattern(1000);
    tail.extend_from_slice(b"next message");
    let dest = SimulatedLanding::new(999, 4);
    let mut feed = Feed::new(tail, 0, Arc::default());
    let err = block_on(stream_from_source(&dest, 1000, 64, &mut feed))
        .expect("the source is fine")
        .expect_err("the lengths differ");
    assert_eq!(err.ordinal, 4);
    assert_eq!(feed.at, 1000, "the segment was not read whole");
    assert_eq!(dest.copies(), 0);
}

#[test]
fn a_source_error_is_returned_as_such() {
    let dest = SimulatedLanding::new(500, 0);
    let mut feed = Feed::new(pattern(250), 0, Arc::default());
    let err =
        block_on(stream_from_source(&dest, dest.len(), 100, &mut feed)).expect_err("source ends");
    assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
}

#[test]
fn a_placement_fits_only_a_segment_of_its_length() {
    let p = Placement {
        segment: 1,
        dest: Arc::new(SimulatedLanding::new(64, 0)),
    };
    assert!(fits(&p, &[3, 64]));
    assert!(
        !fits(&p, &[3, 65]),
        "a longer segment would overrun the device memory"
    );
    assert!(!fits(&p, &[3, 63]), "a shorter one would leave stale bytes");
    assert!(!fits(&p, &[64]), "no segment 1");
}

#[test]
fn copied_into_from_memory_is_the_bytes() {
    let data = pattern(777);
    let dest = SimulatedLanding::new(777, 1);
    block_on(copy_into(&dest, &data, 100)).expect("copy");
    assert_eq!(dest.bytes(), data);
    let short = SimulatedLanding::new(800, 1);
    assert!(block_on(copy_into(&short, &data, 100)).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn placed_bytes_are_the_source(len in 0usize..5000, chunk in 1usize..1500, yields in 0usize..3, fail in proptest::option::of(0usize..5000)) {
        let data = pattern(len);
        let mut dest = SimulatedLanding::new(len, 0);
        if let Some(f) = fail {
            dest = dest.failing_from(f);
        }
        let mut with_next = data.clone();
        with_next.extend_from_slice(&[0xAB; 7]);
        let mut feed = Feed::new(with_next, yields, Arc::default());
        let result = block_on(stream_from_source(&dest, dest.len(), chunk, &mut feed)).expect("source");
        // Every byte of the segment is consumed, whatever the device did.
        prop_assert_eq!(feed.at, len);
        let chunk = chunk.min(len.max(1));
        match fail.filter(|&f| f < len) {
            None => {
                prop_assert!(result.is_ok());
                prop_assert_eq!(dest.bytes(), data);
                prop_assert_eq!(dest.copies(), len.div_ceil(chunk));
            }
            Some(f) => {
                prop_assert!(result.is_err());
                // Whole chunks before the failing one landed.
                let good = f / chunk * chunk;
                prop_assert_eq!(&dest.bytes()[..good], &data[..good]);
            }
        }
    }
}

/// Places segment 0 of every message in a fresh landing it keeps.
#[derive(Default)]
struct KeepAll(Mutex<Vec<Arc<SimulatedLanding>>>);

impl Placer for KeepAll {
    fn place(&self, _: NodeId, _: &[u8], lens: &[u64]) -> Option<Placement> {
        let landing = Arc::new(SimulatedLanding::new(lens[0] as usize, 0));
        self.0.lock().unwrap().push(landing.clone());
        Some(Placement {
            segment: 0,
            dest: landing,
        })
    }
}

#[test]
fn a_placement_survives_a_dropped_finish() {
    let data = pattern(10_000);
    let m = Incoming {
        peer: NodeId(4),
        meta: bytes::Bytes::from_static(b"m"),
        segments: [bytes::Bytes::from(data.clone())].into_iter().collect(),
        placed: None,
    };
    let placer = Arc::new(KeepAll::default());
    let placing = ReceivePlacing::new("test", 1000);
    assert!(block_on(placing.finish()).is_none(), "nothing under way");
    placing.set_placer(placer.clone());
    // Polled once (its first copy pending), then dropped: a recv cancelled half-way.
    {
        let mut placed = std::pin::pin!(placing.place(Event::Message(m)));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(placed.as_mut().poll(&mut cx).is_pending());
    }
    let Some(Event::Message(m)) = block_on(placing.finish()) else {
        panic!("the placement is still there");
    };
    assert_eq!(m.placed.map(|p| p.result), Some(Ok(())));
    assert!(m.segments[0].is_empty());
    assert_eq!(placer.0.lock().unwrap()[0].bytes(), data);
    assert!(block_on(placing.finish()).is_none(), "finished once");
}

#[test]
fn a_placement_decided_early_is_carried_out_without_asking_again() {
    let data = pattern(5_000);
    let message = || Incoming {
        peer: NodeId(2),
        meta: bytes::Bytes::from_static(b"m"),
        segments: [bytes::Bytes::from(data.clone())].into_iter().collect(),
        placed: None,
    };
    let placer = Arc::new(KeepAll::default());
    let placing = ReceivePlacing::new("test", 700);
    placing.set_placer(placer.clone());
    // Decided when the request came: copied where it said, the placer not asked again.
    let early = Arc::new(SimulatedLanding::new(data.len(), 1));
    let decided = Placement {
        segment: 0,
        dest: early.clone(),
    };
    let Event::Message(m) = block_on(placing.place_as(message(), decided)) else {
        panic!("a message");
    };
    assert_eq!(m.placed.map(|p| p.result), Some(Ok(())));
    assert_eq!(early.bytes(), data);
    assert!(placer.0.lock().unwrap().is_empty(), "the placer was asked");
    // A decision of the wrong length leaves the message in host memory.
    let short = Placement {
        segment: 0,
        dest: Arc::new(SimulatedLanding::new(data.len() - 1, 1)),
    };
    let Event::Message(m) = block_on(placing.place_as(message(), short)) else {
        panic!("a message");
    };
    assert!(m.placed.is_none());
    assert_eq!(m.segments[0], data);
    // A message its transport already placed is delivered as it is.
    let mut done = message();
    done.segments[0] = bytes::Bytes::new();
    done.placed = Some(Placed {
        segment: 0,
        len: data.len() as u64,
        result: Ok(()),
    });
    let Event::Message(m) = block_on(placing.place(Event::Message(done.clone()))) else {
        panic!("a message");
    };
    assert_eq!(m.placed, done.placed);
    assert!(placer.0.lock().unwrap().is_empty(), "the placer was asked");
}

#[test]
fn a_short_staging_buffer_is_a_device_error_not_a_panic() {
    #[derive(Debug)]
    struct Short(SimulatedLanding);
    impl DeviceDest for Short {
        fn len(&self) -> usize {
            self.0.len()
        }
        fn ordinal(&self) -> u32 {
            self.0.ordinal()
        }
        fn staging(&self, len: usize) -> Result<StagingBuf, DeviceError> {
            Ok(Box::new(vec![0u8; len / 2]))
        }
        fn copy_from_host(&self, offset: usize, len: usize, buf: StagingBuf) -> CopyFuture<'_> {
            self.0.copy_from_host(offset, len, buf)
        }
    }
    let dest = Short(SimulatedLanding::new(300, 2));
    let mut feed = Feed::new(pattern(310), 0, Arc::default());
    let err = block_on(stream_from_source(&dest, dest.len(), 100, &mut feed))
        .expect("the source is fine")
        .expect_err("refused");
    assert!(err.reason.contains("staging buffer"), "{err}");
    assert_eq!(feed.at, 300, "the segment was still read off the source");
}
