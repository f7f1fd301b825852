//! A server's event loop: moves bytes between the transport and
//! [`ServerState`](crate::proto::server::ServerState), and with `PSNET_CHECKPOINT_DIR` writes
//! its checkpoint ([`crate::checkpoint`]): journal records before the answers that follow
//! them, snapshots as they come.

use std::time::Duration;

use psnet_transport::{NodeId, Transport};

use crate::bootstrap::{self, heartbeat_period, Heard, CAUGHT_UP_WAIT};
use crate::checkpoint::{JobId, ShardFiles};
use crate::config::KvConfig;
use crate::error::KvError;
use crate::proto::ids::{self, describe, Role, SCHEDULER};
use crate::proto::msg::Msg;
use crate::proto::recovery;
use crate::proto::server::{AnswerValue, Output, Push, RowsPush, ServerState};
use crate::reliable::Link;
use crate::wire::Received;

mod answers;
mod served;

use answers::Answers;
use served::Served;

/// Joins the job as a server over `transport` (bound and listening) and serves until the
/// scheduler ends the job.
pub async fn run_server<T: Transport>(config: &KvConfig, transport: T) -> Result<(), KvError> {
    psnet_recorder::install_signal_dump();
    let mut served = Served::default();
    let result = serve(config, transport, &mut served).await;
    served.ended(&result);
    result
}

