//! Test harness for checkpoints: requests as data, a model of the driver's disk (snapshot
//! and journal, fed from the outputs), and jobs that generate rounds of pushes.

use bytes::Bytes;
use psnet_compression::CompressionParams;

use super::{Mode, Output, Push, ServerState};
use crate::proto::msg::{CommandKind, PushFlags};
use crate::proto::sum;

/// Room for any test's keys.
pub(super) const LIMIT: u64 = 1 << 30;

/// What a worker got: its request and the answer, with the bits of a value it carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Answer {
    pub rank: u32,
    pub ts: u64,
    pub result: Result<Option<Vec<u32>>, String>,
}

/// A request to a server.
#[derive(Clone, Debug)]
pub(super) enum Op {
    Push(Push),
    Pull {
        rank: u32,
        ts: u64,
        key: u64,
        n: u64,
    },
    Command {
        rank: u32,
        ts: u64,
        kind: CommandKind,
        body: String,
    },
}

impl Op {
    pub fn ts(&self) -> u64 {
        match self {
            Op::Push(p) => p.ts,
            Op::Pull { ts, .. } | Op::Command { ts, .. } => *ts,
        }
    }

    pub fn apply(&self, s: &mut ServerState) {
        match self {
            Op::Push(p) => s.handle_push(p.clone()),
            Op::Pull { rank, ts, key, n } => s.handle_pull(*rank, *ts, *key, *n, None),
            Op::Command {
                rank,
                ts,
                kind,
                body,
            } => s.handle_command_request(*rank, *ts, *kind, body),
        }
    }
}

pub(super) fn command(ts: u64, kind: CommandKind, body: &str) -> Op {
    Op::Command {
        rank: 0,
        ts,
        kind,
        body: body.into(),
    }
}

pub(super) fn init(ts: u64, key: u64, values: &[f32]) -> Op {
    Op::Push(Push {
        rank: 0,
        ts,
        key,
        flags: PushFlags {
            init: true,
            ..PushFlags::default()
        },
        n_elems: values.len() as u64,
        payload: Bytes::copy_from_slice(sum::as_bytes(values)),
    })
}

/// The driver's files, as the outputs leave them.
#[derive(Clone, Debug, Default)]
pub(super) struct Disk {
    pub snapshot: Vec<u8>,
    pub journal: Vec<Vec<u8>>,
    pub snapshots: usize,
}

impl Disk {
    /// The files of a server that starts with `s`.
    pub fn new(s: &ServerState) -> Self {
        Disk {
            snapshot: s.snapshot(),
            journal: Vec::new(),
            snapshots: 0,
        }
    }

    /// What a restarted server rebuilds from the files.
    pub fn recover(&self, workers: u32) -> ServerState {
        let mut s = ServerState::restore(&self.snapshot, workers, LIMIT).expect("snapshot");
        for r in &self.journal {
            s.apply_journal(r).expect("journal record");
        }
        s
    }
}

/// Takes every output: checkpoint outputs go to `disk` (they must not come without one), the
/// answers come back. Checks that the journal records are exactly the changes applied.
pub(super) fn drain(s: &mut ServerState, mut disk: Option<&mut Disk>) -> Vec<Answer> {
    let mut answers = Vec::new();
    while let Some(out) = s.poll_output() {
        match out {
            Output::Done {
                rank, ts, value, ..
            } => {
                answers.push(Answer {
                    rank,
                    ts,
                    result: Ok(
                        value.map(|k| s.value(k).unwrap().iter().map(|v| v.to_bits()).collect())
                    ),
                })
            }
            Output::Rows { rank, ts, ranges } => {
                let bytes = s.rows_value(&ranges).unwrap();
                let bits = bytes
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                answers.push(Answer {
                    rank,
                    ts,
                    result: Ok(Some(bits)),
                })
            }
            Output::Failed { rank, ts, reason }
            | Output::PeerFailed {
                rank, ts, reason, ..
            } => answers.push(Answer {
                rank,
                ts,
                result: Err(reason),
            }),
            Output::Journal(r) => {
                disk.as_deref_mut()
                    .expect("journal without files")
                    .journal
                    .push(r);
            }
            Output::Snapshot { bytes, reply } => {
                let d = disk.as_deref_mut().expect("snapshot without files");
                d.snapshot = bytes;
                d.journal.clear();
                d.snapshots += 1;
                if let Some((rank, ts)) = reply {
                    answers.push(Answer {
                        rank,
                        ts,
                        result: Ok(None),
                    });
                }
            }
        }
    }
    answers
}

