//! A server rebuilt from its snapshot and journal goes on bit-identically to one that never
//! stopped: every optimizer, both modes, with and without compression, and random requests
//! cut at random points.

use proptest::prelude::*;
use psnet_compression::CompressionParams;

use super::harness::{command, in_flight, init, run, Answer, Disk, Job, Op, LIMIT};
use super::{Mode, Push, ServerState};
use crate::proto::msg::{CommandKind, PushFlags};

/// Every optimizer and the variants of its arithmetic (momentum or not, weight decay,
/// clipping, rescaling), and none. (`multi_precision` does not exist in psnet.)
const OPTIMIZERS: &[Option<&str>] = &[
    None,
    Some(r#"{"type":"sgd","learning_rate":0.1}"#),
    Some(r#"{"type":"sgd","learning_rate":0.05,"momentum":0.9}"#),
    Some(
        r#"{"type":"sgd","learning_rate":0.05,"momentum":0.8,"wd":0.01,"clip_gradient":0.5,"rescale_grad":0.5}"#,
    ),
    Some(r#"{"type":"sgd","learning_rate":0.2,"wd":0.001,"clip_gradient":1.0}"#),
    Some(r#"{"type":"adam"}"#),
    Some(
        r#"{"type":"adam","learning_rate":0.01,"beta1":0.8,"wd":0.01,"clip_gradient":0.3,"rescale_grad":2.0}"#,
    ),
    Some(r#"{"type":"test","rescale_grad":0.5}"#),
];

fn compressions() -> [Option<CompressionParams>; 3] {
    [
        None,
        Some(CompressionParams::two_bit(0.5).unwrap()),
        Some(CompressionParams::one_bit(0.25).unwrap()),
    ]
}

fn matrix() -> Vec<Job> {
    let mut jobs = Vec::new();
    for &optimizer in OPTIMIZERS {
        for mode in [Mode::Sync, Mode::Async] {
            for compression in compressions() {
                jobs.push(Job {
                    workers: 3,
                    keys: vec![(1, 5), (7, 33)],
                    mode,
                    compression,
                    optimizer,
                });
            }
        }
    }
    jobs
}

const ROUNDS: usize = 6;

/// A job's requests, by round (the setup first), and the answers and final state of a
/// server that takes them all without stopping.
fn job_and_reference(job: &Job) -> (Vec<Vec<Op>>, Vec<Answer>, Vec<u8>) {
    let mut rng = fastrand::Rng::with_seed(7);
    let mut ts = 0;
    let mut parts = vec![job.setup(&mut ts, &mut rng)];
    parts.extend(job.rounds(ROUNDS, &mut ts, &mut rng));
    let mut reference = ServerState::new(job.workers);
    let answers = run(&mut reference, &parts.concat(), None);
    (parts, answers, reference.snapshot())
}

#[test]
fn a_restored_snapshot_goes_on_bit_identically() {
    for job in matrix() {
        let (parts, ref_answers, ref_final) = job_and_reference(&job);
        // Setup and two rounds, a snapshot, then the four other rounds on a restored server.
        let (before, after) = (parts[..3].concat(), parts[3..].concat());
        let mut s = ServerState::new(job.workers);
        let mut answers = run(&mut s, &before, None);
        assert!(
            in_flight(&before, &answers).is_empty(),
            "cut between rounds"
        );
        let bytes = s.snapshot();
        drop(s);
        let mut restored = ServerState::restore(&bytes, job.workers, LIMIT).unwrap();
        assert_eq!(restored.snapshot(), bytes, "{job:?}");
        answers.extend(run(&mut restored, &after, None));
        assert_eq!(answers, ref_answers, "{job:?}");
        assert_eq!(restored.snapshot(), ref_final, "{job:?}");
        let updates = match (job.mode, job.optimizer) {
            (Mode::Sync, _) => ROUNDS as u64,
            (Mode::Async, Some(_)) => ROUNDS as u64 * 3,
            (Mode::Async, None) => 0,
        };
        assert_eq!(restored.updates(1), Some(updates), "{job:?}");
    }
}

#[test]
fn snapshot_and_journal_replay_go_on_bit_identically() {
    for job in matrix() {
        let (parts, ref_answers, ref_final) = job_and_reference(&job);
        // Setup and two rounds, a checkpoint asked by a worker, three rounds in the journal,
        // a crash, then the last round on the rebuilt server.
        let mut s = ServerState::new(job.workers).with_checkpoints(0);
        let mut disk = Disk::new(&s);
        let mut answers = run(&mut s, &parts[..3].concat(), Some(&mut disk));
        let ask = command(u64::MAX, CommandKind::Checkpoint, "");
        let asked = run(&mut s, &[ask], Some(&mut disk));
        assert_eq!(asked.len(), 1);
        assert_eq!(asked[0].result, Ok(None));
        assert_eq!(disk.snapshots, 1);
        assert!(disk.journal.is_empty());
        answers.extend(run(&mut s, &parts[3..6].concat(), Some(&mut disk)));
        let updating = job.optimizer.is_some() || job.mode == Mode::Sync;
        // Three rounds of two keys: one record per round, or per push with dist_async.
        let records = match (updating, job.mode) {
            (false, _) => 0,
            (true, Mode::Sync) => 3 * 2,
            (true, Mode::Async) => 3 * 2 * 3,
        };
        assert_eq!(disk.journal.len(), records, "{job:?}");
        let mut rebuilt = disk.recover(job.workers);
        assert_eq!(rebuilt.snapshot(), s.snapshot(), "{job:?}");
        drop(s);
        answers.extend(run(&mut rebuilt, &parts[6..].concat(), None));
        assert_eq!(answers, ref_answers, "{job:?}");
        assert_eq!(rebuilt.snapshot(), ref_final, "{job:?}");
    }
}

#[test]
fn a_crash_after_any_round_loses_nothing_acknowledged() {
    for job in matrix().into_iter().step_by(2) {
        let (parts, ref_answers, ref_final) = job_and_reference(&job);
        for every in [0, 2] {
            let mut s = ServerState::new(job.workers).with_checkpoints(every);
            let mut disk = Disk::new(&s);
            let mut answers = Vec::new();
            for part in &parts {
                answers.extend(run(&mut s, part, Some(&mut disk)));
                assert_eq!(
                    disk.recover(job.workers).snapshot(),
                    s.snapshot(),
                    "{job:?}"
                );
            }
            assert_eq!(answers, ref_answers);
            assert_eq!(s.snapshot(), ref_final);
            let updating = job.optimizer.is_some() || job.mode == Mode::Sync;
            assert_eq!(disk.snapshots > 0, every > 0 && updating, "{job:?}");
        }
    }
}

#[test]
fn losing_the_optimizer_state_would_show() {
    // The tests above can fail: a server that kept values but not momentum or moments
    // goes on differently.
    for (optimizer, compression) in [(2, 0), (5, 1), (6, 2)] {
        let job = Job {
            workers: 2,
            keys: vec![(1, 9)],
            mode: Mode::Sync,
            compression: compressions()[compression],
            optimizer: OPTIMIZERS[optimizer],
        };
        let (parts, _, ref_final) = job_and_reference(&job);
        let mut s = ServerState::new(job.workers);
        run(&mut s, &parts[..3].concat(), None);
        let mut restored = ServerState::restore(&s.snapshot(), 2, LIMIT).unwrap();
        restored
            .handle_command(CommandKind::SetOptimizer, job.optimizer.unwrap())
            .unwrap();
        run(&mut restored, &parts[3..].concat(), None);
        assert_ne!(
            restored.value(1),
            ServerState::restore(&ref_final, 2, LIMIT).unwrap().value(1)
        );
    }
}

const SPECS: &[&str] = &[
    r#"{"type":"sgd","learning_rate":0.1,"momentum":0.9}"#,
    r#"{"type":"adam","learning_rate":0.01}"#,
    r#"{"type":"test"}"#,
    r#"{"type":"sgd","learning_rate":0.3,"wd":0.1,"clip_gradient":0.2}"#,
];
const COMPRESSION_BODIES: &[&str] = &[
    r#"{"type":"2bit","threshold":0.5}"#,
    r#"{"type":"1bit","threshold":0.5}"#,
    r#"{"type":"none"}"#,
];

/// `len` random requests of `workers` workers over keys 1 to 3: pushes (some compressed,
/// some of the wrong size or rank), pulls, inits, commands of every kind.
fn random_ops(seed: u64, len: usize, workers: u32) -> Vec<Op> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut sizes = [4usize, 1, 17];
    let mut compression: Option<CompressionParams> = None;
    let mut ops = Vec::with_capacity(len);
    for i in 0..len {
        let ts = i as u64 + 1;
        let k = rng.usize(..3);
        let key = k as u64 + 1;
        let op = match rng.u32(..100) {
            0..=54 => {
                let rank = if rng.u32(..40) == 0 {
                    workers
                } else {
                    rng.u32(..workers)
                };
                let n = if rng.u32(..30) == 0 {
                    sizes[k] + 1
                } else {
                    sizes[k]
                };
                let grad: Vec<f32> = (0..n).map(|_| rng.f32() * 2.0 - 1.0).collect();
                let c = compression.and_then(|c| c.compressor().unwrap());
                let compressed = rng.u32(..3) == 0;
                let payload = match (compressed, c) {
                    (true, Some(c)) => {
                        let mut out = vec![0u8; c.compressed_len(n)];
                        c.quantize(&grad, &mut vec![0.0; n], &mut out).unwrap();
                        out
                    }
                    (true, None) => vec![0x5A; n.div_ceil(16) * 4],
                    (false, _) => crate::proto::sum::as_bytes(&grad).to_vec(),
                };
                Op::Push(Push {
                    rank,
                    ts,
                    key,
                    flags: PushFlags {
                        init: false,
                        compressed,
                        pull_back: rng.bool(),
                        retry: None,
                        dtype: crate::value::Dtype::F32,
                        have: None,
                        packed: false,
                    },
                    n_elems: n as u64,
                    payload: payload.into(),
                })
            }
            55..=64 => {
                sizes[k] = [1, 4, 17, 40][rng.usize(..4)];
                let values: Vec<f32> = (0..sizes[k]).map(|_| rng.f32()).collect();
                init(ts, key, &values)
            }
            65..=74 => Op::Pull {
                rank: rng.u32(..workers),
                ts,
                key,
                n: sizes[k] as u64,
            },
            75..=82 => command(
                ts,
                CommandKind::SetOptimizer,
                SPECS[rng.usize(..SPECS.len())],
            ),
            83..=86 => {
                let body = COMPRESSION_BODIES[rng.usize(..COMPRESSION_BODIES.len())];
                compression.get_or_insert(CompressionParams::parse(body).unwrap());
                command(ts, CommandKind::SetCompression, body)
            }
            87..=94 => command(ts, CommandKind::SetMode, ["sync", "async"][rng.usize(..2)]),
            _ => command(ts, CommandKind::Checkpoint, ""),
        };
        ops.push(op);
    }
    ops
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Random requests, a crash at a random point, a server rebuilt from the files, the
    /// unanswered pushes resent by their workers, the rest of the requests: the same answers
    /// and the same final state as a server that never stopped.
    #[test]
    fn recovery_at_any_point_matches_a_server_that_never_stopped(
        seed in any::<u64>(),
        len in 0usize..90,
        workers in 1u32..4,
        every in 0u64..4,
        cut in 0.0f64..=1.0,
    ) {
        let ops = random_ops(seed, len, workers);
        let cut = ((len as f64) * cut) as usize;
        let mut reference = ServerState::new(workers).with_checkpoints(every);
        let mut reference_disk = Disk::new(&reference);
        let ref_answers = run(&mut reference, &ops, Some(&mut reference_disk));

        let mut live = ServerState::new(workers).with_checkpoints(every);
        let mut disk = Disk::new(&live);
        let mut answers = run(&mut live, &ops[..cut], Some(&mut disk));
        let rebuilt = disk.recover(workers);
        prop_assert_eq!(rebuilt.snapshot(), live.snapshot());
        drop(live);

        let mut rebuilt = rebuilt.with_checkpoints(every);
        let mut disk = Disk::new(&rebuilt);
        let resent = run(&mut rebuilt, &in_flight(&ops[..cut], &answers), Some(&mut disk));
        prop_assert!(resent.is_empty(), "resent pushes complete nothing: {:?}", resent);
        answers.extend(run(&mut rebuilt, &ops[cut..], Some(&mut disk)));
        prop_assert_eq!(answers, ref_answers);
        prop_assert_eq!(rebuilt.snapshot(), reference.snapshot());
        prop_assert_eq!(disk.recover(workers).snapshot(), rebuilt.snapshot());
    }
}
