//! What every call of a worker shares: its state behind one lock, its links to the nodes, and
//! the requests in flight: sending them (to all servers at once), redialing a server that
//! was lost, and settling each request with its answer.

use std::sync::{Arc, Mutex, MutexGuard};

use psnet_recorder::Recorder;
use psnet_transport::{NodeId, Segment, Transport};
use tokio::sync::{oneshot, Notify};

use crate::error::KvError;
use crate::proto::admission::JobAdmission;
use crate::proto::ids::describe;
use crate::proto::msg::{CommandKind, Msg, NodeInfo, PushFlags};
use crate::proto::worker::{key_of_slot, Asked, Reply, WorkerState, PIECE_SHIFT};
use crate::reliable::Link;
use crate::value::Dtype;

use super::gate::Gate;

/// What one request asks of a server; its id is given when it is sent.
#[derive(Clone)]
pub(crate) enum Ask {
    Push {
        key: u64,
        flags: PushFlags,
        n_elems: u64,
    },
    Pull {
        key: u64,
        n_elems: u64,
    },
    /// A row pull of `key`: ranges of its parts on one server, listed in the request's
    /// value.
    PullRanges {
        key: u64,
        n_ranges: u64,
    },
    /// A row push of `key`: ranges of its parts on one server, the first stored under
    /// `first`, listed in the request's value before the values.
    PushRanges {
        key: u64,
        first: u64,
        dtype: Dtype,
        n_ranges: u64,
        retry: Option<u64>,
    },
    Command {
        kind: CommandKind,
        body: String,
    },
}

impl Ask {
    /// What the worker's state keeps of it.
    pub(crate) fn asked(&self) -> Asked {
        match self {
            Ask::Push { key, flags, .. } => Asked::Push {
                key: *key,
                init: flags.init,
            },
            Ask::Pull { key, .. } => Asked::Pull { key: *key },
            // Counted as pushes of its first part: the server tells a push sent again by it.
            Ask::PushRanges { first, .. } => Asked::Push {
                key: *first,
                init: false,
            },
            // Sent again as it was, and answered with plain values.
            Ask::PullRanges { .. } | Ask::Command { .. } => Asked::Other,
        }
    }

    /// The same request, to send again to a restarted server (a push with its place
    /// among this worker's pushes of the key).
    pub(crate) fn again(mut self, retry: Option<u64>) -> Self {
        match &mut self {
            Ask::Push { flags, .. } => flags.retry = retry,
            Ask::PushRanges { retry: r, .. } => *r = retry,
            _ => {}
        }
        self
    }

    /// The key (or piece) it asks about; None for commands.
    pub(crate) fn slot(&self) -> Option<u64> {
        match self {
            Ask::Push { key, .. }
            | Ask::Pull { key, .. }
            | Ask::PullRanges { key, .. }
            | Ask::PushRanges { key, .. } => Some(*key),
            Ask::Command { .. } => None,
        }
    }

    /// The request as sent, as request `ts` at `priority`, from a worker whose copy of the
    /// key pulled is at version `have` (compressed pulls).
    pub(crate) fn into_msg(self, ts: u64, have: Option<u64>, priority: i32) -> Msg {
        match self {
            Ask::Push {
                key,
                mut flags,
                n_elems,
            } => {
                flags.have = have.filter(|_| flags.pull_back);
                Msg::Push {
                    ts,
                    key,
                    flags,
                    n_elems,
                    priority,
                }
            }
            Ask::Pull { key, n_elems } => Msg::Pull {
                ts,
                key,
                n_elems,
                have,
                priority,
            },
            Ask::PullRanges { n_ranges, .. } => Msg::PullRanges {
                ts,
                n_ranges,
                priority,
            },
            Ask::PushRanges {
                key,
                dtype,
                n_ranges,
                retry,
                ..
            } => Msg::PushRanges {
                ts,
                key,
                dtype,
                retry,
                n_ranges,
                priority,
            },
            Ask::Command { kind, body } => Msg::Command { ts, kind, body },
        }
    }
}

