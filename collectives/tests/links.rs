//! Whole communicators on the in-memory network with modelled links (1 Gbit/s hosts, in
//! simulated time): the ring's time against the wire bound its bytes give.
//!
//! tokio's timers tick in milliseconds, so a message landing 2.1 ms after it was sent is
//! seen at 3 ms: every hop of a ring would gain up to a millisecond. The network here is
//! modelled `SLOW` times slower, with latencies `SLOW` times longer, and the times measured
//! are divided by `SLOW`: a tick is then a microsecond of the network modelled.

mod common;

use std::time::Duration;

use common::{runtime, Comm};
use futures_util::future::try_join_all;
use psnet_collectives::{Config, ReduceOp};
use psnet_memnet::{HostLinks, Link, MemNet, MemNetConfig};
use tokio::time::Instant;

const RATE: f64 = 125e6;
/// How much slower than modelled the network runs (see above).
const SLOW: f64 = 1000.0;

/// `n` ranks, one per host (the network puts endpoints on its hosts in turn), each host's
/// links at 1 Gbit/s with `latency` each way.
async fn world_on_links(n: usize, latency: Duration) -> Vec<Comm> {
    let link = Link::new(RATE / SLOW, latency.mul_f64(SLOW)).unwrap();
    let local = Link::new(RATE * 10.0 / SLOW, Duration::ZERO).unwrap();
    let net = MemNet::new(MemNetConfig {
        hosts: vec![HostLinks::symmetric(link, local); n],
        ..MemNetConfig::default()
    });
    common::world(&net, n, Config::default()).await
}

/// Simulated seconds of one allreduce of `elems` floats on every rank, and whether every
/// rank ended with the sum.
async fn allreduce_time(comms: &[Comm], elems: usize) -> (f64, bool) {
    let mut bufs: Vec<Vec<f32>> = (0..comms.len())
        .map(|r| vec![r as f32 + 1.0; elems])
        .collect();
    let start = Instant::now();
    try_join_all(
        comms
            .iter()
            .zip(bufs.iter_mut())
            .map(|(c, b)| c.allreduce(b, ReduceOp::Sum)),
    )
    .await
    .expect("allreduce");
    let took = start.elapsed().as_secs_f64() / SLOW;
    let n = comms.len() as f32;
    let want = n * (n + 1.0) / 2.0;
    (took, bufs.iter().all(|b| b.iter().all(|&x| x == want)))
}

#[test]
fn the_ring_runs_within_a_tenth_of_its_wire_bound_and_never_under_it() {
    runtime().block_on(async {
        let n = 4;
        let comms = world_on_links(n, Duration::from_micros(50)).await;
        for mib in [1usize, 4, 16] {
            let bytes = mib << 20;
            let (took, right) = allreduce_time(&comms, bytes / 4).await;
            assert!(right, "{mib} MiB: a rank's sum is wrong");
            // Each rank sends and receives 2 (n - 1) / n of the buffer over its own links.
            let bound = 2.0 * (n - 1) as f64 / n as f64 * bytes as f64 / RATE;
            println!(
                "{mib} MiB: {took:.6} s simulated, wire bound {bound:.4} s, {:.3}x",
                took / bound
            );
            assert!(
                took >= bound,
                "{mib} MiB: {took} s beats the wire ({bound} s)"
            );
            assert!(
                took <= 1.1 * bound,
                "{mib} MiB: {took} s against a bound of {bound} s"
            );
        }
    });
}
