//! A push as it arrives: its checks, a key's first value (its init), a retry of one already
//! applied, and a round that lost its pushes.

use super::*;

impl ServerState {
    /// A push from a worker.
    pub fn handle_push(&mut self, p: Push) {
        if p.rank == 0 && !p.flags.init && !self.waiting_for_rank0.is_empty() {
            self.worker_0_went_on();
        }
        if self.applied_before(&p) {
            tracing::debug!(worker = p.rank, key = p.key, retry = ?p.flags.retry,
                "a push sent again was applied before the restart: answered, not applied");
            return self.out.push_back(Output::Done {
                rank: p.rank,
                ts: p.ts,
                value: p.flags.pull_back.then_some(p.key),
                have: p.flags.have,
            });
        }
        if p.flags.init && p.flags.packed {
            let reason = format!("key {}: an init's values are never packed", p.key);
            return self.fail(p.rank, p.ts, reason);
        }
        if p.flags.init {
            return self.init(p);
        }
        // Packed codes are unpacked once what the push says of itself fits the key, and not
        // while they wait for a later round: held, they take no more than the bytes received.
        let mut p = p;
        if p.flags.packed {
            if let Err(reason) = self.check_packed(&p) {
                return self.fail(p.rank, p.ts, reason);
            }
            if self.mode == Mode::Sync {
                let Some(now) = self.defer_to_next_round(p) else {
                    return;
                };
                p = now;
            }
        }
        if let Err(reason) = self.unpack(&mut p) {
            return self.fail(p.rank, p.ts, reason);
        }
        if let Err(reason) = self.check(&p) {
            return self.fail(p.rank, p.ts, reason);
        }
        if self.mode == Mode::Sync && self.round_lost(p.rank, p.ts, p.key) {
            return;
        }
        match self.mode {
            Mode::Async => self.apply_async(p),
            Mode::Sync => self.add_to_round(p),
        }
    }

    /// Whether `p`, sent again after this server restarted ([`PushFlags::retry`]), is a
    /// change this server had applied (and journaled) before: the worker's `n`-th push of a
    /// key is in the key's `n`-th `dist_sync` round, so the round count tells; `dist_async`
    /// counts each worker's pushes. An init sent again finds its key.
    pub(super) fn applied_before(&self, p: &Push) -> bool {
        let (Some(n), Some(k)) = (p.flags.retry, self.keys.get(&p.key)) else {
            return false;
        };
        if p.flags.init {
            return true;
        }
        self.took_update(k, p.rank, n)
    }

    /// In `dist_sync`, with a worker lost, no round can complete: request `ts` of worker
    /// `rank`, a push of `key`, fails on the lost worker's account (true) at once.
    pub(super) fn round_lost(&mut self, rank: u32, ts: u64, key: u64) -> bool {
        let Some((&lost, why)) = self.dead.iter().next() else {
            return false;
        };
        let reason = format!("dist_sync round of key {key} cannot complete: {why}");
        self.out.push_back(Output::PeerFailed {
            rank,
            ts,
            lost,
            reason,
        });
        true
    }

    /// Whether `k` took worker `rank`'s update number `n` (from 0) already: in `dist_sync` the
    /// `n`-th round, in `dist_async` the worker's `n`-th push.
    pub(super) fn took_update(&self, k: &KeyState, rank: u32, n: u64) -> bool {
        match self.mode {
            Mode::Sync => k.updates > n,
            Mode::Async => k
                .pushes_by_worker
                .get(rank as usize)
                .is_some_and(|&applied| applied > n),
        }
    }

    pub(super) fn init(&mut self, p: Push) {
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
        if let Some(held) = self.row_round_holding(p.key) {
            let reason = format!(
                "key {}: init while the row-push round of key {held} holds pushes of it: \
                 initialize keys before pushing them",
                p.key
            );
            return self.fail(p.rank, p.ts, reason);
        }
        let dtype = p.flags.dtype;
        let Some(n) = dtype.count(p.payload.len()) else {
            return self.fail(
                p.rank,
                p.ts,
                format!("key {}: init payload is not {dtype} values", p.key),
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
        if p.rank != 0 {
            // MXNet: only worker 0 pushes a key's initial value; the others' init values are
            // ignored. Anything else sending one is refused, after the checks above.
            let reason = format!(
                "key {}: an init from worker {}: only worker 0 initializes keys",
                p.key, p.rank
            );
            tracing::warn!(
                worker = p.rank,
                key = p.key,
                "refused an init from a worker other than 0"
            );
            return self.fail(p.rank, p.ts, reason);
        }
        if let Err(reason) = self.apply_init(p.key, dtype, &p.payload) {
            return self.fail(p.rank, p.ts, reason);
        }
        self.commit(None, |_, seq| journal::init(seq, p.key, dtype, &p.payload));
        self.out.push_back(Output::Done {
            rank: p.rank,
            ts: p.ts,
            value: p.flags.pull_back.then_some(p.key),
            have: p.flags.have,
        });
    }

    /// Stores `payload` (whole f32) as `key`'s value (live and in replay); `Err` changes
    /// nothing.
    pub(super) fn apply_init(
        &mut self,
        key: u64,
        dtype: Dtype,
        payload: &[u8],
    ) -> Result<(), String> {
        let n = dtype
            .count(payload.len())
            .ok_or_else(|| format!("key {key}: init payload is not {dtype} values"))?;
        let replaced = self.keys.get(&key).map_or(0, KeyState::held_bytes);
        // With compressed pulls an f32 key is held twice: its value and the workers' copy.
        let copies = if self.pull_scheme().is_some() && dtype == Dtype::F32 {
            2
        } else {
            1
        };
        let bytes = n as u64 * 4 * copies;
        let held = self.key_bytes - replaced + bytes;
        if held > self.key_limit {
            return Err(format!(
                "key {key}: {bytes} bytes{} would bring this server's keys to {held} bytes, \
                 beyond PSNET_KV_SERVER_KEY_BYTES={}",
                if copies == 2 {
                    " (its value and the workers' copy: compressed pulls)"
                } else {
                    ""
                },
                self.key_limit
            ));
        }
        self.key_bytes = held;
        let mut value = vec![0f32; n];
        dtype.widen_into(&mut value, payload, false);
        // A copy made again goes whole to every worker: its version is past any they hold.
        let version = self
            .keys
            .get(&key)
            .and_then(|k| k.shadow.as_ref())
            .map_or(0, |s| s.version + 1);
        let mut state = KeyState::new(value, 0);
        state.dtype = dtype;
        if self.pull_scheme().is_some() && dtype == Dtype::F32 {
            state.shadow = Some(Shadow::new(&state.value, version));
        }
        self.keys.insert(key, state);
        Ok(())
    }

    pub(super) fn check(&self, p: &Push) -> Result<(), String> {
        let k = self.check_meta(p)?;
        self.check_payload(
            p.key,
            k.value.len(),
            k.dtype,
            p.flags.compressed,
            p.payload.len(),
        )
    }

    /// `p`'s key, rank, size and type against the key's; the key.
    pub(super) fn check_meta(&self, p: &Push) -> Result<&KeyState, String> {
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
        if p.flags.dtype != k.dtype {
            return Err(format!(
                "key {key} holds {} values, pushed {}",
                k.dtype, p.flags.dtype
            ));
        }
        Ok(k)
    }
}
