//! The server side: answers whatever the client asks, until it says goodbye.

use std::time::Instant;

use psnet::transport::{Event, OutMessage, Transport};

use crate::protocol::Control;
use crate::session::{send_control, PerfResult, CLIENT_ID};

#[cfg(feature = "cuda")]
use crate::bw_gpu::GpuSink;

/// Without the `cuda` feature no test can ask for GPU memory.
#[cfg(not(feature = "cuda"))]
#[derive(Default)]
struct GpuSink {
    _nothing: (),
}

#[cfg(not(feature = "cuda"))]
impl GpuSink {
    fn arm<T: Transport>(&mut self, _: &T, _: u64, _: u64) -> PerfResult<()> {
        Err(crate::kv::GPU_FEATURE.into())
    }

    fn disarm(&self) {}
}

/// Counts one bandwidth test's messages and their arrival times.
struct BwRound {
    size: u64,
    iters: u64,
    arrivals: Vec<Instant>,
    /// The messages are placed in GPU memory as they arrive.
    to_gpu: bool,
}

impl BwRound {
    /// Best rate over windows of a tenth of the messages (perftest reports a peak next to the
    /// average; this is psnet's definition of it).
    fn peak_bytes_per_s(&self) -> f64 {
        let n = self.arrivals.len();
        let window = (n / 10).max(1);
        (0..n.saturating_sub(window))
            .filter_map(|i| {
                let dt = (self.arrivals[i + window] - self.arrivals[i]).as_secs_f64();
                (dt > 0.0).then(|| (window as u64 * self.size) as f64 / dt)
            })
            .fold(0.0, f64::max)
    }
}

/// Serves one client: bandwidth rounds, echoes of pings, until `Bye` or the client's loss.
pub async fn serve_one_client<T: Transport>(t: &T) -> PerfResult<()> {
    let mut round: Option<BwRound> = None;
    let mut sink = GpuSink::default();
    loop {
        let m = match t.recv().await.map_err(|e| e.to_string())? {
            Event::Message(m) => m,
            Event::PeerConnected { peer, addr } => {
                tracing::info!(%peer, %addr, "client connected");
                continue;
            }
            Event::PeerLost { peer, reason } => {
                return Err(format!("{peer} lost before saying goodbye: {reason}"))
            }
        };
        match Control::decode(&m.meta)? {
            Control::BwStart { size, iters } => {
                round = Some(BwRound {
                    size,
                    iters,
                    arrivals: Vec::with_capacity(iters.min(1 << 20) as usize),
                    to_gpu: false,
                });
                send_control(t, CLIENT_ID, Control::Ready, &[]).await?;
            }
            Control::BwStartToGpu { size, iters, gpu } => {
                sink.arm(t, size, gpu)?;
                round = Some(BwRound {
                    size,
                    iters,
                    arrivals: Vec::with_capacity(iters.min(1 << 20) as usize),
                    to_gpu: true,
                });
                send_control(t, CLIENT_ID, Control::Ready, &[]).await?;
            }
            Control::BwData => {
                let Some(r) = round.as_mut() else {
                    return Err("bandwidth data before BwStart".into());
                };
                let got = match (&m.placed, r.to_gpu) {
                    (None, false) => m.segments.iter().map(|s| s.len() as u64).sum(),
                    (Some(placed), true) => {
                        if let Err(e) = &placed.result {
                            return Err(format!("placing a message in GPU memory: {e}"));
                        }
                        placed.len
                    }
                    (None, true) => {
                        return Err("a message for GPU memory arrived in host memory (the \
                                    transport did not place it)"
                            .into())
                    }
                    (Some(_), false) => {
                        return Err("a message for host memory was placed in GPU memory".into())
                    }
                };
                if got != r.size {
                    return Err(format!(
                        "bandwidth message of {got} bytes, expected {}",
                        r.size
                    ));
                }
                r.arrivals.push(Instant::now());
                if r.arrivals.len() as u64 == r.iters {
                    let r = round.take().expect("round is set");
                    if r.to_gpu {
                        sink.disarm();
                    }
                    let elapsed = r
                        .arrivals
                        .last()
                        .zip(r.arrivals.first())
                        .map_or(0, |(l, f)| (*l - *f).as_nanos() as u64);
                    let done = Control::BwDone {
                        elapsed_ns: elapsed,
                        peak_bytes_per_s: r.peak_bytes_per_s(),
                    };
                    send_control(t, CLIENT_ID, done, &[]).await?;
                }
            }
            Control::LatStart { .. } => send_control(t, CLIENT_ID, Control::Ready, &[]).await?,
            Control::Ping => {
                // Echo the very buffers received: no copy on the way back.
                let segs: Vec<_> = m
                    .segments
                    .iter()
                    .map(psnet::transport::Segment::from)
                    .collect();
                t.send(CLIENT_ID, OutMessage::new(&m.meta, &segs))
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Control::Bye => return Ok(()),
            other => return Err(format!("unexpected {other:?} from the client")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn peak_is_the_best_window() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        // 20 messages of 1000 bytes: slow (10 ms apart) then fast (1 ms apart).
        let mut arrivals: Vec<Instant> = (0..10).map(|i| ms(10 * i)).collect();
        arrivals.extend((0..10).map(|i| ms(100 + i)));
        let r = BwRound {
            size: 1000,
            iters: 20,
            arrivals,
            to_gpu: false,
        };
        // Window of 2 messages over 2 ms = 1e6 bytes/s.
        assert!(
            (r.peak_bytes_per_s() - 1.0e6).abs() < 1.0,
            "{}",
            r.peak_bytes_per_s()
        );
    }
}
