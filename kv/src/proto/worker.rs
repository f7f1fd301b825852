//! The worker's state, free of I/O: which requests wait for which server, the barrier in
//! progress, the keys' layouts over the servers, compression residuals, the nodes known lost
//! and when the scheduler was last heard. Events come in through `handle_*` (with `now`);
//! requests are registered with [`WorkerState::begin_request`], which hands back the request
//! id and the receiver of its answer. The driver (`crate::worker`) keeps it behind one lock
//! and only moves bytes.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use psnet_compression::{Compressor, Scheme};
use psnet_transport::NodeId;
use tokio::sync::oneshot;

use super::ids::{self, describe, Group, Role, SCHEDULER};
use super::msg::{Exchange, Msg, PushFlags, NO_REQUEST};
use super::packed;
use super::CAUGHT_UP_WAIT;
use crate::error::KvError;
use crate::placement::Placement;
use crate::value::{Dtype, Value};
use crate::wire::Received;

mod copies;
mod failures;
mod keys;
mod layout;
mod priority;

use layout::pieces;
pub use layout::{key_of_slot, piece_key, Layout, Part, PIECE_ALIGN, PIECE_SHIFT};
pub use priority::{Priorities, UNDECLARED};

/// A server's answer: its value, if it carries one.
pub type Reply = Result<Option<Bytes>, KvError>;

/// What a waiting request asked, as far as sending it again to a restarted server needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Asked {
    /// A push of `key` (`init`: its initial value).
    Push {
        /// The key.
        key: u64,
        /// An init.
        init: bool,
    },
    /// A pull of `key` (a stored key): sent again as it was.
    Pull {
        /// The key.
        key: u64,
    },
    /// A command: sent again as it was.
    Other,
}

/// A request waiting for its answer.
struct Waiting {
    to: NodeId,
    asked: Asked,
    tx: oneshot::Sender<Reply>,
}

/// One part of a push, ready to send.
pub struct PreparedPart {
    /// The key.
    pub key: u64,
    /// Its range, server and the key it is stored under.
    pub part: Part,
    /// The push's flags.
    pub flags: PushFlags,
    /// The part's compressed bytes; None: sent straight from the caller's values.
    pub compressed: Option<Vec<u8>>,
}

/// The state of one worker.
pub struct WorkerState {
    rank: u32,
    servers: Vec<NodeId>,
    num_workers: u32,
    placement: Placement,
    /// `PSNET_PARTITION_BYTES`: the size of a share's pieces (0: whole shares).
    partition_bytes: usize,
    /// The pieces' size of `f32` keys defined while compressed pulls are on, where chosen
    /// by default ([`crate::config::DEFAULT_COMPRESSED_PULL_PARTITION_BYTES`]).
    pull_partition_bytes: Option<usize>,
    heartbeat_timeout: Option<Duration>,
    next_ts: u64,
    /// Requests waiting for an answer, by request id.
    pending: HashMap<u64, Waiting>,
    /// `PSNET_RECOVERY_TIMEOUT` is on: a lost server may be restarted, so requests to it wait
    /// for the scheduler's word (it rejoined, or it is declared failed).
    recovery: bool,
    /// Servers lost while recovery is on, waiting to rejoin: why each was lost.
    recovering: BTreeMap<NodeId, String>,
    /// Pushes of a key (not inits) each server acknowledged since this worker defined the
    /// key: a push sent again to a restarted server says where it stands in that order.
    acknowledged: HashMap<(NodeId, u64), u64>,
    barrier: Option<(Group, oneshot::Sender<Result<(), KvError>>)>,
    keys: HashMap<u64, Layout>,
    /// The priority of each key's requests: its declaration order.
    priorities: Priorities,
    residuals: HashMap<u64, Vec<f32>>,
    compressor: Option<Arc<dyn Compressor>>,
    /// Compressed pushes' codes go packed ([`crate::proto::packed`]).
    pack: bool,
    /// Compressed pulls: the copy of every key pulled.
    copies: copies::Copies,
    /// Counts `set_compressor` calls: residuals kept outside this state (on a GPU) restart
    /// from zero when it changes, as [`Self::residuals`] do.
    compression_epoch: u64,
    dead: BTreeMap<NodeId, String>,
    shutdown: bool,
    /// This worker sent `Finalize`: servers closing now are the job ending, not a failure.
    finalizing: bool,
    names: HashMap<String, u64>,
    scheduler_heard: Instant,
    /// The last time this worker had read everything that reached it: the scheduler's
    /// silence counts only up to then (answers queued behind a backlog are not silence).
    caught_up: Instant,
    /// Since when the worker has been waiting for its next message, if it is.
    waiting_since: Option<Instant>,
}

