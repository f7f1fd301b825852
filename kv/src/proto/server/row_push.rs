//! Row-sparse pushes at a server (MXNet's row_sparse push): the element ranges of a key's
//! parts that a worker's gradient touches (the rows of an embedding table one step used),
//! summed over the workers of a `dist_sync` round in worker-rank order and applied to those
//! elements only (MXNet's lazy update), or applied at once in `dist_async`.
//!
//! A round is the key's as the workers declared it, not a part's: one request per server
//! lists every part of the key held there, so a round completes when every worker's request
//! is in, whichever parts its rows touched. The sum is kept compact: only the union of the
//! ranges the workers sent is ever allocated, never the key's whole part.

use std::collections::{HashSet, VecDeque};
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;

use super::{journal, Mode, Output, ServerState};
use crate::proto::worker::key_of_slot;
use crate::value::Dtype;

/// Bytes of one range in a request's list: slot, start and length, little-endian u64s.
const TRIPLE_BYTES: usize = 24;

/// A row push as the server receives it ([`crate::proto::msg::Msg::PushRanges`]).
#[derive(Clone, Debug)]
pub struct RowsPush {
    /// The pushing worker's rank.
    pub rank: u32,
    /// Its request id.
    pub ts: u64,
    /// The key as the worker declared it: the round's name.
    pub key: u64,
    /// The values' element type.
    pub dtype: Dtype,
    /// Sent again to a restarted server: this worker's row pushes of the key the server
    /// had acknowledged before.
    pub retry: Option<u64>,
    /// Triples in the list.
    pub n_ranges: u64,
    /// The list, then the values.
    pub payload: Bytes,
}

/// One part's ranges in a push: the slot it is stored under and the ranges (local to it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct PartRanges {
    pub(super) slot: u64,
    pub(super) ranges: Vec<Range<usize>>,
}

/// A push waiting in a round, held until the round completes.
#[derive(Debug)]
struct RowArrival {
    ts: u64,
    parts: Vec<PartRanges>,
    dtype: Dtype,
    /// The values, one range after another.
    values: Bytes,
}

/// A `dist_sync` round of a row-pushed key.
#[derive(Debug, Default)]
pub(super) struct RowRound {
    /// The parts every push of the round lists, in the order listed.
    slots: Vec<u64>,
    arrived: Vec<Option<RowArrival>>,
    count: u32,
    /// Second pushes of a worker within the round: they count for the next one.
    deferred: VecDeque<RowsPush>,
}

impl RowRound {
    /// Pushes it holds.
    pub(super) fn held(&self) -> u32 {
        self.count + self.deferred.len() as u32
    }

    /// Every push it holds, as (worker rank, request id), its arrivals then the deferred.
    fn requests(self) -> impl Iterator<Item = (u32, u64)> {
        let arrived = self
            .arrived
            .into_iter()
            .enumerate()
            .filter_map(|(r, a)| a.map(|a| (r as u32, a.ts)));
        arrived.chain(self.deferred.into_iter().map(|p| (p.rank, p.ts)))
    }
}

impl ServerState {
    /// A row push from a worker. Anything that does not add up is refused, naming it, and
    /// changes nothing: a list of another size than announced, values of another size than
    /// the ranges cover, an unknown part or one of another type, a part listed twice, a
    /// range empty, out of order or past its part's end, a part list other than the one the
    /// round's other pushes sent.
    pub fn handle_push_rows(&mut self, p: RowsPush) {
        if p.rank == 0 && !self.waiting_for_rank0.is_empty() {
            self.worker_0_went_on();
        }
        let (parts, values) = match self.parse_rows(&p) {
            Ok(parsed) => parsed,
            Err(reason) => return self.fail(p.rank, p.ts, format!("key {}: {reason}", p.key)),
        };
        if self.rows_applied_before(&p, &parts) {
            tracing::debug!(
                worker = p.rank,
                key = p.key,
                "a row push sent again was applied before the restart: answered, not applied"
            );
            return self.done(p.rank, p.ts);
        }
        match self.mode {
            Mode::Async => {
                let mut grad = vec![0f32; values.len() / p.dtype.size()];
                p.dtype.widen_into(&mut grad, &values, false);
                let slot = parts[0].slot;
                if let Err(reason) = self.apply_rows(Some(p.rank), &parts, &grad) {
                    return self.fail(p.rank, p.ts, reason);
                }
                self.commit(Some(slot), |_, seq| {
                    journal::rows(seq, Some(p.rank), &parts, &grad)
                });
                self.done(p.rank, p.ts)
            }
            Mode::Sync => {
                if !self.round_lost(p.rank, p.ts, p.key) {
                    self.add_to_row_round(p, parts, values)
                }
            }
        }
    }

