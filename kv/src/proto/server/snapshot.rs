//! A server's shard as bytes: [`ServerState::snapshot`] and [`ServerState::restore`].

use std::collections::HashMap;

use std::sync::Arc;

use psnet_compression::{CompressionParams, Scheme};
use psnet_transport::le::{LeReader, LeWriter};

use super::{KeyState, Mode, ServerState};
use crate::error::KvError;
use crate::proto::msg::{CommandKind, MAX_STRING};
use crate::proto::pulled::{Delta, KvCompression, Shadow};
use crate::proto::sum;
use crate::updater::OptimizerSpec;
use crate::value::Dtype;

/// First bytes of a snapshot.
const MAGIC: &[u8; 8] = b"PSNSHARD";
/// Version of the snapshot format.
const VERSION: u32 = 4;

const NOT_SET: u8 = 0;
const NO_COMPRESSION: u8 = 1;
const TWO_BIT: u8 = 2;
const ONE_BIT: u8 = 3;

fn bad(what: impl std::fmt::Display) -> KvError {
    KvError::Checkpoint(format!("malformed snapshot: {what}"))
}

fn truncated(what: &str) -> KvError {
    bad(format_args!("truncated in {what}"))
}

impl ServerState {
    /// The shard as bytes: everything that decides future results, and nothing of what is
    /// under way (see the module docs, "Checkpoints"). Deterministic: equal states give equal
    /// bytes.
    ///
    /// Little-endian: `PSNSHARD`, `u32` version `4`, `u32` workers, `u64` sequence number,
    /// `u8` mode (0 `dist_sync`, 1 `dist_async`), `u8` compression (0 not set, 1 none,
    /// 2 2-bit, 3 1-bit, the last two followed by the `f32` threshold and a `u8` of flags: 1
    /// where pulls are compressed too, 2 where codes travel packed), `u8` optimizer
    /// (0 none; 1 followed by `u32` length, its spec's JSON and the updater's state, see
    /// [`Updater::export_state`](crate::updater::Updater::export_state)), `u64` key count,
    /// then per key in ascending order: `u64` key, `u8` element type ([`Dtype::code`]; the
    /// value is kept in `f32` whatever it is), `u64` updates, `u32` m (0, or the
    /// workers once a `dist_async` push was applied), m `u64` (`dist_async` pushes applied by
    /// each worker), `u64` n, n `f32` (the value), then where pulls are compressed and the
    /// key is `f32`: `u64` the copy's version, n `f32` (the workers' copy), `u8` 1 followed
    /// by the last change's `f32` scale and its codes (the scheme's size for n), or 0.
    pub fn snapshot(&self) -> Vec<u8> {
        let values: usize = self.keys.values().map(|k| 32 + 4 * k.value.len()).sum();
        let mut w = LeWriter::with_capacity(64 + values);
        w.bytes(MAGIC)
            .u32(VERSION)
            .u32(self.num_workers)
            .u64(self.seq)
            .u8(match self.mode {
                Mode::Sync => 0,
                Mode::Async => 1,
            });
        let flags = self
            .compression
            .map_or(0, |c| u8::from(c.pull) | (u8::from(c.pack) << 1));
        match self.compression.map(|c| c.params) {
            None => w.u8(NOT_SET),
            Some(CompressionParams::None) => w.u8(NO_COMPRESSION),
            Some(CompressionParams::TwoBit { threshold }) => {
                w.u8(TWO_BIT).u32(threshold.to_bits()).u8(flags)
            }
            Some(CompressionParams::OneBit { threshold }) => {
                w.u8(ONE_BIT).u32(threshold.to_bits()).u8(flags)
            }
        };
        match (&self.optimizer, &self.updater) {
            (Some(spec), Some(updater)) => {
                let json = spec.to_json();
                w.u8(1).u32(json.len() as u32).bytes(json.as_bytes());
                updater.export_state(&mut w);
            }
            _ => {
                w.u8(0);
            }
        }
        w.u64(self.keys.len() as u64);
        for key in self.keys() {
            let k = &self.keys[&key];
            w.u64(key)
                .u8(k.dtype.code())
                .u64(k.updates)
                .u32(k.pushes_by_worker.len() as u32);
            for &count in &k.pushes_by_worker {
                w.u64(count);
            }
            w.u64(k.value.len() as u64).bytes(sum::as_bytes(&k.value));
            if let Some(shadow) = &k.shadow {
                w.u64(shadow.version).bytes(sum::as_bytes(&shadow.copy));
                match &shadow.last {
                    Some(d) => {
                        w.u8(1).u32(d.scale.to_bits()).bytes(&d.codes);
                    }
                    None => {
                        w.u8(0);
                    }
                }
            }
        }
        w.into_vec()
    }