async fn serve<T: Transport>(
    config: &KvConfig,
    transport: T,
    served: &mut Served,
) -> Result<(), KvError> {
    let mut joined = bootstrap::join(config, transport).await?;
    let Some(job) = JobId::of(&joined.nodes) else {
        return Err(KvError::Bootstrap(
            "the scheduler's table has no scheduler in it".into(),
        ));
    };
    *served = Served::new(config, joined.rank, job);
    let link = joined.link.clone();
    let mut answers = Answers::new(link.clone());
    let num_workers = joined.num_workers();
    let period = heartbeat_period(config);
    let mut state = if joined.rejoined {
        match reload(config, joined.rank, job, num_workers) {
            Ok(state) => state,
            Err(e) => {
                let reason = format!("server {} cannot rejoin: {e}", joined.rank);
                tracing::error!(%reason);
                leave(&link, num_workers, &reason, period).await;
                return Err(e);
            }
        }
    } else {
        ServerState::new(num_workers)
    }
    .with_key_limit(config.server_key_bytes);
    let mut files = match &config.checkpoint_dir {
        None => None,
        Some(dir) => {
            state = state.with_checkpoints(config.checkpoint_every);
            let snapshot = state.snapshot();
            match ShardFiles::create(dir, joined.rank, job, config.checkpoint_fsync, &snapshot) {
                Ok(files) => Some(files),
                Err(e) => {
                    let reason = format!("server {} cannot checkpoint: {e}", joined.rank);
                    leave(&link, num_workers, &reason, period).await;
                    return Err(e);
                }
            }
        }
    };
    if let Some(dir) = &config.checkpoint_dir {
        if let Err(e) = commit_recovery(&link, dir, joined.rank).await {
            let reason = format!(
                "server {} cannot keep a recovery credential: {e}",
                joined.rank
            );
            leave(&link, num_workers, &reason, period).await;
            return Err(e);
        }
    }
    let mut heartbeat = tokio::time::interval(heartbeat_period(config));
    let worker_rank = |id: NodeId| match ids::role_rank(id) {
        Some((Role::Worker, r)) => Some(r),
        _ => None,
    };
    let mut early = std::mem::take(&mut joined.early).into_iter();
    let heard = Heard::new(crate::clock::now());
    // The first node the scheduler declared failed: the job cannot end well after it.
    let mut failure: Option<(NodeId, String)> = None;
    // Why workers said they are leaving, by rank.
    let mut leaving: std::collections::BTreeMap<u32, String> = std::collections::BTreeMap::new();
    loop {
        // A wait for the next message means everything that reached this server was read:
        // only then does the scheduler's silence count (see `Heard`).
        let asked = crate::clock::now();
        let next = async {
            match early.next() {
                Some(event) => Ok(event),
                None => {
                    let event = link.recv().await;
                    let at = crate::clock::now();
                    if at.saturating_duration_since(asked) >= CAUGHT_UP_WAIT {
                        heard.caught_up(at);
                    }
                    event
                }
            }
        };
        tokio::select! {
            event = next => match heard_from_scheduler(event?, &heard) {
                Received::Msg { from, msg, value } => match (msg, worker_rank(from)) {
                    (Msg::Push { ts, key, flags, n_elems, priority }, Some(rank)) => {
                        served.took(rank, ts, if flags.init { "init" } else { "push" }, key);
                        answers.expect(rank, ts, priority);
                        state.handle_push(Push {
                            rank,
                            ts,
                            key,
                            flags,
                            n_elems,
                            payload: value.unwrap_or_default(),
                        })
                    }
                    (Msg::Pull { ts, key, n_elems, have, priority }, Some(rank)) => {
                        served.took(rank, ts, "pull", key);
                        answers.expect(rank, ts, priority);
                        state.handle_pull(rank, ts, key, n_elems, have)
                    }
                    (Msg::PullRanges { ts, n_ranges, priority }, Some(rank)) => {
                        served.took(rank, ts, "pull_rows", 0);
                        answers.expect(rank, ts, priority);
                        let list = value.unwrap_or_default();
                        state.handle_pull_ranges(rank, ts, n_ranges, &list)
                    }
                    (Msg::PushRanges { ts, key, dtype, retry, n_ranges, priority }, Some(rank)) => {
                        served.took(rank, ts, "push_rows", key);
                        answers.expect(rank, ts, priority);
                        state.handle_push_rows(RowsPush {
                            rank,
                            ts,
                            key,
                            dtype,
                            retry,
                            n_ranges,
                            payload: value.unwrap_or_default(),
                        })
                    }
                    (Msg::Command { ts, kind, body }, Some(rank)) => {
                        served.took(rank, ts, "command", 0);
                        state.handle_command_request(rank, ts, kind, &body)
                    }
                    (Msg::NodeFailed { id, reason }, _) if from == SCHEDULER => {
                        if let Some(rank) = worker_rank(id) {
                            state.handle_worker_lost(rank, &reason);
                            answers.forget(rank);
                        }
                        failure.get_or_insert((id, reason));
                    }
                    // A worker about to fail says why: when its connection ends, that is the
                    // cause this server reports to the others.
                    (Msg::Leaving { reason }, Some(rank)) => {
                        leaving.insert(rank, reason);
                    }
                    (Msg::Shutdown, _) if from == SCHEDULER => break,
                    // The scheduler's answer to a heartbeat: heard above.
                    (Msg::Heartbeat, _) if from == SCHEDULER => {}
                    (other, _) => tracing::warn!(from = %describe(from), ?other, "unexpected message at a server"),
                },
                Received::Malformed { from, exchange, reason } => match worker_rank(from) {
                    Some(rank) => state.handle_malformed(rank, exchange, &reason),
                    None => tracing::warn!(from = %describe(from), %reason, "dropping a malformed kv message"),
                },
                Received::Lost { peer, reason } => {
                    served.event("lost", peer);
                    if peer == SCHEDULER {
                        let node = describe(peer);
                        leave(&link, num_workers, &format!("{node} is gone: {reason}"), period).await;
                        return Err(KvError::NodeLost { node, reason });
                    }
                    if let Some(rank) = worker_rank(peer) {
                        let reason = leaving
                            .remove(&rank)
                            .map_or(reason, |why| format!("it left: {why}"));
                        state.handle_worker_lost(rank, &reason);
                        answers.forget(rank);
                    }
                }
                Received::Connected(peer) => served.event("connected", peer),
            },
            _ = heartbeat.tick() => {
                let now = crate::clock::now();
                if now.saturating_duration_since(asked) >= CAUGHT_UP_WAIT {
                    heard.caught_up(now);
                }
                if config.heartbeat_interval.is_some() {
                    if let Some(reason) = heard.silent(config.heartbeat_timeout) {
                        let node = describe(SCHEDULER);
                        leave(&link, num_workers, &format!("{node} is gone: {reason}"), period).await;
                        return Err(KvError::NodeLost { node, reason });
                    }
                }
                // A failed heartbeat means the scheduler is gone: its loss arrives as an
                // event. A stopped one stops reading: the send must not hold up the loop.
                let _ = tokio::time::timeout(period, link.send(SCHEDULER, &Msg::Heartbeat, None)).await;
            }
        }
        if let Err(e) = flush(&mut answers, &mut state, files.as_mut(), served) {
            // An acknowledgement must never go out for a change the journal lacks: stop.
            tracing::error!(error = %e, "cannot write the checkpoint; this server stops");
            let reason = format!("server {} cannot write its checkpoint: {e}", joined.rank);
            leave(&link, num_workers, &reason, period).await;
            return Err(e);
        }
    }
    link.close();
    // The job ended, but not well: this server's exit must say so.
    if let Some((id, reason)) = failure {
        tracing::info!(node = %describe(joined.id), "server done; the job failed");
        return Err(KvError::NodeLost {
            node: describe(id),
            reason,
        });
    }
    tracing::info!(node = %describe(joined.id), "server done");
    Ok(())
}