/// One request of a call, with the bytes it carries (borrowed from the caller).
pub(crate) struct Outgoing<'a> {
    pub(crate) to: NodeId,
    pub(crate) ask: Ask,
    pub(crate) value: Option<Segment<'a>>,
}

/// A request sent and waiting for its answer, with what it takes to send it again if its
/// server restarts first.
pub(crate) struct Wait<'a> {
    sent: Outgoing<'a>,
    rx: Answer,
}

/// Where a request's answer comes, and its record in the flight recorder.
pub(crate) struct Answer {
    rx: oneshot::Receiver<Reply>,
    record: Option<u64>,
}

/// A call's requests, sent, and the receivers of their answers in the same order: its
/// [`Wait`]s, made one at a time as the call takes the answers (a call of many keys holds
/// no second copy of its requests).
pub(crate) struct Sent<'a> {
    requests: Vec<Outgoing<'a>>,
    answers: Vec<Answer>,
}

impl<'a> IntoIterator for Sent<'a> {
    type Item = Wait<'a>;
    type IntoIter = std::iter::Map<
        std::iter::Zip<std::vec::IntoIter<Outgoing<'a>>, std::vec::IntoIter<Answer>>,
        fn((Outgoing<'a>, Answer)) -> Wait<'a>,
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.requests
            .into_iter()
            .zip(self.answers)
            .map(|(sent, rx)| Wait { sent, rx })
    }
}

/// Dials of a rejoined server before its requests are sent anyway (and fail): 10 ms, then
/// twice as long each time, about 1.3 s in all.
pub(crate) const REDIALS: u32 = 8;

/// How long a failed send waits for the receiver to report the peer's loss with its cause.
pub(crate) const LOSS_GRACE: std::time::Duration = std::time::Duration::from_millis(250);

pub(crate) struct Shared<T: Transport> {
    pub(crate) link: Arc<Link<T>>,
    /// Learns a rejoined server's new token.
    pub(crate) admission: Arc<JobAdmission>,
    /// Fixed at join: read without the lock.
    pub(crate) rank: u32,
    pub(crate) servers: Vec<NodeId>,
    /// The turns of sends to each server (as `servers`), by priority.
    pub(crate) gates: Vec<Gate>,
    pub(crate) num_workers: u32,
    pub(crate) state: Mutex<WorkerState>,
    /// `PSNET_KV_SERIAL_SENDS`: one request after another, for benchmarks.
    pub(crate) serial_sends: bool,
    /// Keys larger than `PSNET_PARTITION_BYTES` are cut into pieces, each stored under a
    /// slot of its own ([`crate::proto::worker::piece_key`]).
    pub(crate) partitions: bool,
    /// This worker packs its compressed pushes, and as worker 0 has the servers pack their
    /// answers, whatever the setting says (`PSNET_PACK_CODES`, by default across hosts); a
    /// setting with `"pack": true` packs either way.
    pub(crate) pack_codes: bool,
    /// Woken when the job ends or the scheduler is lost (`finalize` waits for it).
    pub(crate) ended: Notify,
    /// The flight recorder of this worker's requests (`PSNET_RECORDER_*`; `None`: off).
    pub(crate) recorder: Option<Arc<Recorder>>,
}

impl<T: Transport> Shared<T> {
    pub(crate) fn state(&self) -> MutexGuard<'_, WorkerState> {
        // The state is only changed by its own methods, none of which panics half-way: a
        // poisoned lock still guards a consistent state.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends `Leaving` messages, all at once and bounded by [`LOSS_GRACE`]: a peer that does
    /// not read is not waited for.
    pub(crate) async fn tell(&self, messages: Vec<(NodeId, Msg)>) {
        if messages.is_empty() {
            return;
        }
        let sends = messages
            .iter()
            .map(|(to, msg)| self.link.send(*to, msg, None));
        let _ = tokio::time::timeout(LOSS_GRACE, futures_util::future::join_all(sends)).await;
    }

