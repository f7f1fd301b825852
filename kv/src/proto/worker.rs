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

    /// Lays `key` out over the servers for `len` elements of type `dtype` ([`Layout`]:
    /// MXNet's shares, compressed ones when compression is on, or pieces).
    pub fn define_key(&mut self, key: u64, len: usize, dtype: Dtype) -> Result<(), KvError> {
        if self.partition_bytes > 0 && key_of_slot(key) != key {
            return Err(KvError::Invalid(format!(
                "key {key}: keys from 2^{PIECE_SHIFT} up are where the pieces of partitioned \
                 keys are stored (PSNET_PARTITION_BYTES={}); use smaller keys or set \
                 PSNET_PARTITION_BYTES=0",
                self.partition_bytes
            )));
        }
        let whole = |server, offset, len| Part {
            server,
            offset,
            len,
            slot: key,
        };
        let piece_bytes = self.piece_bytes(dtype);
        let parts = if piece_bytes > 0 && len.saturating_mul(dtype.size()) > piece_bytes {
            pieces(
                key,
                len,
                dtype.size(),
                piece_bytes,
                self.placement.server_for(key),
                self.placement.num_servers(),
            )
        } else {
            match self.compressor.as_ref().filter(|_| dtype == Dtype::F32) {
                Some(c) => self
                    .placement
                    .compressed_parts(key, len, c.scheme().factor())
                    .iter()
                    .map(|p| whole(p.server, p.offset, p.len))
                    .collect(),
                None => self
                    .placement
                    .parts(key, len)
                    .iter()
                    .map(|p| whole(p.server, p.offset, p.len))
                    .collect(),
            }
        };
        self.keys.insert(
            key,
            Layout {
                len,
                dtype,
                parts,
                rows: None,
            },
        );
        self.priorities.declare(key);
        // An init starts the key's updates again on every server.
        self.acknowledged.retain(|(_, k), _| key_of_slot(*k) != key);
        Ok(())
    }

    /// How many servers a key of `len` elements is spread over (1 below
    /// `MXNET_KVSTORE_BIGARRAY_BOUND`, every server from it).
    pub fn servers_for(&self, key: u64, len: usize) -> usize {
        self.placement.parts(key, len).len()
    }

    /// Declares `key` (defined) row-sparse, with rows of `width` elements: from now on this
    /// worker pushes it by rows only ([`crate::Worker::push_rows`]) and refuses a dense push.
    pub fn declare_rows(&mut self, key: u64, width: usize) -> Result<(), KvError> {
        let layout = self.keys.get_mut(&key).ok_or(KvError::UnknownKey(key))?;
        if width == 0 || layout.len % width != 0 {
            return Err(KvError::Invalid(format!(
                "key {key}: rows of {width} elements do not divide its {} elements",
                layout.len
            )));
        }
        layout.rows = Some(width);
        Ok(())
    }

    /// A dense push of a row-sparse key is refused, naming the call to use.
    pub(crate) fn dense_push(&self, key: u64) -> Result<(), KvError> {
        match self.keys.get(&key).and_then(|l| l.rows) {
            Some(width) => Err(KvError::Invalid(format!(
                "key {key} is row-sparse (rows of {width} elements): push its rows with \
                 push_rows, not a dense push"
            ))),
            None => Ok(()),
        }
    }

    /// `key`'s layout, if it is defined.
    pub fn defined_layout(&self, key: u64) -> Option<&Layout> {
        self.keys.get(&key)
    }

    /// The layout of `key`, checked against `len` elements of type `dtype`.
    pub fn layout(&self, key: u64, len: usize, dtype: Dtype) -> Result<&Layout, KvError> {
        let layout = self.keys.get(&key).ok_or(KvError::UnknownKey(key))?;
        if layout.dtype != dtype {
            return Err(KvError::Invalid(format!(
                "key {key} was initialized with {} values, given {dtype}",
                layout.dtype
            )));
        }
        if layout.len != len {
            return Err(KvError::SizeMismatch {
                key,
                expected: layout.len,
                got: len,
            });
        }
        Ok(layout)
    }

    /// The parts of a push of `values` to `key`: each part's range, flags and, when
    /// compression is on, its compressed bytes (the residual updated as MXNet does).
    pub fn prepare_push<V: Value>(
        &mut self,
        key: u64,
        values: &[V],
        pull_back: bool,
    ) -> Result<Vec<PreparedPart>, KvError> {
        self.dense_push(key)?;
        let layout = self.layout(key, values.len(), V::DTYPE)?.clone();
        let floats: Option<&[f32]> = match (&self.compressor, V::DTYPE) {
            (None, _) => None,
            (Some(_), Dtype::F32) => Some(bytemuck::cast_slice(values)),
            (Some(_), dtype) => {
                return Err(KvError::Invalid(format!(
                    "key {key}: gradient compression takes float32 values, given {dtype}"
                )))
            }
        };
        let mut parts = Vec::with_capacity(layout.parts.len());
        for p in &layout.parts {
            let compressed = match (&self.compressor, floats) {
                (Some(c), Some(floats)) => {
                    let slice = &floats[p.offset..p.offset + p.len];
                    let mut out = vec![0u8; c.compressed_len(p.len)];
                    let residual = self
                        .residuals
                        .entry(key)
                        .or_insert_with(|| vec![0.0; layout.len]);
                    c.quantize(slice, &mut residual[p.offset..p.offset + p.len], &mut out)
                        .map_err(|e| KvError::Invalid(e.to_string()))?;
                    if self.pack {
                        out = packed::pack(&out).map_err(|e| KvError::Invalid(e.to_string()))?;
                    }
                    Some(out)
                }
                _ => None,
            };
            parts.push(PreparedPart {
                key,
                part: *p,
                flags: PushFlags {
                    init: false,
                    compressed: compressed.is_some(),
                    packed: compressed.is_some() && self.pack,
                    pull_back,
                    retry: None,
                    dtype: V::DTYPE,
                    have: None,
                },
                compressed,
            });
        }
        Ok(parts)
    }

    /// The parts of a push of `n_elems` values of `dtype` sent straight from device memory:
    /// None when gradient compression is on (the values must be quantized where they are read).
    pub fn prepare_device_push(
        &mut self,
        key: u64,
        n_elems: usize,
        dtype: Dtype,
        pull_back: bool,
    ) -> Result<Option<Vec<PreparedPart>>, KvError> {
        self.dense_push(key)?;
        let layout = self.layout(key, n_elems, dtype)?;
        if self.compressor.is_some() {
            return Ok(None);
        }
        let parts = layout
            .parts
            .iter()
            .map(|p| PreparedPart {
                key,
                part: *p,
                flags: PushFlags {
                    init: false,
                    compressed: false,
                    pull_back,
                    retry: None,
                    dtype,
                    have: None,
                    packed: false,
                },
                compressed: None,
            })
            .collect();
        Ok(Some(parts))
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

    /// What to tell before `event` is handled (and the worker's calls fail): a worker that
    /// lost a server says so (`Leaving`) to the scheduler and the other servers. They may see
    /// this worker's connection close before the server's; with this, they name the server,
    /// not the worker.
    pub fn leaving_before(&self, event: &Received) -> Vec<(NodeId, Msg)> {
        match event {
            Received::Lost { peer, reason } if is_server(*peer) && !self.recovery => {
                self.leaving(*peer, reason)
            }
            _ => Vec::new(),
        }
    }

    /// The `Leaving` messages a worker about to fail because `cause` is gone sends to every
    /// live peer its failure reaches (the scheduler and the servers, `cause` aside); none
    /// while the job ends normally or once `cause` was already known lost.
    pub fn leaving(&self, cause: NodeId, reason: &str) -> Vec<(NodeId, Msg)> {
        if self.shutdown || self.finalizing || self.dead.contains_key(&cause) {
            return Vec::new();
        }
        let msg = Msg::Leaving {
            reason: format!("{} is gone: {reason}", describe(cause)),
        };
        std::iter::once(SCHEDULER)
            .chain(self.servers.iter().copied())
            .filter(|to| *to != cause && !self.dead.contains_key(to))
            .map(|to| (to, msg.clone()))
            .collect()
    }

    /// A message from `from` that could not be read: if it answers a request of this worker
    /// to `from`, that request fails naming it; anything else is logged and dropped.
    fn handle_malformed(&mut self, from: NodeId, exchange: Option<Exchange>, reason: String) {
        if let Some(Exchange::Answer(ts)) = exchange {
            if matches!(self.pending.get(&ts), Some(w) if w.to == from) {
                if let Some(w) = self.pending.remove(&ts) {
                    let _ = w.tx.send(Err(KvError::Protocol {
                        node: describe(from),
                        reason: format!("unreadable answer: {reason}"),
                    }));
                }
                return;
            }
        }
        tracing::warn!(from = %describe(from), %reason, "dropping a malformed kv message");
    }

    /// The worker waits for its next message from `now` (`Some`), or got one (`None`): a
    /// wait of [`CAUGHT_UP_WAIT`] or more means it had read everything that reached it.
    pub fn handle_waiting(&mut self, now: Instant, waiting: bool) {
        if let Some(since) = self.waiting_since.take() {
            if now.saturating_duration_since(since) >= CAUGHT_UP_WAIT {
                self.caught_up = self.caught_up.max(now);
            }
        }
        if waiting {
            self.waiting_since = Some(now);
        }
    }

    /// Time passes: a scheduler silent past the heartbeat timeout, as of the last time this
    /// worker had caught up with what reached it, counts as lost. Returns true when that
    /// happened now.
    pub fn handle_timeout(&mut self, now: Instant) -> bool {
        match self.scheduler_silence(now) {
            Some(reason) => {
                self.handle_lost(SCHEDULER, reason);
                true
            }
            None => false,
        }
    }

    /// Why the scheduler counts as lost at `now`, if it does (see [`Self::handle_timeout`]);
    /// the driver tells the servers ([`Self::leaving`]) before it hands the loss over.
    pub fn scheduler_silence(&mut self, now: Instant) -> Option<String> {
        let limit = self.heartbeat_timeout?;
        if self.shutdown || self.dead.contains_key(&SCHEDULER) {
            return None;
        }
        if self
            .waiting_since
            .is_some_and(|since| now.saturating_duration_since(since) >= CAUGHT_UP_WAIT)
        {
            self.caught_up = self.caught_up.max(now);
        }
        let quiet = self
            .caught_up
            .min(now)
            .saturating_duration_since(self.scheduler_heard);
        (quiet > limit).then(|| {
            format!(
                "silent for {:.1} s (PS_HEARTBEAT_TIMEOUT={} s): stopped or cut off",
                quiet.as_secs_f64(),
                limit.as_secs_f64()
            )
        })
    }

    /// This worker's transport closed: nothing more will be answered, barriers included.
    pub fn handle_closed(&mut self) {
        for (_, w) in self.pending.drain() {
            let _ = w.tx.send(Err(KvError::Shutdown));
        }
        self.fail_barrier("this worker's transport is closed".into());
    }

    /// The scheduler declared `node` failed: for a server that was awaited, it did not
    /// rejoin in time, and what waited on it fails now.
    fn handle_failed(&mut self, node: NodeId, reason: String) {
        self.recovering.remove(&node);
        if !self.shutdown && !self.dead.contains_key(&node) {
            self.declare_lost(node, reason);
        }
    }

    /// A lost server was restarted and took its id back (the driver has learned its new
    /// address and token and dialled it): every request still waiting on it is answered
    /// [`KvError::Rejoined`], so that its call sends it again. A push says how many of this
    /// worker's pushes of its key the server acknowledged before it (its place in the
    /// key's order), so that one the server applied before it died is not applied twice.
    pub fn handle_rejoined(&mut self, server: NodeId) {
        let lost = self.recovering.remove(&server);
        if self.dead.contains_key(&server) {
            return;
        }
        tracing::warn!(node = %describe(server), lost = lost.as_deref().unwrap_or("-"),
            "server rejoined: sending again what it had not answered");
        let mut waiting: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, w)| w.to == server)
            .map(|(ts, _)| *ts)
            .collect();
        // Sent in request order, so a key's pushes take their places in the order sent.
        waiting.sort_unstable();
        let mut ahead: HashMap<u64, u64> = HashMap::new();
        for ts in waiting {
            let Some(w) = self.pending.remove(&ts) else {
                continue;
            };
            let retry = match w.asked {
                Asked::Push { key, init: false } => {
                    let before = ahead.entry(key).or_default();
                    let place =
                        self.acknowledged.get(&(server, key)).copied().unwrap_or(0) + *before;
                    *before += 1;
                    Some(place)
                }
                Asked::Push { init: true, .. } => Some(0),
                Asked::Pull { .. } | Asked::Other => None,
            };
            let _ = w.tx.send(Err(KvError::Rejoined {
                node: describe(server),
                retry,
            }));
        }
    }

    /// A node is gone (the transport lost it, the scheduler declared it failed, or it left).
    pub fn handle_lost(&mut self, node: NodeId, reason: String) {
        if self.shutdown || self.dead.contains_key(&node) {
            return;
        }
        if self.recovery && is_server(node) && !self.finalizing {
            if let std::collections::btree_map::Entry::Vacant(e) = self.recovering.entry(node) {
                tracing::warn!(node = %describe(node), %reason,
                    "server lost: waiting for it to restart and rejoin (PSNET_RECOVERY_TIMEOUT)");
                e.insert(reason);
            }
            return;
        }
        self.declare_lost(node, reason);
    }

    /// `node` is gone for good: what waits on it fails (everything, for a server or the
    /// scheduler).
    fn declare_lost(&mut self, node: NodeId, reason: String) {
        if self.finalizing && node != SCHEDULER {
            tracing::debug!(node = %describe(node), %reason, "peer closed while the job ends");
        } else {
            tracing::warn!(node = %describe(node), %reason, "node lost");
        }
        self.dead.insert(node, reason.clone());
        // A lost server takes its shard with it: the keys with a part there, and the
        // dist_sync rounds that other workers (failing on it too) will never finish, cannot
        // complete on any server; without the scheduler the job cannot end. So every request
        // fails now rather than wait forever.
        self.fail_pending_to(node, &reason, is_fatal(node));
        if is_fatal(node) {
            // Nor can a barrier the other workers may never reach.
            self.fail_barrier(format!("{} is gone: {reason}", describe(node)));
        }
    }

    /// Fails every request waiting on `node` (every request at all when `all`).
    fn fail_pending_to(&mut self, node: NodeId, reason: &str, all: bool) {
        let ts: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, w)| all || w.to == node)
            .map(|(ts, _)| *ts)
            .collect();
        for ts in ts {
            if let Some(w) = self.pending.remove(&ts) {
                let _ = w.tx.send(Err(KvError::NodeLost {
                    node: describe(node),
                    reason: reason.to_string(),
                }));
            }
        }
    }

    fn fail_barrier(&mut self, reason: String) {
        if let Some((_, tx)) = self.barrier.take() {
            let _ = tx.send(Err(KvError::Barrier(reason)));
        }
    }
}

#[cfg(test)]
mod tests;
