//! The scheduler's event loop: moves bytes between the transport and
//! [`SchedulerState`](crate::proto::scheduler::SchedulerState).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use psnet_transport::Transport;
use tokio::time::Instant;

use crate::config::KvConfig;
use crate::error::KvError;
use crate::proto::admission::{random_identity, JobAdmission};
use crate::proto::ids::{describe, SCHEDULER};
use crate::proto::msg::Msg;
use crate::proto::scheduler::{Registration, SchedulerState};
use crate::reliable::Link;
use crate::wire::Received;

/// A scheduler over a bound transport, listening for its job's nodes.
pub struct Scheduler<T: Transport> {
    t: T,
    config: KvConfig,
}

impl<T: Transport> Scheduler<T> {
    /// A scheduler on `t`, which must listen where the job's nodes look for it (ps-lite's
    /// `DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT`) and carry the id [`SCHEDULER`]. `config.root`
    /// becomes `t`'s address, so a transport bound to port 0 works.
    pub fn new(config: &KvConfig, t: T) -> Scheduler<T> {
        t.set_local_id(SCHEDULER);
        let mut config = config.clone();
        config.root = t.listen_addr();
        Scheduler { t, config }
    }

    /// Where nodes reach it.
    pub fn addr(&self) -> SocketAddr {
        self.t.listen_addr()
    }

    /// Runs until the job ends. `Err` if nodes died or never registered.
    pub async fn run(self) -> Result<(), KvError> {
        let Scheduler { t, config } = self;
        let config = &config;
        // SIGUSR1 (psnet-launch asking for dumps) must not end a process without a recorder.
        psnet_recorder::install_signal_dump();
        let link = Link::new(Arc::new(t), config.resend);
        let t = link.transport();
        tracing::info!(addr = %t.listen_addr(), servers = config.num_servers, workers = config.num_workers, "scheduler up");
        let identity = random_identity();
        // The scheduler's flight recorder keeps the job's membership: registrations,
        // assignments, connections, and the nodes it declared lost.
        let recorder = psnet_recorder::Recorder::with(
            psnet_recorder::Scope::Kv {
                role: "scheduler".into(),
                rank: 0,
                job: crate::checkpoint::JobId::of_scheduler(&identity.public()).to_string(),
            },
            &config.recorder,
        );
        let record = |what: &'static str, peer: psnet_transport::NodeId| {
            if let Some(r) = &recorder {
                r.event(psnet_recorder::Op::Event { what, peer: peer.0 });
            }
        };
        let mut declared = std::collections::HashSet::new();
        let mut state = SchedulerState::new(
            config.num_servers,
            config.num_workers,
            t.listen_addr(),
            config.heartbeat_timeout,
            identity.public(),
        )
        .with_recovery(config.recovery_timeout);
        let admission = Arc::new(JobAdmission::scheduler(identity));
        t.set_admission(admission.clone());
        let started = Instant::now();
        let tick_every = config
            .heartbeat_interval
            .unwrap_or(Duration::from_secs(1))
            .min(Duration::from_secs(1));
        let mut tick = tokio::time::interval(tick_every);
        loop {
            tokio::select! {
                // What arrived is taken before time is judged: after a stall, the nodes'
                // messages waiting in the socket are their signs of life.
                biased;
                event = link.recv() => {
                    let now = crate::clock::now();
                    let event = match event {
                        Ok(event) => event,
                        Err(e) => {
                            if let Some(r) = &recorder {
                                r.dump_on_failure(&format!("the scheduler's transport failed: {e}"));
                            }
                            return Err(e);
                        }
                    };
                    match event {
                        Received::Msg { from, msg, .. } => match msg {
                            Msg::Register {
                                role,
                                addr,
                                rank_hint,
                                recovery,
                                identity,
                            } => {
                                record("registered", from);
                                let reg = Registration { role, addr, rank_hint, recovery, identity };
                                state.handle_register(from, reg, now)
                            }
                            Msg::RecoveryKey { commit } => state.handle_recovery_key(from, commit),
                            Msg::Barrier { group } => state.handle_barrier(from, group, now),
                            Msg::Heartbeat => state.handle_heartbeat(from, now),
                            Msg::Finalize => state.handle_finalize(from, now),
                            Msg::Leaving { reason } => state.handle_leaving(from, reason),
                            other => tracing::warn!(from = %describe(from), ?other, "unexpected message at the scheduler"),
                        },
                        Received::Malformed { from, reason, .. } => state.handle_malformed(from, &reason),
                        Received::Connected(peer) => {
                            record("connected", peer);
                            state.handle_alive(peer, now)
                        }
                        Received::Lost { peer, reason } => {
                            record("lost", peer);
                            state.handle_lost(peer, &reason)
                        }
                    }
                }
                _ = tick.tick() => {
                    state.handle_timeout(crate::clock::now());
                    if !state.is_assigned() && started.elapsed() > config.bootstrap_timeout {
                        let (s, w) = state.registered();
                        let e = KvError::Bootstrap(format!(
                            "only {s} of {} servers and {w} of {} workers registered within {:?} \
                             (PSNET_BOOTSTRAP_TIMEOUT)",
                            config.num_servers, config.num_workers, config.bootstrap_timeout
                        ));
                        if let Some(r) = &recorder {
                            r.dump_on_failure(&e.to_string());
                        }
                        return Err(e);
                    }
                }
            }
            while let Some((to, msg)) = state.poll_transmit() {
                match &msg {
                    Msg::Assign { your_id, .. } => record("assigned", *your_id),
                    Msg::Reassign { your_id, .. } => record("rejoined", *your_id),
                    Msg::NodeFailed { id, .. } if declared.insert(*id) => {
                        record("declared lost", *id)
                    }
                    _ => {}
                }
                match &msg {
                    Msg::Assign { nodes, .. } => {
                        // Where to redial nodes whose connection drops (PS_RESEND), and the
                        // public identities they will prove their assigned ids with.
                        link.learn_nodes(nodes);
                        admission.learn(nodes);
                    }
                    // A restarted server: its new address and public identity, and
                    // (PS_RESEND) a fresh start with the new process.
                    Msg::Reassign { your_id, nodes } => {
                        if let Some(node) = nodes.iter().find(|n| n.id == *your_id) {
                            link.rejoined(node);
                            admission.learn(std::slice::from_ref(node));
                        }
                    }
                    _ => {}
                }
                if let Err(e) = link.send(to, &msg, None).await {
                    tracing::debug!(to = %describe(to), error = %e, "scheduler could not deliver");
                }
            }
            // Nobody registers once every node is assigned, but a restarted server may while
            // a lost one's rank is held.
            admission.set_registrations(state.takes_registrations());
            if state.is_finished() {
                break;
            }
        }
        // With PS_RESEND the shutdown is delivered like every other message: the scheduler
        // stays long enough for one resend across a dropped connection. Nodes close without
        // acknowledging their last message, so this wait usually runs its course (bounded).
        let give_up = config.resend.unwrap_or_default() * 2;
        link.flush(Instant::now() + give_up).await;
        link.close();
        if state.dead().is_empty() {
            tracing::info!("job finished");
            if let Some(r) = &recorder {
                r.dump_at_end();
            }
            Ok(())
        } else {
            let lost: Vec<String> = state
                .dead()
                .iter()
                .map(|(id, why)| format!("{}: {why}", describe(*id)))
                .collect();
            let e = KvError::NodeLost {
                node: format!("{} node(s)", lost.len()),
                reason: lost.join("; "),
            };
            if let Some(r) = &recorder {
                r.dump_on_failure(&e.to_string());
            }
            Err(e)
        }
    }
}
