//! Joining a job: register with the scheduler under a provisional id, receive the assigned
//! id and the list of nodes, reconnect under the assigned id, connect to peers, and wait for
//! everyone in a barrier.

use std::sync::Arc;
use std::time::Duration;

use psnet_transport::{NodeId, Transport};
use tokio::time::{timeout_at, Instant};

use crate::config::KvConfig;
use crate::error::KvError;
use crate::proto::admission::{random_identity, JobAdmission};
use crate::proto::ids::{self, describe, Group, Role, SCHEDULER};
use crate::proto::msg::{Msg, NodeInfo};
use crate::reliable::Link;
use crate::wire::{self, Received};

/// A node that has joined its job.
pub struct Joined<T: Transport> {
    /// The transport under the assigned id, with `PS_RESEND` if configured.
    pub link: Arc<Link<T>>,
    /// The assigned id.
    pub id: NodeId,
    /// Rank within the role.
    pub rank: u32,
    /// Every node of the job, scheduler included.
    pub nodes: Vec<NodeInfo>,
    /// What arrived during the start-up barrier that is not part of it (a worker that left
    /// the barrier first may already be pushing): the node's loop handles these first.
    pub early: Vec<Received>,
    /// Who may connect: learns the identity of a server that rejoins.
    pub admission: Arc<JobAdmission>,
    /// This node took back the id of a lost server in a running job (`Reassign`): no
    /// start-up barrier was held, and its shard is to be reloaded.
    pub rejoined: bool,
}

impl<T: Transport> Joined<T> {
    /// The servers' ids, by rank.
    pub fn servers(&self) -> Vec<NodeId> {
        let mut s: Vec<&NodeInfo> = self
            .nodes
            .iter()
            .filter(|n| n.role == Role::Server)
            .collect();
        s.sort_by_key(|n| n.rank);
        s.into_iter().map(|n| n.id).collect()
    }

    /// Number of workers.
    pub fn num_workers(&self) -> u32 {
        self.nodes.iter().filter(|n| n.role == Role::Worker).count() as u32
    }
}

/// Joins as a server or worker over `transport` (bound, listening, not yet connected): after
/// the all-nodes barrier, and for a worker once it is connected to every server.
pub async fn join<T: Transport>(config: &KvConfig, transport: T) -> Result<Joined<T>, KvError> {
    let deadline = Instant::now() + config.bootstrap_timeout;
    let listen = transport.listen_addr();
    transport.set_local_id(ids::provisional_id(listen));
    // Until the table arrives nobody's claim can be checked: take none (but the scheduler's).
    transport.set_admission(Arc::new(JobAdmission::joining()));
    transport
        .connect(SCHEDULER, config.root)
        .await
        .map_err(|e| {
            KvError::Bootstrap(format!(
                "cannot reach the scheduler at {} (DMLC_PS_ROOT_URI / DMLC_PS_ROOT_PORT): {e}",
                config.root
            ))
        })?;
    // The identity this node will prove its id with: drawn here, and only its public half
    // leaves the node (see `proto::admission`).
    let identity = random_identity();
    wire::send(
        &transport,
        SCHEDULER,
        &Msg::Register {
            role: config.role,
            addr: listen,
            rank_hint: config.rank_hint,
            recovery: recovery_credential(config),
            identity: identity.public(),
        },
        None,
    )
    .await?;
    let (id, nodes, rejoined) = loop {
        let event = timeout_at(deadline, wire::recv(&transport))
            .await
            .map_err(|_| {
                KvError::Bootstrap(format!(
                    "no rank assigned within {:?} (PSNET_BOOTSTRAP_TIMEOUT): are all \
                     {} servers and {} workers started?",
                    config.bootstrap_timeout, config.num_servers, config.num_workers
                ))
            })??;
        match event {
            Received::Msg {
                msg: Msg::Assign { your_id, nodes },
                ..
            } => break (your_id, nodes, false),
            Received::Msg {
                msg: Msg::Reassign { your_id, nodes },
                ..
            } if config.role == Role::Server => break (your_id, nodes, true),
            Received::Msg {
                msg: Msg::NodeFailed { reason, .. },
                ..
            } => {
                return Err(KvError::Bootstrap(format!(
                    "the scheduler refused this node: {reason}"
                )))
            }
            Received::Lost { peer, reason } if peer == SCHEDULER => {
                return Err(KvError::Bootstrap(format!(
                    "the scheduler went away: {reason}"
                )))
            }
            _ => continue,
        }
    };
    let (role, rank) = ids::role_rank(id)
        .filter(|(r, _)| *r == config.role)
        .ok_or_else(|| KvError::Bootstrap(format!("the scheduler assigned an invalid id {id}")))?;
    if rejoined {
        tracing::warn!(node = %describe(id), addr = %listen, "rejoined the running job");
    } else {
        tracing::info!(node = %describe(id), addr = %listen, "joined the job");
    }
    // Reconnect to the scheduler under the assigned id. From here on, messages go through
    // the link (PS_RESEND, if on, covers every message between assigned ids).
    let admission = Arc::new(JobAdmission::member(id, identity, &nodes));
    transport.set_admission(admission.clone());
    transport.set_local_id(id);
    let link = Link::new(Arc::new(transport), config.resend);
    link.learn_nodes(&nodes);
    link.learn(SCHEDULER, config.root);
    let transport = link.transport();
    transport.disconnect(SCHEDULER);
    transport.connect(SCHEDULER, config.root).await?;
    // After this barrier every node answers under its assigned id, so workers can dial the
    // servers and check who answers. A rejoining server finds the job past it: the workers
    // dial it when the scheduler tells them it is back.
    let early = if rejoined {
        Vec::new()
    } else {
        barrier_inline(&link, Group::ALL, deadline).await?
    };
    if role == Role::Worker {
        for server in nodes.iter().filter(|n| n.role == Role::Server) {
            link.transport().connect(server.id, server.addr).await?;
        }
    }
    Ok(Joined {
        link: Arc::new(link),
        id,
        rank,
        nodes,
        early,
        admission,
        rejoined,
    })
}

