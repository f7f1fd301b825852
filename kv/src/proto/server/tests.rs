use super::*;
use proptest::prelude::*;
use psnet_compression::TwoBitCompressor;

fn bytes_of(v: &[f32]) -> Bytes {
    Bytes::copy_from_slice(sum::as_bytes(v))
}

pub(super) fn push(rank: u32, ts: u64, key: u64, values: &[f32]) -> Push {
    Push {
        rank,
        ts,
        key,
        flags: PushFlags::default(),
        n_elems: values.len() as u64,
        payload: bytes_of(values),
    }
}

fn init(state: &mut ServerState, key: u64, values: &[f32]) {
    let mut p = push(0, 1000 + key, key, values);
    p.flags.init = true;
    state.handle_push(p);
    assert_eq!(
        state.poll_output(),
        Some(Output::Done {
            rank: 0,
            ts: 1000 + key,
            value: None,
            have: None,
        })
    );
}

pub(super) fn drain(state: &mut ServerState) -> Vec<Output> {
    std::iter::from_fn(|| state.poll_output()).collect()
}

pub(super) fn failed_reason(out: &[Output]) -> String {
    match out {
        [Output::Failed { reason, .. }] => reason.clone(),
        [Output::PeerFailed { reason, .. }] => reason.clone(),
        other => panic!("expected one failure, got {other:?}"),
    }
}

#[test]
fn sync_round_answers_only_when_every_worker_pushed() {
    let mut s = ServerState::new(3);
    init(&mut s, 7, &[0.0; 2]);
    s.handle_push(push(2, 1, 7, &[1.0, 2.0]));
    s.handle_push(push(0, 2, 7, &[10.0, 20.0]));
    assert!(
        drain(&mut s).is_empty(),
        "answered before the round completed"
    );
    s.handle_push(push(1, 3, 7, &[100.0, 200.0]));
    let mut done = drain(&mut s);
    done.sort_by_key(|o| match o {
        Output::Done { rank, .. } => *rank,
        _ => u32::MAX,
    });
    assert_eq!(
        done,
        vec![
            Output::Done {
                rank: 0,
                ts: 2,
                value: None,
                have: None,
            },
            Output::Done {
                rank: 1,
                ts: 3,
                value: None,
                have: None,
            },
            Output::Done {
                rank: 2,
                ts: 1,
                value: None,
                have: None,
            },
        ]
    );
    // No updater: the round's sum replaces the value (MXNet).
    assert_eq!(s.value(7), Some(&[111.0f32, 222.0][..]));
    s.handle_push(push(0, 4, 7, &[1.0, 1.0]));
    s.handle_push(push(1, 5, 7, &[1.0, 1.0]));
    s.handle_push(push(2, 6, 7, &[1.0, 1.0]));
    assert_eq!(drain(&mut s).len(), 3);
    assert_eq!(
        s.value(7),
        Some(&[3.0f32, 3.0][..]),
        "replaced, not accumulated"
    );
}

#[test]
fn second_push_in_a_round_waits_for_the_next() {
    let mut s = ServerState::new(2);
    init(&mut s, 1, &[0.0]);
    s.handle_push(push(0, 1, 1, &[1.0]));
    s.handle_push(push(0, 2, 1, &[5.0]));
    assert!(
        drain(&mut s).is_empty(),
        "one worker completed a round alone"
    );
    s.handle_push(push(1, 3, 1, &[2.0]));
    let out = drain(&mut s);
    assert_eq!(out.len(), 2);
    assert_eq!(s.value(1), Some(&[3.0f32][..]));
    s.handle_push(push(1, 4, 1, &[7.0]));
    let out = drain(&mut s);
    assert!(out.contains(&Output::Done {
        rank: 0,
        ts: 2,
        value: None,
        have: None,
    }));
    assert_eq!(s.value(1), Some(&[12.0f32][..]));
}

