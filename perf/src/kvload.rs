//! `psnet-perf kvload`: a dist_sync job with many processes and many small keys (by default
//! 16 workers, 4 servers, 100,000 keys of 4 elements plus 2 keys sharded over every server),
//! every round's pulled values checked exactly, and the peak resident memory of every process
//! reported: what the reliability issue's load row measures. The launching process samples
//! the job's processes' peak RSS (`VmHWM`) from `/proc` while they run.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use psnet::kv::{KvConfig, Worker};
use serde::Serialize;

use crate::session::PerfResult;

/// `psnet-perf kvload`'s settings.
#[derive(Args, Clone, Debug)]
pub struct LoadArgs {
    /// Servers to launch.
    #[arg(long, default_value_t = 4)]
    pub servers: u32,
    /// Workers to launch.
    #[arg(long, default_value_t = 16)]
    pub workers: u32,
    /// Small keys.
    #[arg(long, default_value_t = 100_000)]
    pub keys: u64,
    /// Elements of each small key.
    #[arg(long, default_value_t = 4)]
    pub elems: usize,
    /// Keys sharded over every server (more elements than MXNET_KVSTORE_BIGARRAY_BOUND).
    #[arg(long, default_value_t = 2)]
    pub sharded: u64,
    /// Elements of each sharded key.
    #[arg(long, default_value_t = 1 << 20)]
    pub sharded_elems: usize,
    /// dist_sync rounds (a push+pull of every key each).
    #[arg(long, default_value_t = 5)]
    pub rounds: u32,
    /// Print JSON Lines.
    #[arg(long)]
    pub json: bool,
}

/// One worker's gradient for element `e` of key `key` in round `round`: small integers, so
/// that every sum over workers is exact in f32 whatever the order.
fn grad(rank: u32, key: u64, e: usize, round: u32) -> f32 {
    ((rank as u64 + 1) * (key % 7 + 1) + e as u64 % 3 + round as u64) as f32
}

/// What every worker pulls after `round`: the servers (no optimizer) hold the round's sum.
fn expected(workers: u32, key: u64, e: usize, round: u32) -> f32 {
    (0..workers).map(|r| grad(r, key, e, round)).sum()
}

/// The key ids: small keys from 0, sharded keys after them.
fn key_sizes(args: &LoadArgs) -> Vec<(u64, usize)> {
    (0..args.keys)
        .map(|k| (k, args.elems))
        .chain((0..args.sharded).map(|s| (args.keys + s, args.sharded_elems)))
        .collect()
}

/// One worker's whole job; rank 0 prints the round times.
pub fn run_worker(config: KvConfig, args: &LoadArgs) -> PerfResult<()> {
    // Two threads, and the checks in `block_in_place`: computing and checking millions of
    // values must not hold up the worker's heartbeats (the scheduler would declare it dead).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let kv = psnet::kv::join(&config).await.map_err(|e| e.to_string())?;
        let result = rounds(&kv, args).await;
        let rank = kv.rank();
        kv.finalize().await.map_err(|e| e.to_string())?;
        let (init_s, round_s) = result?;
        if rank == 0 && !args.json {
            println!(
                "init of {} keys: {:.2} s; rounds: {}",
                args.keys + args.sharded,
                init_s,
                round_s
                    .iter()
                    .map(|s| format!("{s:.2} s"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        Ok(())
    })
}

/// Init, then every round's push+pull of every key, each pulled value checked exactly.
async fn rounds(kv: &Worker, args: &LoadArgs) -> PerfResult<(f64, Vec<f64>)> {
    let err = |e: psnet::kv::KvError| e.to_string();
    let sizes = key_sizes(args);
    let keys: Vec<u64> = sizes.iter().map(|(k, _)| *k).collect();
    let started = Instant::now();
    let zeros: Vec<Vec<f32>> = sizes.iter().map(|(_, n)| vec![0.0; *n]).collect();
    let refs: Vec<&[f32]> = zeros.iter().map(|v| v.as_slice()).collect();
    kv.init(&keys, &refs).await.map_err(err)?;
    let init_s = started.elapsed().as_secs_f64();
    let (rank, workers) = (kv.rank(), kv.num_workers());
    let mut outs = zeros.clone();
    let mut times = Vec::new();
    for round in 0..args.rounds {
        let grads: Vec<Vec<f32>> = tokio::task::block_in_place(|| {
            sizes
                .iter()
                .map(|&(k, n)| (0..n).map(|e| grad(rank, k, e, round)).collect())
                .collect()
        });
        let refs: Vec<&[f32]> = grads.iter().map(|v| v.as_slice()).collect();
        let t = Instant::now();
        kv.pushpull_many(&keys, &refs, &mut outs)
            .await
            .map_err(err)?;
        times.push(t.elapsed().as_secs_f64());
        tokio::task::block_in_place(|| check(&sizes, &outs, workers, round))?;
    }
    Ok((init_s, times))
}

/// Every pulled value against its exact sum.
fn check(sizes: &[(u64, usize)], outs: &[Vec<f32>], workers: u32, round: u32) -> PerfResult<()> {
    for (&(k, _), out) in sizes.iter().zip(outs) {
        if let Some((e, got)) = out
            .iter()
            .enumerate()
            .find(|&(e, &v)| v != expected(workers, k, e, round))
        {
            return Err(format!(
                "round {round}: key {k} element {e} is {got}, expected {}",
                expected(workers, k, e, round)
            ));
        }
    }
    Ok(())
}

/// The peak resident memory of each process of the job, by role.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PeakRss {
    /// Role (`scheduler`, `server`, `worker`) and its processes' peaks in KiB.
    pub by_role: BTreeMap<String, Vec<u64>>,
}

/// Samples the peak RSS (`VmHWM`) of every descendant of this process until stopped.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    peaks: Arc<Mutex<BTreeMap<u32, (String, u64)>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    /// Starts sampling every `every`.
    pub fn start(every: Duration) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let peaks = Arc::new(Mutex::new(BTreeMap::new()));
        let thread = {
            let (stop, peaks) = (stop.clone(), peaks.clone());
            std::thread::spawn(move || {
                let me = std::process::id();
                while !stop.load(Ordering::Relaxed) {
                    for pid in descendants(me) {
                        let (Some(role), Some(kib)) = (role_of(pid), peak_kib(pid)) else {
                            continue;
                        };
                        let mut p = peaks.lock().unwrap_or_else(|e| e.into_inner());
                        let entry = p.entry(pid).or_insert((role, 0));
                        entry.1 = entry.1.max(kib);
                    }
                    std::thread::sleep(every);
                }
            })
        };
        Sampler {
            stop,
            peaks,
            thread: Some(thread),
        }
    }

    /// Stops and returns the peaks.
    pub fn finish(mut self) -> PeakRss {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let mut out = PeakRss::default();
        for (_, (role, kib)) in self.peaks.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            out.by_role.entry(role.clone()).or_default().push(*kib);
        }
        out
    }
}

