//! The driver: runs one rank's plan of one call. It moves bytes and nothing else — sends the
//! pieces the plan releases, hands it the pieces that arrived for this call, and applies those
//! it releases — until the plan is done, a rank it waits for is lost or disagrees, or the
//! call's time is up.
//!
//! The buffer is a [`Pieces`]: host memory, or a GPU buffer whose pieces are sent from and
//! reduced into on the device.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use psnet_transport::{NodeId, OutMessage, Segment, Transport, TransportError};
use tokio::time::Instant;

use crate::comm::Communicator;
use crate::error::CollectiveError;
use crate::pieces::{Outgoing, Pieces, Sent};
use crate::plan::Plan;
use crate::wire::{self, Call, Header, Kind};
use psnet_recorder::Tally;

/// A spinning wait reads the clock once every this many polls (see `run_plan`). 2-rank same-host
/// 8-byte allreduces took 2.96-3.08 us (in place) with it against 3.05-3.31 us reading it
/// every poll (5 alternating runs, 2 cores), together with the same change in the TCP
/// transport's queue reader.
const CLOCK_EVERY: u32 = 8;

/// How long telling the other ranks about a failure may take.
const ABORT_SEND: Duration = Duration::from_secs(2);
/// How long a failed call waits for its sends in flight, so that a half-written message does
/// not close a connection before the other ranks hear why.
const SETTLE: Duration = Duration::from_secs(1);
/// How long a failed send waits for the peer's connection to end before it is blamed.
const BLAME_WAIT: Duration = Duration::from_millis(500);

pub(crate) async fn drive<T: Transport, P: Pieces>(
    comm: &Communicator<T>,
    seq: u64,
    call: Call,
    mut plan: Plan,
    pieces: P,
    record: Option<u64>,
) -> Result<(), CollectiveError> {
    let mut sends: FuturesUnordered<BoxFuture<'_, Sent>> = FuturesUnordered::new();
    let mut tally = Tally::default();
    let mut run = Run {
        comm,
        seq,
        call,
        plan: &mut plan,
        pieces: &pieces,
        sends: &mut sends,
        tally: &mut tally,
        record,
    };
    let result = run_plan(&mut run).await;
    if let (Some(r), Some(id)) = (&comm.recorder, record) {
        let error = result.as_ref().err().map(ToString::to_string);
        r.finish(id, tally.peers(), error.as_deref());
    }
    if result.is_err() && !sends.is_empty() {
        let _ = tokio::time::timeout(SETTLE, async { while sends.next().await.is_some() {} }).await;
    }
    drop(sends);
    finish_call(comm, seq);
    result
}

/// One call being driven.
struct Run<'p, 'r, T: Transport, P: Pieces> {
    comm: &'p Communicator<T>,
    seq: u64,
    call: Call,
    plan: &'r mut Plan,
    pieces: &'p P,
    sends: &'r mut FuturesUnordered<BoxFuture<'p, Sent>>,
    /// Pieces per peer, for the flight recorder.
    tally: &'r mut Tally,
    /// The call's record in the flight recorder.
    record: Option<u64>,
}