#[test]
fn pull_back_answers_carry_the_value() {
    let mut s = ServerState::new(1);
    init(&mut s, 3, &[1.0]);
    let mut p = push(0, 9, 3, &[4.0]);
    p.flags.pull_back = true;
    s.handle_push(p);
    assert_eq!(
        drain(&mut s),
        vec![Output::Done {
            rank: 0,
            ts: 9,
            value: Some(3),
            have: None,
        }]
    );
    s.handle_pull(0, 10, 3, 1, None);
    assert_eq!(
        drain(&mut s),
        vec![Output::Done {
            rank: 0,
            ts: 10,
            value: Some(3),
            have: None,
        }]
    );
}

#[test]
fn bad_requests_fail_with_clear_reasons() {
    let mut s = ServerState::new(2);
    s.handle_push(push(0, 1, 5, &[1.0]));
    assert!(failed_reason(&drain(&mut s)).contains("key 5 was pushed before it was initialized"));
    s.handle_pull(1, 2, 5, 1, None);
    assert!(failed_reason(&drain(&mut s)).contains("key 5 was pulled before it was initialized"));
    init(&mut s, 5, &[0.0; 4]);
    s.handle_push(push(0, 3, 5, &[1.0; 3]));
    assert!(failed_reason(&drain(&mut s)).contains("pushed 3 elements, this server holds 4"));
    s.handle_pull(0, 4, 5, 8, None);
    assert!(failed_reason(&drain(&mut s)).contains("pulled 8 elements"));
    let mut p = push(0, 5, 5, &[1.0; 4]);
    p.flags.compressed = true;
    s.handle_push(p);
    assert!(failed_reason(&drain(&mut s)).contains("no compression was set"));
    let mut p = push(0, 6, 5, &[1.0; 4]);
    p.payload = p.payload.slice(..15);
    s.handle_push(p);
    assert!(failed_reason(&drain(&mut s)).contains("push of 15 bytes"));
    s.handle_push(push(9, 7, 5, &[1.0; 4]));
    assert!(failed_reason(&drain(&mut s)).contains("rank 9 out of range"));
    assert!(s.handle_command(CommandKind::SetMode, "sometimes").is_err());
    assert!(s
        .handle_command(CommandKind::SetOptimizer, "{\"type\":\"nope\"}")
        .is_err());
    assert!(s
        .handle_command(CommandKind::SetCompression, "{\"type\":\"3bit\"}")
        .is_err());
}

#[test]
fn async_needs_an_updater_and_applies_each_push() {
    let mut s = ServerState::new(2);
    s.handle_command(CommandKind::SetMode, "async").unwrap();
    init(&mut s, 1, &[1.0, 1.0]);
    s.handle_push(push(1, 1, 1, &[1.0, 2.0]));
    assert!(failed_reason(&drain(&mut s)).contains("set_optimizer"));
    s.handle_command(
        CommandKind::SetOptimizer,
        r#"{"type": "sgd", "learning_rate": 0.5}"#,
    )
    .unwrap();
    s.handle_push(push(1, 2, 1, &[1.0, 2.0]));
    assert_eq!(
        drain(&mut s),
        vec![Output::Done {
            rank: 1,
            ts: 2,
            value: None,
            have: None,
        }]
    );
    assert_eq!(s.value(1), Some(&[0.5f32, 0.0][..]));
}

#[test]
fn sync_with_updater_applies_it_to_the_sum() {
    let mut s = ServerState::new(2);
    s.handle_command(
        CommandKind::SetOptimizer,
        r#"{"type":"sgd","learning_rate":0.1}"#,
    )
    .unwrap();
    init(&mut s, 1, &[1.0]);
    s.handle_push(push(0, 1, 1, &[2.0]));
    s.handle_push(push(1, 2, 1, &[3.0]));
    assert_eq!(drain(&mut s).len(), 2);
    assert_eq!(s.value(1), Some(&[1.0f32 - 0.1 * 5.0][..]));
}