/// Whether losing `node` leaves nothing this worker waits for able to finish: a server takes
/// its shard with it, and without the scheduler the job cannot end.
fn is_fatal(node: NodeId) -> bool {
    node == SCHEDULER || is_server(node)
}

fn is_server(node: NodeId) -> bool {
    matches!(ids::role_rank(node), Some((Role::Server, _)))
}

impl WorkerState {
    /// The worker of rank `rank` in a job with these servers (by rank) and workers;
    /// `heartbeat_timeout`: how long the scheduler may stay silent (None: forever).
    pub fn new(
        rank: u32,
        servers: Vec<NodeId>,
        num_workers: u32,
        placement: Placement,
        heartbeat_timeout: Option<Duration>,
        now: Instant,
    ) -> Self {
        WorkerState {
            rank,
            servers,
            num_workers,
            placement,
            partition_bytes: 0,
            pull_partition_bytes: None,
            heartbeat_timeout,
            next_ts: 1,
            pending: HashMap::new(),
            recovery: false,
            recovering: BTreeMap::new(),
            acknowledged: HashMap::new(),
            barrier: None,
            keys: HashMap::new(),
            priorities: Priorities::new(true),
            residuals: HashMap::new(),
            compressor: None,
            pack: false,
            copies: Default::default(),
            compression_epoch: 0,
            dead: BTreeMap::new(),
            shutdown: false,
            finalizing: false,
            names: HashMap::new(),
            scheduler_heard: now,
            caught_up: now,
            waiting_since: None,
        }
    }

    /// Cuts every key defined from now on of more than `bytes` into pieces of about `bytes`
    /// (`PSNET_PARTITION_BYTES`; 0, the default here: MXNet's shares), but for `f32` keys
    /// defined while compressed pulls are on where [`Self::with_pull_partition_bytes`] says
    /// otherwise. See [`Layout`].
    pub fn with_partition_bytes(mut self, bytes: usize) -> Self {
        self.partition_bytes = bytes;
        self
    }

    /// Cuts `f32` keys defined while compressed pulls are on (whose pieces then travel as
    /// codes both ways) into pieces of about `bytes` instead (the default's choice, where
    /// `PSNET_PARTITION_BYTES` is unset and the job partitions). Every worker must set
    /// compression before it defines its keys, as MXNet asks, for their layouts to agree.
    pub fn with_pull_partition_bytes(mut self, bytes: usize) -> Self {
        self.pull_partition_bytes = Some(bytes);
        self
    }

    /// The size of the pieces of a key of `dtype` defined now (0: none).
    fn piece_bytes(&self, dtype: Dtype) -> usize {
        match (self.pull_partition_bytes, self.copies.scheme(), dtype) {
            (Some(bytes), Some(_), Dtype::F32) if self.partition_bytes > 0 => bytes,
            _ => self.partition_bytes,
        }
    }

    /// Gives requests the priority of their key's declaration order (`on`, the default), or
    /// none (`PSNET_KV_PRIORITY=0`).
    pub fn with_priorities(mut self, on: bool) -> Self {
        self.priorities = Priorities::new(on);
        self
    }

    /// The priority of a request for `slot` (a key, or a piece of one): higher is sent and
    /// answered first ([`Priorities`]).
    pub fn priority(&self, slot: u64) -> i32 {
        self.priorities.of_slot(slot)
    }

    /// Holds requests to a lost server until the scheduler says it rejoined or failed
    /// (`PSNET_RECOVERY_TIMEOUT` on), instead of failing them at once.
    pub fn with_recovery(mut self, on: bool) -> Self {
        self.recovery = on;
        self
    }

    /// Whether `server` is lost and may come back: requests to it wait.
    pub fn is_recovering(&self, server: NodeId) -> bool {
        self.recovering.contains_key(&server)
    }

    /// This worker's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The servers' ids, by rank.
    pub fn servers(&self) -> &[NodeId] {
        &self.servers
    }

    /// Number of workers in the job.
    pub fn num_workers(&self) -> u32 {
        self.num_workers
    }

    /// Whether the scheduler ended the job.
    pub fn is_shutdown(&self) -> bool {
        self.shutdown
    }

    /// This worker told the scheduler it is done: from now on servers may close before the
    /// scheduler's shutdown arrives (they got theirs first), which is no failure.
    pub fn handle_finalize_sent(&mut self) {
        self.finalizing = true;
    }

