//! The journal: the records of the changes the server acknowledges (one each, in the order
//! it applied them), queued by the live server with the snapshots that start a new journal,
//! and their replay.

use psnet_transport::le::{LeReader, LeWriter};

use super::row_push::PartRanges;
use super::{Output, ServerState};
use crate::error::KvError;
use crate::proto::msg::{CommandKind, MAX_STRING};
use crate::proto::sum;
use crate::value::Dtype;

/// Version of the record format.
const VERSION: u8 = 3;
const INIT: u8 = 1;
const COMMAND: u8 = 2;
const ROUND: u8 = 3;
const PUSH: u8 = 4;
const ROWS: u8 = 5;
/// A rows record's worker rank for a `dist_sync` round.
const ROUND_RANK: u32 = u32::MAX;

/// One decoded record, borrowing its bytes.
enum Record<'a> {
    Init {
        key: u64,
        dtype: Dtype,
        values: &'a [u8],
    },
    Command {
        kind: CommandKind,
        body: &'a str,
    },
    Round {
        key: u64,
        merged: &'a [u8],
    },
    Push {
        key: u64,
        rank: u32,
        compressed: bool,
        payload: &'a [u8],
    },
    Rows {
        rank: Option<u32>,
        parts: Vec<PartRanges>,
        grad: &'a [u8],
    },
}

fn header(seq: u64, tag: u8, capacity: usize) -> LeWriter {
    let mut w = LeWriter::with_capacity(10 + capacity);
    w.u8(VERSION).u8(tag).u64(seq);
    w
}

/// `values`: whole f32, little-endian.
fn values(tag: u8, seq: u64, key: u64, values: &[u8]) -> Vec<u8> {
    debug_assert_eq!(values.len() % 4, 0);
    let mut w = header(seq, tag, 16 + values.len());
    w.u64(key).u64(values.len() as u64 / 4).bytes(values);
    w.into_vec()
}

/// An init: the key's element type and new value (checked to be whole elements).
pub(super) fn init(seq: u64, key: u64, dtype: Dtype, value: &[u8]) -> Vec<u8> {
    let mut w = header(seq, INIT, 17 + value.len());
    w.u64(key)
        .u8(dtype.code())
        .u64((value.len() / dtype.size()) as u64)
        .bytes(value);
    w.into_vec()
}

/// A command that was carried out.
pub(super) fn command(seq: u64, kind: CommandKind, body: &str) -> Vec<u8> {
    let mut w = header(seq, COMMAND, 5 + body.len());
    // Bodies come from messages, whose strings are at most MAX_STRING bytes.
    w.u8(kind.code())
        .u32(body.len() as u32)
        .bytes(body.as_bytes());
    w.into_vec()
}

/// A completed `dist_sync` round: its merged gradient.
pub(super) fn round(seq: u64, key: u64, merged: &[f32]) -> Vec<u8> {
    values(ROUND, seq, key, sum::as_bytes(merged))
}

/// A `dist_async` push of worker `rank`: its payload as received.
pub(super) fn push(seq: u64, key: u64, rank: u32, compressed: bool, payload: &[u8]) -> Vec<u8> {
    let mut w = header(seq, PUSH, 21 + payload.len());
    w.u64(key)
        .u32(rank)
        .u8(u8::from(compressed))
        .u64(payload.len() as u64)
        .bytes(payload);
    w.into_vec()
}

/// A row gradient applied: a `dist_async` push of worker `rank`, or (None) a completed
/// `dist_sync` round; its parts' ranges and values (f32).
pub(super) fn rows(seq: u64, rank: Option<u32>, parts: &[PartRanges], grad: &[f32]) -> Vec<u8> {
    let ranges: usize = parts.iter().map(|p| p.ranges.len()).sum();
    let mut w = header(
        seq,
        ROWS,
        20 + 16 * parts.len() + 16 * ranges + 4 * grad.len(),
    );
    w.u32(rank.unwrap_or(ROUND_RANK)).u64(parts.len() as u64);
    for p in parts {
        w.u64(p.slot).u64(p.ranges.len() as u64);
        for r in &p.ranges {
            w.u64(r.start as u64).u64(r.len() as u64);
        }
    }
    w.u64(grad.len() as u64).bytes(sum::as_bytes(grad));
    w.into_vec()
}

/// A count read first and bounded by the bytes left at `unit` bytes each.
fn count(r: &mut LeReader<'_>, unit: usize, what: &str) -> Result<usize, String> {
    let n = r.u64().map_err(|_| truncated(what))?;
    if n > (r.remaining() / unit) as u64 {
        return Err(format!(
            "{what}: {n} announced, {} bytes left",
            r.remaining()
        ));
    }
    Ok(n as usize)
}

fn truncated(what: &str) -> String {
    format!("truncated in {what}")
}