#[test]
fn lost_worker_fails_waiting_rounds_and_later_pushes() {
    let mut s = ServerState::new(2);
    init(&mut s, 1, &[0.0]);
    s.handle_push(push(0, 1, 1, &[1.0]));
    s.handle_worker_lost(1, "connection closed by the peer");
    // On the lost worker's account (the pusher exits 2, the "peer failed" code).
    let out = drain(&mut s);
    assert!(
        matches!(
            out[..],
            [Output::PeerFailed {
                rank: 0,
                lost: 1,
                ..
            }]
        ),
        "{out:?}"
    );
    let reason = failed_reason(&out);
    assert!(reason.contains("worker 1 (node 11) is gone"), "{reason}");
    s.handle_push(push(0, 2, 1, &[1.0]));
    let out = drain(&mut s);
    assert!(
        matches!(out[..], [Output::PeerFailed { lost: 1, .. }]),
        "{out:?}"
    );
    assert!(failed_reason(&out).contains("worker 1 (node 11)"));
    s.handle_pull(0, 3, 1, 1, None);
    assert_eq!(
        drain(&mut s),
        vec![Output::Done {
            rank: 0,
            ts: 3,
            value: Some(1),
            have: None,
        }]
    );
}

#[test]
fn compressed_pushes_sum_the_dequantized_values_in_rank_order() {
    let mut s = ServerState::new(2);
    s.handle_command(
        CommandKind::SetCompression,
        r#"{"type":"2bit","threshold":0.5}"#,
    )
    .unwrap();
    init(&mut s, 4, &[0.0; 5]);
    let c = TwoBitCompressor::new(0.5).unwrap();
    let grads = [[0.6f32, -0.6, 0.1, 1.0, -2.0], [0.7, 0.7, -0.7, 0.0, 0.0]];
    let mut expected = [0f32; 5];
    for (rank, g) in grads.iter().enumerate().rev() {
        let mut residual = [0f32; 5];
        let mut out = vec![0u8; c.compressed_len(5)];
        c.quantize(g, &mut residual, &mut out).unwrap();
        s.handle_push(Push {
            rank: rank as u32,
            ts: rank as u64,
            key: 4,
            flags: PushFlags {
                compressed: true,
                ..PushFlags::default()
            },
            n_elems: 5,
            payload: Bytes::from(out),
        });
    }
    for g in &grads {
        let mut residual = [0f32; 5];
        let mut out = vec![0u8; c.compressed_len(5)];
        c.quantize(g, &mut residual, &mut out).unwrap();
        c.dequantize_add(&out, &mut expected).unwrap();
    }
    assert_eq!(drain(&mut s).len(), 2);
    assert_eq!(s.value(4).unwrap(), &expected);
    assert_eq!(expected, [1.0, 0.0, -0.5, 0.5, -0.5]);
}

