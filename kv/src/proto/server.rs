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

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use psnet_compression::{CompressionParams, Compressor};

use super::msg::{CommandKind, Exchange, PushFlags, NO_REQUEST};
use super::sum;
use crate::updater::{OptimizerSpec, Updater};

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
    /// Request `ts` of worker `rank` is done; with `value` set, send that key's stored value.
    Done {
        /// Worker rank.
        rank: u32,
        /// Request id.
        ts: u64,
        /// Key whose value goes with the answer (pulls, push-pulls).
        value: Option<u64>,
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
}

/// A push waiting in a round.
#[derive(Debug)]
struct Arrived {
    ts: u64,
    pull_back: bool,
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
}

/// One server's store and round bookkeeping.
pub struct ServerState {
    num_workers: u32,
    mode: Mode,
    updater: Option<Box<dyn Updater>>,
    compressor: Option<Box<dyn Compressor>>,
    /// The compression settings in force; None until a worker sets them (no compression).
    compression: Option<CompressionParams>,
    keys: HashMap<u64, KeyState>,
    /// Bytes of values held, and the most allowed.
    key_bytes: u64,
    key_limit: u64,
    dead: BTreeMap<u32, String>,
    out: VecDeque<Output>,
}

impl ServerState {
    /// A server for `num_workers` workers, in `dist_sync` mode, with no updater.
    pub fn new(num_workers: u32) -> Self {
        ServerState {
            num_workers: num_workers.max(1),
            mode: Mode::Sync,
            updater: None,
            compressor: None,
            compression: None,
            keys: HashMap::new(),
            key_bytes: 0,
            key_limit: u64::MAX,
            dead: BTreeMap::new(),
            out: VecDeque::new(),
        }
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

    /// A `dist_sync` round holding pushes, if any: its key and how many workers pushed.
    fn round_in_progress(&self) -> Option<(u64, u32)> {
        self.keys
            .iter()
            .find(|(_, k)| k.round.count > 0 || !k.round.deferred.is_empty())
            .map(|(key, k)| (*key, k.round.count))
    }

    /// A worker's command: optimizer, compression, mode. `Err` is the reason to report.
    pub fn handle_command(&mut self, kind: CommandKind, body: &str) -> Result<(), String> {
        match kind {
            CommandKind::SetOptimizer => {
                let spec = OptimizerSpec::parse(body).map_err(|e| e.to_string())?;
                self.updater = Some(spec.build());
            }
            CommandKind::SetCompression => {
                let params = CompressionParams::parse(body).map_err(|e| e.to_string())?;
                match self.compression {
                    Some(current) if current == params => {}
                    // Pushes compressed with the settings in force may be on their way or
                    // waiting in a round, and the other workers go on compressing with them.
                    Some(current) => {
                        return Err(format!(
                            "gradient compression is already {current} on this server, refusing \
                             {params}: every worker must set the same compression, once"
                        ))
                    }
                    None => {
                        self.compressor = params.compressor().map_err(|e| e.to_string())?;
                        self.compression = Some(params);
                    }
                }
            }
            CommandKind::SetMode => {
                let mode = match body {
                    "sync" => Mode::Sync,
                    "async" => Mode::Async,
                    other => return Err(format!("unknown mode {other:?}: use sync or async")),
                };
                if mode == Mode::Async {
                    if let Some((key, count)) = self.round_in_progress() {
                        return Err(format!(
                            "cannot switch to dist_async while the dist_sync round of key {key} \
                             holds pushes ({count} of {} workers pushed): set the mode before \
                             pushing",
                            self.num_workers
                        ));
                    }
                }
                self.mode = mode;
            }
        }
        Ok(())
    }

    /// A pull of `key` by worker `rank`.
    pub fn handle_pull(&mut self, rank: u32, ts: u64, key: u64, n_elems: u64) {
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
            }),
        }
    }

    /// Worker `rank` is gone: rounds that wait for it can never complete, so every push
    /// waiting in one fails now, naming it, and later `dist_sync` pushes fail at once.
    pub fn handle_worker_lost(&mut self, rank: u32, reason: &str) {
        let reason = format!("worker {rank} (node {}) is gone: {reason}", 9 + 2 * rank);
        self.dead.insert(rank, reason.clone());
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
        // The loss itself is logged by the node; these are its consequences.
        for (r, ts, key) in failed {
            self.out.push_back(Output::Failed {
                rank: r,
                ts,
                reason: format!("dist_sync round of key {key} cannot complete: {reason}"),
            });
        }
    }

    /// A push from a worker.
    pub fn handle_push(&mut self, p: Push) {
        if p.flags.init {
            return self.init(p);
        }
        if let Err(reason) = self.check(&p) {
            return self.fail(p.rank, p.ts, reason);
        }
        match self.mode {
            Mode::Async => self.apply_async(p),
            Mode::Sync => self.add_to_round(p),
        }
    }

    fn init(&mut self, p: Push) {
        if p.flags.compressed {
            return self.fail(
                p.rank,
                p.ts,
                format!("key {}: init values are plain f32, never compressed", p.key),
            );
        }
        if let Some(k) = self.keys.get(&p.key) {
            let round = &k.round;
            if round.count > 0 || !round.deferred.is_empty() {
                let reason = format!(
                    "key {}: init while its dist_sync round holds pushes ({} of {} workers \
                     pushed): initialize keys before pushing them",
                    p.key, round.count, self.num_workers
                );
                return self.fail(p.rank, p.ts, reason);
            }
        }
        let Some(n) = sum::f32_count(&p.payload) else {
            return self.fail(
                p.rank,
                p.ts,
                format!("key {}: init payload is not f32 values", p.key),
            );
        };
        if n as u64 != p.n_elems {
            return self.fail(
                p.rank,
                p.ts,
                format!(
                    "key {}: init announces {} elements, carries {n}",
                    p.key, p.n_elems
                ),
            );
        }
        let replaced = self
            .keys
            .get(&p.key)
            .map_or(0, |k| k.value.len() as u64 * 4);
        let held = self.key_bytes - replaced + n as u64 * 4;
        if held > self.key_limit {
            return self.fail(
                p.rank,
                p.ts,
                format!(
                    "key {}: {} bytes would bring this server's keys to {held} bytes, beyond \
                     PSNET_KV_SERVER_KEY_BYTES={}",
                    p.key,
                    n * 4,
                    self.key_limit
                ),
            );
        }
        self.key_bytes = held;
        let mut value = vec![0f32; n];
        sum::copy_from_le(&mut value, &p.payload);
        self.keys.insert(
            p.key,
            KeyState {
                value: Arc::new(value),
                round: Round::default(),
            },
        );
        self.out.push_back(Output::Done {
            rank: p.rank,
            ts: p.ts,
            value: p.flags.pull_back.then_some(p.key),
        });
    }

    fn check(&self, p: &Push) -> Result<(), String> {
        let key = p.key;
        let k = self
            .keys
            .get(&key)
            .ok_or_else(|| format!("key {key} was pushed before it was initialized"))?;
        let n = k.value.len();
        if p.n_elems != n as u64 {
            return Err(format!(
                "key {key}: pushed {} elements, this server holds {n}",
                p.n_elems
            ));
        }
        if p.rank >= self.num_workers {
            return Err(format!(
                "worker rank {} out of range ({} workers)",
                p.rank, self.num_workers
            ));
        }
        if p.flags.compressed {
            let c = self.compressor.as_ref().ok_or_else(|| {
                format!("key {key}: compressed push, but no compression was set on this server")
            })?;
            let want = c.compressed_len(n);
            if p.payload.len() != want {
                return Err(format!(
                    "key {key}: compressed push of {} bytes, expected {want} for {n} elements",
                    p.payload.len()
                ));
            }
        } else if p.payload.len() != 4 * n {
            return Err(format!(
                "key {key}: push of {} bytes, expected {} ({n} f32)",
                p.payload.len(),
                4 * n
            ));
        }
        if self.mode == Mode::Sync {
            if let Some((_, why)) = self.dead.iter().next() {
                return Err(format!(
                    "dist_sync round of key {key} cannot complete: {why}"
                ));
            }
        }
        Ok(())
    }

    /// Decodes a checked payload into `dst` (`add`: accumulate instead of overwrite).
    fn decode(
        compressor: Option<&dyn Compressor>,
        compressed: bool,
        payload: &[u8],
        dst: &mut [f32],
        add: bool,
    ) {
        match (compressed, compressor) {
            (true, Some(c)) => {
                // Lengths were checked, so these cannot fail.
                let r = if add {
                    c.dequantize_add(payload, dst)
                } else {
                    c.dequantize(payload, dst)
                };
                debug_assert!(r.is_ok());
            }
            _ if add => sum::add_from_le(dst, payload),
            _ => sum::copy_from_le(dst, payload),
        }
    }

    fn apply_async(&mut self, p: Push) {
        let Some(updater) = self.updater.as_mut() else {
            return self.fail(
                p.rank,
                p.ts,
                "dist_async needs an optimizer on the servers: call set_optimizer first".into(),
            );
        };
        let k = self.keys.get_mut(&p.key).expect("checked");
        let mut grad = std::mem::take(&mut k.round.merged);
        grad.resize(k.value.len(), 0.0);
        Self::decode(
            self.compressor.as_deref(),
            p.flags.compressed,
            &p.payload,
            &mut grad,
            false,
        );
        let result = updater.update(p.key, &grad, Arc::make_mut(&mut k.value).as_mut_slice());
        k.round.merged = grad;
        match result {
            Ok(()) => self.out.push_back(Output::Done {
                rank: p.rank,
                ts: p.ts,
                value: p.flags.pull_back.then_some(p.key),
            }),
            Err(e) => self.fail(p.rank, p.ts, format!("key {}: update failed: {e}", p.key)),
        }
    }

    fn add_to_round(&mut self, p: Push) {
        let workers = self.num_workers as usize;
        let compressor = self.compressor.as_deref();
        let k = self.keys.get_mut(&p.key).expect("checked");
        let round = &mut k.round;
        if round.arrived.len() != workers {
            round.arrived.resize_with(workers, || None);
        }
        let rank = p.rank as usize;
        if round.arrived[rank].is_some() {
            // Already pushed this round: it counts for the next one.
            round.deferred.push_back(p);
            return;
        }
        round.arrived[rank] = Some(Arrived {
            ts: p.ts,
            pull_back: p.flags.pull_back,
            payload: Some(p.payload),
            compressed: p.flags.compressed,
        });
        round.count += 1;
        // Sum every rank that is now next in line, in rank order.
        while let Some(Some(a)) = round.arrived.get_mut(round.next as usize) {
            let payload = a.payload.take().expect("held until summed");
            if round.next == 0 {
                round.merged.resize(k.value.len(), 0.0);
                Self::decode(compressor, a.compressed, &payload, &mut round.merged, false);
            } else {
                Self::decode(compressor, a.compressed, &payload, &mut round.merged, true);
            }
            round.next += 1;
        }
        if round.count as usize == workers {
            self.complete_round(p.key);
        }
    }

    fn complete_round(&mut self, key: u64) {
        let k = self.keys.get_mut(&key).expect("round of a known key");
        let round = std::mem::take(&mut k.round);
        let mut merged = round.merged;
        let result = match self.updater.as_mut() {
            Some(u) => u.update(key, &merged, Arc::make_mut(&mut k.value).as_mut_slice()),
            None => {
                // MXNet without an updater: the round's sum replaces the value. The old buffer
                // becomes the next round's scratch space unless an answer still holds it.
                let old = std::mem::replace(&mut k.value, Arc::new(merged));
                merged = Arc::try_unwrap(old).unwrap_or_default();
                Ok(())
            }
        };
        k.round.merged = merged;
        for (rank, a) in round.arrived.into_iter().enumerate() {
            let Some(a) = a else { continue };
            let rank = rank as u32;
            match &result {
                Ok(()) => self.out.push_back(Output::Done {
                    rank,
                    ts: a.ts,
                    value: a.pull_back.then_some(key),
                }),
                Err(e) => self.fail(rank, a.ts, format!("key {key}: update failed: {e}")),
            }
        }
        for p in round.deferred {
            self.handle_push(p);
        }
    }
}

#[cfg(test)]
mod tests;
