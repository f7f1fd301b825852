use super::*;
use proptest::prelude::*;

fn samples() -> Vec<Msg> {
    let addr: SocketAddr = "127.0.0.1:9000".parse().unwrap();
    let node = NodeInfo {
        id: NodeId(10),
        role: Role::Server,
        rank: 1,
        addr,
        identity: psnet_transport::PublicIdentity([5; 32]),
    };
    vec![
        Msg::Register {
            role: Role::Worker,
            addr,
            rank_hint: None,
            recovery: None,
            identity: psnet_transport::PublicIdentity([1; 32]),
        },
        Msg::Register {
            role: Role::Server,
            addr,
            rank_hint: Some(3),
            recovery: Some([3; 32]),
            identity: psnet_transport::PublicIdentity([2; 32]),
        },
        Msg::RecoveryKey { commit: [4; 32] },
        Msg::PeerFailed {
            ts: 5,
            lost: NodeId(11),
            reason: "worker 1 (node 11) is gone".into(),
        },
        Msg::Assign {
            your_id: NodeId(9),
            nodes: vec![NodeInfo {
                id: NodeId(8),
                role: Role::Server,
                rank: 0,
                addr: "[::1]:7".parse().unwrap(),
                identity: psnet_transport::PublicIdentity([3; 32]),
            }],
        },
        Msg::Reassign {
            your_id: NodeId(8),
            nodes: vec![node.clone(), node.clone()],
        },
        Msg::Rejoined { node },
        Msg::Barrier { group: Group::ALL },
        Msg::BarrierDone {
            group: Group::WORKERS,
        },
        Msg::BarrierFailed {
            group: Group::WORKERS,
            reason: "worker 1 died".into(),
        },
        Msg::Heartbeat,
        Msg::NodeFailed {
            id: NodeId(11),
            reason: "gone".into(),
        },
        Msg::Finalize,
        Msg::Shutdown,
        Msg::Leaving {
            reason: "the scheduler is gone".into(),
        },
        Msg::Command {
            ts: 3,
            kind: CommandKind::SetOptimizer,
            body: "{\"type\":\"sgd\"}".into(),
        },
        Msg::Command {
            ts: 4,
            kind: CommandKind::Checkpoint,
            body: String::new(),
        },
        Msg::Push {
            ts: 1,
            key: u64::MAX,
            flags: PushFlags {
                init: false,
                compressed: true,
                pull_back: true,
                retry: None,
                dtype: crate::value::Dtype::F32,
                have: None,
                packed: false,
            },
            n_elems: 1 << 40,
            priority: i32::MIN,
        },
        Msg::Push {
            ts: 9,
            key: 3,
            flags: PushFlags {
                init: false,
                compressed: false,
                pull_back: false,
                retry: Some(41),
                dtype: crate::value::Dtype::F16,
                have: None,
                packed: false,
            },
            n_elems: 2,
            priority: -5,
        },
        Msg::Push {
            ts: 10,
            key: 4,
            flags: PushFlags {
                init: false,
                compressed: true,
                pull_back: true,
                retry: Some(3),
                dtype: crate::value::Dtype::BF16,
                have: Some(u64::MAX - 1),
                packed: true,
            },
            n_elems: 2,
            priority: i32::MAX,
        },
        Msg::Pull {
            ts: 2,
            key: 7,
            n_elems: 9,
            have: None,
            priority: 0,
        },
        Msg::Pull {
            ts: 3,
            key: 7,
            n_elems: 9,
            have: Some(12),
            priority: -1,
        },
        Msg::PullRanges {
            ts: 5,
            n_ranges: u64::MAX,
            priority: -7,
        },
        Msg::PushRanges {
            ts: 6,
            key: 9,
            dtype: Dtype::F16,
            retry: Some(3),
            n_ranges: 4,
            priority: 2,
        },
        Msg::PushRanges {
            ts: 6,
            key: 9,
            dtype: Dtype::F32,
            retry: None,
            n_ranges: 0,
            priority: -2,
        },
        Msg::Pulled {
            ts: 4,
            version: 7,
            form: Form::Full,
        },
        Msg::Pulled {
            ts: 4,
            version: 8,
            form: Form::Delta { scale: 0.125 },
        },
        Msg::Pulled {
            ts: 4,
            version: 8,
            form: Form::Same,
        },
        Msg::Pulled {
            ts: 4,
            version: 9,
            form: Form::Packed { scale: 0.25 },
        },
        Msg::Done { ts: 5 },
        Msg::Failed {
            ts: 6,
            reason: "nope".into(),
        },
    ]
}

