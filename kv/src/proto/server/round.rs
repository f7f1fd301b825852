//! Updates: `dist_sync` rounds (summed in rank order, then applied) and `dist_async` pushes
//! (applied one by one). The functions that change a key's value are shared by the live
//! server and the replay of its journal.

use std::sync::Arc;

use psnet_compression::Compressor;

use super::{journal, Arrived, Output, Push, ServerState};
use crate::value::Dtype;

impl ServerState {
    /// Whether a payload of `len` bytes (`compressed` or plain f32) fits `key`, which holds
    /// `n` elements. Checked before anything is decoded.
    pub(super) fn check_payload(
        &self,
        key: u64,
        n: usize,
        dtype: Dtype,
        compressed: bool,
        len: usize,
    ) -> Result<(), String> {
        if compressed && dtype != Dtype::F32 {
            return Err(format!(
                "key {key}: a compressed push to a {dtype} key: gradient compression takes \
                 float32 values only"
            ));
        }
        if compressed {
            let c = self.compressor.as_ref().ok_or_else(|| {
                format!("key {key}: compressed push, but no compression was set on this server")
            })?;
            let want = c.compressed_len(n);
            if len != want {
                return Err(format!(
                    "key {key}: compressed push of {len} bytes, expected {want} for {n} elements"
                ));
            }
        } else if len != dtype.size() * n {
            return Err(format!(
                "key {key}: push of {len} bytes, expected {} ({n} {dtype})",
                dtype.size() * n
            ));
        }
        Ok(())
    }

