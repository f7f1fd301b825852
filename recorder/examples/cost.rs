//! What recording one operation costs: `cargo run --release -p psnet-recorder --example
//! cost`. Prints nanoseconds per call for the recorder's steps and for the clock alone.

use std::time::Instant;

use psnet_recorder::{DumpPolicy, Op, Recorder, Scope, Tally};

fn main() {
    const N: u64 = 2_000_000;
    let r = Recorder::new(
        Scope::Collectives {
            comm: 1,
            rank: 0,
            size: 2,
        },
        4096,
        DumpPolicy::Never,
        std::env::temp_dir(),
    )
    .expect("a recorder");
    let op = |seq| Op::Call {
        seq,
        coll: "allreduce",
        dtype: "float",
        count: 2,
        reduce: "sum",
        root: 0,
    };
    let t = Instant::now();
    for seq in 0..N {
        let id = r.start(op(seq));
        let mut tally = Tally::default();
        tally.sent(1);
        tally.received(1);
        r.finish(id, tally.peers(), None);
    }
    let per = t.elapsed().as_nanos() as f64 / N as f64;
    println!("start + finish (a collective call's or a kv request's record): {per:.1} ns");
    let t = Instant::now();
    for seq in 0..N {
        let id = r.begin(op(seq));
        r.started(id);
        r.done(id);
    }
    let per = t.elapsed().as_nanos() as f64 / N as f64;
    println!("begin + started + done (three steps, for comparison): {per:.1} ns");
    let t = Instant::now();
    let mut sum = 0u64;
    for _ in 0..N {
        sum = sum.wrapping_add(psnet_recorder::now_us());
    }
    let per = t.elapsed().as_nanos() as f64 / N as f64;
    println!("the system clock, for comparison: {per:.1} ns per read ({sum})");
}
