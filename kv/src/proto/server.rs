//! A server's state: the stored shard of every key, `dist_sync` rounds, `dist_async` updates.
//! No I/O: pushes, pulls and commands come in through `handle_*`, and what to answer comes out
//! of [`ServerState::poll_output`]; the driver sends it.
//!
//! `dist_sync`: a round of a key completes when every worker has pushed it once. The pushes
//! are summed in worker-rank order whatever order they arrive in (a push that arrives early
//! is held, without copying, until the ranks before it are in), so results are
//! bit-reproducible from run to run. Then the updater runs (or, without one, the sum
//! replaces the stored value, as MXNet does), and every push of the round is answered. A
//! second push by one worker within a round waits for the next round.
//!
//! `dist_async`: each push is applied at once; an updater is required.
//!
//! Bad requests are answered [`Output::Failed`] with a reason naming the key and the sizes,
//! and change nothing: a push or pull of a key never initialized, counts or byte lengths that
//! disagree with the key, compressed bytes the server's compression does not expect, metadata
//! that does not decode ([`ServerState::handle_malformed`]). Commands that would corrupt what
//! is under way are refused too: compression settings other than those in force (pushes made
//! with other settings would be decoded wrongly), a switch to `dist_async` or a re-`init`
//! while a `dist_sync` round holds pushes (they would never be answered). No count from a
//! header is ever used to allocate.
//!
//! # Checkpoints
//!
//! With checkpoints on ([`ServerState::with_checkpoints`]), every change the server
//! acknowledges comes out first as an [`Output::Journal`] record, queued before the answers
//! that acknowledge it: an `init`, an optimizer, compression or mode command, each completed
//! `dist_sync` round (its merged gradient) and each `dist_async` push (its payload). The
//! driver appends the record to the journal before it sends what follows. Every
//! `checkpoint_every` updates of a key, and on a worker's [`CommandKind::Checkpoint`], an
//! [`Output::Snapshot`] of the whole shard ([`ServerState::snapshot`]) replaces the previous
//! snapshot and starts an empty journal. [`ServerState::restore`] of the last snapshot
//! followed by [`ServerState::apply_journal`] of the records after it, in order, rebuilds a
//! state bit-identical to the one that wrote them, through the same code that applied the
//! changes live; records carry sequence numbers, so that records the snapshot already holds
//! are skipped and a missing one is an error.
//!
//! What a snapshot and the journal hold: the mode, the compression settings, the optimizer
//! and every key's optimizer state, every key's value and update count, and the sequence
//! number. What they deliberately do not hold, because nothing of it was acknowledged or it
//! describes the running job rather than the shard: the pushes of a `dist_sync` round not yet
//! complete and pushes deferred to a later round (their workers were never answered and
//! resend them), the workers known to be lost, answers not yet sent, scratch buffers, and the
//! counts towards the next periodic snapshot.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use psnet_compression::Compressor;

use super::msg::{Exchange, PushFlags, NO_REQUEST};
// The tests of this module's files take their names from here.
#[cfg(test)]
use super::msg::CommandKind;
use super::pulled::{Form, KvCompression, Shadow};
use super::sum;
use crate::updater::{OptimizerSpec, Updater};
use crate::value::Dtype;

mod commands;
mod journal;
mod push;
mod round;
mod row_push;
mod rows;
mod snapshot;

pub use commands::CommandError;
pub use row_push::RowsPush;
pub use rows::RowsGone;

#[doc(hidden)]
pub use journal::fuzz_decode;

/// Synchronous or asynchronous updates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `dist_sync`: merge every worker's push, then update.
    Sync,
    /// `dist_async`: update on every push.
    Async,
}

/// A push as the server receives it.
#[derive(Clone, Debug)]
pub struct Push {
    /// The pushing worker's rank.
    pub rank: u32,
    /// Its request id.
    pub ts: u64,
    /// The key.
    pub key: u64,
    /// Init / compressed / pull-back.
    pub flags: PushFlags,
    /// Elements of this server's part.
    pub n_elems: u64,
    /// f32 little-endian values, or compressed bytes.
    pub payload: Bytes,
}

