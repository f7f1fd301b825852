//! Journal records come out before the answers that acknowledge their change, on every path;
//! damaged snapshots and records are errors, never panics.

use proptest::prelude::*;
use psnet_compression::CompressionParams;

use super::harness::{command, run, Disk, Job, Op, LIMIT};
use super::tests::push;
use super::{fuzz_decode, Mode, Output, ServerState};
use crate::proto::msg::CommandKind;

fn outputs(s: &mut ServerState) -> Vec<Output> {
    std::iter::from_fn(|| s.poll_output()).collect()
}

fn done(rank: u32, ts: u64, value: Option<u64>) -> Output {
    Output::Done {
        rank,
        ts,
        value,
        have: None,
    }
}

/// The kinds of `out`: `J` journal, `S` snapshot, `D` done, `F` failed.
fn kinds(out: &[Output]) -> String {
    out.iter()
        .map(|o| match o {
            Output::Journal(_) => 'J',
            Output::Snapshot { .. } => 'S',
            Output::Done { .. } | Output::Rows { .. } => 'D',
            Output::Failed { .. } | Output::PeerFailed { .. } => 'F',
        })
        .collect()
}

#[test]
fn every_acknowledged_change_is_journaled_before_its_answer() {
    let mut s = ServerState::new(2).with_checkpoints(0);
    // Commands.
    for (ts, kind, body) in [
        (
            1,
            CommandKind::SetCompression,
            r#"{"type":"2bit","threshold":0.5}"#,
        ),
        (
            2,
            CommandKind::SetOptimizer,
            r#"{"type":"sgd","learning_rate":0.1}"#,
        ),
        (3, CommandKind::SetMode, "sync"),
    ] {
        s.handle_command_request(0, ts, kind, body);
        let out = outputs(&mut s);
        assert_eq!(kinds(&out), "JD", "{kind:?}");
        assert_eq!(out[1], done(0, ts, None));
    }
    // Init.
    let mut p = push(0, 4, 9, &[1.0, 2.0]);
    p.flags.init = true;
    s.handle_push(p);
    let out = outputs(&mut s);
    assert_eq!(kinds(&out), "JD");
    assert_eq!(out[1], done(0, 4, None));
    // A dist_sync round: nothing until it completes, then the record, then both answers.
    s.handle_push(push(1, 5, 9, &[1.0, 1.0]));
    assert!(outputs(&mut s).is_empty());
    // Worker 1 again: deferred to the next round.
    s.handle_push(push(1, 6, 9, &[2.0, 2.0]));
    assert!(outputs(&mut s).is_empty());
    let mut last = push(0, 7, 9, &[3.0, 3.0]);
    last.flags.pull_back = true;
    s.handle_push(last);
    let out = outputs(&mut s);
    assert_eq!(kinds(&out), "JDD");
    assert_eq!(out[1], done(0, 7, Some(9)));
    assert_eq!(out[2], done(1, 5, None));
    // The deferred push opens the next round, which worker 0 completes: again record first.
    s.handle_push(push(0, 8, 9, &[1.0, 1.0]));
    assert_eq!(kinds(&outputs(&mut s)), "JDD");
    // dist_async.
    s.handle_command_request(0, 9, CommandKind::SetMode, "async");
    assert_eq!(kinds(&outputs(&mut s)), "JD");
    let mut p = push(1, 10, 9, &[1.0, 1.0]);
    p.flags.pull_back = true;
    s.handle_push(p);
    let out = outputs(&mut s);
    assert_eq!(kinds(&out), "JD");
    assert_eq!(out[1], done(1, 10, Some(9)));
    // What fails changes nothing and is not journaled.
    s.handle_push(push(1, 11, 9, &[1.0; 3]));
    s.handle_push(push(1, 12, 5, &[1.0]));
    s.handle_command_request(1, 13, CommandKind::SetMode, "never");
    s.handle_command_request(1, 14, CommandKind::SetCompression, r#"{"type":"1bit"}"#);
    assert_eq!(kinds(&outputs(&mut s)), "FFFF");
    // Pulls change nothing.
    s.handle_pull(0, 15, 9, 2, None);
    assert_eq!(kinds(&outputs(&mut s)), "D");
    assert_eq!(s.seq(), 8);
}

#[test]
fn snapshots_come_when_due_or_asked_and_before_the_answers() {
    let mut s = ServerState::new(1).with_checkpoints(2);
    s.handle_command_request(0, 1, CommandKind::SetOptimizer, r#"{"type":"test"}"#);
    let mut p = push(0, 2, 3, &[0.0]);
    p.flags.init = true;
    s.handle_push(p);
    assert_eq!(kinds(&outputs(&mut s)), "JDJD");
    s.handle_push(push(0, 3, 3, &[1.0]));
    assert_eq!(kinds(&outputs(&mut s)), "JD");
    // The second update of key 3: its record, the snapshot, then the answer.
    s.handle_push(push(0, 4, 3, &[1.0]));
    let out = outputs(&mut s);
    assert_eq!(kinds(&out), "JSD");
    let Output::Snapshot { bytes, reply: None } = &out[1] else {
        panic!("{out:?}")
    };
    let restored = ServerState::restore(bytes, 1, LIMIT).unwrap();
    assert_eq!(restored.value(3), Some(&[2.0f32][..]));
    assert_eq!(restored.seq(), 4);
    // Asked: the snapshot carries the request, answered by the driver once written.
    s.handle_command_request(0, 5, CommandKind::Checkpoint, "");
    match outputs(&mut s).as_slice() {
        [Output::Snapshot {
            reply: Some((0, 5)),
            ..
        }] => {}
        other => panic!("{other:?}"),
    }
    // Without checkpoints: refused, naming the variable; and no record ever comes out.
    let mut off = ServerState::new(1);
    off.handle_command_request(0, 1, CommandKind::Checkpoint, "");
    match outputs(&mut off).as_slice() {
        [Output::Failed { reason, .. }] => {
            assert!(reason.contains("PSNET_CHECKPOINT_DIR"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    off.handle_command_request(0, 2, CommandKind::SetOptimizer, r#"{"type":"test"}"#);
    let mut p = push(0, 3, 3, &[0.0]);
    p.flags.init = true;
    off.handle_push(p);
    off.handle_push(push(0, 4, 3, &[1.0]));
    assert_eq!(kinds(&outputs(&mut off)), "DDD");
}

/// A server with every kind of state, its disk, and the requests that made it.
fn rich() -> (ServerState, Disk) {
    let job = Job {
        workers: 2,
        keys: vec![(4, 3), (11, 20)],
        mode: Mode::Async,
        compression: Some(CompressionParams::two_bit(0.5).unwrap()),
        optimizer: Some(r#"{"type":"adam","clip_gradient":0.5}"#),
    };
    let mut rng = fastrand::Rng::with_seed(3);
    let mut ts = 0;
    let mut ops = job.setup(&mut ts, &mut rng);
    ops.extend(job.rounds(2, &mut ts, &mut rng).concat());
    ops.push(command(ts + 1, CommandKind::SetMode, "sync"));
    ops.push(Op::Push(push(0, ts + 2, 4, &[1.0, 2.0, 3.0])));
    ops.push(Op::Push(push(1, ts + 3, 4, &[1.0, 2.0, 3.0])));
    // Left in flight.
    ops.push(Op::Push(push(0, ts + 4, 11, &[0.5; 20])));
    let mut s = ServerState::new(2).with_checkpoints(0);
    let mut disk = Disk::new(&s);
    run(&mut s, &ops, Some(&mut disk));
    (s, disk)
}

#[test]
fn damaged_snapshots_are_errors_never_panics() {
    let (s, _) = rich();
    let bytes = s.snapshot();
    assert!(ServerState::restore(&bytes, 2, LIMIT).is_ok());
    for cut in 0..bytes.len() {
        let err = ServerState::restore(&bytes[..cut], 2, LIMIT).err();
        let err = err.unwrap_or_else(|| panic!("restored from {cut} of {} bytes", bytes.len()));
        assert!(err.to_string().contains("checkpoint: "), "{err}");
    }
    let mut longer = bytes.clone();
    longer.push(0);
    let err = ServerState::restore(&longer, 2, LIMIT).err().unwrap();
    assert!(err.to_string().contains("1 trailing bytes"), "{err}");
    for at in 0..bytes.len() {
        for flip in [0x01, 0x80, 0xFF] {
            let mut bad = bytes.clone();
            bad[at] ^= flip;
            // Values may take any bits; the rest must be refused or read back consistently.
            fuzz_decode(&bad);
        }
    }
    let err = ServerState::restore(&bytes, 3, LIMIT).err().unwrap();
    assert!(
        err.to_string()
            .contains("written for 2 workers, this job has 3"),
        "{err}"
    );
    let err = ServerState::restore(&bytes, 2, 40).err().unwrap();
    assert!(
        err.to_string().contains("PSNET_KV_SERVER_KEY_BYTES=40"),
        "{err}"
    );
}

#[test]
fn damaged_or_missing_records_are_errors_and_change_nothing() {
    let (s, disk) = rich();
    let base = ServerState::restore(&disk.snapshot, 2, LIMIT).unwrap();
    assert!(disk.journal.len() > 8);
    let mut replayed = ServerState::restore(&disk.snapshot, 2, LIMIT).unwrap();
    for (i, record) in disk.journal.iter().enumerate() {
        let before = replayed.snapshot();
        for cut in 0..record.len() {
            assert!(
                replayed.apply_journal(&record[..cut]).is_err(),
                "record {i} cut at {cut}"
            );
        }
        let mut longer = record.clone();
        longer.push(0);
        assert!(replayed.apply_journal(&longer).is_err());
        // A later record: the ones between are missing.
        if let Some(next) = disk.journal.get(i + 1) {
            let err = replayed.apply_journal(next).unwrap_err().to_string();
            assert!(err.contains("are missing"), "{err}");
        }
        assert_eq!(replayed.snapshot(), before, "errors change nothing");
        assert!(replayed.apply_journal(record).unwrap());
        // Applied once: again is a record the state already holds.
        assert!(!replayed.apply_journal(record).unwrap());
    }
    assert_eq!(replayed.snapshot(), s.snapshot());
    // Records that do not fit the state they are applied to.
    let mut other = ServerState::new(2);
    other.seq = base.seq();
    for record in &disk.journal[4..] {
        let before = other.snapshot();
        let mut r = record.clone();
        r[2..10].copy_from_slice(&(other.seq() + 1).to_le_bytes());
        if let Err(e) = other.apply_journal(&r) {
            assert!(e.to_string().contains("does not apply"), "{e}");
            assert_eq!(other.snapshot(), before);
        }
    }
    let mut bad = disk.journal[0].clone();
    bad[0] = 9;
    let err = replayed.apply_journal(&bad).unwrap_err().to_string();
    assert!(err.contains("record version 9"), "{err}");
    bad[0] = 3;
    bad[1] = 77;
    let err = replayed.apply_journal(&bad).unwrap_err().to_string();
    assert!(err.contains("unknown record tag 77"), "{err}");
}

#[test]
fn records_replay_onto_the_initial_snapshot() {
    let (s, disk) = rich();
    assert_eq!(disk.snapshots, 0, "no snapshot since the first");
    let rebuilt = disk.recover(2);
    assert_eq!(rebuilt.snapshot(), s.snapshot());
    assert_eq!(rebuilt.mode(), Mode::Sync);
    assert!(rebuilt.updates(4).unwrap() > 0);
    // The sync round in progress at the end is not in the state (never acknowledged), and
    // nothing else is missing.
    assert_eq!(s.updates(11), rebuilt.updates(11));
    assert_eq!(rebuilt.value(11), s.value(11));
    assert!(s.round_in_progress().is_some() && rebuilt.round_in_progress().is_none());
}

proptest! {
    /// Arbitrary bytes, as a snapshot or as records, never panic.
    #[test]
    fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..300)) {
        fuzz_decode(&data);
        crate::checkpoint::fuzz_journal_file(&data);
    }

    /// Records with a valid header and random contents never panic either.
    #[test]
    fn records_with_random_bodies_never_panic(
        tag in 1u8..5,
        body in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        let mut record = vec![1, tag];
        record.extend_from_slice(&1u64.to_le_bytes());
        record.extend_from_slice(&body);
        fuzz_decode(&record);
    }
}
