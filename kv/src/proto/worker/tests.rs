use super::*;
use crate::proto::ids::node_id;

const S0: NodeId = NodeId(8);
const S1: NodeId = NodeId(10);

fn state(now: Instant) -> WorkerState {
    WorkerState::new(
        0,
        vec![S0, S1],
        2,
        Placement::new(2, 100).unwrap(),
        Some(Duration::from_secs(10)),
        now,
    )
}

fn msg(from: NodeId, msg: Msg) -> Received {
    Received::Msg {
        from,
        msg,
        value: None,
    }
}

#[test]
fn job_control_is_taken_only_from_the_node_entitled_to_send_it() {
    let now = Instant::now();
    let mut s = state(now);
    let (ts, _rx) = s.begin_request(S0, Asked::Other).unwrap();
    let worker1 = node_id(Role::Worker, 1);
    let control = [
        Msg::Shutdown,
        Msg::Heartbeat,
        Msg::NodeFailed {
            id: S0,
            reason: "x".into(),
        },
        Msg::BarrierDone {
            group: Group::WORKERS,
        },
        Msg::BarrierFailed {
            group: Group::WORKERS,
            reason: "x".into(),
        },
    ];
    for m in &control {
        assert!(s.entitled(SCHEDULER, m), "{m:?}");
        for other in [S0, worker1] {
            assert!(!s.entitled(other, m), "{m:?} from {other}");
        }
    }
    // An answer only from the server that was asked.
    assert!(s.entitled(S0, &Msg::Done { ts }));
    assert!(!s.entitled(S1, &Msg::Done { ts }));
    // A forged shutdown changes nothing.
    s.handle_received(msg(S1, Msg::Shutdown), now);
    assert!(!s.is_shutdown());
}

#[test]
fn answers_reach_their_request_and_failures_name_the_server() {
    let now = Instant::now();
    let mut s = state(now);
    let (a, mut rx_a) = s.begin_request(S0, Asked::Other).unwrap();
    let (b, mut rx_b) = s.begin_request(S1, Asked::Other).unwrap();
    assert_ne!(a, b);
    s.handle_received(
        Received::Msg {
            from: S0,
            msg: Msg::Done { ts: a },
            value: Some(Bytes::from_static(b"v")),
        },
        now,
    );
    assert_eq!(
        rx_a.try_recv().unwrap().unwrap(),
        Some(Bytes::from_static(b"v"))
    );
    s.handle_received(
        msg(
            S1,
            Msg::Failed {
                ts: b,
                reason: "no".into(),
            },
        ),
        now,
    );
    let err = rx_b.try_recv().unwrap().unwrap_err().to_string();
    assert!(
        err.contains("server 1 (node 10)") && err.contains("no"),
        "{err}"
    );
}

#[test]
fn a_lost_server_fails_every_request_the_barrier_and_later_calls() {
    let now = Instant::now();
    let mut s = state(now);
    let (_, mut to_s1) = s.begin_request(S1, Asked::Other).unwrap();
    let mut barrier = s.begin_barrier(Group::WORKERS).unwrap();
    s.handle_received(
        Received::Lost {
            peer: S0,
            reason: "reset".into(),
        },
        now,
    );
    // Even the request to the other server: its round can never complete.
    let err = to_s1.try_recv().unwrap().unwrap_err().to_string();
    assert!(err.contains("server 0 (node 8)"), "{err}");
    let err = barrier.try_recv().unwrap().unwrap_err().to_string();
    assert!(err.contains("server 0 (node 8) is gone"), "{err}");
    let err = s
        .begin_request(S1, Asked::Other)
        .expect_err("refused")
        .to_string();
    assert!(err.contains("server 0 (node 8)"), "{err}");
    assert!(s.begin_barrier(Group::WORKERS).is_err());
}

#[test]
fn a_silent_scheduler_is_lost_after_the_heartbeat_timeout() {
    let t0 = Instant::now();
    let mut s = state(t0);
    let (_, mut rx) = s.begin_request(S0, Asked::Other).unwrap();
    s.handle_received(msg(SCHEDULER, Msg::Heartbeat), t0 + Duration::from_secs(5));
    // Then it waits for its next message: nothing is queued for it.
    s.handle_waiting(t0 + Duration::from_secs(5), true);
    assert!(!s.handle_timeout(t0 + Duration::from_secs(15)));
    assert!(s.handle_timeout(t0 + Duration::from_secs(16)));
    let reason = s.scheduler_lost().expect("lost").to_string();
    assert!(reason.contains("PS_HEARTBEAT_TIMEOUT=10 s"), "{reason}");
    let err = rx.try_recv().unwrap().unwrap_err().to_string();
    assert!(err.contains("the scheduler (node 1)"), "{err}");
    // Reported once.
    assert!(!s.handle_timeout(t0 + Duration::from_secs(30)));
}

