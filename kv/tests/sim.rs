//! Deterministic simulation: whole kv jobs (scheduler, servers and workers as tasks of one
//! process) on the in-memory network, in simulated time, over many seeds.
//!
//! Each seed draws a job (servers, workers, rounds, key sizes, message delays) and a
//! scenario: `dist_sync` plain, with 2-bit or 1-bit compression (pulls compressed too in
//! half of those seeds, and in a third of the restart seeds), `dist_async`, `PS_RESEND`
//! across connections reset at random, a node killed mid-run, a server frozen mid-run. Every
//! run checks what the real-process tests check: values bit-identical to the rank-ordered
//! reference, every push applied exactly once, a dead node named by every survivor within
//! the heartbeat timeout, and no hang (a job is given 10 simulated minutes).
//!
//! `PSNET_SIM_SEEDS=N` runs seeds 0..N (default 500); `PSNET_SIM_SEED=S` replays seed S
//! alone. The faults and the job come from the seed; the interleaving of tasks is tokio's
//! (current-thread, paused clock) and may differ between builds.

use std::sync::Arc;
use std::time::Duration;

use psnet_compression::{CompressionParams, Scheme};
use psnet_kv::proto::ids::{self, describe, Role, SCHEDULER};
use psnet_kv::proto::pulled::Shadow;
use psnet_kv::proto::worker::Layout;
use psnet_kv::updater::OptimizerSpec;
use psnet_kv::KvCompression;
use psnet_kv::{run_server, KvConfig, KvError, Mode, Scheduler, Worker};
use psnet_memnet::{Faults, MemNet, MemTransport};
use psnet_transport::auth::Secret;
use psnet_transport::NodeId;
use tokio::task::JoinHandle;
use tokio::time::Instant;

#[path = "sim/intruders.rs"]
mod intruders;
#[path = "sim/restart.rs"]
mod restart;

type SimWorker = Worker<MemTransport>;

const HEARTBEAT: Duration = Duration::from_secs(1);
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);
const JOB_LIMIT: Duration = Duration::from_secs(600);
/// Arrays from this many elements are sharded over every server.
const BIGARRAY_BOUND: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    Sync,
    TwoBit,
    OneBit,
    Async,
    ResendResets,
    Kill,
    Freeze,
    /// The scheduler stops mid-run (SIGSTOP): every worker and server must notice.
    SchedulerFreeze,
    /// A server is killed mid-run and restarted: it rejoins and the job ends as if it had
    /// never stopped (`dist_sync`; and `dist_async` below).
    Restart,
    RestartAsync,
}

const SCENARIOS: [Scenario; 10] = [
    Scenario::Sync,
    Scenario::TwoBit,
    Scenario::OneBit,
    Scenario::Async,
    Scenario::ResendResets,
    Scenario::Kill,
    Scenario::Freeze,
    Scenario::SchedulerFreeze,
    Scenario::Restart,
    Scenario::RestartAsync,
];

/// The job a seed draws.
#[derive(Clone, Debug)]
struct Plan {
    seed: u64,
    scenario: Scenario,
    servers: u32,
    workers: u32,
    rounds: u32,
    /// Element counts of the keys 0, 1, ...; the last is sharded over all servers.
    lens: Vec<usize>,
    max_delay: Duration,
    /// `PSNET_PARTITION_BYTES`: 0 (MXNet's layout) or pieces of 128 or 256 elements, so
    /// that the sharded key goes as several pieces spread over the servers.
    partition_bytes: usize,
    /// Compressed pulls (with 2-bit or 1-bit pushes).
    pull: bool,
    /// Packed codes (with compression), both ways.
    pack: bool,
}

impl Plan {
    fn draw(seed: u64) -> Plan {
        let mut rng = fastrand::Rng::with_seed(seed);
        let scenario = SCENARIOS[(seed % SCENARIOS.len() as u64) as usize];
        let min_workers = if scenario == Scenario::Kill { 2 } else { 1 };
        Plan {
            seed,
            scenario,
            servers: rng.u32(1..=3),
            workers: rng.u32(min_workers..=3),
            rounds: rng.u32(2..=5),
            lens: vec![rng.usize(1..BIGARRAY_BOUND), rng.usize(BIGARRAY_BOUND..600)],
            max_delay: Duration::from_micros(rng.u64(0..=3000)),
            partition_bytes: [0, 512, 1024][rng.usize(0..3)],
            pull: match scenario {
                Scenario::TwoBit | Scenario::OneBit => rng.bool(),
                Scenario::Restart => rng.u32(0..3) == 0,
                _ => false,
            },
            pack: rng.bool(),
        }
    }

