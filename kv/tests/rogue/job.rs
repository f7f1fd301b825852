//! A live job over 127.0.0.1 with one misbehaving member: a scheduler, one server, an honest
//! worker (rank 0, a real [`psnet_kv::Worker`]) and a [`Rogue`] (rank 1).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_kv::{run_server, KvConfig, KvError, Role, Scheduler};
use psnet_transport::NodeId;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::{Rogue, PATIENCE};

/// The honest worker.
pub type Honest = psnet_kv::Worker<TcpTransport>;

/// How the job is set up.
pub struct Setup {
    /// Every node's kv configuration is passed through this.
    pub kv: fn(KvConfig) -> KvConfig,
    /// The server's transport settings (its listener's limits).
    pub server: TcpConfig,
    /// The rogue's transport settings.
    pub rogue: TcpConfig,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            kv: |c| c,
            server: loopback(),
            rogue: loopback(),
        }
    }
}

/// Transport settings on 127.0.0.1, any free port.
pub fn loopback() -> TcpConfig {
    TcpConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)))
}

/// A running job.
pub struct Job {
    /// Worker 0.
    pub honest: Arc<Honest>,
    /// Worker 1.
    pub rogue: Rogue,
    server: JoinHandle<Result<(), KvError>>,
    scheduler: JoinHandle<Result<(), KvError>>,
}

impl Job {
    /// Starts the job and waits until every node has joined.
    pub async fn start(setup: Setup) -> Job {
        psnet_config::logging::init();
        let config = |role, root| {
            (setup.kv)(
                KvConfig::local(role, root, 1, 2)
                    .bootstrap_timeout(PATIENCE)
                    .heartbeats(None, None),
            )
        };
        let bind = |c: TcpConfig| async move {
            TcpTransport::bind(NodeId(0), c)
                .await
                .expect("bind 127.0.0.1")
        };
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let sched = Scheduler::new(&config(Role::Scheduler, any), bind(loopback()).await);
        let root = sched.addr();
        let scheduler = tokio::spawn(sched.run());
        let server = {
            let c = config(Role::Server, root);
            let t = bind(setup.server).await;
            tokio::spawn(async move { run_server(&c, t).await })
        };
        let honest = {
            let mut c = config(Role::Worker, root);
            c.rank_hint = Some(0);
            let t = bind(loopback()).await;
            tokio::spawn(async move { Honest::join(&c, t).await })
        };
        let resend = config(Role::Worker, root).resend.is_some();
        let rogue = Rogue::join(root, 1, setup.rogue, resend).await;
        let honest = tokio::time::timeout(PATIENCE, honest)
            .await
            .expect("the honest worker joins in time")
            .unwrap()
            .expect("the honest worker joins");
        assert_eq!(honest.rank(), 0);
        Job {
            honest: Arc::new(honest),
            rogue,
            server,
            scheduler,
        }
    }

    /// The server's id.
    pub fn server(&self) -> NodeId {
        self.rogue.servers()[0]
    }

    /// Whether the server is still running (it has not returned, or panicked).
    pub fn server_running(&self) -> bool {
        !self.server.is_finished()
    }

    /// Both workers leave; the server and the scheduler must end cleanly (a panic in the
    /// server fails here).
    pub async fn finish(self) {
        let Job {
            honest,
            rogue,
            server,
            scheduler,
        } = self;
        let honest = Arc::try_unwrap(honest).unwrap_or_else(|_| panic!("honest worker shared"));
        let done = async {
            let (h, ()) = tokio::join!(honest.finalize(), rogue.finalize());
            h.expect("the honest worker finalizes");
            server
                .await
                .expect("the server did not panic")
                .expect("the server ends cleanly");
            scheduler
                .await
                .expect("the scheduler did not panic")
                .expect("the scheduler ends cleanly");
        };
        tokio::time::timeout(PATIENCE + Duration::from_secs(5), done)
            .await
            .expect("the job ends in time");
    }
}

/// The key every test's round runs on.
pub const KEY: u64 = 1;
/// Its length.
pub const LEN: usize = 4;

/// Worker 0's part of a round: init `KEY` to zeros (rank 0's init and the workers' barrier),
/// wait for `go`, then push-pull ones. With the rogue's push of twos the round's sum is 3.
pub fn honest_round(job: &Job, go: oneshot::Receiver<()>) -> tokio::task::JoinHandle<Vec<f32>> {
    let w = job.honest.clone();
    tokio::spawn(async move {
        w.init(&[KEY], &[&[0.0; LEN]]).await.expect("honest init");
        go.await.expect("go");
        let mut out = vec![0.0; LEN];
        w.pushpull(KEY, &[1.0; LEN], &mut out)
            .await
            .expect("the honest worker's round");
        out
    })
}

/// The rogue's honest share of the round (twos), then the honest worker's result, checked.
pub async fn complete_round(job: &mut Job, honest: tokio::task::JoinHandle<Vec<f32>>) {
    let s = job.server();
    assert_eq!(job.rogue.push(s, KEY, &[2.0; LEN]).await, Ok(None));
    assert_eq!(honest.await.expect("honest task"), vec![3.0; LEN]);
    assert!(job.server_running());
}

/// Lets the honest worker's round go (`go`), completes it with the rogue's push, checks the
/// honest worker's sum and that the server still runs, then ends the job cleanly.
pub async fn end_round_and_job(
    mut job: Job,
    go: oneshot::Sender<()>,
    honest: tokio::task::JoinHandle<Vec<f32>>,
) {
    go.send(()).expect("the honest worker waits");
    complete_round(&mut job, honest).await;
    job.finish().await;
}