    /// Decodes a checked payload into `dst` (`add`: accumulate instead of overwrite).
    fn decode(
        compressor: Option<&dyn Compressor>,
        dtype: Dtype,
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
            _ => dtype.widen_into(dst, payload, add),
        }
    }

    pub(super) fn apply_async(&mut self, p: Push) {
        if self.updater.is_none() {
            return self.fail(
                p.rank,
                p.ts,
                "dist_async needs an optimizer on the servers: call set_optimizer first".into(),
            );
        }
        if let Err(reason) = self.apply_push(p.key, p.rank, p.flags.compressed, &p.payload) {
            return self.fail(p.rank, p.ts, reason);
        }
        self.commit(Some(p.key), |_, seq| {
            journal::push(seq, p.key, p.rank, p.flags.compressed, &p.payload)
        });
        self.out.push_back(Output::Done {
            rank: p.rank,
            ts: p.ts,
            value: p.flags.pull_back.then_some(p.key),
            have: p.flags.have,
        });
    }

    /// Applies one push of worker `rank` of a checked payload to `key` with the updater
    /// (`dist_async`, live and in replay); `Err` changes nothing.
    pub(super) fn apply_push(
        &mut self,
        key: u64,
        rank: u32,
        compressed: bool,
        payload: &[u8],
    ) -> Result<(), String> {
        if rank >= self.num_workers {
            return Err(format!(
                "key {key}: a push of worker {rank}, the job has {} workers",
                self.num_workers
            ));
        }
        let updater = self.updater.as_mut().ok_or_else(|| {
            format!("key {key}: a dist_async push needs an optimizer on the servers")
        })?;
        let k = self
            .keys
            .get_mut(&key)
            .ok_or_else(|| format!("key {key} was pushed before it was initialized"))?;
        let mut grad = std::mem::take(&mut k.round.merged);
        grad.resize(k.value.len(), 0.0);
        Self::decode(
            self.compressor.as_deref(),
            k.dtype,
            compressed,
            payload,
            &mut grad,
            false,
        );
        let result = updater.update(key, &grad, Arc::make_mut(&mut k.value).as_mut_slice());
        k.round.merged = grad;
        result.map_err(|e| format!("key {key}: update failed: {e}"))?;
        k.updates += 1;
        if k.pushes_by_worker.is_empty() {
            k.pushes_by_worker = vec![0; self.num_workers as usize];
        }
        k.pushes_by_worker[rank as usize] += 1;
        Ok(())
    }

    /// Keeps `p` for its key's next round if its worker pushed this round already (None);
    /// else gives it back.
    pub(super) fn defer_to_next_round(&mut self, p: Push) -> Option<Push> {
        let Some(k) = self.keys.get_mut(&p.key) else {
            return Some(p);
        };
        let round = &mut k.round;
        if !round
            .arrived
            .get(p.rank as usize)
            .is_some_and(Option::is_some)
        {
            return Some(p);
        }
        round.deferred.push_back(p);
        None
    }

    pub(super) fn add_to_round(&mut self, p: Push) {
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
            have: p.flags.have,
            payload: Some(p.payload),
            compressed: p.flags.compressed,
        });
        round.count += 1;
        // Sum every rank that is now next in line, in rank order.
        while let Some(Some(a)) = round.arrived.get_mut(round.next as usize) {
            let payload = a.payload.take().expect("held until summed");
            // Rank 0 starts the sum, the others add to it.
            let first = round.next == 0;
            if first {
                round.merged.resize(k.value.len(), 0.0);
            }
            let (dtype, compressed) = (k.dtype, a.compressed);
            Self::decode(
                compressor,
                dtype,
                compressed,
                &payload,
                &mut round.merged,
                !first,
            );
            round.next += 1;
        }
        if round.count as usize == workers {
            self.complete_round(p.key);
        }
    }

    fn complete_round(&mut self, key: u64) {
        let k = self.keys.get_mut(&key).expect("round of a known key");
        let round = std::mem::take(&mut k.round);
        let result = self.apply_merged(key, round.merged);
        if result.is_ok() {
            // The round's merged gradient: kept as the key's scratch buffer with an updater,
            // the key's value without one.
            self.commit(Some(key), |s, seq| {
                let k = &s.keys[&key];
                let merged = match s.updater {
                    Some(_) => &k.round.merged,
                    None => &*k.value,
                };
                journal::round(seq, key, merged)
            });
        }
        for (rank, a) in round.arrived.into_iter().enumerate() {
            let Some(a) = a else { continue };
            let rank = rank as u32;
            match &result {
                Ok(()) => self.out.push_back(Output::Done {
                    rank,
                    ts: a.ts,
                    value: a.pull_back.then_some(key),
                    have: a.have,
                }),
                Err(e) => self.fail(rank, a.ts, e.clone()),
            }
        }
        for p in round.deferred {
            self.handle_push(p);
        }
    }

    /// Applies a round's merged gradient (as many elements as the key holds) to `key` (live
    /// and in replay): the updater runs or, without one, the sum replaces the value (MXNet).
    /// `Err` changes nothing.
    pub(super) fn apply_merged(&mut self, key: u64, mut merged: Vec<f32>) -> Result<(), String> {
        let k = self
            .keys
            .get_mut(&key)
            .ok_or_else(|| format!("key {key} was pushed before it was initialized"))?;
        let pull_scheme = self.compression.and_then(|c| c.pull_scheme());
        let result = match self.updater.as_mut() {
            Some(u) => u
                .update(key, &merged, Arc::make_mut(&mut k.value).as_mut_slice())
                .map_err(|e| format!("key {key}: update failed: {e}")),
            None if merged.len() != k.value.len() => Err(format!(
                "key {key}: a merged gradient of {} elements, the key holds {}",
                merged.len(),
                k.value.len()
            )),
            None => {
                // The old buffer becomes the next round's scratch space unless an answer
                // still holds it.
                let old = std::mem::replace(&mut k.value, Arc::new(merged));
                merged = Arc::try_unwrap(old).unwrap_or_default();
                Ok(())
            }
        };
        k.round.merged = merged;
        if result.is_ok() {
            k.updates += 1;
            // Compressed pulls: the round's change of the weights, as codes for the workers.
            if let (Some(scheme), Some(shadow)) = (pull_scheme, k.shadow.as_mut()) {
                shadow.advance(scheme, &k.value);
            }
        }
        result
    }
}
