//! A server killed mid-run and restarted under its rank: it reloads its shard from its
//! checkpoint, the scheduler gives it its id back, the workers send again what it had not
//! answered, and the job ends with the values of a job that never lost it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use psnet_kv::proto::ids::{self, describe, Role};
use psnet_kv::{run_server, KvConfig, KvError};
use psnet_memnet::MemNet;
use psnet_transport::NodeId;
use tokio::time::Instant;

use super::{finish_healthy, start_with, Plan};

/// How long the scheduler holds a lost server's rank.
pub const RECOVERY: Duration = Duration::from_secs(30);

/// This seed's checkpoint directory (removed when dropped).
pub struct CheckpointDir(pub PathBuf);

impl CheckpointDir {
    pub fn new(seed: u64) -> Self {
        let dir =
            std::env::temp_dir().join(format!("psnet-sim-restart-{}-{seed}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        CheckpointDir(dir)
    }
}

impl Drop for CheckpointDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A node's configuration in a job whose servers checkpoint to `dir` every `every` updates
/// of a key, and may be restarted.
pub fn config(
    plan: &Plan,
    role: Role,
    root: std::net::SocketAddr,
    dir: &CheckpointDir,
) -> KvConfig {
    let every = plan.seed % 4;
    // Some seeds with PS_RESEND: the link forgets the old process's sequence numbers.
    let resend = ((plan.seed / 10) % 3 == 1).then(|| Duration::from_millis(50));
    plan.config(role, root)
        .resend(resend)
        .checkpoint_dir(Some(dir.0.clone()))
        .checkpoint_every(every)
        .recovery_timeout(Some(RECOVERY))
}

/// Runs the plan's rounds while one server is killed after a few milliseconds and started
/// again (with `DMLC_SERVER_ID` = its rank) after up to two seconds: every worker's values,
/// after every round, must be the reference's, bit for bit; every push applied once.
pub async fn restarted_server_job(plan: Arc<Plan>) -> Result<(), String> {
    let mut rng = fastrand::Rng::with_seed(plan.seed.rotate_left(29));
    // Enough rounds that the kill lands while the job runs (a push-pull takes about two
    // message delays).
    let plan = Arc::new(Plan {
        rounds: 30,
        ..(*plan).clone()
    });
    let dir = Arc::new(CheckpointDir::new(plan.seed));
    let net = MemNet::with_faults(plan.faults());
    let mut job = {
        let dir = dir.clone();
        start_with(&plan, net, None, move |p, role, root| {
            config(p, role, root, &dir)
        })
        .await?
    };
    let rank = rng.u32(0..plan.servers);
    let victim = ids::node_id(Role::Server, rank);
    let kill_after = plan.max_delay.max(Duration::from_micros(100)) * rng.u32(1..40);
    let restart_after = Duration::from_millis(rng.u64(0..2000));
    let net = job.net.clone();
    let root = job.root;
    let restarted = {
        let (plan, dir) = (plan.clone(), dir.clone());
        tokio::spawn(async move {
            tokio::time::sleep(kill_after).await;
            if !net.kill(victim) {
                panic!("server {rank} was gone before the kill");
            }
            let killed = tokio::time::Instant::now();
            if never_restarted(&plan) {
                return Err(killed);
            }
            tokio::time::sleep(restart_after).await;
            if with_impostor(&plan) {
                impostor(&plan, &net, root, rank).await;
            }
            let mut c = config(&plan, Role::Server, root, &dir);
            c.rank_hint = Some(rank);
            let t = net.bind(NodeId(0));
            Ok(tokio::spawn(async move { run_server(&c, t).await }))
        })
    };
    // The killed server's task ends with its transport; the others run to the job's end.
    let old = std::mem::take(&mut job.servers);
    let finished = {
        let plan = plan.clone();
        tokio::spawn(async move { finish_healthy(plan, job).await })
    };
    if never_restarted(&plan) {
        return unrecovered(plan, finished, restarted, victim).await;
    }
    let again = restarted.await.unwrap().expect("restarted");
    let mut killed = 0;
    for s in old {
        if s.await.unwrap().is_err() {
            killed += 1;
        }
    }
    finished.await.unwrap()?;
    again
        .await
        .unwrap()
        .map_err(|e| format!("the restarted server: {e}"))?;
    if killed != 1 {
        return Err(format!(
            "{killed} servers ended in error, expected the killed one"
        ));
    }
    Ok(())
}

/// One seed in three: before the real server is restarted, a server of another checkpoint
/// directory (a stranger, or a member holding the job's secret) registers wishing the lost
/// rank.
fn with_impostor(plan: &Plan) -> bool {
    (plan.seed / 7) % 3 == 0
}

/// A server over a checkpoint directory of its own asks for `rank` while the job holds it:
/// the scheduler must refuse it for want of the lost server's recovery credential, whether
/// its directory has none or another's.
async fn impostor(plan: &Plan, net: &MemNet, root: std::net::SocketAddr, rank: u32) {
    let other = CheckpointDir::new(plan.seed ^ 0x5eed_0000);
    std::fs::create_dir_all(&other.0).unwrap();
    if plan.seed % 2 == 0 {
        let forged = [0x42; psnet_kv::proto::recovery::CREDENTIAL_LEN];
        psnet_kv::checkpoint::write_credential(&other.0, rank, &forged).unwrap();
    }
    let mut c = config(plan, Role::Server, root, &other);
    c.rank_hint = Some(rank);
    match run_server(&c, net.bind(NodeId(0))).await {
        Err(e) if e.to_string().contains("recovery credential") => {}
        other => panic!("an impostor for server {rank} was not refused: {other:?}"),
    }
}

/// One seed in five never restarts the server: the job must fail, every worker naming it,
/// once the recovery timeout has passed, and not much later.
fn never_restarted(plan: &Plan) -> bool {
    (plan.seed / 10) % 5 == 0
}

async fn unrecovered(
    plan: Arc<Plan>,
    finished: tokio::task::JoinHandle<Result<(), String>>,
    restarted: tokio::task::JoinHandle<
        Result<tokio::task::JoinHandle<Result<(), KvError>>, Instant>,
    >,
    victim: NodeId,
) -> Result<(), String> {
    let Err(killed) = restarted.await.unwrap() else {
        return Err("restarted a server that was to stay dead".into());
    };
    let err = match finished.await.unwrap() {
        Ok(()) => return Err(format!("{} rounds finished without a server", plan.rounds)),
        Err(e) => e,
    };
    let after = killed.elapsed();
    let name = describe(victim);
    if !err.contains(&name) || !err.contains("PSNET_RECOVERY_TIMEOUT") {
        return Err(format!(
            "the error does not name {name} and the timeout: {err}"
        ));
    }
    let bound = RECOVERY + plan.heartbeat().0 * 3;
    if after < RECOVERY || after > bound {
        return Err(format!(
            "failed {after:?} after the kill, expected {RECOVERY:?}..{bound:?}"
        ));
    }
    Ok(())
}