    /// A server rebuilt from [`snapshot`](Self::snapshot)'s bytes, for `num_workers` workers
    /// (which must be the count the snapshot was written with) and a bound of `key_limit`
    /// bytes of values (`PSNET_KV_SERVER_KEY_BYTES`, which the snapshot's values must fit).
    /// Checkpoints are off in the result (turn them on with
    /// [`with_checkpoints`](Self::with_checkpoints)); apply the journal's records with
    /// [`apply_journal`](Self::apply_journal).
    ///
    /// Malformed input is an error naming what is wrong, never a panic; no length read from
    /// `bytes` allocates more than `bytes` holds.
    pub fn restore(bytes: &[u8], num_workers: u32, key_limit: u64) -> Result<Self, KvError> {
        let mut r = LeReader::new(bytes);
        let magic = r.take(MAGIC.len()).map_err(|_| truncated("the magic"))?;
        if magic != MAGIC {
            return Err(bad("it does not start with PSNSHARD"));
        }
        let version = r.u32().map_err(|_| truncated("the version"))?;
        if version != VERSION {
            return Err(bad(format_args!(
                "version {version}, this build reads {VERSION}"
            )));
        }
        let mut s = ServerState::new(num_workers).with_key_limit(key_limit);
        let workers = r.u32().map_err(|_| truncated("the worker count"))?;
        if workers != s.num_workers {
            return Err(KvError::Checkpoint(format!(
                "the snapshot was written for {workers} workers, this job has {}",
                s.num_workers
            )));
        }
        s.seq = r.u64().map_err(|_| truncated("the sequence number"))?;
        s.mode = match r.u8().map_err(|_| truncated("the mode"))? {
            0 => Mode::Sync,
            1 => Mode::Async,
            other => return Err(bad(format_args!("mode {other}"))),
        };
        // The mode in force after a restart is worker 0's or the default: another worker's
        // mode is compared with it at once (a `sync` set by worker 0 is not told apart from
        // the default, and a wait for a worker 0 that set it before the snapshot would never
        // end). An agreeing one changes nothing; a different one is refused, naming both.
        s.set_by_rank0.insert(CommandKind::SetMode.code());
        let compression = match r.u8().map_err(|_| truncated("the compression"))? {
            NOT_SET => None,
            NO_COMPRESSION => Some(KvCompression::from(CompressionParams::None)),
            kind @ (TWO_BIT | ONE_BIT) => {
                let threshold = f32::from_bits(r.u32().map_err(|_| truncated("the threshold"))?);
                let params = if kind == TWO_BIT {
                    CompressionParams::two_bit(threshold)
                } else {
                    CompressionParams::one_bit(threshold)
                };
                let params = params.map_err(|e| bad(format_args!("compression: {e}")))?;
                let flags = r.u8().map_err(|_| truncated("the compression"))?;
                if flags > 3 {
                    return Err(bad(format_args!("compression flags {flags}")));
                }
                Some(KvCompression {
                    params,
                    pull: flags & 1 != 0,
                    pack: flags & 2 != 0,
                })
            }
            other => return Err(bad(format_args!("compression kind {other}"))),
        };
        if let Some(params) = compression {
            s.compressor = params
                .params
                .compressor()
                .map_err(|e| bad(format_args!("compression: {e}")))?;
            s.compression = Some(params);
            // Set by worker 0 (only its is applied): the others' must still agree with it.
            s.set_by_rank0.insert(CommandKind::SetCompression.code());
        }
        match r.u8().map_err(|_| truncated("the optimizer"))? {
            0 => {}
            1 => {
                let len = r.u32().map_err(|_| truncated("the optimizer"))? as usize;
                if len > MAX_STRING {
                    return Err(bad(format_args!("an optimizer spec of {len} bytes")));
                }
                let text = r.take(len).map_err(|_| truncated("the optimizer"))?;
                let text = std::str::from_utf8(text).map_err(|_| bad("optimizer not UTF-8"))?;
                let spec = OptimizerSpec::parse(text).map_err(bad)?;
                let mut updater = spec.build();
                updater.import_state(&mut r).map_err(bad)?;
                s.updater = Some(updater);
                s.optimizer = Some(spec);
                // The optimizer in force is worker 0's (it overrides any other's): after a
                // restart the others' must still agree with it.
                s.set_by_rank0.insert(CommandKind::SetOptimizer.code());
            }
            other => return Err(bad(format_args!("optimizer flag {other}"))),
        }
        let count = r.u64().map_err(|_| truncated("the key count"))?;
        if count > (r.remaining() / 24) as u64 {
            return Err(bad(format_args!(
                "{count} keys announced, {} bytes left",
                r.remaining()
            )));
        }
        s.keys = HashMap::with_capacity(count as usize);
        let mut previous = None;
        for _ in 0..count {
            let key = r.u64().map_err(|_| truncated("a key"))?;
            if previous.is_some_and(|p| key <= p) {
                return Err(bad(format_args!("key {key} out of order or repeated")));
            }
            previous = Some(key);
            let code = r.u8().map_err(|_| truncated("a value type"))?;
            let dtype = Dtype::from_code(code)
                .ok_or_else(|| bad(format_args!("key {key}: value type {code}")))?;
            let updates = r.u64().map_err(|_| truncated("an update count"))?;
            let m = r.u32().map_err(|_| truncated("a worker count"))?;
            if m != 0 && m != s.num_workers {
                return Err(bad(format_args!(
                    "key {key}: pushes counted for {m} workers, the job has {}",
                    s.num_workers
                )));
            }
            let mut pushes_by_worker = Vec::with_capacity(m as usize);
            for _ in 0..m {
                pushes_by_worker.push(r.u64().map_err(|_| truncated("a push count"))?);
            }
            let n = r.u64().map_err(|_| truncated("a value length"))?;
            if n > (r.remaining() / 4) as u64 {
                return Err(bad(format_args!(
                    "key {key}: {n} elements announced, {} bytes left",
                    r.remaining()
                )));
            }
            let raw = r.take(4 * n as usize).expect("bounded above");
            s.key_bytes += raw.len() as u64;
            if s.key_bytes > key_limit {
                return Err(KvError::Checkpoint(format!(
                    "the snapshot holds more than PSNET_KV_SERVER_KEY_BYTES={key_limit} bytes \
                     of values"
                )));
            }
            let mut value = vec![0f32; n as usize];
            sum::copy_from_le(&mut value, raw);
            let mut state = KeyState::new(value, updates);
            state.pushes_by_worker = pushes_by_worker;
            state.dtype = dtype;
            if let (Some(scheme), Dtype::F32) = (s.pull_scheme(), dtype) {
                state.shadow = Some(read_shadow(&mut r, key, n as usize, scheme)?);
                s.key_bytes += 4 * n;
                if s.key_bytes > key_limit {
                    return Err(KvError::Checkpoint(format!(
                        "the snapshot holds more than PSNET_KV_SERVER_KEY_BYTES={key_limit} \
                         bytes of values and workers' copies"
                    )));
                }
            }
            s.keys.insert(key, state);
        }
        if !r.is_empty() {
            return Err(bad(format_args!("{} trailing bytes", r.remaining())));
        }
        Ok(s)
    }
}

/// A key's copy for compressed pulls: its version, its `n` values, its last change.
fn read_shadow(
    r: &mut LeReader<'_>,
    key: u64,
    n: usize,
    scheme: Scheme,
) -> Result<Shadow, KvError> {
    let version = r.u64().map_err(|_| truncated("a copy's version"))?;
    let raw = r
        .take(4 * n)
        .map_err(|_| truncated(&format!("key {key}'s copy")))?;
    let mut copy = vec![0f32; n];
    sum::copy_from_le(&mut copy, raw);
    let last = match r.u8().map_err(|_| truncated("a copy's last change"))? {
        0 => None,
        1 => {
            let scale = f32::from_bits(r.u32().map_err(|_| truncated("a change's scale"))?);
            if !scale.is_finite() || scale < 0.0 {
                return Err(bad(format_args!("key {key}: a change's scale of {scale}")));
            }
            let codes = r
                .take(scheme.compressed_size(n))
                .map_err(|_| truncated(&format!("key {key}'s last change")))?;
            Some(Delta::new(scale, codes.to_vec()))
        }
        other => return Err(bad(format_args!("key {key}: change flag {other}"))),
    };
    Ok(Shadow {
        copy: Arc::new(copy),
        version,
        last,
    })
}