async fn run_plan<T: Transport, P: Pieces>(
    run: &mut Run<'_, '_, T, P>,
) -> Result<(), CollectiveError> {
    let Run {
        comm,
        seq,
        call,
        ref mut plan,
        pieces,
        ref mut sends,
        ref mut tally,
        record,
    } = *run;
    let deadline = comm.config.call_timeout.map(|t| Instant::now() + t);
    // Real time, not tokio's: with a paused clock (the simulation) spinning must still end.
    let mut idle_since: Option<std::time::Instant> = None;
    let mut polls = 0u32;
    // News that came before this call (a claimed rank, another rank's abort) fails it before
    // any of its data leaves: a peer given this rank's part could otherwise finish the call
    // with a squatter's data before this rank's abort reached it.
    check_news(comm, &comm.mailbox.lock(), seq)?;
    reach_partners(comm, plan).await;
    loop {
        let mut progress = false;
        while let Some(req) = plan.poll_send() {
            progress = true;
            let header = Header {
                kind: Kind::Data,
                comm: comm.comm,
                seq,
                tag: req.tag,
                call,
            }
            .encode();
            let out = Outgoing {
                op: req.op,
                rank: req.to,
                to: comm.members[req.to],
                header,
            };
            tally.sent(req.to as u32);
            sends.push(pieces.send(&*comm.transport, out, req.piece)?);
        }
        // Sends that completed meanwhile (polled here too, so they progress while we reduce).
        while let Some(Some((op, to, result))) = sends.next().now_or_never() {
            progress = true;
            if let Err(e) = result {
                return Err(send_error(comm, to, e).await);
            }
            plan.handle_sent(op);
        }
        // Armed before looking, so that mail arriving after the look wakes the wait below.
        let changed = comm.mailbox.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        for a in take_mail(comm, seq)? {
            progress = true;
            let Some(rank) = rank_of(comm, a.from) else {
                tracing::warn!(node = %a.from, "a collectives message from a node of no communicator here: dropped");
                continue;
            };
            if a.header.call != call {
                return Err(CollectiveError::Mismatch {
                    rank,
                    ours: call.to_string(),
                    theirs: a.header.call.to_string(),
                });
            }
            let tag = a.header.tag;
            tally.received(rank as u32);
            plan.handle_message(rank, tag, a.payload())
                .map_err(|e| CollectiveError::Protocol {
                    rank,
                    detail: e.to_string(),
                })?;
        }
        while let Some(apply) = plan.poll_apply() {
            progress = true;
            pieces.apply(apply.piece, apply.action, call.op, &apply.data)?;
            plan.handle_applied(apply.op);
        }
        if plan.is_done() {
            return Ok(());
        }
        if progress {
            idle_since = None;
            continue;
        }
        check_awaited(comm, plan)?;
        // Spin a while before sleeping: an answer usually comes within a round trip, and a
        // sleeping process waits for the kernel to wake it (tens of microseconds on a busy
        // host). Yielding lets this runtime's other tasks (the transport's readers) run.
        let idle = *idle_since.get_or_insert_with(std::time::Instant::now);
        // The clock is read every CLOCK_EVERY polls: reading it was 9% of a same-host 8-byte
        // allreduce's samples. A spin of zero never spins.
        polls = polls.wrapping_add(1);
        let spin = comm.config.spin;
        if !spin.is_zero() && (polls % CLOCK_EVERY != 0 || idle.elapsed() < spin) {
            if comm.oversubscribed {
                std::thread::yield_now();
            }
            tokio::task::yield_now().await;
            continue;
        }
        // About to sleep: the flight recorder gets this call's pieces so far, so that a dump
        // of a hung call (SIGUSR1) shows whom it waits for.
        if let (Some(r), Some(id)) = (&comm.recorder, record) {
            r.progress(id, tally.peers());
        }
        let timeout = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            Some((op, to, result)) = sends.next(), if !sends.is_empty() => {
                if let Err(e) = result {
                    return Err(send_error(comm, to, e).await);
                }
                plan.handle_sent(op);
            }
            _ = &mut changed => {}
            () = timeout => {
                return Err(CollectiveError::Timeout {
                    call: call.to_string(),
                    waited: comm.config.call_timeout.unwrap_or_default(),
                    ranks: plan.awaited_ranks(),
                });
            }
        }
    }
}

/// This call's messages that arrived, and the communicator-wide news: an abort from another
/// rank, a rank that sent for a call this rank had finished, too much mail.
fn take_mail<T: Transport>(
    comm: &Communicator<T>,
    seq: u64,
) -> Result<Vec<crate::mailbox::Arrival>, CollectiveError> {
    let mut mail = comm.mailbox.lock();
    check_news(comm, &mail, seq)?;
    Ok(mail.take_call(comm.comm, seq))
}

/// The communicator-wide news that fails call `seq`, if any.
fn check_news<T: Transport>(
    comm: &Communicator<T>,
    mail: &crate::mailbox::Mail,
    seq: u64,
) -> Result<(), CollectiveError> {
    if let Some(abort) = mail.abort_of(comm.comm, seq) {
        if let Some(rank) = rank_of(comm, abort.from) {
            return Err(CollectiveError::Aborted {
                rank,
                reason: abort.reason.clone(),
            });
        }
    }
    if let Some((from, header)) = mail.late.get(&comm.comm) {
        if let Some(rank) = rank_of(comm, *from) {
            let history = comm.history.lock().unwrap_or_else(|p| p.into_inner());
            let ours = history.iter().find(|(s, _)| *s == header.seq).map_or_else(
                || "a call it had finished".to_string(),
                |(_, c)| c.to_string(),
            );
            return Err(CollectiveError::Mismatch {
                rank,
                ours: format!("{ours} (call {})", header.seq),
                theirs: format!("{} (call {})", header.call, header.seq),
            });
        }
    }
    if let Some((node, why)) = &mail.claimed {
        if let Some(rank) = rank_of(comm, *node) {
            return Err(CollectiveError::Claimed {
                rank,
                node: *node,
                detail: why.clone(),
            });
        }
    }
    if let Some(why) = &mail.overflow {
        return Err(CollectiveError::Protocol {
            rank: usize::MAX,
            detail: why.clone(),
        });
    }
    Ok(())
}

/// Call `seq` is over: whatever arrives for it from now on shows a rank that made another call.
pub(crate) fn finish_call<T: Transport>(comm: &Communicator<T>, seq: u64) {
    comm.mailbox.lock().finish_call(comm.comm, seq);
}