/// The shard of a server that took back a lost server's rank: its checkpoint, without
/// which it cannot rejoin (it would answer with values the job never had).
/// Draws this rank's recovery credential, keeps it beside the shard, and commits to it at
/// the scheduler: only a server that can read it may take this rank back if this one is
/// lost ([`crate::proto::recovery`]).
async fn commit_recovery<T: Transport>(
    link: &Link<T>,
    dir: &std::path::Path,
    rank: u32,
) -> Result<(), KvError> {
    let credential = recovery::fresh();
    crate::checkpoint::write_credential(dir, rank, &credential)?;
    let commit = recovery::commitment(&credential);
    link.send(SCHEDULER, &Msg::RecoveryKey { commit }, None)
        .await
}

fn reload(
    config: &KvConfig,
    rank: u32,
    job: JobId,
    num_workers: u32,
) -> Result<ServerState, KvError> {
    let Some(dir) = &config.checkpoint_dir else {
        return Err(KvError::Checkpoint(
            "it has no PSNET_CHECKPOINT_DIR to reload its shard from".into(),
        ));
    };
    let started = std::time::Instant::now();
    let state =
        crate::checkpoint::load_shard(dir, rank, Some(job), num_workers, config.server_key_bytes)?
            .ok_or_else(|| {
                KvError::Checkpoint(format!("no snapshot of server {rank} in {}", dir.display()))
            })?;
    tracing::warn!(
        rank,
        keys = state.keys().len(),
        seq = state.seq(),
        ms = started.elapsed().as_millis() as u64,
        "reloaded the shard"
    );
    Ok(state)
}

/// Tells every worker why this server is about to exit, then closes: their errors then name
/// the cause (a lost scheduler), not just this server's closed connection. Bounded by
/// `within`: a worker that does not read is not waited for.
async fn leave<T: Transport>(link: &Link<T>, workers: u32, reason: &str, within: Duration) {
    let msg = Msg::Leaving {
        reason: reason.to_string(),
    };
    let sends = async {
        // The scheduler first: a server that says why it stops is not waited for to
        // restart, and every node's error names its reason.
        let _ = link.send(SCHEDULER, &msg, None).await;
        for rank in 0..workers {
            let _ = link
                .send(ids::node_id(Role::Worker, rank), &msg, None)
                .await;
        }
    };
    let _ = tokio::time::timeout(within, sends).await;
    link.close();
}

