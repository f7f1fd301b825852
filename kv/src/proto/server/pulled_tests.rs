//! Compressed pulls at the server: answers by the version a worker holds, the copy advanced
//! by each round, refusals with `dist_async`, and the copy carried by snapshots and
//! rebuilt by the journal.

use super::tests::{drain, push};
use super::*;
use crate::proto::pulled::Delta;

const PULL_2BIT: &str = r#"{"type":"2bit","threshold":0.5,"pull":true}"#;

fn server(workers: u32) -> ServerState {
    let mut s = ServerState::new(workers);
    s.handle_command(CommandKind::SetCompression, PULL_2BIT)
        .unwrap();
    s.handle_command(
        CommandKind::SetOptimizer,
        r#"{"type":"test","rescale_grad":1.0}"#,
    )
    .unwrap();
    s
}

fn init(s: &mut ServerState, key: u64, values: &[f32]) {
    let mut p = push(0, 9000 + key, key, values);
    p.flags.init = true;
    s.handle_push(p);
    drain(s);
}

/// A round of plain pushes with pull-back from every worker, each saying it holds `have`.
fn round(
    s: &mut ServerState,
    key: u64,
    ts: u64,
    grads: &[&[f32]],
    have: Option<u64>,
) -> Vec<Output> {
    for (rank, g) in grads.iter().enumerate() {
        let mut p = push(rank as u32, ts, key, g);
        p.flags.pull_back = true;
        p.flags.have = have;
        s.handle_push(p);
    }
    drain(s)
}

#[test]
fn each_round_advances_the_copy_and_answers_go_by_the_version_held() {
    let mut s = server(2);
    init(&mut s, 3, &[1.0, 2.0, 3.0, 4.0]);
    let shadow = s.shadow(3).expect("a copy once pulls are compressed");
    assert_eq!((shadow.version, shadow.last.is_none()), (0, true));

    // No copy yet: the whole copy, version 1.
    let out = round(
        &mut s,
        3,
        1,
        &[&[0.5, 0.0, 0.0, -1.0], &[0.5, 0.0, 0.0, -1.0]],
        None,
    );
    let Output::Done {
        value: Some(3),
        have: None,
        ..
    } = out[0]
    else {
        panic!("{out:?}")
    };
    let (value, pulled) = s.answer_value(3, None).unwrap();
    assert_eq!(
        pulled.unwrap(),
        PulledAnswer {
            version: 1,
            form: Form::Full
        }
    );
    let copy = s.shadow(3).unwrap().copy.clone();
    assert_eq!(value.as_bytes(), sum::as_bytes(&copy));
    // The master moved by the sum; the copy by the codes of that change.
    assert_eq!(s.value(3).unwrap(), &[2.0, 2.0, 3.0, 2.0]);
    let Some(Delta { scale, codes, .. }) = s.shadow(3).unwrap().last.clone() else {
        panic!("a finite change goes as codes")
    };
    // The change is [1, 0, 0, -2], its mean magnitude 0.75: the elements at or past it
    // move by their own mean magnitude, 1.5.
    assert_eq!(scale, 1.5);
    let mut expected = vec![1.0f32, 2.0, 3.0, 4.0];
    crate::proto::pulled::apply(
        psnet_compression::Scheme::TwoBit,
        &codes,
        scale,
        &mut expected,
    )
    .unwrap();
    assert_eq!(&expected[..], &copy[..]);
    assert_eq!(&copy[..], &[2.5, 2.0, 3.0, 2.5]);

    // A worker at version 1 gets the next round's codes; at 2 nothing; at 0 the whole copy.
    round(&mut s, 3, 2, &[&[0.0; 4], &[0.0; 4]], Some(1));
    let (value, pulled) = s.answer_value(3, Some(1)).unwrap();
    let last = s.shadow(3).unwrap().last.clone().unwrap();
    assert_eq!(pulled.unwrap().form, Form::Delta { scale: last.scale });
    assert_eq!(value.as_bytes(), &last.codes[..]);
    assert_eq!(value.as_bytes().len(), 4);
    let (value, pulled) = s.answer_value(3, Some(2)).unwrap();
    assert_eq!(
        (pulled.unwrap().form, value.as_bytes().len()),
        (Form::Same, 0)
    );
    assert_eq!(
        s.answer_value(3, Some(0)).unwrap().1.unwrap().form,
        Form::Full
    );

    // A plain pull says its version too.
    s.handle_pull(1, 50, 3, 4, Some(2));
    assert_eq!(
        drain(&mut s),
        [Output::Done {
            rank: 1,
            ts: 50,
            value: Some(3),
            have: Some(2)
        }]
    );

    // A key initialized again: its copy goes whole to everyone, past every version held.
    init(&mut s, 3, &[9.0; 4]);
    let shadow = s.shadow(3).unwrap();
    assert_eq!((shadow.version, &shadow.copy[..]), (3, &[9.0f32; 4][..]));
    assert_eq!(
        s.answer_value(3, Some(2)).unwrap().1.unwrap().form,
        Form::Full
    );
}