    fn faults(&self) -> Faults {
        // At least 50 µs a message, so that rounds take simulated time and a fault struck
        // after some milliseconds lands mid-run.
        let f = Faults::seeded(self.seed).delay(Duration::from_micros(50), self.max_delay);
        match self.scenario {
            // After start-up, about one send in 40 resets its connection.
            Scenario::ResendResets => f.resets(0.025, 200),
            _ => f,
        }
    }

    /// Heartbeat period and timeout. Shorter when the scheduler stops: the workers go on
    /// with real rounds until they notice, and the simulation's cost is those rounds.
    fn heartbeat(&self) -> (Duration, Duration) {
        match self.scenario {
            Scenario::SchedulerFreeze => (HEARTBEAT / 5, HEARTBEAT_TIMEOUT / 5),
            _ => (HEARTBEAT, HEARTBEAT_TIMEOUT),
        }
    }

    /// `dist_async` rather than `dist_sync`.
    fn is_async(&self) -> bool {
        matches!(self.scenario, Scenario::Async | Scenario::RestartAsync)
    }

    fn compression(&self) -> Option<KvCompression> {
        let params = match self.scenario {
            Scenario::TwoBit => CompressionParams::two_bit(0.5).unwrap(),
            Scenario::OneBit => CompressionParams::one_bit(0.0).unwrap(),
            Scenario::Restart if self.pull => CompressionParams::two_bit(0.5).unwrap(),
            _ => return None,
        };
        Some(KvCompression {
            params,
            pull: self.pull,
            pack: self.pack,
        })
    }

    fn config(&self, role: Role, root: std::net::SocketAddr) -> KvConfig {
        let resend = (self.scenario == Scenario::ResendResets).then(|| Duration::from_millis(50));
        KvConfig::local(role, root, self.servers, self.workers)
            .heartbeats(Some(self.heartbeat().0), Some(self.heartbeat().1))
            .bigarray_bound(BIGARRAY_BOUND)
            .partition_bytes(self.partition_bytes)
            .bootstrap_timeout(Duration::from_secs(60))
            .resend(resend)
    }
}

/// A worker's gradient for `key` in `round`: multiples of 1/64 in [-2, 2), or small integers
/// where the order of application varies (dist_async) so that any order sums exactly.
fn grad(plan: &Plan, rank: u32, round: u32, key: usize) -> Vec<f32> {
    let mut rng = fastrand::Rng::with_seed(
        plan.seed ^ (u64::from(rank) << 48) ^ (u64::from(round) << 32) ^ key as u64,
    );
    (0..plan.lens[key])
        .map(|_| match plan.is_async() {
            true => rng.i32(-4..=4) as f32,
            false => rng.i32(-128..128) as f32 / 64.0,
        })
        .collect()
}

fn initial(plan: &Plan, key: usize) -> Vec<f32> {
    (0..plan.lens[key]).map(|i| (i % 7) as f32 - 3.0).collect()
}