    /// A server rejoined (`Rejoined` from the scheduler): accept its new token, redial it at
    /// its new address, then let the state have the event, which sends again what waited on
    /// it. A server that cannot be dialled fails those requests when they are sent.
    pub(crate) async fn reconnect(&self, node: &NodeInfo) {
        self.admission.learn(std::slice::from_ref(node));
        self.link.rejoined(node);
        let t = self.link.transport();
        t.disconnect(node.id);
        let mut pause = std::time::Duration::from_millis(10);
        for attempt in 1..=REDIALS {
            match t.connect(node.id, node.addr).await {
                Ok(()) => return,
                Err(e) if attempt == REDIALS => {
                    tracing::warn!(node = %describe(node.id), addr = %node.addr, error = %e,
                        "cannot dial the rejoined server");
                }
                Err(_) => {
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
            }
        }
    }

    /// Hands one received event to the state.
    pub(crate) fn handle(&self, event: crate::wire::Received) {
        if let Some(r) = &self.recorder {
            let connection = match &event {
                crate::wire::Received::Lost { peer, .. } => Some(("lost", *peer)),
                crate::wire::Received::Connected(peer) => Some(("connected", *peer)),
                _ => None,
            };
            if let Some((what, peer)) = connection {
                r.event(psnet_recorder::Op::Event { what, peer: peer.0 });
            }
        }
        let ended = {
            let mut state = self.state();
            state.handle_received(event, crate::clock::now());
            state.is_shutdown() || state.scheduler_lost().is_some()
        };
        if ended {
            self.ended.notify_one();
        }
    }

    /// Sends a call's requests: to each server by priority, to all servers at once.
    /// (A large send completes only once its bytes are out, after its RDMA WRITE on verbs: one
    /// server after another would serialize the parts of a sharded key.) The receivers come
    /// back in the requests' order.
    pub(crate) async fn send_all<'a>(
        &self,
        requests: Vec<Outgoing<'a>>,
    ) -> Result<Sent<'a>, KvError> {
        if self.serial_sends {
            let mut answers = Vec::with_capacity(requests.len());
            for r in &requests {
                answers.push(self.request(r).await?);
            }
            return Ok(Sent { requests, answers });
        }
        // Every request waits for its server's turn at once (`Gate`): each server's go by
        // priority, then in the call's order, and servers are sent to in parallel. They are
        // queued highest priority first, so that the first, which finds its server free,
        // is the call's most urgent.
        let mut order: Vec<usize> = (0..requests.len()).collect();
        {
            let state = self.state();
            let priority = |i: usize| {
                requests[i]
                    .ask
                    .slot()
                    .map_or(i32::MAX, |s| state.priority(s))
            };
            order.sort_by_key(|&i| std::cmp::Reverse(priority(i)));
        }
        let requests_ref = &requests;
        let sends = order
            .into_iter()
            .map(|i| async move { (i, self.request(&requests_ref[i]).await) });
        let mut slots: Vec<Option<Answer>> = (0..requests.len()).map(|_| None).collect();
        for (i, sent) in futures_util::future::join_all(sends).await {
            slots[i] = Some(sent?);
        }
        // Every slot is filled: each request was sent, or the call failed above.
        let answers = slots.into_iter().flatten().collect();
        Ok(Sent { requests, answers })
    }