/// Notes when the scheduler was last heard from, and passes the event on.
fn heard_from_scheduler(event: Received, heard: &Heard) -> Received {
    if let Received::Msg { from, .. } | Received::Connected(from) = &event {
        if *from == SCHEDULER {
            heard.mark(crate::clock::now());
        }
    }
    event
}

/// Queues every answer the state has ready for its worker's sending task ([`Answers`]):
/// answers to different workers go out in parallel, each worker's by its requests' priority
/// ([`Answers`]), and the loop goes
/// on taking requests meanwhile. Values are shared with
/// the state, not copied. Journal records are written (and flushed to disk with
/// `PSNET_CHECKPOINT_FSYNC=1`) before any answer that follows them; an error writing one is
/// returned before anything after it is sent.
fn flush<T: Transport>(
    answers: &mut Answers<T>,
    state: &mut ServerState,
    mut files: Option<&mut ShardFiles>,
    served: &mut Served,
) -> Result<(), KvError> {
    while let Some(out) = state.poll_output() {
        let (rank, msg, value) = match out {
            Output::Done {
                rank,
                ts,
                value,
                have,
            } => match value.and_then(|k| state.answer_value(k, have)) {
                Some((value, Some(p))) => {
                    let msg = Msg::Pulled {
                        ts,
                        version: p.version,
                        form: p.form,
                    };
                    let value = (!matches!(value, AnswerValue::Empty)).then_some(value);
                    (rank, msg, value)
                }
                Some((value, None)) => (rank, Msg::Done { ts }, Some(value)),
                None => (rank, Msg::Done { ts }, None),
            },
            Output::Failed { rank, ts, reason } => (rank, Msg::Failed { ts, reason }, None),
            Output::Rows { rank, ts, ranges } => match state.rows_value(&ranges) {
                Ok(bytes) => (rank, Msg::Done { ts }, Some(AnswerValue::Narrow(bytes))),
                Err(gone) => (
                    rank,
                    Msg::Failed {
                        ts,
                        reason: gone.to_string(),
                    },
                    None,
                ),
            },
            Output::PeerFailed {
                rank,
                ts,
                lost,
                reason,
            } => {
                let lost = ids::node_id(Role::Worker, lost);
                (rank, Msg::PeerFailed { ts, lost, reason }, None)
            }
            Output::Journal(record) => {
                checkpoint_files(&mut files)?.append(&record)?;
                continue;
            }
            Output::Snapshot { bytes, reply } => {
                let files = checkpoint_files(&mut files)?;
                // Written in place: the loop waits (a shard's worth of disk writes).
                let written = files.write_snapshot(&bytes);
                if let Err(e) = &written {
                    // The previous snapshot and the journal still hold every change.
                    tracing::warn!(error = %e, "snapshot not written; the journal goes on");
                }
                let Some((rank, ts)) = reply else { continue };
                let msg = match written {
                    Ok(()) => Msg::Done { ts },
                    Err(e) => Msg::Failed {
                        ts,
                        reason: e.to_string(),
                    },
                };
                (rank, msg, None)
            }
        };
        if let Some(files) = files.as_deref_mut() {
            files.sync()?;
        }
        match &msg {
            Msg::Done { ts } | Msg::Pulled { ts, .. } => served.answered(rank, *ts, None),
            Msg::Failed { ts, reason } => served.answered(rank, *ts, Some(reason)),
            Msg::PeerFailed { ts, reason, .. } => served.answered(rank, *ts, Some(reason)),
            _ => {}
        }
        answers.send(rank, msg, value);
    }
    Ok(())
}

/// The checkpoint files, which exist whenever the state produces records.
fn checkpoint_files<'a>(
    files: &'a mut Option<&mut ShardFiles>,
) -> Result<&'a mut ShardFiles, KvError> {
    files
        .as_deref_mut()
        .ok_or_else(|| KvError::Checkpoint("a checkpoint output without checkpoint files".into()))
}