/// `n` units of `unit` bytes, `n` read first and bounded by the bytes left.
fn sized<'a>(r: &mut LeReader<'a>, unit: usize, what: &str) -> Result<&'a [u8], String> {
    let n = count(r, unit, what)?;
    Ok(r.take(n * unit).expect("bounded by count"))
}

fn decode(bytes: &[u8]) -> Result<(u64, Record<'_>), String> {
    let mut r = LeReader::new(bytes);
    let version = r.u8().map_err(|_| truncated("the version"))?;
    if version != VERSION {
        return Err(format!(
            "record version {version}, this build reads {VERSION}"
        ));
    }
    let tag = r.u8().map_err(|_| truncated("the tag"))?;
    let seq = r.u64().map_err(|_| truncated("the sequence number"))?;
    let key = |r: &mut LeReader<'_>| r.u64().map_err(|_| truncated("the key"));
    let record = match tag {
        INIT => {
            let key = key(&mut r)?;
            let code = r.u8().map_err(|_| truncated("the value type"))?;
            let dtype =
                Dtype::from_code(code).ok_or_else(|| format!("unknown value type {code}"))?;
            Record::Init {
                key,
                dtype,
                values: sized(&mut r, dtype.size(), "init values")?,
            }
        }
        COMMAND => {
            let code = r.u8().map_err(|_| truncated("the command"))?;
            let kind = CommandKind::from_code(code)
                .filter(|k| *k != CommandKind::Checkpoint)
                .ok_or_else(|| format!("unknown command {code}"))?;
            let len = r.u32().map_err(|_| truncated("the command body"))? as usize;
            if len > MAX_STRING {
                return Err(format!("a command body of {len} bytes"));
            }
            let body = r.take(len).map_err(|_| truncated("the command body"))?;
            let body = std::str::from_utf8(body).map_err(|_| "a command body not UTF-8")?;
            Record::Command { kind, body }
        }
        ROUND => Record::Round {
            key: key(&mut r)?,
            merged: sized(&mut r, 4, "a merged gradient")?,
        },
        PUSH => {
            let key = key(&mut r)?;
            let rank = r.u32().map_err(|_| truncated("the worker rank"))?;
            let compressed = match r.u8().map_err(|_| truncated("the push flags"))? {
                0 => false,
                1 => true,
                other => return Err(format!("push flags {other}")),
            };
            Record::Push {
                key,
                rank,
                compressed,
                payload: sized(&mut r, 1, "a push payload")?,
            }
        }
        ROWS => {
            let rank = r.u32().map_err(|_| truncated("the worker rank"))?;
            let n_parts = count(&mut r, 16, "the parts of a row gradient")?;
            let mut parts = Vec::with_capacity(n_parts);
            for _ in 0..n_parts {
                let slot = key(&mut r)?;
                let n = count(&mut r, 16, "the ranges of a part")?;
                let mut ranges = Vec::with_capacity(n);
                for _ in 0..n {
                    let start = r.u64().map_err(|_| truncated("a range"))?;
                    let len = r.u64().map_err(|_| truncated("a range"))?;
                    let end = start
                        .checked_add(len)
                        .filter(|&e| e <= usize::MAX as u64)
                        .ok_or_else(|| format!("a range of {len} from {start}"))?;
                    ranges.push(start as usize..end as usize);
                }
                parts.push(PartRanges { slot, ranges });
            }
            Record::Rows {
                rank: (rank != ROUND_RANK).then_some(rank),
                parts,
                grad: sized(&mut r, 4, "a row gradient")?,
            }
        }
        other => return Err(format!("unknown record tag {other}")),
    };
    if !r.is_empty() {
        return Err(format!("{} trailing bytes", r.remaining()));
    }
    Ok((seq, record))
}

impl ServerState {
    pub(super) fn checkpoint_refused(&self) -> Option<String> {
        (!self.checkpoints()).then(|| super::CommandError::CheckpointsOff.to_string())
    }

    /// A change was applied: counts it and, with checkpoints on, queues its journal record
    /// (`record(state, seq)`), then a snapshot if `updated` (a key's update) makes one due.
    pub(super) fn commit(
        &mut self,
        updated: Option<u64>,
        record: impl FnOnce(&Self, u64) -> Vec<u8>,
    ) {
        self.seq += 1;
        let Some(every) = self.checkpoint_every else {
            return;
        };
        let bytes = record(self, self.seq);
        self.out.push_back(Output::Journal(bytes));
        let Some(k) = updated.and_then(|key| self.keys.get_mut(&key)) else {
            return;
        };
        k.since_snapshot += 1;
        if every > 0 && k.since_snapshot >= every {
            self.queue_snapshot(None);
        }
    }

    /// Queues a snapshot of the state as it is now; the counts towards the next start over.
    pub(super) fn queue_snapshot(&mut self, reply: Option<(u32, u64)>) {
        let bytes = self.snapshot();
        for k in self.keys.values_mut() {
            k.since_snapshot = 0;
        }
        tracing::debug!(seq = self.seq, bytes = bytes.len(), "snapshot");
        self.out.push_back(Output::Snapshot { bytes, reply });
    }