#[test]
fn compressed_pulls_and_dist_async_refuse_each_other_by_name() {
    let mut s = server(2);
    let e = s.handle_command(CommandKind::SetMode, "async").unwrap_err();
    assert_eq!(e, CommandError::CompressedPullsNeedSync);
    assert!(
        e.to_string().contains("compressed pulls are for dist_sync"),
        "{e}"
    );
    assert_eq!(s.mode(), Mode::Sync);
    let mut s = ServerState::new(2);
    s.handle_command(CommandKind::SetMode, "async").unwrap();
    let e = s
        .handle_command(CommandKind::SetCompression, PULL_2BIT)
        .unwrap_err();
    assert_eq!(e, CommandError::CompressedPullsNeedSync);
    // Without pulls, the same compression is taken.
    s.handle_command(
        CommandKind::SetCompression,
        r#"{"type":"2bit","threshold":0.5}"#,
    )
    .unwrap();
}

#[test]
fn half_keys_and_keys_before_the_setting_are_answered_right() {
    let mut s = ServerState::new(1);
    init(&mut s, 1, &[1.0, 2.0]);
    s.handle_command(CommandKind::SetCompression, PULL_2BIT)
        .unwrap();
    // A key initialized before: its copy starts from its value.
    assert_eq!(&s.shadow(1).unwrap().copy[..], &[1.0, 2.0]);
    let mut p = push(0, 1, 2, &[]);
    p.flags.init = true;
    p.flags.dtype = Dtype::F16;
    p.payload = Bytes::from(Dtype::F16.narrow(&[1.0, 2.0]));
    p.n_elems = 2;
    s.handle_push(p);
    drain(&mut s);
    assert!(s.shadow(2).is_none(), "half keys are pulled whole");
    assert!(s.answer_value(2, Some(0)).unwrap().1.is_none());
}

#[test]
fn the_copy_survives_a_snapshot_and_is_rebuilt_by_the_journal() {
    let mut s = server(2).with_checkpoints(0);
    init(&mut s, 5, &[0.5; 300]);
    let grads: Vec<f32> = (0..300).map(|i| (i % 13) as f32 / 8.0 - 0.7).collect();
    round(&mut s, 5, 1, &[&grads, &grads], None);
    let snapshot = s.snapshot();
    let mut journal = Vec::new();
    let mut ts = 10;
    for _ in 0..3 {
        ts += 1;
        for out in round(&mut s, 5, ts, &[&grads, &grads], Some(ts - 10)) {
            if let Output::Journal(record) = out {
                journal.push(record);
            }
        }
    }
    let mut restored = ServerState::restore(&snapshot, 2, u64::MAX).unwrap();
    let at_snapshot = restored.shadow(5).unwrap().clone();
    assert_eq!(at_snapshot.version, 1);
    for record in &journal {
        restored.apply_journal(record).unwrap();
    }
    assert_eq!(
        restored.shadow(5),
        s.shadow(5),
        "the journal rebuilds the same copy"
    );
    assert_eq!(restored.snapshot(), s.snapshot(), "bit for bit");
    assert_eq!(restored.shadow(5).unwrap().version, 4);
    // A snapshot cut short in the copy is refused, not read.
    let whole = s.snapshot();
    for cut in [whole.len() - 1, whole.len() - 5, whole.len() - 1300] {
        let e = ServerState::restore(&whole[..cut], 2, u64::MAX).unwrap_err();
        assert!(e.to_string().contains("malformed snapshot"), "{e}");
    }
}