/// Applies `ops` one by one, draining after each; with `disk`, checks that each request
/// leaves one journal record per change applied.
pub(super) fn run(s: &mut ServerState, ops: &[Op], mut disk: Option<&mut Disk>) -> Vec<Answer> {
    let mut answers = Vec::new();
    for op in ops {
        let seq = s.seq();
        let (records, snapshots) = disk
            .as_deref()
            .map_or((0, 0), |d| (d.journal.len(), d.snapshots));
        op.apply(s);
        answers.extend(drain(s, disk.as_deref_mut()));
        if let Some(d) = disk.as_deref() {
            if d.snapshots == snapshots {
                assert_eq!(
                    d.journal.len() - records,
                    (s.seq() - seq) as usize,
                    "one record per change: {op:?}"
                );
            }
        }
    }
    answers
}

/// The pushes among `ops` that `answers` did not answer: what the workers resend.
pub(super) fn in_flight(ops: &[Op], answers: &[Answer]) -> Vec<Op> {
    ops.iter()
        .filter(|op| matches!(op, Op::Push(_)))
        .filter(|op| !answers.iter().any(|a| a.ts == op.ts()))
        .cloned()
        .collect()
}

/// A job's settings, from which requests are generated.
#[derive(Clone, Debug)]
pub(super) struct Job {
    pub workers: u32,
    pub keys: Vec<(u64, usize)>,
    pub mode: Mode,
    pub compression: Option<CompressionParams>,
    pub optimizer: Option<&'static str>,
}

impl Job {
    /// Mode, compression, optimizer and the keys' init, from request id `ts` on.
    pub fn setup(&self, ts: &mut u64, rng: &mut fastrand::Rng) -> Vec<Op> {
        let mut ops = Vec::new();
        let mut next = || {
            *ts += 1;
            *ts
        };
        if self.mode == Mode::Async {
            ops.push(command(next(), CommandKind::SetMode, "async"));
        }
        if let Some(c) = self.compression {
            ops.push(command(next(), CommandKind::SetCompression, &c.to_string()));
        }
        if let Some(o) = self.optimizer {
            ops.push(command(next(), CommandKind::SetOptimizer, o));
        }
        for &(key, n) in &self.keys {
            let values: Vec<f32> = (0..n).map(|_| rng.f32() * 2.0 - 1.0).collect();
            ops.push(init(next(), key, &values));
        }
        ops
    }

    /// `rounds` rounds: each worker pushes each key once (in a shuffled order; compressed
    /// with its own residuals when compression is on; some asking for the value back), then
    /// worker 0 pulls every key.
    pub fn rounds(&self, rounds: usize, ts: &mut u64, rng: &mut fastrand::Rng) -> Vec<Vec<Op>> {
        let compressor = self.compression.and_then(|c| c.compressor().unwrap());
        let mut residuals: Vec<Vec<f32>> = (0..self.workers as usize * self.keys.len())
            .map(|i| vec![0.0; self.keys[i % self.keys.len()].1])
            .collect();
        let mut out = Vec::new();
        for _ in 0..rounds {
            let mut pushes: Vec<(u32, usize)> = (0..self.workers)
                .flat_map(|r| (0..self.keys.len()).map(move |k| (r, k)))
                .collect();
            rng.shuffle(&mut pushes);
            let mut ops = Vec::new();
            for (rank, k) in pushes {
                let (key, n) = self.keys[k];
                let grad: Vec<f32> = (0..n).map(|_| rng.f32() * 4.0 - 2.0).collect();
                let payload = match &compressor {
                    Some(c) => {
                        let residual = &mut residuals[rank as usize * self.keys.len() + k];
                        let mut bytes = vec![0u8; c.compressed_len(n)];
                        c.quantize(&grad, residual, &mut bytes).unwrap();
                        Bytes::from(bytes)
                    }
                    None => Bytes::copy_from_slice(sum::as_bytes(&grad)),
                };
                *ts += 1;
                ops.push(Op::Push(Push {
                    rank,
                    ts: *ts,
                    key,
                    flags: PushFlags {
                        init: false,
                        compressed: compressor.is_some(),
                        pull_back: rng.bool(),
                        retry: None,
                        dtype: crate::value::Dtype::F32,
                        have: None,
                        packed: false,
                    },
                    n_elems: n as u64,
                    payload,
                }));
            }
            for &(key, n) in &self.keys {
                *ts += 1;
                ops.push(Op::Pull {
                    rank: 0,
                    ts: *ts,
                    key,
                    n: n as u64,
                });
            }
            out.push(ops);
        }
        out
    }
}
