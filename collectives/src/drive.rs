//! The driver: runs one rank's plan of one call. It moves bytes and nothing else — sends the
//! pieces the plan releases, hands it the pieces that arrived for this call, and applies those
//! it releases — until the plan is done or a rank it waits for is lost.
//!
//! Each piece of the buffer sits behind its own lock, so a send can borrow one piece (the
//! transport reads the caller's memory until the send completes) while another is being
//! reduced into; the plan's order makes the two never meet on one piece.

use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use psnet_transport::{OutMessage, Segment, Transport, TransportError};
use tokio::sync::RwLock;

use crate::comm::Communicator;
use crate::element::{copy_bytes, reduce_bytes, Element};
use crate::error::CollectiveError;
use crate::plan::{Action, Plan};
use crate::wire::{self, Call, Header, Kind};

/// How long telling the other ranks about a failure may take.
const ABORT_SEND: Duration = Duration::from_secs(2);

pub(crate) async fn drive<T: Transport, E: Element>(
    comm: &Communicator<T>,
    seq: u64,
    call: Call,
    mut plan: Plan,
    buf: &mut [E],
) -> Result<(), CollectiveError> {
    let pieces = split_pieces(buf, &plan);
    let mut sends = FuturesUnordered::new();
    loop {
        let mut progress = false;
        while let Some(req) = plan.poll_send() {
            progress = true;
            let to = comm.members[req.to];
            let header = Header {
                kind: Kind::Data,
                comm: comm.comm,
                seq,
                tag: req.tag,
                call,
            }
            .encode();
            let piece = pieces[req.piece].try_read().map_err(|_| {
                CollectiveError::Invalid("internal: a piece sent while being written".into())
            })?;
            let transport = &comm.transport;
            sends.push(async move {
                let bytes: &[u8] = bytemuck::cast_slice(&piece[..]);
                let segment = [Segment::from(bytes)];
                let result = transport.send(to, OutMessage::new(&header, &segment)).await;
                (req.op, req.to, result)
            });
        }
        // Armed before looking, so that mail arriving after the look wakes the wait below.
        let changed = comm.mailbox.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let arrived = {
            let mut mail = comm.mailbox.lock();
            if let Some((from, why)) = mail.aborted.get(&comm.comm) {
                return Err(CollectiveError::Aborted {
                    rank: rank_of(comm, *from).unwrap_or(usize::MAX),
                    reason: why.clone(),
                });
            }
            mail.calls.remove(&(comm.comm, seq)).unwrap_or_default()
        };
        for a in arrived {
            progress = true;
            let rank = rank_of(comm, a.from).ok_or_else(|| CollectiveError::Protocol {
                rank: usize::MAX,
                detail: format!(
                    "a message from node {}, no member of this communicator",
                    a.from
                ),
            })?;
            if a.header.call != call {
                return Err(CollectiveError::Mismatch {
                    rank,
                    ours: call.to_string(),
                    theirs: a.header.call.to_string(),
                });
            }
            plan.handle_message(rank, a.header.tag, a.data)
                .map_err(|e| CollectiveError::Protocol {
                    rank,
                    detail: e.to_string(),
                })?;
        }
        while let Some(apply) = plan.poll_apply() {
            progress = true;
            let mut piece = pieces[apply.piece].try_write().map_err(|_| {
                CollectiveError::Invalid("internal: a piece written while being sent".into())
            })?;
            match apply.action {
                Action::Copy => copy_bytes(&mut piece, &apply.data),
                Action::Reduce(order) => reduce_bytes(call.op, order, &mut piece, &apply.data),
            }
            drop(piece);
            plan.handle_applied(apply.op);
        }
        if plan.is_done() {
            return Ok(());
        }
        if progress {
            continue;
        }
        check_awaited(comm, &plan)?;
        tokio::select! {
            Some((op, to, result)) = sends.next(), if !sends.is_empty() => {
                result.map_err(|e| send_error(comm, to, e))?;
                plan.handle_sent(op);
            }
            _ = &mut changed => {}
        }
    }
}

/// The buffer split into the plan's pieces, each behind its own lock.
fn split_pieces<'a, E: Element>(buf: &'a mut [E], plan: &Plan) -> Vec<RwLock<&'a mut [E]>> {
    let mut rest = buf;
    let mut pieces = Vec::with_capacity(plan.pieces().len());
    let mut at = 0;
    for range in plan.pieces() {
        debug_assert_eq!(range.start, at);
        let (piece, tail) = rest.split_at_mut(range.len());
        pieces.push(RwLock::new(piece));
        rest = tail;
        at = range.end;
    }
    pieces
}

fn rank_of<T: Transport>(comm: &Communicator<T>, node: psnet_transport::NodeId) -> Option<usize> {
    comm.members.iter().position(|&m| m == node)
}

/// Fails if a rank the plan still waits for can no longer send: lost, closed, or talking
/// nonsense.
fn check_awaited<T: Transport>(comm: &Communicator<T>, plan: &Plan) -> Result<(), CollectiveError> {
    let mail = comm.mailbox.lock();
    if let Some(why) = &mail.closed {
        return Err(CollectiveError::Transport(format!(
            "closed with {} transfers of this call left: {why}",
            plan.remaining()
        )));
    }
    for rank in plan.awaited_ranks() {
        let node = comm.members[rank];
        if let Some(reason) = mail.lost.get(&node) {
            return Err(CollectiveError::RankLost {
                rank,
                node,
                reason: reason.clone(),
            });
        }
        if let Some(detail) = mail.malformed.get(&node) {
            return Err(CollectiveError::Protocol {
                rank,
                detail: detail.clone(),
            });
        }
    }
    Ok(())
}

fn send_error<T: Transport>(
    comm: &Communicator<T>,
    to: usize,
    e: TransportError,
) -> CollectiveError {
    match e {
        TransportError::PeerLost { peer, reason } => CollectiveError::RankLost {
            rank: to,
            node: peer,
            reason,
        },
        other => CollectiveError::RankLost {
            rank: to,
            node: comm.members[to],
            reason: other.to_string(),
        },
    }
}

/// Marks the communicator failed with `error` and tells every other rank why, unless the
/// error came from one of them.
pub(crate) async fn fail<T: Transport>(comm: &Communicator<T>, error: &CollectiveError) {
    {
        let mut failed = comm.failed.lock().unwrap_or_else(|p| p.into_inner());
        if failed.is_some() {
            return;
        }
        *failed = Some(error.clone());
    }
    tracing::error!(rank = comm.rank, error = %error, "collective failed");
    if matches!(error, CollectiveError::Aborted { .. }) {
        return;
    }
    tell_all(comm, &format!("rank {}: {error}", comm.rank)).await;
}

/// Sends every other rank an abort carrying `reason`, each send bounded in time.
pub(crate) async fn tell_all<T: Transport>(comm: &Communicator<T>, reason: &str) {
    let header = wire::control(Kind::Abort, comm.comm).encode();
    let segment = [Segment::from(reason.as_bytes())];
    let mut tell = FuturesUnordered::new();
    for (rank, &node) in comm.members.iter().enumerate() {
        if rank != comm.rank {
            let msg = OutMessage::new(&header, &segment);
            tell.push(tokio::time::timeout(
                ABORT_SEND,
                comm.transport.send(node, msg),
            ));
        }
    }
    while tell.next().await.is_some() {}
}