/// What the job must end with: the test optimizer (`w += sum`) applied to every round's
/// rank-ordered sum of what the workers sent (decoded, with each worker's error feedback, as
/// the servers see it under compression).
fn reference(plan: &Plan) -> Vec<Vec<Vec<f32>>> {
    let compressor = plan
        .compression()
        .and_then(|p| p.params.compressor().unwrap())
        .map(Arc::<dyn psnet_compression::Compressor>::from);
    let mut residuals: Vec<Vec<Vec<f32>>> = (0..plan.workers)
        .map(|_| plan.lens.iter().map(|&n| vec![0.0; n]).collect())
        .collect();
    let mut w: Vec<Vec<f32>> = (0..plan.lens.len()).map(|k| initial(plan, k)).collect();
    let mut after_round = Vec::new();
    for round in 0..plan.rounds {
        for (key, wk) in w.iter_mut().enumerate() {
            let mut sum: Vec<f32> = Vec::new();
            for rank in 0..plan.workers {
                let g = grad(plan, rank, round, key);
                let sent = match &compressor {
                    None => g,
                    Some(c) => {
                        let mut codes = vec![0u8; c.compressed_len(g.len())];
                        let r = &mut residuals[rank as usize][key];
                        c.quantize(&g, r, &mut codes).unwrap();
                        let mut decoded = vec![0.0; g.len()];
                        c.dequantize(&codes, &mut decoded).unwrap();
                        decoded
                    }
                };
                if rank == 0 {
                    sum = sent;
                } else {
                    sum.iter_mut().zip(&sent).for_each(|(s, v)| *s += v);
                }
            }
            wk.iter_mut().zip(&sum).for_each(|(w, s)| *w += s);
        }
        after_round.push(w.clone());
    }
    after_round
}

struct Job {
    net: MemNet,
    /// Where the scheduler listens.
    root: std::net::SocketAddr,
    scheduler: JoinHandle<Result<(), KvError>>,
    servers: Vec<JoinHandle<Result<(), KvError>>>,
    workers: Vec<SimWorker>,
}

async fn start(plan: &Plan) -> Result<Job, String> {
    start_with(plan, MemNet::with_faults(plan.faults()), None, Plan::config).await
}

/// Starts `plan`'s job on `net`, every node holding `secret` and configured by `config`
/// (the plan's role, the scheduler's address).
async fn start_with(
    plan: &Plan,
    net: MemNet,
    secret: Option<Secret>,
    config: impl Fn(&Plan, Role, std::net::SocketAddr) -> KvConfig,
) -> Result<Job, String> {
    let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    let bind = |id| net.bind_with_secret(id, secret.clone());
    let scheduler = Scheduler::new(&config(plan, Role::Scheduler, any), bind(SCHEDULER));
    let root = scheduler.addr();
    let scheduler = tokio::spawn(scheduler.run());
    let servers = (0..plan.servers)
        .map(|_| {
            let (c, t) = (config(plan, Role::Server, root), bind(NodeId(0)));
            tokio::spawn(async move { run_server(&c, t).await })
        })
        .collect();
    let joins: Vec<_> = (0..plan.workers)
        .map(|_| {
            let (c, t) = (config(plan, Role::Worker, root), bind(NodeId(0)));
            tokio::spawn(async move { SimWorker::join(&c, t).await })
        })
        .collect();
    let mut workers = Vec::new();
    for j in joins {
        workers.push(j.await.unwrap().map_err(|e| format!("join: {e}"))?);
    }
    workers.sort_by_key(|w| w.rank());
    Ok(Job {
        net,
        root,
        scheduler,
        servers,
        workers,
    })
}