#[test]
fn after_shutdown_losses_are_not_errors() {
    let now = Instant::now();
    let mut s = state(now);
    s.handle_received(msg(SCHEDULER, Msg::Shutdown), now);
    assert!(s.is_shutdown());
    s.handle_received(
        Received::Lost {
            peer: S0,
            reason: "closed by the peer".into(),
        },
        now,
    );
    assert!(s.scheduler_lost().is_none());
    assert!(!s.handle_timeout(now + Duration::from_secs(60)));
}

#[test]
fn keys_are_laid_out_and_checked() {
    let mut s = state(Instant::now());
    assert!(matches!(
        s.layout(3, 4, Dtype::F32),
        Err(KvError::UnknownKey(3))
    ));
    s.define_key(3, 4, Dtype::F32).unwrap();
    s.define_key(4, 250, Dtype::F32).unwrap();
    assert_eq!(s.layout(3, 4, Dtype::F32).unwrap().parts.len(), 1);
    let big = s.layout(4, 250, Dtype::F32).unwrap();
    assert_eq!(big.parts.len(), 2, "sharded over both servers");
    assert_eq!(big.parts.iter().map(|p| p.len).sum::<usize>(), 250);
    assert!(matches!(
        s.layout(3, 5, Dtype::F32),
        Err(KvError::SizeMismatch {
            expected: 4,
            got: 5,
            ..
        })
    ));
    let parts = s.prepare_push(4, &[1.0; 250], true).unwrap();
    assert!(parts
        .iter()
        .all(|p| p.flags.pull_back && p.compressed.is_none()));
    assert_eq!(s.key("w"), 0);
    assert_eq!(s.key("b"), 1);
    assert_eq!(s.key("w"), 0);
}

#[test]
fn a_worker_about_to_fail_tells_the_scheduler_and_the_other_servers_why_once() {
    let now = Instant::now();
    let mut s = state(now);
    let lost = |peer| Received::Lost {
        peer,
        reason: "closed by the peer".into(),
    };
    let leaving = |reason: &str| Msg::Leaving {
        reason: reason.into(),
    };
    let why = "server 1 (node 10) is gone: closed by the peer";
    assert_eq!(
        s.leaving_before(&lost(S1)),
        vec![(SCHEDULER, leaving(why)), (S0, leaving(why))]
    );
    // Not for another worker, nor for the scheduler's end (its silence is told separately).
    assert!(s.leaving_before(&lost(node_id(Role::Worker, 1))).is_empty());
    assert!(s.leaving_before(&lost(SCHEDULER)).is_empty());
    // Once: a server already known lost is not reported again, and not told.
    s.handle_received(lost(S1), now);
    assert!(s.leaving_before(&lost(S1)).is_empty());
    assert_eq!(
        s.leaving(SCHEDULER, "silent"),
        vec![(S0, leaving("the scheduler (node 1) is gone: silent"))]
    );
    // Nor while the job ends (servers close after their shutdown).
    let mut done = state(now);
    done.handle_finalize_sent();
    assert!(done.leaving_before(&lost(S0)).is_empty());
}