/// What the driver must send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    /// Request `ts` of worker `rank` is done; with `value` set, send that key's stored value
    /// ([`ServerState::answer_value`]).
    Done {
        /// Worker rank.
        rank: u32,
        /// Request id.
        ts: u64,
        /// Key whose value goes with the answer (pulls, push-pulls).
        value: Option<u64>,
        /// With compressed pulls: the version of the worker's copy of that key.
        have: Option<u64>,
    },
    /// Request `ts` of worker `rank` failed.
    Failed {
        /// Worker rank.
        rank: u32,
        /// Request id.
        ts: u64,
        /// Why, naming the key and what was wrong.
        reason: String,
    },
    /// Request `ts` of worker `rank` cannot complete because worker `lost` is gone.
    PeerFailed {
        /// Worker rank.
        rank: u32,
        /// Request id.
        ts: u64,
        /// The lost worker's rank.
        lost: u32,
        /// Why, naming the key and the loss.
        reason: String,
    },
    /// Request `ts` of worker `rank`, a row pull, is answered with these ranges of these
    /// keys ([`ServerState::rows_value`]).
    Rows {
        /// Worker rank.
        rank: u32,
        /// Request id.
        ts: u64,
        /// Each key (or piece) and an element range of it, in the order asked.
        ranges: Vec<(u64, std::ops::Range<usize>)>,
    },
    /// With checkpoints on: append this record to the journal before sending any output that
    /// follows (the answers that acknowledge its change follow it). See
    /// [`ServerState::apply_journal`] for its format.
    Journal(Vec<u8>),
    /// With checkpoints on: make this ([`ServerState::snapshot`]'s bytes) the server's
    /// snapshot and start an empty journal, before sending any output that follows. If the
    /// snapshot cannot be written, the previous snapshot and the journal (which holds every
    /// change since) still make a complete checkpoint.
    Snapshot {
        /// The snapshot.
        bytes: Vec<u8>,
        /// The worker's request that asked for it (rank, request id): answer it `Done` once
        /// the snapshot is written, or `Failed` if it cannot be.
        reply: Option<(u32, u64)>,
    },
}

/// The bytes of a value an answer carries.
#[derive(Clone, Debug)]
pub enum AnswerValue {
    /// An `f32` key's value, shared with the state (no copy).
    Shared(Arc<Vec<f32>>),
    /// A half key's value, rounded to its type.
    Narrow(Vec<u8>),
    /// A compressed pull's codes, shared with the state.
    Codes(Arc<Vec<u8>>),
    /// Nothing (a compressed pull whose worker is up to date).
    Empty,
}

impl AnswerValue {
    /// The wire bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            AnswerValue::Shared(v) => sum::as_bytes(v),
            AnswerValue::Narrow(b) => b,
            AnswerValue::Codes(c) => c,
            AnswerValue::Empty => &[],
        }
    }
}

/// A compressed pull's answer: the version of the copy it makes and how its value reads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PulledAnswer {
    /// The copy's version once applied.
    pub version: u64,
    /// How to read the value.
    pub form: Form,
}

/// A push waiting in a round.
#[derive(Debug)]
struct Arrived {
    ts: u64,
    pull_back: bool,
    /// The pusher's copy version (compressed pulls).
    have: Option<u64>,
    /// Held until the ranks before it are summed.
    payload: Option<Bytes>,
    compressed: bool,
}

#[derive(Debug, Default)]
struct Round {
    /// Sum of ranks `0..next`.
    merged: Vec<f32>,
    next: u32,
    arrived: Vec<Option<Arrived>>,
    count: u32,
    deferred: VecDeque<Push>,
}

struct KeyState {
    /// Shared with answers still being sent; updated in place once they are gone (a copy is
    /// made only if an update overtakes a send).
    value: Arc<Vec<f32>>,
    round: Round,
    /// Updates applied since the key's init (completed rounds, async pushes).
    updates: u64,
    /// `dist_async` pushes applied since the key's init, by worker rank (empty until the
    /// first): a push sent again to a restarted server is found applied by these counts.
    pushes_by_worker: Vec<u64>,
    /// Updates since the last snapshot (not checkpointed).
    since_snapshot: u64,
    /// The element type it was initialized with: pushes carry it, pulls answer in it; the
    /// value itself is kept in `f32` (see [`crate::value`]).
    dtype: Dtype,
    /// With compressed pulls, an `f32` key's copy as the workers hold it.
    shadow: Option<Shadow>,
}

impl KeyState {
    /// Bytes of values this key holds: its value, and the workers' copy if it keeps one.
    fn held_bytes(&self) -> u64 {
        let copy = self.shadow.as_ref().map_or(0, |s| s.copy.len());
        (self.value.len() + copy) as u64 * 4
    }

    fn new(value: Vec<f32>, updates: u64) -> Self {
        KeyState {
            value: Arc::new(value),
            round: Round::default(),
            updates,
            pushes_by_worker: Vec::new(),
            since_snapshot: 0,
            dtype: Dtype::F32,
            shadow: None,
        }
    }
}