    fn done(&mut self, rank: u32, ts: u64) {
        self.out.push_back(Output::Done {
            rank,
            ts,
            value: None,
            have: None,
        });
    }

    /// The push's parts and its values' bytes, checked against the keys held: bounded by
    /// the payload before anything is allocated.
    fn parse_rows(&self, p: &RowsPush) -> Result<(Vec<PartRanges>, Bytes), String> {
        if p.rank >= self.num_workers {
            return Err(format!(
                "a row push of worker {}, the job has {} workers",
                p.rank, self.num_workers
            ));
        }
        let list_len = p
            .n_ranges
            .checked_mul(TRIPLE_BYTES as u64)
            .filter(|&n| n <= p.payload.len() as u64)
            .ok_or_else(|| {
                format!(
                    "a row push announces {} ranges and carries {} bytes",
                    p.n_ranges,
                    p.payload.len()
                )
            })? as usize;
        let mut parts: Vec<PartRanges> = Vec::new();
        let mut listed: HashSet<u64> = HashSet::new();
        let mut elems = 0usize;
        for triple in p.payload[..list_len].chunks_exact(TRIPLE_BYTES) {
            let word = |i: usize| u64::from_le_bytes(triple[i..i + 8].try_into().expect("8"));
            let (slot, start, len) = (word(0), word(8), word(16));
            // A part of the key named: the key itself, or one of its pieces.
            if slot != p.key && key_of_slot(slot) != p.key {
                return Err(format!("part {slot} is not a part of key {}", p.key));
            }
            let k = self
                .keys
                .get(&slot)
                .ok_or_else(|| format!("part {slot} was pushed before it was initialized"))?;
            if k.dtype != p.dtype {
                return Err(format!(
                    "part {slot} holds {} values, pushed {}",
                    k.dtype, p.dtype
                ));
            }
            let held = k.value.len() as u64;
            let new_part = parts.last().is_none_or(|last| last.slot != slot);
            if new_part {
                if !listed.insert(slot) {
                    return Err(format!("part {slot} is listed twice"));
                }
                parts.push(PartRanges {
                    slot,
                    ranges: Vec::new(),
                });
            }
            let part = parts.last_mut().expect("pushed above");
            // (slot, 0, 0) names a part with no rows: alone in its part's list.
            if len == 0 && start == 0 && new_part {
                continue;
            }
            let after = part.ranges.last().map_or(0, |r| r.end as u64);
            let stop = start.checked_add(len).filter(|&s| s <= held);
            let Some(stop) = stop.filter(|_| len > 0 && start >= after) else {
                return Err(format!(
                    "part {slot}: a row push's range of {len} elements from {start} is empty, \
                     out of order or past the {held} elements this server holds"
                ));
            };
            part.ranges.push(start as usize..stop as usize);
            elems += len as usize;
        }
        if parts.is_empty() {
            return Err("a row push lists no part".into());
        }
        let values = p.payload.slice(list_len..);
        if Some(values.len()) != elems.checked_mul(p.dtype.size()) {
            return Err(format!(
                "a row push's ranges cover {elems} {} values, it carries {} bytes of them",
                p.dtype,
                values.len()
            ));
        }
        Ok((parts, values))
    }

    /// Whether `p`, sent again after this server restarted, was applied before: its first
    /// part's updates (or, in `dist_async`, the worker's pushes of it) tell, as for a push.
    fn rows_applied_before(&self, p: &RowsPush, parts: &[PartRanges]) -> bool {
        let (Some(n), Some(k)) = (p.retry, self.keys.get(&parts[0].slot)) else {
            return false;
        };
        self.took_update(k, p.rank, n)
    }