proptest! {
    /// Whatever order pushes arrive in, the result is the rank-ordered sum, bit for bit.
    #[test]
    fn arrival_order_never_changes_the_sum(
        grads in proptest::collection::vec(proptest::collection::vec(-1e6f32..1e6, 8), 2..6),
        order_seed in any::<u64>(),
    ) {
        let workers = grads.len();
        let mut order: Vec<usize> = (0..workers).collect();
        let mut seed = order_seed;
        for i in (1..workers).rev() {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            order.swap(i, (seed >> 33) as usize % (i + 1));
        }
        let mut s = ServerState::new(workers as u32);
        init(&mut s, 1, &[0.0; 8]);
        for &r in &order {
            s.handle_push(push(r as u32, r as u64, 1, &grads[r]));
        }
        let mut expected = grads[0].clone();
        for g in &grads[1..] {
            for (e, x) in expected.iter_mut().zip(g) {
                *e += *x;
            }
        }
        prop_assert_eq!(drain(&mut s).len(), workers);
        let got = s.value(1).unwrap();
        prop_assert!(got.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn key_values_beyond_the_server_limit_are_refused_naming_it() {
    // Room for 10 floats.
    let mut s = ServerState::new(1).with_key_limit(40);
    init(&mut s, 1, &[1.0; 6]);
    let mut p = push(0, 7, 2, &[0.0; 5]);
    p.flags.init = true;
    s.handle_push(p);
    let reason = failed_reason(&drain(&mut s));
    assert!(reason.contains("PSNET_KV_SERVER_KEY_BYTES=40"), "{reason}");
    assert!(s.value(2).is_none(), "the refused key is not stored");
    // Re-initializing a key replaces its bytes rather than adding to them.
    init(&mut s, 1, &[2.0; 10]);
    assert_eq!(s.value(1).unwrap().len(), 10);
    init(&mut s, 1, &[3.0; 4]);
    init(&mut s, 3, &[4.0; 6]);
}

fn compressed(rank: u32, ts: u64, key: u64, threshold: f32, values: &[f32]) -> Push {
    let c = TwoBitCompressor::new(threshold).unwrap();
    let mut residual = vec![0f32; values.len()];
    let mut out = vec![0u8; c.compressed_len(values.len())];
    c.quantize(values, &mut residual, &mut out).unwrap();
    Push {
        rank,
        ts,
        key,
        flags: PushFlags {
            compressed: true,
            ..PushFlags::default()
        },
        n_elems: values.len() as u64,
        payload: Bytes::from(out),
    }
}

#[test]
fn compression_settings_cannot_change_once_set() {
    let mut s = ServerState::new(2);
    let half = r#"{"type":"2bit","threshold":0.5}"#;
    s.handle_command(CommandKind::SetCompression, half).unwrap();
    init(&mut s, 4, &[0.0; 5]);
    // Worker 1's compressed push waits in the round for worker 0's.
    s.handle_push(compressed(1, 1, 4, 0.5, &[0.6; 5]));
    for other in [
        r#"{"type":"2bit","threshold":1.0}"#,
        r#"{"type":"1bit","threshold":0.5}"#,
        r#"{"type":"none"}"#,
    ] {
        let err = s
            .handle_command(CommandKind::SetCompression, other)
            .unwrap_err();
        assert!(
            matches!(err, CommandError::CompressionAlreadySet { .. }),
            "{err}"
        );
        let err = err.to_string();
        let current = psnet_compression::CompressionParams::parse(half).unwrap();
        let wanted = psnet_compression::CompressionParams::parse(other).unwrap();
        assert!(err.contains(&format!("already {current}")), "{err}");
        assert!(err.contains(&format!("refusing {wanted}")), "{err}");
        assert!(err.contains("every worker must set the same"), "{err}");
    }
    // The same settings again change nothing.
    s.handle_command(CommandKind::SetCompression, half).unwrap();
    s.handle_push(compressed(0, 2, 4, 0.5, &[0.6; 5]));
    assert_eq!(drain(&mut s).len(), 2);
    // Both 0.6 quantize to +0.5 with the threshold they were made with.
    assert_eq!(s.value(4).unwrap(), &[1.0; 5]);
}

#[test]
fn a_round_holding_pushes_refuses_async_and_reinit() {
    let mut s = ServerState::new(2);
    init(&mut s, 7, &[0.0; 2]);
    s.handle_push(push(1, 1, 7, &[1.0, 2.0]));
    let err = s.handle_command(CommandKind::SetMode, "async").unwrap_err();
    assert_eq!(
        err,
        CommandError::RoundInProgress {
            key: 7,
            count: 1,
            workers: 2
        }
    );
    let err = err.to_string();
    assert!(err.contains("dist_async"), "{err}");
    assert!(err.contains("round of key 7"), "{err}");
    assert!(err.contains("1 of 2 workers pushed"), "{err}");
    assert_eq!(s.mode(), Mode::Sync);
    // Sync again is no change.
    s.handle_command(CommandKind::SetMode, "sync").unwrap();
    let mut again = push(0, 2, 7, &[9.0, 9.0]);
    again.flags.init = true;
    s.handle_push(again);
    let reason = failed_reason(&drain(&mut s));
    assert!(
        reason.contains("key 7: init while its dist_sync round holds pushes"),
        "{reason}"
    );
    // The round goes on as if nothing happened.
    s.handle_push(push(0, 3, 7, &[10.0, 20.0]));
    assert_eq!(drain(&mut s).len(), 2);
    assert_eq!(s.value(7).unwrap(), &[11.0, 22.0]);
    // Between rounds both are fine.
    s.handle_command(CommandKind::SetMode, "async").unwrap();
    init(&mut s, 7, &[5.0; 3]);
    assert_eq!(s.value(7).unwrap(), &[5.0; 3]);
}

#[test]
fn init_values_are_never_compressed() {
    let mut s = ServerState::new(1);
    let mut p = push(0, 1, 3, &[1.0; 4]);
    p.flags.init = true;
    p.flags.compressed = true;
    s.handle_push(p);
    let reason = failed_reason(&drain(&mut s));
    assert!(
        reason.contains("key 3: init values are plain f32"),
        "{reason}"
    );
    assert_eq!(s.value(3), None);
}

#[test]
fn unreadable_requests_are_answered_for_their_id_or_no_request() {
    let mut s = ServerState::new(2);
    s.handle_malformed(1, Some(Exchange::Request(9)), "kv message truncated");
    assert_eq!(
        drain(&mut s),
        vec![Output::Failed {
            rank: 1,
            ts: 9,
            reason: "could not read the request: kv message truncated".into()
        }]
    );
    for exchange in [None, Some(Exchange::Answer(9))] {
        s.handle_malformed(0, exchange, "unknown kv message tag 99");
        match drain(&mut s).as_slice() {
            [Output::Failed {
                rank: 0,
                ts,
                reason,
            }] => {
                assert_eq!(*ts, NO_REQUEST);
                assert!(reason.contains("unknown kv message tag 99"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }
}

/// The second hardening round: a member holding a worker's token sent `init` or a
/// `SetOptimizer` with lr=1000, and servers took them from any worker at any time.
#[test]
fn only_worker_0_initializes_and_sets_what_the_others_must_agree_with() {
    let mut s = ServerState::new(2);
    let mut p = push(1, 1, 3, &[9.0]);
    p.flags.init = true;
    s.handle_push(p);
    assert!(failed_reason(&drain(&mut s)).contains("only worker 0 initializes"));
    init(&mut s, 3, &[1.0]);
    let sgd = r#"{"type":"sgd","learning_rate":0.1}"#;
    let bad = r#"{"type":"sgd","learning_rate":1000}"#;
    // Another worker's optimizer that comes before worker 0's (MXNet: every worker sends it)
    // waits for it, and is then refused: it disagrees. Before, it was taken, and stayed in
    // force if worker 0 never sent one.
    s.handle_command_request(1, 2, CommandKind::SetOptimizer, bad);
    assert!(drain(&mut s).is_empty(), "answered before worker 0 spoke");
    s.handle_command_request(0, 3, CommandKind::SetOptimizer, sgd);
    let out = drain(&mut s);
    assert!(
        matches!(out[0], Output::Done { rank: 0, ts: 3, .. }),
        "{out:?}"
    );
    assert!(failed_reason(&out[1..]).contains("worker 0"), "{out:?}");
    // From then on the others must agree, and agreeing changes nothing. A different
    // optimizer (a changed learning rate, which may come before worker 0's same change) waits
    // for worker 0's next; here worker 0 pushes a gradient first, which refuses it (below).
    s.handle_command_request(1, 4, CommandKind::SetOptimizer, bad);
    assert!(drain(&mut s).is_empty(), "a change waits for worker 0's");
    s.handle_command_request(1, 5, CommandKind::SetOptimizer, sgd);
    assert!(matches!(drain(&mut s)[..], [Output::Done { rank: 1, .. }]));
    // The same for the mode and the compression: an agreeing one waits, then passes.
    s.handle_command_request(1, 6, CommandKind::SetMode, "sync");
    let two_bit = r#"{"type":"2bit","threshold":0.5}"#;
    s.handle_command_request(1, 11, CommandKind::SetCompression, two_bit);
    assert!(drain(&mut s).is_empty(), "mode not yet set by worker 0");
    s.handle_command_request(0, 7, CommandKind::SetMode, "sync");
    assert!(matches!(
        drain(&mut s)[..],
        [
            Output::Done { rank: 0, .. },
            Output::Done { rank: 1, ts: 6, .. }
        ]
    ));
    s.handle_command_request(1, 8, CommandKind::SetMode, "async");
    assert!(failed_reason(&drain(&mut s)).contains("worker 0"));
    s.handle_command_request(0, 12, CommandKind::SetCompression, two_bit);
    assert!(matches!(
        drain(&mut s)[..],
        [
            Output::Done { rank: 0, .. },
            Output::Done {
                rank: 1,
                ts: 11,
                ..
            }
        ]
    ));
    let one_bit = r#"{"type":"1bit","threshold":0.5}"#;
    s.handle_command_request(1, 13, CommandKind::SetCompression, one_bit);
    assert!(failed_reason(&drain(&mut s)).contains("worker 0"));
    // Whether a worker packs its codes is its own: the same setting with "pack" agrees.
    let packing = r#"{"type":"2bit","threshold":0.5,"pack":true}"#;
    s.handle_command_request(1, 14, CommandKind::SetCompression, packing);
    assert!(matches!(
        drain(&mut s)[..],
        [Output::Done {
            rank: 1,
            ts: 14,
            ..
        }]
    ));
    let other = r#"{"type":"2bit","threshold":0.7,"pack":true}"#;
    s.handle_command_request(1, 15, CommandKind::SetCompression, other);
    assert!(failed_reason(&drain(&mut s)).contains("already"));
    // One round at lr 0.1 proves worker 0's optimizer is the one in force; worker 0's push
    // refuses worker 1's change it never made.
    s.handle_push(push(0, 9, 3, &[1.0]));
    let refused = failed_reason(&drain(&mut s));
    assert!(
        refused.contains("worker 0 pushed a gradient without changing it"),
        "{refused}"
    );
    s.handle_push(push(1, 10, 3, &[1.0]));
    drain(&mut s);
    let v = s.value(3).unwrap()[0];
    assert!((v - 0.8).abs() < 1e-6, "lr 0.1 on a sum of 2 from 1: {v}");
}

#[test]
fn commands_waiting_for_worker_0_fail_with_its_refusal_and_are_bounded() {
    let mut s = ServerState::new(2);
    let sgd = r#"{"type":"sgd","learning_rate":0.1}"#;
    s.handle_command_request(1, 1, CommandKind::SetOptimizer, sgd);
    assert!(drain(&mut s).is_empty());
    s.handle_command_request(0, 2, CommandKind::SetOptimizer, r#"{"type":"nope"}"#);
    let out = drain(&mut s);
    assert_eq!(out.len(), 2, "{out:?}");
    assert!(
        failed_reason(&out[1..]).contains("worker 0's SetOptimizer"),
        "{out:?}"
    );
    // A worker cannot make a server hold its commands without end.
    for ts in 10..18 {
        s.handle_command_request(1, ts, CommandKind::SetMode, "async");
    }
    assert!(drain(&mut s).is_empty());
    s.handle_command_request(1, 18, CommandKind::SetMode, "async");
    assert!(failed_reason(&drain(&mut s)).contains("already wait"));
    // Nothing was applied: the mode is still the default.
    s.handle_command_request(0, 19, CommandKind::SetMode, "sync");
    let out = drain(&mut s);
    assert_eq!(out.len(), 9, "{out:?}");
    assert!(out[1..]
        .iter()
        .all(|o| matches!(o, Output::Failed { rank: 1, .. })));
}

#[test]
fn commands_waiting_for_worker_0_fail_when_it_is_gone() {
    let mut s = ServerState::new(3);
    s.handle_command_request(1, 1, CommandKind::SetMode, "sync");
    s.handle_command_request(2, 2, CommandKind::SetOptimizer, r#"{"type":"sgd"}"#);
    assert!(drain(&mut s).is_empty());
    // Worker 2 is gone: its own wait is dropped, worker 1's stays.
    s.handle_worker_lost(2, "killed");
    assert!(drain(&mut s).is_empty());
    s.handle_worker_lost(0, "killed");
    let out = drain(&mut s);
    assert!(
        matches!(&out[..], [Output::PeerFailed { rank: 1, ts: 1, lost: 0, reason }] if reason.contains("worker 0")),
        "{out:?}"
    );
    // Later ones fail at once.
    s.handle_command_request(1, 3, CommandKind::SetCompression, r#"{"type":"2bit"}"#);
    assert!(matches!(
        drain(&mut s)[..],
        [Output::PeerFailed {
            rank: 1,
            ts: 3,
            lost: 0,
            ..
        }]
    ));
}

/// MXNet's users change the learning rate by setting the optimizer again on every worker:
/// worker 1's change may reach a server before worker 0's. It waits for it, and passes.
#[test]
fn another_workers_new_optimizer_waits_for_worker_0s_same_change() {
    let mut s = ServerState::new(2);
    let sgd = |lr: f32| format!(r#"{{"type":"sgd","learning_rate":{lr}}}"#);
    s.handle_command_request(0, 1, CommandKind::SetOptimizer, &sgd(0.1));
    s.handle_command_request(1, 2, CommandKind::SetOptimizer, &sgd(0.1));
    assert_eq!(drain(&mut s).len(), 2);
    s.handle_command_request(1, 3, CommandKind::SetOptimizer, &sgd(0.01));
    assert!(
        drain(&mut s).is_empty(),
        "worker 1's change came first: it waits"
    );
    s.handle_command_request(0, 4, CommandKind::SetOptimizer, &sgd(0.01));
    assert!(matches!(
        drain(&mut s)[..],
        [
            Output::Done { rank: 0, ts: 4, .. },
            Output::Done { rank: 1, ts: 3, .. }
        ]
    ));
    // A mode that differs is refused at once: modes do not change.
    s.handle_command_request(0, 5, CommandKind::SetMode, "sync");
    drain(&mut s);
    s.handle_command_request(1, 6, CommandKind::SetMode, "async");
    assert!(failed_reason(&drain(&mut s)).contains("worker 0"));
}

#[test]
fn packed_codes_sum_as_the_codes_they_pack_and_bad_ones_are_refused_by_name() {
    let setting = r#"{"type":"2bit","threshold":0.5}"#;
    let grads: [Vec<f32>; 2] = [
        (0..300).map(|i| ((i % 5) as f32 - 2.0) * 0.4).collect(),
        (0..300).map(|i| ((i % 3) as f32 - 1.0) * 0.7).collect(),
    ];
    let mut plain = ServerState::new(2);
    plain
        .handle_command(CommandKind::SetCompression, setting)
        .unwrap();
    init(&mut plain, 4, &[0.0; 300]);
    let mut packed = ServerState::new(2);
    packed
        .handle_command(CommandKind::SetCompression, setting)
        .unwrap();
    init(&mut packed, 4, &[0.0; 300]);
    for (rank, g) in grads.iter().enumerate() {
        let p = compressed(rank as u32, rank as u64, 4, 0.5, g);
        plain.handle_push(p.clone());
        let mut q = p.clone();
        q.flags.packed = true;
        q.payload = Bytes::from(crate::proto::packed::pack(&p.payload).unwrap());
        if rank == 1 {
            // An unknown form, codes past the key's end, packed codes of a plain push: each
            // refused,
            // and the round still waits for worker 1's push.
            for (payload, compressed_flag, why) in [
                (Bytes::from_static(&[9, 2, 3]), true, "unknown form 9"),
                (
                    Bytes::from_static(&[1, 0xff, 0x7f]),
                    true,
                    "run past 76 bytes",
                ),
                (q.payload.clone(), false, "uncompressed"),
            ] {
                let mut bad = q.clone();
                bad.ts = 77;
                bad.payload = payload;
                bad.flags.compressed = compressed_flag;
                packed.handle_push(bad);
                match &drain(&mut packed)[..] {
                    [Output::Failed { ts: 77, reason, .. }] => {
                        assert!(reason.contains(why), "{reason}")
                    }
                    other => panic!("{other:?}"),
                }
            }
        }
        packed.handle_push(q);
    }
    assert_eq!(drain(&mut plain).len(), 2);
    assert_eq!(drain(&mut packed).len(), 2);
    assert_eq!(packed.value(4).unwrap(), plain.value(4).unwrap());
    assert!(plain.value(4).unwrap().iter().any(|&v| v != 0.0));
}

#[test]
fn a_packed_push_for_a_later_round_waits_packed_and_counts_there() {
    let mut s = ServerState::new(2);
    s.handle_command(
        CommandKind::SetCompression,
        r#"{"type":"2bit","threshold":0.5}"#,
    )
    .unwrap();
    init(&mut s, 4, &[0.0; 300]);
    let grad: Vec<f32> = (0..300).map(|i| ((i % 5) as f32 - 2.0) * 0.4).collect();
    let packed = |ts: u64, rank: u32| {
        let mut p = compressed(rank, ts, 4, 0.5, &grad);
        p.flags.packed = true;
        p.payload = Bytes::from(crate::proto::packed::pack(&p.payload).unwrap());
        p
    };
    s.handle_push(packed(1, 1));
    let second = packed(2, 1);
    let held = second.payload.len();
    s.handle_push(second);
    assert!(drain(&mut s).is_empty(), "both wait for worker 0");
    let round = &s.keys[&4].round;
    assert_eq!(round.deferred.len(), 1);
    assert_eq!(round.deferred[0].payload.len(), held, "held as it came");
    assert!(round.deferred[0].flags.packed);
    // Worker 0 completes round 1; worker 1's second push then opens round 2.
    s.handle_push(packed(3, 0));
    assert_eq!(drain(&mut s).len(), 2);
    s.handle_push(packed(4, 0));
    let done = drain(&mut s);
    assert_eq!(done.len(), 2, "{done:?}");
    assert!(done.iter().all(|o| matches!(o, Output::Done { .. })));
}

#[test]
fn packed_inits_and_packed_codes_longer_than_the_keys_are_refused_before_they_wait() {
    let mut s = ServerState::new(2);
    s.handle_command(
        CommandKind::SetCompression,
        r#"{"type":"2bit","threshold":0.5}"#,
    )
    .unwrap();
    init(&mut s, 4, &[0.0; 300]);
    let grad = [0.7f32; 300];
    let mut init_packed = compressed(0, 1, 4, 0.5, &grad);
    init_packed.flags.init = true;
    init_packed.flags.packed = true;
    s.handle_push(init_packed);
    assert!(failed_reason(&drain(&mut s)).contains("never packed"));
    // Worker 1's push opens the round; its next would wait for the next round, but 77
    // packed bytes are more than the key's 76 bytes of codes and one: refused at once.
    s.handle_push(compressed(1, 2, 4, 0.5, &grad));
    let mut long = compressed(1, 3, 4, 0.5, &grad);
    long.flags.packed = true;
    long.payload = Bytes::from(vec![0u8; 78]);
    s.handle_push(long);
    let reason = failed_reason(&drain(&mut s));
    assert!(
        reason.contains("78 bytes of packed codes, at most 77"),
        "{reason}"
    );
    assert!(s.keys[&4].round.deferred.is_empty());
    // A packed push to a half key is refused too, before it could wait.
    let mut init_half = push(0, 9, 5, &[0.0; 150]);
    (
        init_half.flags.init,
        init_half.flags.dtype,
        init_half.n_elems,
    ) = (true, Dtype::F16, 300);
    s.handle_push(init_half);
    drain(&mut s);
    assert_eq!(s.dtype(5), Some(Dtype::F16));
    let mut half = compressed(1, 4, 5, 0.5, &grad);
    half.flags.packed = true;
    half.flags.dtype = Dtype::F16;
    s.handle_push(half);
    assert!(failed_reason(&drain(&mut s)).contains("float32"));
}