    /// Applies one journal record ([`Output::Journal`]) through the
    /// code that applied the change live: `Ok(true)` when applied, `Ok(false)` when the state
    /// already holds it (its sequence number is not above [`seq`](Self::seq): a record
    /// written before the snapshot this state was restored from). A malformed record, one
    /// that skips a sequence number (an acknowledged change would be missing) or one that
    /// does not apply to this state is an error, and changes nothing.
    ///
    /// A record is little-endian: version `3`, tag, `u64` sequence number, then
    /// * `1` init: `u64` key, `u8` element type ([`Dtype::code`]), `u64` n, n elements of
    ///   that type (the value);
    /// * `2` command: `u8` command code, `u32` length, the body (UTF-8);
    /// * `3` `dist_sync` round: `u64` key, `u64` n, n `f32` (the merged gradient);
    /// * `4` `dist_async` push: `u64` key, `u32` worker rank, `u8` compressed, `u64`
    ///   length, the payload;
    /// * `5` row gradient: `u32` worker rank (of a `dist_async` push; `u32::MAX`: a
    ///   `dist_sync` round), `u64` parts, per part `u64` slot, `u64` ranges and per range
    ///   `u64` start and length, then `u64` n and n `f32` (the ranges' values in order).
    pub fn apply_journal(&mut self, record: &[u8]) -> Result<bool, KvError> {
        let (seq, record) = decode(record)
            .map_err(|e| KvError::Checkpoint(format!("malformed journal record: {e}")))?;
        if seq <= self.seq {
            return Ok(false);
        }
        if seq != self.seq + 1 {
            return Err(KvError::Checkpoint(format!(
                "journal record {seq} follows change {}: records {} to {} are missing",
                self.seq,
                self.seq + 1,
                seq - 1
            )));
        }
        // Replay changes the state only: no records, no snapshots, no answers.
        let every = self.checkpoint_every.take();
        let result = self.replay(record);
        self.checkpoint_every = every;
        result.map_err(|e| {
            KvError::Checkpoint(format!("journal record {seq} does not apply: {e}"))
        })?;
        self.seq = seq;
        Ok(true)
    }

    fn replay(&mut self, record: Record<'_>) -> Result<(), String> {
        match record {
            Record::Init { key, dtype, values } => self.apply_init(key, dtype, values),
            Record::Command { kind, body } => {
                self.apply_command(kind, body).map_err(|e| e.to_string())
            }
            Record::Round { key, merged } => {
                let n = self.held(key)?;
                if merged.len() != 4 * n {
                    return Err(format!(
                        "key {key}: a merged gradient of {} bytes, the key holds {n} f32",
                        merged.len()
                    ));
                }
                let mut grad = vec![0f32; n];
                sum::copy_from_le(&mut grad, merged);
                self.apply_merged(key, grad)
            }
            Record::Push {
                key,
                rank,
                compressed,
                payload,
            } => {
                let n = self.held(key)?;
                let dtype = self.keys[&key].dtype;
                self.check_payload(key, n, dtype, compressed, payload.len())?;
                self.apply_push(key, rank, compressed, payload)
            }
            Record::Rows { rank, parts, grad } => {
                let mut values = vec![0f32; grad.len() / 4];
                sum::copy_from_le(&mut values, grad);
                self.apply_rows(rank, &parts, &values)
            }
        }
    }

    /// Elements `key` holds.
    fn held(&self, key: u64) -> Result<usize, String> {
        self.keys
            .get(&key)
            .map(|k| k.value.len())
            .ok_or_else(|| format!("key {key} is not initialized"))
    }
}

/// For fuzzing the checkpoint decoders: `data` as a snapshot (restored, snapshot again,
/// restored again: the two snapshots must agree) and as journal records applied to a state
/// with a key, compression and an optimizer. Panics only on a bug.
#[doc(hidden)]
pub fn fuzz_decode(data: &[u8]) {
    if let Ok(state) = ServerState::restore(data, 2, 1 << 24) {
        let again = state.snapshot();
        let restored = ServerState::restore(&again, 2, 1 << 24).expect("a snapshot restores");
        assert_eq!(restored.snapshot(), again, "snapshots are stable");
    }
    let mut s = ServerState::new(2);
    let _ = s.apply_journal(data);
    let _ = s.apply_command(CommandKind::SetCompression, r#"{"type":"2bit"}"#);
    let _ = s.apply_command(CommandKind::SetOptimizer, r#"{"type":"adam"}"#);
    let _ = s.apply_init(1, Dtype::F32, &[0u8; 64]);
    let _ = s.apply_journal(data);
    // As the next record.
    if data.len() >= 10 {
        let mut next = data.to_vec();
        next[2..10].copy_from_slice(&(s.seq() + 1).to_le_bytes());
        let _ = s.apply_journal(&next);
    }
}