    fn add_to_row_round(&mut self, p: RowsPush, parts: Vec<PartRanges>, values: Bytes) {
        let workers = self.num_workers as usize;
        let slots: Vec<u64> = parts.iter().map(|q| q.slot).collect();
        let round = self.row_rounds.entry(p.key).or_default();
        if round.count == 0 {
            round.slots = slots;
            round.arrived.clear();
            round.arrived.resize_with(workers, || None);
        } else if round.slots != slots {
            let reason = format!(
                "key {}: a row push lists the parts {slots:?}, the other pushes of its round \
                 list {:?}",
                p.key, round.slots
            );
            return self.fail(p.rank, p.ts, reason);
        }
        let rank = p.rank as usize;
        if round.arrived[rank].is_some() {
            round.deferred.push_back(p);
            return;
        }
        round.arrived[rank] = Some(RowArrival {
            ts: p.ts,
            parts,
            dtype: p.dtype,
            values,
        });
        round.count += 1;
        if round.count as usize == workers {
            self.complete_row_round(p.key);
        }
    }

    fn complete_row_round(&mut self, key: u64) {
        let round = self.row_rounds.remove(&key).expect("a round in progress");
        let arrivals: Vec<&RowArrival> = round.arrived.iter().flatten().collect();
        let (parts, merged) = merge(&arrivals);
        let first = parts[0].slot;
        let result = self.apply_rows(None, &parts, &merged);
        if result.is_ok() {
            self.commit(Some(first), |_, seq| {
                journal::rows(seq, None, &parts, &merged)
            });
        }
        for (rank, a) in round.arrived.into_iter().enumerate() {
            let Some(a) = a else { continue };
            match &result {
                Ok(()) => self.done(rank as u32, a.ts),
                Err(e) => self.fail(rank as u32, a.ts, format!("key {key}: {e}")),
            }
        }
        for p in round.deferred {
            self.handle_push_rows(p);
        }
    }

    /// Applies a row gradient (live and in replay): `grad` holds the values of `parts`'
    /// ranges one after another. With an updater, it updates those elements only (MXNet's
    /// lazy update); without one (`dist_sync` only), the gradient replaces the part's value,
    /// every other element zero, as MXNet's server copies a merged row_sparse array. `rank`:
    /// a `dist_async` push of that worker; None: a completed `dist_sync` round. Every part
    /// listed takes one update. `Err` changes nothing.
    pub(super) fn apply_rows(
        &mut self,
        rank: Option<u32>,
        parts: &[PartRanges],
        grad: &[f32],
    ) -> Result<(), String> {
        if let Some(r) = rank.filter(|&r| r >= self.num_workers) {
            return Err(format!(
                "a row push of worker {r}, the job has {} workers",
                self.num_workers
            ));
        }
        if rank.is_some() && self.updater.is_none() {
            return Err(
                "dist_async needs an optimizer on the servers: call set_optimizer first".into(),
            );
        }
        let mut elems = 0usize;
        for part in parts {
            let held = self
                .keys
                .get(&part.slot)
                .map(|k| k.value.len())
                .ok_or_else(|| format!("part {} is not initialized", part.slot))?;
            let mut end = 0;
            for r in &part.ranges {
                if r.start < end || r.is_empty() || r.end > held {
                    return Err(format!(
                        "part {}: the range {r:?} is empty, out of order or past its {held} \
                         elements",
                        part.slot
                    ));
                }
                end = r.end;
                elems += r.len();
            }
            if let Some(u) = &self.updater {
                u.fits(part.slot, held).map_err(|e| e.to_string())?;
            }
        }
        if elems != grad.len() {
            return Err(format!(
                "a row gradient of {} values for ranges of {elems}",
                grad.len()
            ));
        }
        let pull_scheme = self.pull_scheme();
        let workers = self.num_workers as usize;
        let mut at = 0;
        for part in parts {
            let n: usize = part.ranges.iter().map(|r| r.len()).sum();
            let g = &grad[at..at + n];
            at += n;
            let k = self.keys.get_mut(&part.slot).expect("checked above");
            let value = Arc::make_mut(&mut k.value).as_mut_slice();
            match self.updater.as_mut() {
                Some(u) => u
                    .update_ranges(part.slot, &part.ranges, g, value)
                    .map_err(|e| format!("part {}: update failed: {e}", part.slot))?,
                None => {
                    value.fill(0.0);
                    let mut from = 0;
                    for r in &part.ranges {
                        value[r.clone()].copy_from_slice(&g[from..from + r.len()]);
                        from += r.len();
                    }
                }
            }
            k.updates += 1;
            if let Some(rank) = rank {
                if k.pushes_by_worker.is_empty() {
                    k.pushes_by_worker = vec![0; workers];
                }
                k.pushes_by_worker[rank as usize] += 1;
            }
            if let (Some(scheme), Some(shadow)) = (pull_scheme, k.shadow.as_mut()) {
                shadow.advance(scheme, &k.value);
            }
        }
        Ok(())
    }