/// One server's store and round bookkeeping.
pub struct ServerState {
    num_workers: u32,
    mode: Mode,
    /// The updater and the spec it was built from.
    updater: Option<Box<dyn Updater>>,
    optimizer: Option<OptimizerSpec>,
    compressor: Option<Box<dyn Compressor>>,
    /// The compression settings in force; None until a worker sets them (no compression).
    compression: Option<KvCompression>,
    keys: HashMap<u64, KeyState>,
    /// Bytes of values held, and the most allowed.
    key_bytes: u64,
    key_limit: u64,
    dead: BTreeMap<u32, String>,
    out: VecDeque<Output>,
    /// Changes applied (the sequence number of the last journal record).
    seq: u64,
    /// Checkpoints on: a snapshot every this many updates of a key (0: only on request).
    checkpoint_every: Option<u64>,
    /// The commands in force that worker 0 gave (optimizer, mode, compression): another
    /// worker's command of the kind is answered only if it agrees, and changes nothing
    /// ([`Self::handle_command_request`]).
    set_by_rank0: std::collections::BTreeSet<u8>,
    /// Other workers' commands of those kinds that came before worker 0's: answered when
    /// worker 0's comes.
    waiting_for_rank0: Vec<commands::Waiting>,
    /// `dist_sync` rounds of row-pushed keys, by the key the workers declared.
    row_rounds: HashMap<u64, row_push::RowRound>,
}

impl std::fmt::Debug for ServerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerState")
            .field("num_workers", &self.num_workers)
            .field("mode", &self.mode)
            .field("optimizer", &self.optimizer)
            .field("compression", &self.compression)
            .field("keys", &self.keys.len())
            .field("key_bytes", &self.key_bytes)
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

impl ServerState {
    /// A server for `num_workers` workers, in `dist_sync` mode, with no updater.
    pub fn new(num_workers: u32) -> Self {
        ServerState {
            num_workers: num_workers.max(1),
            mode: Mode::Sync,
            updater: None,
            optimizer: None,
            compressor: None,
            compression: None,
            keys: HashMap::new(),
            key_bytes: 0,
            key_limit: u64::MAX,
            dead: BTreeMap::new(),
            out: VecDeque::new(),
            seq: 0,
            checkpoint_every: None,
            set_by_rank0: Default::default(),
            waiting_for_rank0: Vec::new(),
            row_rounds: HashMap::new(),
        }
    }

    /// Turns checkpoints on: every acknowledged change comes out as an [`Output::Journal`]
    /// record before its answers, and an [`Output::Snapshot`] every `every` updates of a key
    /// (`PSNET_CHECKPOINT_EVERY`; 0: only when a worker asks). Off by default, at no cost.
    pub fn with_checkpoints(mut self, every: u64) -> Self {
        self.checkpoint_every = Some(every);
        self
    }

    /// Whether checkpoints are on.
    pub fn checkpoints(&self) -> bool {
        self.checkpoint_every.is_some()
    }

    /// Changes applied so far: the sequence number of the last journal record (counted with
    /// checkpoints off too).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Updates applied to `key` since its init (completed `dist_sync` rounds, `dist_async`
    /// pushes).
    pub fn updates(&self, key: u64) -> Option<u64> {
        self.keys.get(&key).map(|k| k.updates)
    }

    /// The keys held, in ascending order.
    pub fn keys(&self) -> Vec<u64> {
        let mut keys: Vec<u64> = self.keys.keys().copied().collect();
        keys.sort_unstable();
        keys
    }

    /// Bounds the bytes of key values this server holds (`PSNET_KV_SERVER_KEY_BYTES`): an
    /// init that would go beyond fails with an error naming the limit.
    pub fn with_key_limit(mut self, bytes: u64) -> Self {
        self.key_limit = bytes;
        self
    }

    /// The current mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The stored value of `key`.
    pub fn value(&self, key: u64) -> Option<&[f32]> {
        self.keys.get(&key).map(|k| k.value.as_slice())
    }

    /// The stored value of `key`, shared (to send without copying while the state goes on).
    pub fn shared_value(&self, key: u64) -> Option<Arc<Vec<f32>>> {
        self.keys.get(&key).map(|k| k.value.clone())
    }

    /// The element type `key` was initialized with.
    pub fn dtype(&self, key: u64) -> Option<Dtype> {
        self.keys.get(&key).map(|k| k.dtype)
    }

    /// What an answer carrying `key`'s value sends: the `f32` value itself, shared, or its
    /// rounding to the key's half type. With compressed pulls, to a worker whose copy is at
    /// version `have`: the workers' copy, the codes of its last change, or nothing, and how
    /// to read it.
    pub fn answer_value(
        &self,
        key: u64,
        have: Option<u64>,
    ) -> Option<(AnswerValue, Option<PulledAnswer>)> {
        let k = self.keys.get(&key)?;
        if let Some(shadow) = &k.shadow {
            let mut form = shadow.answer(have);
            let pack = self.compression.is_some_and(|c| c.pack);
            let value = match (form, &shadow.last) {
                (Form::Full, _) => AnswerValue::Shared(shadow.copy.clone()),
                (Form::Delta { scale }, Some(d)) => match pack.then(|| d.packed()).flatten() {
                    Some(packed) => {
                        form = Form::Packed { scale };
                        AnswerValue::Codes(packed)
                    }
                    None => AnswerValue::Codes(d.codes.clone()),
                },
                _ => AnswerValue::Empty,
            };
            let version = shadow.version;
            return Some((value, Some(PulledAnswer { version, form })));
        }
        Some(match k.dtype {
            Dtype::F32 => (AnswerValue::Shared(k.value.clone()), None),
            half => (AnswerValue::Narrow(half.narrow(&k.value)), None),
        })
    }