/// Every process below `pid` (children, grandchildren, ...).
fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        let tasks = std::fs::read_dir(format!("/proc/{p}/task"))
            .into_iter()
            .flatten();
        for task in tasks.flatten() {
            let children =
                std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for c in children.split_whitespace().filter_map(|c| c.parse().ok()) {
                out.push(c);
                todo.push(c);
            }
        }
    }
    out
}

/// The process's kv role (`DMLC_ROLE` in its environment), if it has one.
fn role_of(pid: u32) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(b"DMLC_ROLE="))
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// `VmHWM` of the process, in KiB.
fn peak_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// The report of the launching process: each role's largest and median peak.
pub fn report(peaks: &PeakRss, args: &LoadArgs, wall_s: f64) -> String {
    let mut out = format!(
        "psnet kvload: {} servers, {} workers, {} keys of {} elements + {} sharded keys of {} elements, {} dist_sync rounds, every value checked: {:.1} s\n peak RSS per process (VmHWM, sampled every 50 ms):\n",
        args.servers, args.workers, args.keys, args.elems, args.sharded, args.sharded_elems, args.rounds, wall_s
    );
    for (role, kibs) in &peaks.by_role {
        let mut k = kibs.clone();
        k.sort_unstable();
        let mib = |v: u64| v as f64 / 1024.0;
        out.push_str(&format!(
            "  {role:<10} {:>3} processes  max {:>8.1} MiB  median {:>8.1} MiB\n",
            k.len(),
            mib(*k.last().unwrap_or(&0)),
            mib(k[k.len() / 2]),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_sums_are_exact_and_differ_by_key_element_and_round() {
        assert_eq!(expected(2, 0, 0, 0), grad(0, 0, 0, 0) + grad(1, 0, 0, 0));
        assert_eq!(
            expected(16, 6, 2, 9),
            16.0 * 7.0 * 17.0 / 2.0 + 16.0 * (2.0 + 9.0)
        );
        assert_ne!(expected(3, 1, 0, 0), expected(3, 2, 0, 0));
        assert_ne!(expected(3, 1, 0, 0), expected(3, 1, 0, 1));
    }

    #[test]
    fn a_child_process_is_sampled_by_role() {
        let sampler = Sampler::start(Duration::from_millis(10));
        let mut child = std::process::Command::new("sleep")
            .arg("0.3")
            .env("DMLC_ROLE", "server")
            .spawn()
            .unwrap();
        child.wait().unwrap();
        let peaks = sampler.finish();
        let servers = &peaks.by_role["server"];
        assert_eq!(servers.len(), 1);
        assert!(servers[0] > 0);
    }
}