/// One worker's part: set-up, init, then every round's pushpull of every key; returns the
/// values it pulled after each round.
async fn work(plan: Arc<Plan>, w: Arc<SimWorker>) -> Result<Vec<Vec<Vec<f32>>>, KvError> {
    if let Some(c) = plan.compression() {
        w.set_gradient_compression(c).await?;
    }
    if plan.is_async() {
        w.set_mode(Mode::Async).await?;
    }
    w.set_optimizer(&OptimizerSpec::parse(r#"{"type":"test","rescale_grad":1.0}"#).unwrap())
        .await?;
    let keys: Vec<u64> = (0..plan.lens.len() as u64).collect();
    let inits: Vec<Vec<f32>> = (0..plan.lens.len()).map(|k| initial(&plan, k)).collect();
    let refs: Vec<&[f32]> = inits.iter().map(|v| v.as_slice()).collect();
    w.init(&keys, &refs).await?;
    let mut pulled = Vec::new();
    for round in 0..plan.rounds {
        let mut now = Vec::new();
        for key in 0..plan.lens.len() {
            let g = grad(&plan, w.rank(), round, key);
            let mut out = vec![0.0; g.len()];
            if plan.is_async() {
                w.push(key as u64, &g).await?;
            } else {
                w.pushpull(key as u64, &g, &mut out).await?;
            }
            now.push(out);
        }
        pulled.push(now);
    }
    if plan.is_async() {
        w.barrier().await?;
        let mut last = Vec::new();
        for (key, &n) in plan.lens.iter().enumerate() {
            let mut out = vec![0.0; n];
            w.pull(key as u64, &mut out).await?;
            last.push(out);
        }
        pulled.push(last);
    }
    Ok(pulled)
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Runs a job to its end and checks its results.
async fn healthy_job(plan: Arc<Plan>) -> Result<(), String> {
    let job = start(&plan).await?;
    finish_healthy(plan, job).await
}

/// With compressed pulls, what the workers pull after each round instead of the servers'
/// values (`master`, the reference): each stored part's copy, advanced by that round's
/// codes of its change, as `layouts` (each key's) place the parts.
fn pulled_copies(
    scheme: Scheme,
    master: &[Vec<Vec<f32>>],
    layouts: &[Layout],
    plan: &Plan,
) -> Vec<Vec<Vec<f32>>> {
    let mut shadows: Vec<Vec<Shadow>> = layouts
        .iter()
        .enumerate()
        .map(|(key, l)| {
            let init = initial(plan, key);
            l.parts
                .iter()
                .map(|p| Shadow::new(&init[p.offset..p.offset + p.len], 0))
                .collect()
        })
        .collect();
    master
        .iter()
        .map(|round| {
            round
                .iter()
                .enumerate()
                .map(|(key, w)| {
                    let mut copy = vec![0.0; w.len()];
                    for (p, s) in layouts[key].parts.iter().zip(&mut shadows[key]) {
                        let range = p.offset..p.offset + p.len;
                        s.advance(scheme, &w[range.clone()]);
                        copy[range].copy_from_slice(&s.copy);
                    }
                    copy
                })
                .collect()
        })
        .collect()
}

/// Runs a started job to its end and checks its results.
async fn finish_healthy(plan: Arc<Plan>, job: Job) -> Result<(), String> {
    let mut expected = reference(&plan);
    let pull_scheme = plan.compression().and_then(|c| c.pull_scheme());
    let tasks: Vec<_> = job
        .workers
        .into_iter()
        .map(|w| {
            let (plan, w) = (plan.clone(), Arc::new(w));
            tokio::spawn(async move {
                let r = work(plan, w.clone()).await;
                (w, r)
            })
        })
        .collect();
    let mut finals = Vec::new();
    for t in tasks {
        let (w, r) = t.await.unwrap();
        let rank = w.rank();
        let pulled = r.map_err(|e| format!("worker {rank}: {e}"))?;
        if let (Some(scheme), true) = (pull_scheme, finals.is_empty()) {
            let layouts: Vec<Layout> = (0..plan.lens.len() as u64)
                .map(|k| w.layout(k).expect("initialized"))
                .collect();
            expected = pulled_copies(scheme, &expected, &layouts, &plan);
        }
        if plan.is_async() {
            // Every push applied exactly once, in whatever order: integers sum exactly.
            let last = expected.last().unwrap();
            for (key, got) in pulled.last().unwrap().iter().enumerate() {
                if !same_bits(got, &last[key]) {
                    return Err(format!(
                        "worker {rank} key {key}: {got:?}, expected {:?}",
                        last[key]
                    ));
                }
            }
        } else {
            for (round, keys) in pulled.iter().enumerate() {
                for (key, got) in keys.iter().enumerate() {
                    if !same_bits(got, &expected[round][key]) {
                        return Err(format!(
                            "worker {rank} round {round} key {key}: {got:?}, expected {:?}",
                            expected[round][key]
                        ));
                    }
                }
            }
        }
        finals.push(Arc::try_unwrap(w).unwrap_or_else(|_| panic!("worker still shared")));
    }
    // Each finalize waits for the job's end, which needs every worker's: all at once.
    let finals: Vec<_> = finals
        .into_iter()
        .map(|w| tokio::spawn(w.finalize()))
        .collect();
    for f in finals {
        f.await.unwrap().map_err(|e| format!("finalize: {e}"))?;
    }
    for s in job.servers {
        s.await.unwrap().map_err(|e| format!("server: {e}"))?;
    }
    job.scheduler
        .await
        .unwrap()
        .map_err(|e| format!("scheduler: {e}"))
}

/// Kills or freezes one node mid-run: every surviving worker must fail, naming it, within
/// the heartbeat timeout, and the scheduler must report it.
async fn failing_job(plan: Arc<Plan>) -> Result<(), String> {
    let mut rng = fastrand::Rng::with_seed(plan.seed.rotate_left(17));
    let job = start(&plan).await?;
    let victim = match plan.scenario {
        Scenario::Kill if rng.bool() => ids::node_id(Role::Worker, rng.u32(0..plan.workers)),
        Scenario::SchedulerFreeze => SCHEDULER,
        _ => ids::node_id(Role::Server, rng.u32(0..plan.servers)),
    };
    // Many rounds, so that the fault lands while the job runs.
    let long = Arc::new(Plan {
        rounds: 10_000,
        ..(*plan).clone()
    });
    let struck = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let net = job.net.clone();
    let strike = {
        let (struck, scenario) = (struck.clone(), plan.scenario);
        let after = Duration::from_millis(rng.u64(1..100));
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let live = match scenario {
                Scenario::Freeze | Scenario::SchedulerFreeze => net.freeze(victim, true),
                _ => net.kill(victim),
            };
            *struck.lock().unwrap() = Some(Instant::now());
            live
        })
    };
    // Every worker runs (a victim too, until it is struck); survivors are checked.
    let tasks: Vec<_> = job
        .workers
        .into_iter()
        .map(|w| {
            let (plan, w) = (long.clone(), Arc::new(w));
            tokio::spawn(async move {
                let r = work(plan, w.clone()).await;
                // The worker is returned, not dropped: a survivor that gave up must not
                // look like a second failure to the others.
                (w.rank(), r.map(|_| ()), Instant::now(), w)
            })
        })
        .collect();
    let live = strike.await.unwrap();
    let at = struck.lock().unwrap().expect("struck");
    let name = describe(victim);
    if !live {
        let mut errors = Vec::new();
        for t in tasks {
            let (rank, r, _, _) = t.await.unwrap();
            errors.push(format!("worker {rank}: {r:?}"));
        }
        return Err(format!("{name} was gone before the strike: {errors:?}"));
    }
    // Declared dead after the heartbeat timeout, told at the scheduler's next tick.
    let (heartbeat, heartbeat_timeout) = plan.heartbeat();
    let bound = heartbeat_timeout + heartbeat * 2;
    let mut held = Vec::new();
    for t in tasks {
        let Ok(joined) = tokio::time::timeout_at(at + bound * 4, t).await else {
            return Err(format!(
                "a worker neither finished nor failed within {:?} of {name}'s failure",
                bound * 4
            ));
        };
        let (rank, r, when, w) = joined.unwrap();
        held.push(w);
        if ids::node_id(Role::Worker, rank) == victim {
            continue;
        }
        let err = match r {
            Ok(()) => {
                return Err(format!(
                    "worker {rank} finished 10000 rounds without {name}"
                ))
            }
            Err(e) => e.to_string(),
        };
        if !err.contains(&name) && !err.contains("shutting down") {
            return Err(format!("worker {rank}'s error does not name {name}: {err}"));
        }
        if when.duration_since(at) > bound {
            return Err(format!(
                "worker {rank} noticed {name} after {:?} (bound {bound:?})",
                when.duration_since(at)
            ));
        }
    }
    drop(held);
    if victim == SCHEDULER {
        // Every server gives up on the stopped scheduler too, naming it, in time.
        for (rank, s) in job.servers.into_iter().enumerate() {
            let Ok(r) = tokio::time::timeout_at(at + bound, s).await else {
                return Err(format!(
                    "server {rank} did not notice {name} within {bound:?}"
                ));
            };
            match r.unwrap() {
                Err(e) if e.to_string().contains(&name) => {}
                other => {
                    return Err(format!(
                        "server {rank} ended with {other:?}, not naming {name}"
                    ))
                }
            }
        }
        job.scheduler.abort();
        return Ok(());
    }
    // The survivors exit (as their processes would after the error); then the scheduler
    // ends the job and reports the victim.
    let Ok(sched) = tokio::time::timeout(bound * 4, job.scheduler).await else {
        return Err(format!("the scheduler did not end after {name}'s failure"));
    };
    let sched = sched.unwrap();
    match sched {
        Err(e) if e.to_string().contains(&name) => {}
        other => return Err(format!("the scheduler did not report {name}: {other:?}")),
    }
    // Every other server ends too, and not as if the job had gone well: its error names the
    // victim (its process exits non-zero).
    for (rank, s) in job.servers.into_iter().enumerate() {
        if ids::node_id(Role::Server, rank as u32) == victim {
            s.abort();
            continue;
        }
        let Ok(r) = tokio::time::timeout(bound * 4, s).await else {
            return Err(format!("server {rank} did not end after {name}'s failure"));
        };
        match r.unwrap() {
            Err(e)
                if e.to_string().contains(&name) && e.exit_code() == psnet_kv::EXIT_PEER_FAILED => {
            }
            other => {
                return Err(format!(
                    "server {rank} ended with {other:?} after {name}'s failure"
                ))
            }
        }
    }
    Ok(())
}

/// One process's runtime on a simulated clock: time jumps ahead whenever every task waits.
fn simulated_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
}