    /// Registers a request and sends it; the receiver yields the answer.
    pub(crate) async fn request(&self, sent: &Outgoing<'_>) -> Result<Answer, KvError> {
        let to = sent.to;
        let priority = {
            let state = self.state();
            sent.ask.slot().map_or(i32::MAX, |s| state.priority(s))
        };
        // The request's id is drawn once it is this server's turn: ids go in sending order.
        let server = self.servers.iter().position(|&s| s == to);
        let turn = match server {
            Some(i) => Some(self.gates[i].turn(priority).await),
            None => None,
        };
        let (ts, mut rx, have) = {
            let mut state = self.state();
            let (ts, rx) = state.begin_request(to, sent.ask.asked())?;
            (ts, rx, state.copy_version(to, sent.ask.asked()))
        };
        let record = self
            .recorder
            .as_ref()
            .map(|r| r.start(self.recorded(sent, ts)));
        let answer = |rx| Answer { rx, record };
        let msg = sent.ask.clone().into_msg(ts, have, priority);
        let sent_out = self.link.send_segment(to, &msg, sent.value).await;
        drop(turn);
        let Err(e) = sent_out else {
            return Ok(answer(rx));
        };
        // A server that may rejoin: the request waits for it, and goes again then.
        if self.state().is_recovering(to) {
            return Ok(answer(rx));
        }
        // The peer's loss, with its cause (a `Leaving` or the scheduler's word), may be on
        // its way through the receiver: an error naming the cause beats "not connected". So
        // may the news that the server is lost but may rejoin, or has already.
        if let Ok(Ok(reply)) = tokio::time::timeout(LOSS_GRACE, &mut rx).await {
            let (tx, ready) = oneshot::channel();
            let _ = tx.send(reply);
            return Ok(answer(ready));
        }
        if self.state().is_recovering(to) {
            return Ok(answer(rx));
        }
        let error = self.state().abandon_request(ts, to).unwrap_or(e);
        self.settled(record, Err(&error));
        Err(error)
    }

    /// Request `ts` as the flight recorder keeps it.
    fn recorded(&self, sent: &Outgoing<'_>, ts: u64) -> psnet_recorder::Op {
        let (what, slot) = match &sent.ask {
            Ask::Push { key, flags, .. } if flags.init => ("init", *key),
            Ask::Push { key, flags, .. } if flags.pull_back => ("push_pull", *key),
            Ask::Push { key, .. } => ("push", *key),
            Ask::Pull { key, .. } => ("pull", *key),
            Ask::PullRanges { key, .. } => ("pull_rows", *key),
            Ask::PushRanges { key, .. } => ("push_rows", *key),
            Ask::Command { .. } => ("command", 0),
        };
        // A piece of a partitioned key is recorded as the key and the piece's number (its
        // slot, a number past 2^48, named nothing a user knows); a share of an unpartitioned
        // key is told by its server.
        let (key, part) = match self.partitions {
            true => (key_of_slot(slot), (slot >> PIECE_SHIFT) as u32),
            false => (slot, 0),
        };
        psnet_recorder::Op::Request {
            req: ts,
            what,
            key,
            part,
            server: self
                .servers
                .iter()
                .position(|s| *s == sent.to)
                .map_or(u32::MAX, |r| r as u32),
            bytes: sent.value.map_or(0, |v| v.len() as u64),
        }
    }

    /// A request's record ends; a failure dumps the recorder.
    fn settled(&self, record: Option<u64>, outcome: Result<(), &KvError>) {
        let (Some(r), Some(id)) = (&self.recorder, record) else {
            return;
        };
        match outcome {
            Ok(()) => r.finish(id, &[], None),
            Err(e) => {
                r.finish(id, &[], Some(&e.to_string()));
                r.dump_on_failure(&format!("a request failed: {e}"));
            }
        }
    }

    /// The answer to a request; one whose server restarted before answering is sent again
    /// (as often as that happens: the scheduler ends the wait when a server does not come
    /// back within `PSNET_RECOVERY_TIMEOUT`).
    pub(crate) async fn settle(&self, wait: Wait<'_>) -> Reply {
        let Wait { mut sent, mut rx } = wait;
        loop {
            match rx.rx.await.unwrap_or(Err(KvError::Shutdown)) {
                Err(KvError::Rejoined { node, retry }) => {
                    tracing::debug!(%node, ?retry, "sending a request again");
                    if let (Some(r), Some(id)) = (&self.recorder, rx.record) {
                        r.finish(id, &[], Some("its server restarted first: sent again"));
                    }
                    sent = Outgoing {
                        ask: sent.ask.again(retry),
                        ..sent
                    };
                    rx = self.request(&sent).await?;
                }
                reply => {
                    self.settled(rx.record, reply.as_ref().map(|_| ()));
                    return reply;
                }
            }
        }
    }
}