    /// The workers' copy of `key` and its version, with compressed pulls.
    pub fn shadow(&self, key: u64) -> Option<&Shadow> {
        self.keys.get(&key)?.shadow.as_ref()
    }

    /// The scheme of compressed pulls, if they are on.
    fn pull_scheme(&self) -> Option<psnet_compression::Scheme> {
        self.compression.and_then(|c| c.pull_scheme())
    }

    /// The next answer to send.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    /// Refuses request `ts` of worker `rank`, logging why.
    fn fail(&mut self, rank: u32, ts: u64, reason: String) {
        tracing::warn!(worker = rank, ts, %reason, "request failed");
        self.out.push_back(Output::Failed { rank, ts, reason });
    }

    /// A message from worker `rank` that could not be read (`reason`): the request it asks,
    /// when its id could be read, fails with the reason; otherwise the worker is told under
    /// [`NO_REQUEST`], so that nobody waits on a message the server dropped.
    pub fn handle_malformed(&mut self, rank: u32, exchange: Option<Exchange>, reason: &str) {
        match exchange {
            Some(Exchange::Request(ts)) => {
                self.fail(rank, ts, format!("could not read the request: {reason}"))
            }
            _ => self.fail(
                rank,
                NO_REQUEST,
                format!("could not read a message of this worker: {reason}"),
            ),
        }
    }

    /// A `dist_sync` round holding pushes, if any (the lowest key's, so that the answer does
    /// not depend on the map's order): its key and how many workers pushed.
    fn round_in_progress(&self) -> Option<(u64, u32)> {
        self.keys
            .iter()
            .filter(|(_, k)| k.round.count > 0 || !k.round.deferred.is_empty())
            .map(|(key, k)| (*key, k.round.count))
            .min_by_key(|(key, _)| *key)
            .or_else(|| self.row_round_in_progress())
    }

    /// A pull of `key` by worker `rank`, whose copy of it (compressed pulls) is at version
    /// `have`.
    pub fn handle_pull(&mut self, rank: u32, ts: u64, key: u64, n_elems: u64, have: Option<u64>) {
        match self.keys.get(&key) {
            None => self.fail(
                rank,
                ts,
                format!("key {key} was pulled before it was initialized"),
            ),
            Some(k) if k.value.len() as u64 != n_elems => {
                let have = k.value.len();
                self.fail(
                    rank,
                    ts,
                    format!("key {key}: pulled {n_elems} elements, this server holds {have}"),
                )
            }
            Some(_) => self.out.push_back(Output::Done {
                rank,
                ts,
                value: Some(key),
                have,
            }),
        }
    }

    /// Worker `rank` is gone: rounds that wait for it can never complete, so every push
    /// waiting in one fails now, naming it, and later `dist_sync` pushes fail at once.
    pub fn handle_worker_lost(&mut self, rank: u32, reason: &str) {
        let reason = format!("worker {rank} (node {}) is gone: {reason}", 9 + 2 * rank);
        self.dead.insert(rank, reason.clone());
        self.waiting_commands_lost(rank, &reason);
        if self.mode == Mode::Async {
            return;
        }
        let mut failed = Vec::new();
        for (key, k) in self.keys.iter_mut() {
            let round = std::mem::take(&mut k.round);
            for (r, a) in round.arrived.into_iter().enumerate() {
                if let Some(a) = a {
                    failed.push((r as u32, a.ts, *key));
                }
            }
            failed.extend(round.deferred.into_iter().map(|p| (p.rank, p.ts, *key)));
            k.round.merged = round.merged;
        }
        failed.extend(self.row_rounds_lost());
        // The loss itself is logged by the node; these are its consequences.
        for (r, ts, key) in failed {
            self.out.push_back(Output::PeerFailed {
                rank: r,
                ts,
                lost: rank,
                reason: format!("dist_sync round of key {key} cannot complete: {reason}"),
            });
        }
    }
}

mod unpack;

#[cfg(test)]
mod dtype_tests;
#[cfg(test)]
mod harness;
#[cfg(test)]
mod journal_tests;
#[cfg(test)]
mod pulled_tests;
#[cfg(test)]
mod recovery_tests;
#[cfg(test)]
mod retry_tests;
#[cfg(test)]
mod row_push_tests;
#[cfg(test)]
mod tests;