    /// Worker `rank` is gone: every row round fails what it holds.
    pub(super) fn row_rounds_lost(&mut self) -> Vec<(u32, u64, u64)> {
        let mut failed = Vec::new();
        for (key, round) in std::mem::take(&mut self.row_rounds) {
            failed.extend(round.requests().map(|(r, ts)| (r, ts, key)));
        }
        failed
    }

    /// The key of a row round holding pushes of part `slot`, if any.
    pub(super) fn row_round_holding(&self, slot: u64) -> Option<u64> {
        self.row_rounds
            .iter()
            .find(|(_, r)| r.held() > 0 && r.slots.contains(&slot))
            .map(|(key, _)| *key)
    }

    /// A row round holding pushes, if any: (key, pushes held).
    pub(super) fn row_round_in_progress(&self) -> Option<(u64, u32)> {
        self.row_rounds
            .iter()
            .filter(|(_, r)| r.held() > 0)
            .map(|(key, r)| (*key, r.count))
            .min_by_key(|(key, _)| *key)
    }
}

/// The round's sum: per part, the union of the ranges its pushes sent (merged where they
/// touch), and their values summed in the pushes' (worker-rank) order, one range after
/// another. Starting every sum from `-0.0` adds exactly what the workers sent (`-0.0 + x`
/// is `x` for every `x`).
fn merge(arrivals: &[&RowArrival]) -> (Vec<PartRanges>, Vec<f32>) {
    let first = arrivals[0];
    let mut parts: Vec<PartRanges> = Vec::with_capacity(first.parts.len());
    for (j, part) in first.parts.iter().enumerate() {
        let mut all: Vec<Range<usize>> = arrivals
            .iter()
            .flat_map(|a| a.parts[j].ranges.iter().cloned())
            .collect();
        all.sort_unstable_by_key(|r| r.start);
        let mut union: Vec<Range<usize>> = Vec::new();
        for r in all {
            match union.last_mut() {
                Some(u) if r.start <= u.end => u.end = u.end.max(r.end),
                _ => union.push(r),
            }
        }
        parts.push(PartRanges {
            slot: part.slot,
            ranges: union,
        });
    }
    let total: usize = parts.iter().flat_map(|p| &p.ranges).map(|r| r.len()).sum();
    let mut merged = vec![-0.0f32; total];
    for a in arrivals {
        let size = a.dtype.size();
        let mut values = &a.values[..];
        let mut base = 0;
        for (part, union) in a.parts.iter().zip(&parts) {
            let mut u = 0;
            let mut offset = base;
            for r in &part.ranges {
                // Each range lies inside one range of the union: advance to it.
                while union.ranges[u].end <= r.start {
                    offset += union.ranges[u].len();
                    u += 1;
                }
                let at = offset + (r.start - union.ranges[u].start);
                let (these, rest) = values.split_at(r.len() * size);
                a.dtype
                    .widen_into(&mut merged[at..at + r.len()], these, true);
                values = rest;
            }
            base += union.ranges.iter().map(|r| r.len()).sum::<usize>();
        }
    }
    (parts, merged)
}
