//! Intruders against whole jobs in simulated time: processes that were never issued a token
//! claiming members' ids, and, in a job with a shared secret, processes without it racing
//! the members to register.

use psnet_kv::proto::ids::Group;
use psnet_kv::proto::msg::Msg;
use psnet_transport::{OutMessage, Transport};

use super::*;

/// Nodes that joined no job try every address of the network under ids they were never
/// issued a token for: an id nobody was assigned, the live ids of the scheduler, a server and
/// a worker, and a provisional id. Every attempt must be refused by the transport's admission
/// (no connection is swapped for a live one), and, all through the job, a rogue keeps trying
/// to deliver what only the scheduler or an asked server may send.
async fn intruded_job(plan: Arc<Plan>) -> Result<(), String> {
    let job = start(&plan).await?;
    let ports = 10_000..10_000 + 1 + plan.servers as u16 + plan.workers as u16;
    let claims = [
        NodeId(99),
        SCHEDULER,
        ids::node_id(Role::Server, 0),
        ids::node_id(Role::Worker, 0),
        ids::provisional_id("127.0.0.1:1".parse().unwrap()),
    ];
    let mut refused = std::collections::BTreeSet::new();
    for claim in claims {
        let rogue = job.net.bind(claim);
        for port in ports.clone() {
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            for target in 0..plan.servers.max(plan.workers) {
                for id in [
                    SCHEDULER,
                    ids::node_id(Role::Server, target),
                    ids::node_id(Role::Worker, target),
                ] {
                    match rogue.connect(id, addr).await {
                        Ok(()) => {
                            return Err(format!("{claim} was let in by {id} at {addr}"));
                        }
                        Err(e) => {
                            let e = e.to_string();
                            let admission = [
                                "never assigned",
                                "without the proof of its id",
                                "registrations",
                            ];
                            if admission.iter().any(|r| e.contains(r)) {
                                refused.insert((claim, port));
                            }
                        }
                    }
                }
            }
        }
    }
    // Every (claim, listener) pair is refused by admission: registrations closed once the
    // job was assigned.
    let listeners = (1 + plan.servers + plan.workers) as usize;
    if refused.len() != claims.len() * listeners {
        return Err(format!(
            "{} (claim, listener) pairs refused by admission, expected {}",
            refused.len(),
            claims.len() * listeners
        ));
    }
    let rogue = job.net.bind(NodeId(99));
    let targets: Vec<(NodeId, std::net::SocketAddr)> = job
        .workers
        .iter()
        .map(|w| {
            let id = ids::node_id(Role::Worker, w.rank());
            (id, w.debug_transport().listen_addr())
        })
        .collect();
    let victim = ids::node_id(Role::Server, 0);
    let attack = tokio::spawn(async move {
        let forged = |ts: u64| {
            vec![
                Msg::Shutdown,
                Msg::NodeFailed {
                    id: victim,
                    reason: "forged".into(),
                },
                Msg::BarrierDone {
                    group: Group::WORKERS,
                },
                Msg::Done { ts },
            ]
        };
        for ts in 1..300u64 {
            for (id, addr) in &targets {
                if rogue.connect(*id, *addr).await.is_ok() {
                    for msg in forged(ts) {
                        let meta = msg.encode();
                        let _ = rogue.send(*id, OutMessage::new(&meta, &[])).await;
                    }
                }
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    });
    let result = finish_healthy(plan, job).await;
    attack.abort();
    result
}

/// Runs `job` on `seeds` drawn dist_sync plans in simulated time; every one must end healthy.
fn sync_jobs_over_seeds<F, Fut>(seeds: u64, job: F, what: &str)
where
    F: Fn(Arc<Plan>) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    psnet_config::logging::init();
    let mut failed = Vec::new();
    for seed in 0..seeds {
        let plan = Arc::new(Plan {
            scenario: Scenario::Sync,
            ..Plan::draw(seed * SCENARIOS.len() as u64)
        });
        let rt = simulated_runtime();
        let outcome = rt.block_on(async {
            tokio::time::timeout(JOB_LIMIT, job(plan.clone()))
                .await
                .unwrap_or_else(|_| Err("hung".into()))
        });
        if let Err(e) = outcome {
            eprintln!("seed {seed} ({plan:?}): {e}");
            failed.push(seed);
        }
    }
    assert!(failed.is_empty(), "{what} failed: {failed:?}");
}

#[test]
fn an_intruder_is_refused_under_any_claimed_id_and_the_job_ends_healthy() {
    sync_jobs_over_seeds(40, intruded_job, "intruded jobs");
}

/// What a squatter got from the scheduler: a place in the job, or the refusal's text.
async fn squat(
    plan: &Plan,
    net: &MemNet,
    root: std::net::SocketAddr,
    secret: Option<Secret>,
) -> Result<u32, String> {
    let t = net.bind_with_secret(NodeId(0), secret);
    SimWorker::join(&plan.config(Role::Worker, root), t)
        .await
        .map(|w| w.rank())
        .map_err(|e| e.to_string())
}

/// A job whose nodes share a secret; before any member registers, squatters without it and
/// with a wrong one race to take worker slots at the scheduler. Each must be refused naming
/// the secret, and the job must end with the right weights.
async fn squatted_job(plan: Arc<Plan>) -> Result<(), String> {
    let net = MemNet::with_faults(plan.faults());
    let secret = Secret::new(format!("job {}", plan.seed)).unwrap();
    // The scheduler listens at the network's first port: the squatters know where to go.
    let root = std::net::SocketAddr::from(([127, 0, 0, 1], 10_000));
    let squatters: Vec<_> = [None, Some(Secret::new("a guess").unwrap())]
        .into_iter()
        .map(|s| {
            let (plan, net) = (plan.clone(), net.clone());
            tokio::spawn(async move { squat(&plan, &net, root, s).await })
        })
        .collect();
    let job = start_with(&plan, net, Some(secret), Plan::config).await?;
    for s in squatters {
        match s.await.unwrap() {
            Ok(rank) => return Err(format!("a squatter took worker rank {rank}")),
            Err(e) if e.contains("secret") => {}
            Err(e) => return Err(format!("a squatter failed, but not on the secret: {e}")),
        }
    }
    finish_healthy(plan, job).await
}

#[test]
fn with_a_secret_squatters_cannot_take_a_slot_and_the_job_ends_healthy() {
    sync_jobs_over_seeds(20, squatted_job, "squatted jobs");
}

/// The hole the secret closes: in an open job, a squatter that registers first is given a
/// worker's place (it is then a member, with a token).
#[test]
fn without_a_secret_a_squatter_that_registers_first_takes_a_slot() {
    let plan = Plan {
        scenario: Scenario::Sync,
        workers: 2,
        ..Plan::draw(0)
    };
    let rt = simulated_runtime();
    let taken = rt.block_on(async move {
        let net = MemNet::reliable();
        let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
        let scheduler = Scheduler::new(&plan.config(Role::Scheduler, any), net.bind(SCHEDULER));
        let root = scheduler.addr();
        let _scheduler = tokio::spawn(scheduler.run());
        let _servers: Vec<_> = (0..plan.servers)
            .map(|_| {
                let (c, t) = (plan.config(Role::Server, root), net.bind(NodeId(0)));
                tokio::spawn(async move { run_server(&c, t).await })
            })
            .collect();
        let squatter = {
            let (plan, net) = (plan.clone(), net.clone());
            tokio::spawn(async move { squat(&plan, &net, root, None).await })
        };
        let honest = {
            let (c, t) = (plan.config(Role::Worker, root), net.bind(NodeId(0)));
            tokio::spawn(async move { SimWorker::join(&c, t).await })
        };
        let taken = tokio::time::timeout(JOB_LIMIT, squatter).await;
        honest.abort();
        taken
    });
    let rank = taken
        .expect("no hang")
        .unwrap()
        .expect("the squatter is let in");
    assert!(rank < 2);
}