    /// Why the scheduler counts as lost, if it does.
    pub fn scheduler_lost(&self) -> Option<&str> {
        self.dead.get(&SCHEDULER).map(String::as_str)
    }

    /// The integer key for a string key: assigned in order of first use, from 0 (MXNet's
    /// rule, so every worker must name its keys in the same order).
    pub fn key(&mut self, name: &str) -> u64 {
        let next = self.names.len() as u64;
        *self.names.entry(name.to_string()).or_insert(next)
    }

    /// Sets (or clears) gradient compression; residuals start again from zero.
    pub fn set_compressor(&mut self, compressor: Option<Arc<dyn Compressor>>) {
        self.compressor = compressor;
        self.residuals.clear();
        self.compression_epoch += 1;
    }

    /// Whether compressed pushes' codes go packed ([`crate::proto::packed`]).
    pub fn set_packing(&mut self, pack: bool) {
        self.pack = pack;
    }

    /// Compressed pulls on with `scheme`'s codes, or off (see [`crate::proto::pulled`]):
    /// pulls then say the version of this worker's copy, and answers apply to it.
    pub fn set_pull_compression(&mut self, scheme: Option<Scheme>) {
        self.copies.set_scheme(scheme);
    }

    /// The version of this worker's copy of what request `asked` of `to` pulls (a pull, or
    /// a push that answers with the value), with compressed pulls.
    pub fn copy_version(&self, to: NodeId, asked: Asked) -> Option<u64> {
        match asked {
            Asked::Pull { key } | Asked::Push { key, init: false } => self.copies.version(to, key),
            _ => None,
        }
    }

    /// The compression in force (scheme and threshold), and a number that changes whenever
    /// it is set again (when residuals start again from zero).
    pub fn compression(&self) -> (Option<(Scheme, f32)>, u64) {
        let c = self
            .compressor
            .as_ref()
            .map(|c| (c.scheme(), c.threshold()));
        (c, self.compression_epoch)
    }

    /// The loss that fails a request to `to` at once, if any.
    fn blocking_loss(&self, to: NodeId) -> Option<KvError> {
        self.dead
            .iter()
            .find(|(id, _)| **id == to || is_fatal(**id))
            .map(|(node, reason)| KvError::NodeLost {
                node: describe(*node),
                reason: reason.clone(),
            })
    }

    /// Registers a request to `to` asking `asked`: its id, and where its answer will arrive.
    /// Fails at once if `to`, a server or the scheduler is known lost (a server that may
    /// still rejoin is not: the request waits for it).
    pub fn begin_request(
        &mut self,
        to: NodeId,
        asked: Asked,
    ) -> Result<(u64, oneshot::Receiver<Reply>), KvError> {
        if let Some(e) = self.blocking_loss(to) {
            return Err(e);
        }
        let ts = self.next_ts;
        self.next_ts += 1;
        let (tx, rx) = oneshot::channel();
        self.pending.insert(ts, Waiting { to, asked, tx });
        Ok((ts, rx))
    }

    /// The request `ts` could not be sent: forget it. Returns the loss that explains it, if
    /// one is known by now. (To a server that may still rejoin, the driver keeps the request
    /// instead, see [`Self::is_recovering`]: its answer is then a [`KvError::Rejoined`].)
    pub fn abandon_request(&mut self, ts: u64, to: NodeId) -> Option<KvError> {
        self.pending.remove(&ts);
        self.blocking_loss(to)
    }

    /// Enters a barrier of `group`: the receiver yields its outcome. Fails at once if one is
    /// already in progress or a node is known lost.
    pub fn begin_barrier(
        &mut self,
        group: Group,
    ) -> Result<oneshot::Receiver<Result<(), KvError>>, KvError> {
        if self.barrier.is_some() {
            return Err(KvError::Invalid("a barrier is already in progress".into()));
        }
        if let Some((node, reason)) = self.dead.iter().next() {
            return Err(KvError::Barrier(format!(
                "{} is gone: {reason}",
                describe(*node)
            )));
        }
        let (tx, rx) = oneshot::channel();
        self.barrier = Some((group, tx));
        Ok(rx)
    }

    /// The barrier's message could not be sent: forget it.
    pub fn abandon_barrier(&mut self) {
        self.barrier = None;
    }