#[test]
fn the_workers_copies_count_against_the_servers_key_bytes() {
    // 40 bytes of room: a 4-element key (16 bytes) fits, with its copy (32) too.
    let mut s = ServerState::new(1).with_key_limit(40);
    init(&mut s, 1, &[1.0; 4]);
    s.handle_command(CommandKind::SetCompression, PULL_2BIT)
        .unwrap();
    // Another 4-element key would bring value and copy to 64 bytes.
    let mut p = push(0, 7, 2, &[1.0; 4]);
    p.flags.init = true;
    s.handle_push(p);
    let reason = super::tests::failed_reason(&drain(&mut s));
    assert!(
        reason.contains("32 bytes (its value and the workers' copy"),
        "{reason}"
    );
    assert!(reason.contains("PSNET_KV_SERVER_KEY_BYTES=40"), "{reason}");
    // Without room for the copies, compressed pulls are refused and nothing changes.
    let mut s = ServerState::new(1).with_key_limit(20);
    init(&mut s, 1, &[1.0; 4]);
    let e = s
        .handle_command(CommandKind::SetCompression, PULL_2BIT)
        .unwrap_err();
    assert!(matches!(e, CommandError::KeyBytes { limit: 20, .. }), "{e}");
    assert!(s.shadow(1).is_none());
    s.handle_command(
        CommandKind::SetCompression,
        r#"{"type":"2bit","threshold":0.5}"#,
    )
    .unwrap();
    // A snapshot's copies count when it is read back.
    let mut s = server(1).with_key_limit(32);
    init(&mut s, 3, &[1.0; 4]);
    let bytes = s.snapshot();
    assert!(ServerState::restore(&bytes, 1, 32).is_ok());
    let e = ServerState::restore(&bytes, 1, 24).unwrap_err().to_string();
    assert!(e.contains("workers' copies"), "{e}");
}

/// Two rounds of 1,000 elements on key 3 with compression `setting`: the change of the
/// second, as codes.
fn two_rounds(setting: &str) -> (ServerState, Delta) {
    let mut s = ServerState::new(2);
    s.handle_command(CommandKind::SetCompression, setting)
        .unwrap();
    s.handle_command(
        CommandKind::SetOptimizer,
        r#"{"type":"test","rescale_grad":1.0}"#,
    )
    .unwrap();
    let n = 1000;
    init(&mut s, 3, &vec![1.0; n]);
    let grad: Vec<f32> = (0..n).map(|i| ((i % 7) as f32 - 3.0) * 0.25).collect();
    round(&mut s, 3, 1, &[&grad, &grad], None);
    round(&mut s, 3, 2, &[&grad, &grad], Some(1));
    let last = s.shadow(3).unwrap().last.clone().unwrap();
    (s, last)
}

#[test]
fn with_packing_every_worker_gets_the_same_packed_codes_of_the_change() {
    let (s, last) = two_rounds(r#"{"type":"2bit","threshold":0.5,"pull":true,"pack":true}"#);
    let (value, pulled) = s.answer_value(3, Some(1)).unwrap();
    assert_eq!(pulled.unwrap().form, Form::Packed { scale: last.scale });
    let codes = crate::proto::packed::unpack(value.as_bytes(), last.codes.len()).unwrap();
    assert_eq!(&codes[..], &last.codes[..]);
    let (again, _) = s.answer_value(3, Some(1)).unwrap();
    let (AnswerValue::Codes(first), AnswerValue::Codes(second)) = (&value, &again) else {
        panic!("codes answer codes")
    };
    assert!(
        Arc::ptr_eq(first, second),
        "packed once, the same bytes to all"
    );
    // A worker without a copy still gets the whole copy.
    let (_, pulled) = s.answer_value(3, None).unwrap();
    assert_eq!(pulled.unwrap().form, Form::Full);
}

#[test]
fn without_packing_no_answer_is_packed_and_nothing_is_packed_for_it() {
    let (s, last) = two_rounds(PULL_2BIT);
    let (value, pulled) = s.answer_value(3, Some(1)).unwrap();
    assert_eq!(pulled.unwrap().form, Form::Delta { scale: last.scale });
    assert_eq!(value.as_bytes(), &last.codes[..]);
    assert!(s
        .shadow(3)
        .unwrap()
        .last
        .as_ref()
        .unwrap()
        .packed
        .get()
        .is_none());
}