fn run_seed(seed: u64) -> Result<Plan, (Plan, String)> {
    let plan = Plan::draw(seed);
    let rt = simulated_runtime();
    let p = Arc::new(plan.clone());
    let outcome = rt.block_on(async move {
        let job = async {
            match p.scenario {
                Scenario::Kill | Scenario::Freeze | Scenario::SchedulerFreeze => {
                    failing_job(p.clone()).await
                }
                Scenario::Restart | Scenario::RestartAsync => {
                    restart::restarted_server_job(p.clone()).await
                }
                _ => healthy_job(p.clone()).await,
            }
        };
        tokio::time::timeout(JOB_LIMIT, job)
            .await
            .unwrap_or_else(|_| Err(format!("hung for {JOB_LIMIT:?} of simulated time")))
    });
    // Tasks still running (servers of a failed job) are dropped with the runtime.
    drop(rt);
    match outcome {
        Ok(()) => Ok(plan),
        Err(e) => Err((plan, e)),
    }
}

fn env_u64(name: &'static str) -> Option<u64> {
    let raw = psnet_config::env::harness_var(name)?;
    Some(
        raw.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={raw:?} is not a number")),
    )
}

#[test]
fn whole_jobs_over_many_seeds() {
    psnet_config::logging::init();
    let seeds: Vec<u64> = match env_u64("PSNET_SIM_SEED") {
        Some(one) => vec![one],
        None => (0..env_u64("PSNET_SIM_SEEDS").unwrap_or(500)).collect(),
    };
    let started = std::time::Instant::now();
    let mut failed = Vec::new();
    let mut per_scenario = std::collections::BTreeMap::new();
    for &seed in &seeds {
        match run_seed(seed) {
            Ok(plan) => {
                *per_scenario
                    .entry(format!("{:?}", plan.scenario))
                    .or_insert(0) += 1
            }
            Err((plan, why)) => {
                eprintln!("seed {seed} FAILED ({plan:?}): {why}");
                failed.push(seed);
            }
        }
    }
    eprintln!(
        "simulation: {} seeds in {:.1?}, passed per scenario: {per_scenario:?}",
        seeds.len(),
        started.elapsed()
    );
    assert!(
        failed.is_empty(),
        "{} of {} seeds failed: {failed:?}; replay one with PSNET_SIM_SEED=<seed> \
         cargo test -p psnet-kv --test sim",
        failed.len(),
        seeds.len()
    );
}

#[test]
fn the_reference_sums_in_rank_order() {
    // Guards the checker itself: a plan's reference differs from a sum in another order
    // for values where float addition is not associative.
    let plan = Plan {
        seed: 1,
        scenario: Scenario::Sync,
        servers: 1,
        workers: 3,
        rounds: 1,
        lens: vec![1],
        max_delay: Duration::ZERO,
        partition_bytes: 0,
        pull: false,
        pack: false,
    };
    let r = reference(&plan);
    let g: Vec<f32> = (0..3).map(|rank| grad(&plan, rank, 0, 0)[0]).collect();
    let w0 = initial(&plan, 0)[0];
    assert_eq!(
        r[0][0][0].to_bits(),
        (w0 + ((g[0] + g[1]) + g[2])).to_bits()
    );
}