    /// Whether `from` may send `msg` to a worker: answers only from the server asked, job
    /// control only from the scheduler.
    pub fn entitled(&self, from: NodeId, msg: &Msg) -> bool {
        match msg {
            Msg::Done { ts }
            | Msg::Pulled { ts, .. }
            | Msg::Failed { ts, .. }
            | Msg::PeerFailed { ts, .. } => self.pending.get(ts).is_none_or(|w| w.to == from),
            Msg::NodeFailed { .. }
            | Msg::Rejoined { .. }
            | Msg::BarrierDone { .. }
            | Msg::BarrierFailed { .. }
            | Msg::Heartbeat
            | Msg::Shutdown => from == SCHEDULER,
            _ => true,
        }
    }

    /// One event from the transport, at `now`.
    pub fn handle_received(&mut self, event: Received, now: Instant) {
        if matches!(&event, Received::Msg { from, .. } | Received::Connected(from) if *from == SCHEDULER)
        {
            self.scheduler_heard = now;
            self.caught_up = self.caught_up.max(now);
        }
        match event {
            Received::Msg { from, msg, .. } if !self.entitled(from, &msg) => {
                tracing::warn!(from = %describe(from), ?msg,
                    "refused: this node may not send this message to a worker");
            }
            Received::Msg { from, msg, value } => match msg {
                Msg::Done { ts } => {
                    if let Some(w) = self.pending.remove(&ts) {
                        // Counted only where a server may rejoin: a map entry per key
                        // and server is memory a job without recovery does not need.
                        if let (Asked::Push { key, init: false }, true) = (w.asked, self.recovery) {
                            *self.acknowledged.entry((w.to, key)).or_default() += 1;
                        }
                        let _ = w.tx.send(Ok(value));
                    }
                }
                Msg::Pulled { ts, version, form } => {
                    if let Some(w) = self.pending.remove(&ts) {
                        if let (Asked::Push { key, init: false }, true) = (w.asked, self.recovery) {
                            *self.acknowledged.entry((w.to, key)).or_default() += 1;
                        }
                        let reply = match w.asked {
                            Asked::Pull { key } | Asked::Push { key, .. } => self
                                .copies
                                .handle_pulled(w.to, key, version, form, value)
                                .map(Some)
                                .map_err(|reason| KvError::Protocol {
                                    node: describe(from),
                                    reason,
                                }),
                            Asked::Other => Err(KvError::Protocol {
                                node: describe(from),
                                reason: format!("a pull's answer to request {ts}, a command"),
                            }),
                        };
                        let _ = w.tx.send(reply);
                    }
                }
                // A round that waited for a worker now gone: this worker fails on that
                // one's account (exit 2, the launcher blames the lost one).
                Msg::PeerFailed { ts, lost, reason } => {
                    if let Some(w) = self.pending.remove(&ts) {
                        let _ = w.tx.send(Err(KvError::NodeLost {
                            node: describe(lost),
                            reason: format!("{reason} (answered by {})", describe(from)),
                        }));
                    }
                }
                Msg::Failed { ts, reason } => match self.pending.remove(&ts) {
                    Some(w) => {
                        let _ = w.tx.send(Err(KvError::Remote {
                            node: describe(from),
                            reason,
                        }));
                    }
                    None if ts == NO_REQUEST => tracing::warn!(from = %describe(from), %reason,
                        "a message of this worker was refused"),
                    None => tracing::debug!(from = %describe(from), ts, %reason,
                        "failure of a request no longer waited for"),
                },
                Msg::BarrierDone { group } => {
                    if matches!(&self.barrier, Some((g, _)) if *g == group) {
                        if let Some((_, tx)) = self.barrier.take() {
                            let _ = tx.send(Ok(()));
                        }
                    }
                }
                Msg::BarrierFailed { reason, .. } => self.fail_barrier(reason),
                Msg::NodeFailed { id, reason } => self.handle_failed(id, reason),
                Msg::Rejoined { node } => self.handle_rejoined(node.id),
                Msg::Shutdown => self.shutdown = true,
                // The scheduler's answer to a heartbeat: heard above.
                Msg::Heartbeat => {}
                Msg::Leaving { reason } => self.handle_lost(from, format!("it left: {reason}")),
                other => {
                    tracing::warn!(from = %describe(from), ?other, "unexpected message at a worker")
                }
            },
            Received::Malformed {
                from,
                exchange,
                reason,
            } => self.handle_malformed(from, exchange, reason),
            Received::Lost { peer, reason } => self.handle_lost(peer, reason),
            Received::Connected(_) => {}
        }
    }
}

#[cfg(test)]
mod tests;