#[test]
fn an_unreadable_answer_fails_its_request_naming_the_server() {
    let now = Instant::now();
    let mut s = state(now);
    let (ts, mut rx) = s.begin_request(S0, Asked::Other).unwrap();
    let (other, mut other_rx) = s.begin_request(S1, Asked::Other).unwrap();
    let unreadable = |from, ts| Received::Malformed {
        from,
        exchange: Some(Exchange::Answer(ts)),
        reason: "kv message truncated".into(),
    };
    // Only the server asked can fail a request this way.
    s.handle_received(unreadable(S1, ts), now);
    assert!(rx.try_recv().is_err(), "failed by a server not asked");
    s.handle_received(unreadable(S0, ts), now);
    let err = rx.try_recv().unwrap().unwrap_err();
    assert!(matches!(err, KvError::Protocol { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("server 0 (node 8)"), "{text}");
    assert!(
        text.contains("unreadable answer: kv message truncated"),
        "{text}"
    );
    // Refusals of messages the server could not tie to a request change no request.
    s.handle_received(
        msg(
            S1,
            Msg::Failed {
                ts: NO_REQUEST,
                reason: "could not read a message of this worker".into(),
            },
        ),
        now,
    );
    s.handle_received(
        Received::Malformed {
            from: S1,
            exchange: None,
            reason: "unknown kv message tag 99".into(),
        },
        now,
    );
    assert!(other_rx.try_recv().is_err());
    s.handle_received(msg(S1, Msg::Done { ts: other }), now);
    assert!(other_rx.try_recv().unwrap().is_ok());
}

#[test]
fn a_worker_behind_a_backlog_does_not_blame_the_scheduler_until_it_catches_up() {
    let t0 = Instant::now();
    let mut s = state(t0);
    s.handle_received(msg(SCHEDULER, Msg::Heartbeat), t0);
    // 30 s of messages taken one after another without a wait: the scheduler's answers may
    // be queued behind them.
    let mut t = t0;
    for _ in 0..300 {
        t += Duration::from_millis(100);
        s.handle_waiting(t, true);
        s.handle_waiting(t, false);
        s.handle_received(msg(S0, Msg::Heartbeat), t);
    }
    assert!(!s.handle_timeout(t));
    assert!(s.scheduler_lost().is_none());
    // Caught up (it waited for its next message) and still nothing: now it is silence.
    s.handle_waiting(t, true);
    assert!(s.handle_timeout(t + Duration::from_millis(5)));
    assert!(s.scheduler_lost().unwrap().contains("silent for 30.0 s"));
}

fn lost(peer: NodeId) -> Received {
    Received::Lost {
        peer,
        reason: "crashed".into(),
    }
}

fn rejoined(id: NodeId) -> Received {
    msg(
        SCHEDULER,
        Msg::Rejoined {
            node: crate::proto::msg::NodeInfo {
                id,
                role: Role::Server,
                rank: 0,
                addr: "127.0.0.1:1".parse().unwrap(),
                identity: psnet_transport::PublicIdentity([1; 32]),
            },
        },
    )
}

fn retry_of(rx: &mut oneshot::Receiver<Reply>) -> Option<u64> {
    match rx.try_recv() {
        Ok(Err(KvError::Rejoined { retry, .. })) => retry,
        other => panic!("not told to send again: {other:?}"),
    }
}

#[test]
fn requests_to_a_lost_server_wait_for_it_and_pushes_go_again_with_their_place() {
    let now = Instant::now();
    let mut s = state(now).with_recovery(true);
    let push = |key| Asked::Push { key, init: false };
    // Key 3: two pushes acknowledged, then three more waiting (one of them to S1).
    for _ in 0..2 {
        let (ts, _rx) = s.begin_request(S0, push(3)).unwrap();
        s.handle_received(msg(S0, Msg::Done { ts }), now);
    }
    let (_, mut a) = s.begin_request(S0, push(3)).unwrap();
    let (_, mut other) = s.begin_request(S1, push(3)).unwrap();
    let (_, mut b) = s.begin_request(S0, push(3)).unwrap();
    let (_, mut init) = s
        .begin_request(S0, Asked::Push { key: 5, init: true })
        .unwrap();
    let (_, mut pull) = s.begin_request(S0, Asked::Other).unwrap();
    assert!(
        s.leaving_before(&lost(S0)).is_empty(),
        "a worker that waits does not leave"
    );
    s.handle_received(lost(S0), now);
    assert!(s.is_recovering(S0));
    for rx in [&mut a, &mut b, &mut init, &mut pull] {
        assert!(rx.try_recv().is_err(), "held, not failed");
    }
    // New requests to it are taken (and held) too.
    let (_, mut late) = s.begin_request(S0, push(3)).unwrap();
    s.handle_received(rejoined(S0), now);
    assert!(!s.is_recovering(S0));
    assert_eq!(retry_of(&mut a), Some(2), "after the two acknowledged");
    assert_eq!(retry_of(&mut b), Some(3));
    assert_eq!(retry_of(&mut late), Some(4));
    assert_eq!(retry_of(&mut init), Some(0));
    assert_eq!(retry_of(&mut pull), None);
    assert!(
        other.try_recv().is_err(),
        "S1's request is none of S0's business"
    );
    // A key defined again (an init) starts its count again.
    s.define_key(3, 4, Dtype::F32).unwrap();
    let (_, mut again) = s.begin_request(S0, push(3)).unwrap();
    s.handle_received(lost(S0), now);
    s.handle_received(rejoined(S0), now);
    assert_eq!(retry_of(&mut again), Some(0));
}

#[test]
fn a_lost_server_that_does_not_rejoin_fails_what_waits_on_it() {
    let now = Instant::now();
    let mut s = state(now).with_recovery(true);
    let (_, mut rx) = s.begin_request(S0, Asked::Other).unwrap();
    s.handle_received(lost(S0), now);
    s.handle_received(
        msg(
            SCHEDULER,
            Msg::NodeFailed {
                id: S0,
                reason: "not restarted within PSNET_RECOVERY_TIMEOUT=30 s".into(),
            },
        ),
        now,
    );
    let err = rx.try_recv().unwrap().unwrap_err().to_string();
    assert!(
        err.contains("server 0") && err.contains("PSNET_RECOVERY_TIMEOUT"),
        "{err}"
    );
    assert!(
        s.begin_request(S1, Asked::Other).is_err(),
        "a lost shard fails every call"
    );
    // Without recovery, the loss fails requests at once.
    let mut s = state(now);
    let (_, mut rx) = s.begin_request(S0, Asked::Other).unwrap();
    s.handle_received(lost(S0), now);
    assert!(rx.try_recv().unwrap().is_err());
}

fn partitioned(servers: usize, bound: usize, bytes: usize) -> WorkerState {
    let ids = (0..servers as u32)
        .map(|r| node_id(Role::Server, r))
        .collect();
    WorkerState::new(
        0,
        ids,
        2,
        Placement::new(servers, bound).unwrap(),
        None,
        Instant::now(),
    )
    .with_partition_bytes(bytes)
}

#[test]
fn large_keys_go_as_pieces_spread_over_the_servers() {
    // 128 f32 elements a piece (512 bytes); key 1 starts on server 9973 % 2 = 1.
    let mut s = partitioned(2, 1_000_000, 512);
    s.define_key(1, 600, Dtype::F32).unwrap();
    let parts = &s.layout(1, 600, Dtype::F32).unwrap().parts;
    let got: Vec<(usize, usize, usize, u64)> = parts
        .iter()
        .map(|p| (p.server, p.offset, p.len, p.slot))
        .collect();
    let piece = |g: u64| 1 | (g << PIECE_SHIFT);
    assert_eq!(
        got,
        [
            (1, 0, 128, 1),
            (0, 128, 128, piece(1)),
            (1, 256, 128, piece(2)),
            (0, 384, 128, piece(3)),
            (1, 512, 88, piece(4)),
        ]
    );
    // A key of at most PSNET_PARTITION_BYTES keeps MXNet's layout: key 3 on server 1.
    s.define_key(3, 128, Dtype::F32).unwrap();
    let small = &s.layout(3, 128, Dtype::F32).unwrap().parts;
    assert_eq!(small.len(), 1);
    assert_eq!((small[0].server, small[0].slot), (1, 3));
    // f16 pieces hold twice the elements.
    s.define_key(4, 600, Dtype::F16).unwrap();
    let half = &s.layout(4, 600, Dtype::F16).unwrap().parts;
    assert_eq!(
        half.iter().map(|p| p.len).collect::<Vec<_>>(),
        [256, 256, 88]
    );
    // Keys from 2^48 would meet the pieces: refused, naming the variable.
    let err = s.define_key(1 << PIECE_SHIFT, 4, Dtype::F32).unwrap_err();
    assert!(err.to_string().contains("PSNET_PARTITION_BYTES"), "{err}");
    // Without partitioning they are taken, and every key has MXNet's shares.
    let mut whole = partitioned(2, 100, 0);
    whole.define_key(1 << PIECE_SHIFT, 4, Dtype::F32).unwrap();
    whole.define_key(1, 600, Dtype::F32).unwrap();
    let shares = &whole.layout(1, 600, Dtype::F32).unwrap().parts;
    assert_eq!(
        shares
            .iter()
            .map(|p| (p.server, p.len, p.slot))
            .collect::<Vec<_>>(),
        [(0, 300, 1), (1, 300, 1)]
    );
}

#[test]
fn pieces_of_a_key_are_pushed_with_their_own_compressed_codes() {
    let mut s = partitioned(2, 1_000_000, 512);
    let c: Arc<dyn Compressor> = Arc::from(
        psnet_compression::CompressionParams::two_bit(0.5)
            .unwrap()
            .compressor()
            .unwrap()
            .unwrap(),
    );
    s.set_compressor(Some(c.clone()));
    s.define_key(1, 300, Dtype::F32).unwrap();
    let values: Vec<f32> = (0..300).map(|i| (i % 7) as f32 - 3.0).collect();
    let parts = s.prepare_push(1, &values, true).unwrap();
    assert_eq!(parts.len(), 3);
    // The pieces' codes, end to end, are the codes of the whole array: every piece starts
    // on a compressed word.
    let mut residual = vec![0.0; 300];
    let mut whole = vec![0u8; c.compressed_len(300)];
    c.quantize(&values, &mut residual, &mut whole).unwrap();
    let joined: Vec<u8> = parts
        .iter()
        .flat_map(|p| p.compressed.clone().unwrap())
        .collect();
    assert_eq!(joined, whole);
}

proptest::proptest! {
    #[test]
    fn every_layout_covers_the_key_once_in_order(
        len in 0usize..5000,
        servers in 1usize..5,
        bytes in 0usize..3000,
        key in 0u64..1000,
        half in proptest::bool::ANY,
    ) {
        let dtype = if half { Dtype::F16 } else { Dtype::F32 };
        let mut s = partitioned(servers, 700, bytes);
        s.define_key(key, len, dtype).unwrap();
        let parts = &s.layout(key, len, dtype).unwrap().parts;
        let mut next = 0;
        let mut slots = std::collections::HashSet::new();
        for p in parts {
            proptest::prop_assert_eq!(p.offset, next);
            next += p.len;
            proptest::prop_assert!(p.server < servers);
            proptest::prop_assert_eq!(key_of_slot(p.slot), key);
            proptest::prop_assert!(slots.insert((p.server, p.slot)), "one slot twice on a server");
            if parts.len() > 1 && bytes > 0 && len * dtype.size() > bytes {
                proptest::prop_assert_eq!(p.offset % PIECE_ALIGN, 0);
                proptest::prop_assert!(p.len > 0);
            }
        }
        proptest::prop_assert_eq!(next, len);
        if bytes == 0 || len * dtype.size() <= bytes {
            let mxnet: Vec<(usize, usize, usize)> = Placement::new(servers, 700)
                .unwrap()
                .parts(key, len)
                .iter()
                .map(|p| (p.server, p.offset, p.len))
                .collect();
            let ours: Vec<(usize, usize, usize)> =
                parts.iter().map(|p| (p.server, p.offset, p.len)).collect();
            proptest::prop_assert_eq!(ours, mxnet);
        }
    }
}

/// The second hardening round: a worker failing because another worker died exited 1 (its
/// own fault) instead of 2 ("peer failed"), so the launcher could blame it.
#[test]
fn a_round_failed_by_another_workers_loss_is_that_workers_failure() {
    let now = Instant::now();
    let mut s = state(now);
    let (ts, mut rx) = s.begin_request(S0, Asked::Other).unwrap();
    let w1 = node_id(Role::Worker, 1);
    s.handle_received(
        msg(
            S0,
            Msg::PeerFailed {
                ts,
                lost: w1,
                reason: "dist_sync round of key 1 cannot complete: worker 1 is gone".into(),
            },
        ),
        now,
    );
    let err = rx.try_recv().unwrap().unwrap_err();
    assert!(err.is_peer_failure(), "{err}");
    assert_eq!(err.exit_code(), crate::error::EXIT_PEER_FAILED);
    let text = err.to_string();
    assert!(
        text.contains("worker 1 (node 11)") && text.contains("server 0"),
        "{text}"
    );
}

#[test]
fn keys_defined_with_compressed_pulls_on_take_the_larger_pieces_chosen_for_them() {
    let pieces = |s: &WorkerState, key: u64| s.defined_layout(key).unwrap().parts.len();
    let mut s = partitioned(2, 1_000_000, 512).with_pull_partition_bytes(2048);
    s.define_key(1, 2048, Dtype::F32).unwrap();
    s.set_pull_compression(Some(Scheme::TwoBit));
    s.define_key(2, 2048, Dtype::F32).unwrap();
    s.set_pull_compression(None);
    s.define_key(3, 2048, Dtype::F32).unwrap();
    // 8 KiB keys: 16 pieces of 512 bytes, or 4 of 2 KiB; key 1 keeps its layout.
    assert_eq!((pieces(&s, 1), pieces(&s, 2), pieces(&s, 3)), (16, 4, 16));
    // Half keys never travel as codes: the usual pieces.
    s.set_pull_compression(Some(Scheme::TwoBit));
    s.define_key(4, 4096, Dtype::F16).unwrap();
    assert_eq!(pieces(&s, 4), 16);
    // PSNET_PARTITION_BYTES set: no other size is chosen.
    let mut set = partitioned(2, 1_000_000, 512);
    set.set_pull_compression(Some(Scheme::TwoBit));
    set.define_key(1, 2048, Dtype::F32).unwrap();
    assert_eq!(pieces(&set, 1), 16);
}