#[test]
fn every_message_round_trips() {
    for m in samples() {
        assert_eq!(Msg::decode(&m.encode()), Ok(m.clone()), "{m:?}");
    }
}

#[test]
fn rejects_bad_input() {
    assert_eq!(Msg::decode(&[]), Err(DecodeError::Truncated));
    let v = VERSION;
    assert_eq!(Msg::decode(&[v + 1, 6]), Err(DecodeError::Version(v + 1)));
    assert_eq!(Msg::decode(&[v, 99]), Err(DecodeError::UnknownTag(99)));
    assert_eq!(Msg::decode(&[v, 6, 0]), Err(DecodeError::Trailing(1)));
    let mut huge = vec![v, 2];
    huge.extend_from_slice(&9u64.to_le_bytes());
    huge.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(Msg::decode(&huge), Err(DecodeError::Invalid(_))));
    assert!(matches!(
        Msg::decode(&[v, 3, 0]),
        Err(DecodeError::Invalid("bad group"))
    ));
    // A compressed pull's answer with a scale that is not a finite number >= 0, or an
    // unknown form, is refused.
    for (form, scale) in [
        (1u8, f32::NAN),
        (1, -1.0),
        (1, f32::INFINITY),
        (3, f32::NAN),
        (3, -0.5),
        (4, 0.0),
    ] {
        let mut m = vec![v, 20];
        m.extend_from_slice(&1u64.to_le_bytes());
        m.extend_from_slice(&2u64.to_le_bytes());
        m.push(form);
        if form == 1 || form == 3 {
            m.extend_from_slice(&scale.to_bits().to_le_bytes());
        }
        assert!(
            matches!(Msg::decode(&m), Err(DecodeError::Invalid(_))),
            "{form} {scale}"
        );
    }
    // A pull's copy flag is 0 or 1.
    let mut m = vec![v, 12];
    m.extend_from_slice(&[0; 24]);
    m.push(2);
    assert!(matches!(Msg::decode(&m), Err(DecodeError::Invalid(_))));
}

#[test]
fn envelopes_round_trip() {
    for m in samples() {
        let body = m.encode();
        let env = Envelope {
            seq: Some(7),
            ack: Some(u64::MAX),
        };
        let bytes = env.encode(&body);
        assert_eq!(bytes.len(), ENVELOPE_LEN + body.len());
        assert_eq!(decode_frame(&bytes), Ok((Some(env), Some(m.clone()))));
        let seq_only = Envelope {
            seq: Some(1),
            ack: None,
        };
        assert_eq!(
            decode_frame(&seq_only.encode(&body)),
            Ok((Some(seq_only), Some(m.clone())))
        );
        assert_eq!(decode_frame(&body), Ok((None, Some(m.clone()))));
        // A node without PS_RESEND refuses enveloped messages, saying why.
        assert_eq!(Msg::decode(&bytes), Err(DecodeError::Enveloped));
    }
    let ack = Envelope {
        seq: None,
        ack: Some(3),
    };
    assert_eq!(decode_frame(&ack.encode(&[])), Ok((Some(ack), None)));
    assert!(DecodeError::Enveloped.to_string().contains("PS_RESEND"));
}

#[test]
fn rejects_bad_envelopes() {
    let body = Msg::Heartbeat.encode();
    let bad = |bytes: Vec<u8>| assert!(decode_frame(&bytes).is_err(), "{bytes:?}");
    bad(vec![ENVELOPE]);
    bad(vec![ENVELOPE, 0]);
    bad(vec![ENVELOPE, 4]);
    // A sequence number without its message, a message without a sequence number.
    bad(Envelope {
        seq: Some(1),
        ack: None,
    }
    .encode(&[]));
    bad(Envelope {
        seq: None,
        ack: Some(1),
    }
    .encode(&body));
    // Zero is never a sequence number or an ack.
    bad(Envelope {
        seq: Some(0),
        ack: None,
    }
    .encode(&body));
    bad(Envelope {
        seq: None,
        ack: Some(0),
    }
    .encode(&[]));
    // Envelopes do not nest.
    let inner = Envelope {
        seq: Some(1),
        ack: None,
    }
    .encode(&body);
    bad(Envelope {
        seq: Some(2),
        ack: None,
    }
    .encode(&inner));
}

