//! A server's event loop: moves bytes between the transport and
//! [`ServerState`](crate::proto::server::ServerState).

use std::sync::Arc;

use psnet_transport::{NodeId, Transport};

use crate::bootstrap::{self, heartbeat_period};
use crate::config::KvConfig;
use crate::error::KvError;
use crate::proto::ids::{self, describe, Role, SCHEDULER};
use crate::proto::msg::Msg;
use crate::proto::server::{Output, Push, ServerState};
use crate::proto::sum;
use crate::reliable::Link;
use crate::wire::Received;

/// Joins the job as a server over `transport` (bound and listening) and serves until the
/// scheduler ends the job.
pub async fn run_server<T: Transport>(config: &KvConfig, transport: T) -> Result<(), KvError> {
    let mut joined = bootstrap::join(config, transport).await?;
    let link = joined.link.clone();
    let mut state = ServerState::new(joined.num_workers());
    let mut heartbeat = tokio::time::interval(heartbeat_period(config));
    let worker_rank = |id: NodeId| match ids::role_rank(id) {
        Some((Role::Worker, r)) => Some(r),
        _ => None,
    };
    let mut early = std::mem::take(&mut joined.early).into_iter();
    loop {
        let next = async {
            match early.next() {
                Some(event) => Ok(event),
                None => link.recv().await,
            }
        };
        tokio::select! {
            event = next => match event? {
                Received::Msg { from, msg, value } => match (msg, worker_rank(from)) {
                    (Msg::Push { ts, key, flags, n_elems }, Some(rank)) => state.handle_push(Push {
                        rank,
                        ts,
                        key,
                        flags,
                        n_elems,
                        payload: value.unwrap_or_default(),
                    }),
                    (Msg::Pull { ts, key, n_elems }, Some(rank)) => state.handle_pull(rank, ts, key, n_elems),
                    (Msg::Command { ts, kind, body }, Some(_)) => {
                        let reply = match state.handle_command(kind, &body) {
                            Ok(()) => Msg::Done { ts },
                            Err(reason) => Msg::Failed { ts, reason },
                        };
                        if let Err(e) = link.send(from, &reply, None).await {
                            tracing::debug!(to = %describe(from), error = %e, "reply lost");
                        }
                    }
                    (Msg::NodeFailed { id, reason }, _) if from == SCHEDULER => {
                        if let Some(rank) = worker_rank(id) {
                            state.handle_worker_lost(rank, &reason);
                        }
                    }
                    (Msg::Shutdown, _) if from == SCHEDULER => break,
                    (other, _) => tracing::warn!(from = %describe(from), ?other, "unexpected message at a server"),
                },
                Received::Lost { peer, reason } => {
                    if peer == SCHEDULER {
                        return Err(KvError::NodeLost { node: describe(peer), reason });
                    }
                    if let Some(rank) = worker_rank(peer) {
                        state.handle_worker_lost(rank, &reason);
                    }
                }
                Received::Connected(_) => {}
            },
            _ = heartbeat.tick() => {
                // A failed heartbeat means the scheduler is gone: its loss arrives as an event.
                let _ = link.send(SCHEDULER, &Msg::Heartbeat, None).await;
            }
        }
        flush(&link, &mut state);
    }
    tracing::info!(node = %describe(joined.id), "server done");
    link.close();
    Ok(())
}

/// Sends every answer the state has ready, each in its own task: answers to different workers
/// go out in parallel, and the loop goes on taking requests meanwhile. Values are shared with
/// the state, not copied.
fn flush<T: Transport>(link: &Arc<Link<T>>, state: &mut ServerState) {
    while let Some(out) = state.poll_output() {
        let (rank, msg, value) = match out {
            Output::Done { rank, ts, value } => (
                rank,
                Msg::Done { ts },
                value.and_then(|k| state.shared_value(k)),
            ),
            Output::Failed { rank, ts, reason } => (rank, Msg::Failed { ts, reason }, None),
        };
        let link = link.clone();
        tokio::spawn(async move {
            let to = ids::node_id(Role::Worker, rank);
            let bytes = value.as_deref().map(|v| sum::as_bytes(v));
            if let Err(e) = link.send(to, &msg, bytes).await {
                tracing::debug!(worker = rank, error = %e, "answer lost");
            }
        });
    }
}