/// Connects to the ranks this call sends to or receives from that are not connected yet
/// (`peers.rs`). One that cannot be reached is lost, and fails the call only where the call
/// still needs it: a send to it fails, and a receive from it once nothing it sent before it
/// went is left.
async fn reach_partners<T: Transport>(comm: &Communicator<T>, plan: &Plan) {
    let _ = reach_ranks(comm, &plan.partners()).await;
}

/// Connects to those of `ranks` that are not connected yet (`peers.rs`); one that cannot be
/// reached is lost.
pub(crate) async fn reach_ranks<T: Transport>(
    comm: &Communicator<T>,
    ranks: &[usize],
) -> Result<(), CollectiveError> {
    let nodes = ranks.iter().map(|&r| comm.members[r]);
    if comm.peers.unreached(nodes.clone()).is_empty() {
        return Ok(());
    }
    let within = comm.config.join_timeout;
    let Err(e) = comm.peers.reach(&*comm.transport, nodes, within).await else {
        return Ok(());
    };
    let rank = rank_of(comm, e.node).unwrap_or(usize::MAX);
    comm.mailbox
        .lock()
        .lost
        .entry(e.node)
        .or_insert_with(|| e.reason.clone());
    Err(CollectiveError::RankLost {
        rank,
        node: e.node,
        reason: e.reason,
    })
}

fn rank_of<T: Transport>(comm: &Communicator<T>, node: NodeId) -> Option<usize> {
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
    // Looked at whenever the call would sleep: the awaited ranks are worth finding only if
    // some rank is lost or malformed.
    if mail.lost.is_empty() && mail.malformed.is_empty() {
        return Ok(());
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

/// The error for a send to rank `to` that failed. A rank that fails tells the others why
/// and then exits, so a send to it may break before its reason is read: the reason comes
/// first on its connection, and the connection's end after it. So this waits (at most
/// [`BLAME_WAIT`]) until the connection's end has been read, and names the first failure
/// another rank reported, if one did, rather than the broken pipe it left behind.
async fn send_error<T: Transport>(
    comm: &Communicator<T>,
    to: usize,
    e: TransportError,
) -> CollectiveError {
    let node = comm.members[to];
    let waited = tokio::time::timeout(BLAME_WAIT, async {
        loop {
            let changed = comm.mailbox.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mail = comm.mailbox.lock();
                if mail.aborted.contains_key(&comm.comm)
                    || mail.lost.contains_key(&node)
                    || mail.closed.is_some()
                {
                    return;
                }
            }
            changed.await;
        }
    });
    let _ = waited.await;
    let aborted = comm.mailbox.lock().aborted.get(&comm.comm).cloned();
    if let Some(abort) = aborted {
        if let Some(rank) = rank_of(comm, abort.from) {
            return CollectiveError::Aborted {
                rank,
                reason: abort.reason,
            };
        }
    }
    lost_by_send(comm, to, e)
}

pub(crate) fn lost_by_send<T: Transport>(
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

/// Marks the communicator failed with `error` in call `seq` and tells every other rank why,
/// unless the error came from one of them.
pub(crate) async fn fail<T: Transport>(comm: &Communicator<T>, seq: u64, error: &CollectiveError) {
    if !comm.set_failed(error) {
        return;
    }
    tracing::error!(rank = comm.rank, error = %error, "collective failed");
    if matches!(error, CollectiveError::Aborted { .. }) {
        return;
    }
    Teller::of(comm)
        .tell(seq, &format!("rank {}: {error}", comm.rank))
        .await;
}

/// What telling the other ranks of a failure needs, owned (so a destructor can spawn it).
pub(crate) struct Teller<T: Transport> {
    transport: Arc<T>,
    comm: u32,
    pub(crate) rank: usize,
    members: Vec<NodeId>,
    peers: Arc<crate::peers::Peers>,
}

impl<T: Transport> Teller<T> {
    pub(crate) fn of(comm: &Communicator<T>) -> Self {
        Teller {
            transport: comm.transport.clone(),
            comm: comm.comm,
            rank: comm.rank,
            members: comm.members.clone(),
            peers: comm.peers.clone(),
        }
    }

    /// Sends every other rank an abort of call `seq` carrying `reason`, each send bounded in
    /// time; ranks not connected yet are dialled (in the same time).
    pub(crate) async fn tell(&self, seq: u64, reason: &str) {
        let mut header = wire::control(Kind::Abort, self.comm);
        header.seq = seq;
        let header = header.encode();
        let segment = [Segment::from(reason.as_bytes())];
        let mut tell = FuturesUnordered::new();
        for (rank, &node) in self.members.iter().enumerate() {
            if rank != self.rank {
                let msg = OutMessage::new(&header, &segment);
                let (transport, peers) = (&*self.transport, &self.peers);
                tell.push(tokio::time::timeout(ABORT_SEND, async move {
                    let _ = peers.reach(transport, [node], ABORT_SEND).await;
                    transport.send(node, msg).await
                }));
            }
        }
        while tell.next().await.is_some() {}
    }
}
