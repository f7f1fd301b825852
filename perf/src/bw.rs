//! The bandwidth test's client side (perftest's `ib_write_bw`).

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::task::Poll;
use std::time::Instant;

use psnet::transport::{OutMessage, Segment, Transport, TransportError};

use crate::protocol::Control;
use crate::report::{peak_is_meaningful, BwRow};
use crate::session::{expect_ready, next_message, send_control, PerfResult, SERVER_ID};

/// Default message count: perftest's 5000, capped so that one size moves at most 2 GiB.
pub fn default_iters(size: u64) -> u64 {
    ((2u64 << 30) / size.max(1)).clamp(100, 5000)
}

/// Default messages in flight (perftest's `--tx-depth` is 128 work requests; a psnet message
/// above the eager limit is a whole rendezvous, so fewer keep the wire as busy).
pub const DEFAULT_TX_DEPTH: usize = 16;

type SendFuture<'a> = Pin<Box<dyn Future<Output = Result<(), TransportError>> + Send + 'a>>;

/// Sends `iters` messages of `size` bytes from one registered buffer, keeping up to `depth`
/// sends in flight, and waits for the server to confirm the last one. The row has a peak only
/// where the transport makes it meaningful ([`peak_is_meaningful`]).
pub async fn run<T: Transport>(t: &T, size: u64, iters: u64, depth: usize) -> PerfResult<BwRow> {
    let len = usize::try_from(size).map_err(|_| format!("size {size} does not fit in memory"))?;
    let mut buf = t.alloc_registered(len).map_err(|e| e.to_string())?;
    fill(&mut buf);
    run_from(t, size, iters, depth, &[Segment::registered(&buf, 0..len)]).await
}

/// What every bandwidth test sends: byte i is i mod 256.
pub fn fill(buf: &mut [u8]) {
    buf.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
}

/// [`run`] with the message's segments given (`size` bytes in all): from host or GPU memory.
pub async fn run_from<T: Transport>(
    t: &T,
    size: u64,
    iters: u64,
    depth: usize,
    segs: &[Segment<'_>],
) -> PerfResult<BwRow> {
    run_started(t, Control::BwStart { size, iters }, depth, segs).await
}

/// [`run`] with the server receiving each message into GPU `gpu`'s memory.
pub async fn run_to_gpu<T: Transport>(
    t: &T,
    size: u64,
    iters: u64,
    depth: usize,
    gpu: usize,
) -> PerfResult<BwRow> {
    let len = usize::try_from(size).map_err(|_| format!("size {size} does not fit in memory"))?;
    let mut buf = t.alloc_registered(len).map_err(|e| e.to_string())?;
    fill(&mut buf);
    let start = Control::BwStartToGpu {
        size,
        iters,
        gpu: gpu as u64,
    };
    run_started(t, start, depth, &[Segment::registered(&buf, 0..len)]).await
}

/// The bandwidth test announced by `start` (a [`Control::BwStart`] or its kin).
async fn run_started<T: Transport>(
    t: &T,
    start: Control,
    depth: usize,
    segs: &[Segment<'_>],
) -> PerfResult<BwRow> {
    let (size, iters) = match start {
        Control::BwStart { size, iters } | Control::BwStartToGpu { size, iters, .. } => {
            (size, iters)
        }
        other => return Err(format!("internal: {other:?} starts no bandwidth test")),
    };
    if depth == 0 {
        return Err("--tx-depth must be at least 1".into());
    }
    send_control(t, SERVER_ID, start, &[]).await?;
    expect_ready(t).await?;
    let meta = Control::BwData.encode();
    let meta = &meta[..];
    let start = Instant::now();
    let mut in_flight: Vec<SendFuture<'_>> = Vec::with_capacity(depth);
    let mut started = 0u64;
    while started < iters || !in_flight.is_empty() {
        while started < iters && in_flight.len() < depth {
            in_flight.push(Box::pin(t.send(SERVER_ID, OutMessage::new(meta, segs))));
            started += 1;
        }
        complete_some(&mut in_flight)
            .await
            .map_err(|e| e.to_string())?;
    }
    match next_message(t).await?.0 {
        Control::BwDone {
            peak_bytes_per_s, ..
        } => Ok(BwRow::new(
            size,
            iters,
            start.elapsed().as_secs_f64(),
            peak_is_meaningful(t.capabilities().name).then_some(peak_bytes_per_s),
        )),
        other => Err(format!("expected BwDone from the server, got {other:?}")),
    }
}

/// Polls every send in flight (each must be polled to make progress) until at least one has
/// finished; removes the finished ones.
async fn complete_some(in_flight: &mut Vec<SendFuture<'_>>) -> Result<(), TransportError> {
    poll_fn(|cx| {
        let before = in_flight.len();
        let mut failure = None;
        in_flight.retain_mut(|f| match f.as_mut().poll(cx) {
            Poll::Ready(Ok(())) => false,
            Poll::Ready(Err(e)) => {
                failure.get_or_insert(e);
                false
            }
            Poll::Pending => true,
        });
        match failure {
            Some(e) => Poll::Ready(Err(e)),
            None if in_flight.len() < before => Poll::Ready(Ok(())),
            None => Poll::Pending,
        }
    })
    .await
}