/// A barrier before the node's own event loop runs. Everything else that arrives meanwhile
/// is kept, in order, and returned.
async fn barrier_inline<T: Transport>(
    link: &Link<T>,
    group: Group,
    deadline: Instant,
) -> Result<Vec<Received>, KvError> {
    link.send(SCHEDULER, &Msg::Barrier { group }, None).await?;
    let mut early = Vec::new();
    loop {
        let event = timeout_at(deadline, link.recv()).await.map_err(|_| {
            KvError::Bootstrap("the start-up barrier did not complete in time".into())
        })??;
        match event {
            Received::Msg {
                msg: Msg::BarrierDone { group: g },
                ..
            } if g == group => return Ok(early),
            Received::Msg {
                msg: Msg::BarrierFailed { reason, .. },
                ..
            } => return Err(KvError::Barrier(reason)),
            Received::Msg {
                msg: Msg::NodeFailed { id, reason },
                ..
            } => {
                return Err(KvError::NodeLost {
                    node: describe(id),
                    reason,
                })
            }
            Received::Lost { peer, reason } if peer == SCHEDULER => {
                return Err(KvError::NodeLost {
                    node: describe(peer),
                    reason,
                })
            }
            // The provisional connection to the scheduler closing is expected.
            Received::Lost { peer, .. } if ids::is_provisional(peer) => {}
            other => early.push(other),
        }
    }
}

/// Heartbeat period for a node's loop (a very long one when heartbeats are off).
pub fn heartbeat_period(config: &KvConfig) -> Duration {
    config
        .heartbeat_interval
        .unwrap_or(Duration::from_secs(3600))
}

/// When a node last heard from the scheduler, which answers every heartbeat: a scheduler that
/// stopped (SIGSTOP, a partition) keeps its connections open, so only its silence tells.
///
/// Silence counts only up to the last time this node had read everything that reached it
/// (it waited for its next message): a node busy with a backlog of workers' messages has the
/// scheduler's answers queued behind them, and that is not the scheduler's silence.
pub struct Heard(std::sync::Mutex<(std::time::Instant, std::time::Instant)>);

pub use crate::proto::CAUGHT_UP_WAIT;

impl Heard {
    /// Heard at `now`.
    pub fn new(now: std::time::Instant) -> Self {
        Heard(std::sync::Mutex::new((now, now)))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (std::time::Instant, std::time::Instant)> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The scheduler was heard from at `now`.
    pub fn mark(&self, now: std::time::Instant) {
        let mut h = self.lock();
        h.0 = now;
        h.1 = h.1.max(now);
    }

    /// This node had read everything that reached it at `now`.
    pub fn caught_up(&self, now: std::time::Instant) {
        let mut h = self.lock();
        h.1 = h.1.max(now);
    }

    /// Why the scheduler counts as lost, if it had been silent for longer than `limit`
    /// (`PS_HEARTBEAT_TIMEOUT`; None: never) when this node last caught up.
    pub fn silent(&self, limit: Option<Duration>) -> Option<String> {
        let limit = limit?;
        let (heard, caught_up) = *self.lock();
        let quiet = caught_up.saturating_duration_since(heard);
        (quiet > limit).then(|| {
            format!(
                "silent for {:.1} s (PS_HEARTBEAT_TIMEOUT={} s): stopped or cut off",
                quiet.as_secs_f64(),
                limit.as_secs_f64()
            )
        })
    }
}

/// The recovery credential a server shows when it registers: the one its rank keeps in its
/// checkpoint directory, where it names its rank (`DMLC_SERVER_ID`) and the file exists. Only
/// a running job that lost that rank reads it ([`crate::proto::recovery`]).
fn recovery_credential(config: &KvConfig) -> Option<[u8; crate::proto::recovery::CREDENTIAL_LEN]> {
    let (Role::Server, Some(dir), Some(rank)) =
        (config.role, &config.checkpoint_dir, config.rank_hint)
    else {
        return None;
    };
    match crate::checkpoint::read_credential(dir, rank) {
        Ok(credential) => credential,
        Err(e) => {
            tracing::warn!(error = %e, "no recovery credential to show");
            None
        }
    }
}