#[test]
fn request_ids_are_read_from_metadata_that_does_not_decode() {
    let push = Msg::Push {
        ts: 42,
        key: 7,
        flags: PushFlags::default(),
        n_elems: 3,
        priority: 0,
    }
    .encode();
    // Truncated after the id, or with a bad field after it: the id is still there.
    assert!(Msg::decode(&push[..12]).is_err());
    assert_eq!(peek_exchange(&push[..12]), Some(Exchange::Request(42)));
    let mut flags = push.clone();
    flags[18] = 0x30;
    assert_eq!(
        Msg::decode(&flags),
        Err(DecodeError::Invalid("unknown value type"))
    );
    assert_eq!(peek_exchange(&flags), Some(Exchange::Request(42)));
    let done = Msg::Done { ts: 9 }.encode();
    let mut trailing = done.clone();
    trailing.push(1);
    assert_eq!(peek_exchange(&trailing), Some(Exchange::Answer(9)));
    // No id to read: too short, another version, a message without one.
    assert_eq!(peek_exchange(&push[..9]), None);
    let mut other_version = push.clone();
    other_version[0] = VERSION + 1;
    assert_eq!(peek_exchange(&other_version), None);
    assert_eq!(peek_exchange(&Msg::Heartbeat.encode()), None);
    assert_eq!(peek_exchange(&[]), None);
}

#[test]
fn messages_refuse_segments_they_do_not_carry() {
    let push = Msg::Push {
        ts: 1,
        key: 1,
        flags: PushFlags::default(),
        n_elems: 1,
        priority: 0,
    };
    assert_eq!(push.check_segments(0), Ok(()));
    assert_eq!(push.check_segments(1), Ok(()));
    let err = push.check_segments(2).unwrap_err();
    assert_eq!(
        err.to_string(),
        "a kv push carries 2 data segment(s), at most 1"
    );
    assert_eq!(Msg::Done { ts: 1 }.check_segments(1), Ok(()));
    assert!(Msg::Done { ts: 1 }.check_segments(2).is_err());
    let pull = Msg::Pull {
        ts: 1,
        key: 1,
        n_elems: 1,
        have: None,
        priority: 0,
    };
    assert!(pull.check_segments(1).is_err());
    assert!(Msg::Heartbeat.check_segments(1).is_err());
    assert_eq!(Msg::Heartbeat.check_segments(0), Ok(()));
}

#[test]
fn an_envelope_splits_from_a_message_that_does_not_decode() {
    let env = Envelope {
        seq: Some(3),
        ack: None,
    };
    let bytes = env.encode(&[VERSION, 99]);
    assert_eq!(
        split_frame(&bytes),
        Ok((Some(env), Some(&[VERSION, 99][..])))
    );
    assert_eq!(decode_frame(&bytes), Err(DecodeError::UnknownTag(99)));
    assert_eq!(
        split_frame(&[VERSION, 6]),
        Ok((None, Some(&[VERSION, 6][..])))
    );
    assert!(split_frame(&[ENVELOPE, 0]).is_err());
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = Msg::decode(&bytes);
        let _ = decode_frame(&bytes);
        let _ = peek_exchange(&bytes);
    }

    #[test]
    fn arbitrary_envelope_bodies_never_panic(
        flags in any::<u8>(),
        rest in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        let mut bytes = vec![ENVELOPE, flags];
        bytes.extend_from_slice(&rest);
        let _ = decode_frame(&bytes);
    }

    #[test]
    fn truncated_envelopes_are_errors(i in 0usize..14, cut in 0usize..80, seq in 1u64.., ack in 1u64..) {
        let env = Envelope { seq: Some(seq), ack: Some(ack) };
        let bytes = env.encode(&samples()[i].encode());
        if cut < bytes.len() {
            prop_assert!(decode_frame(&bytes[..cut]).is_err());
        }
    }

    #[test]
    fn truncations_of_valid_messages_are_errors(i in 0usize..14, cut in 0usize..64) {
        let m = &samples()[i];
        let bytes = m.encode();
        if cut < bytes.len() {
            prop_assert!(Msg::decode(&bytes[..cut]).is_err());
        }
    }
}

#[test]
fn only_a_registration_with_a_recovery_credential_is_confidential() {
    let confidential: Vec<Msg> = samples().into_iter().filter(Msg::is_confidential).collect();
    assert!(
        matches!(
            &confidential[..],
            [Msg::Register {
                recovery: Some(_),
                ..
            }]
        ),
        "{confidential:?}"
    );
}
