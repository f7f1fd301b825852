//! Seeds of the kv_msg target: every kv message, framed and enveloped, and the packed codes.

use super::*;

pub(super) fn kv() -> Vec<Seed> {
    const T: &str = "kv_msg";
    let addr: SocketAddr = "127.0.0.1:9000".parse().unwrap();
    let msgs = vec![
        (
            "register",
            Msg::Register {
                role: Role::Worker,
                addr,
                rank_hint: Some(3),
                recovery: Some([7; 32]),
                identity: psnet_transport::PublicIdentity([6; 32]),
            },
        ),
        ("recovery_key", Msg::RecoveryKey { commit: [9; 32] }),
        (
            "peer_failed",
            Msg::PeerFailed {
                ts: 3,
                lost: NodeId(11),
                reason: "gone".into(),
            },
        ),
        (
            "assign",
            Msg::Assign {
                your_id: NodeId(9),
                nodes: vec![
                    NodeInfo {
                        id: NodeId(8),
                        role: Role::Server,
                        rank: 0,
                        addr: "[::1]:7".parse().unwrap(),
                        identity: psnet_transport::PublicIdentity([3; 32]),
                    },
                    NodeInfo {
                        id: NodeId(9),
                        role: Role::Worker,
                        rank: 0,
                        addr,
                        identity: psnet_transport::PublicIdentity([4; 32]),
                    },
                ],
            },
        ),
        ("barrier", Msg::Barrier { group: Group::ALL }),
        (
            "barrier-failed",
            Msg::BarrierFailed {
                group: Group::WORKERS,
                reason: "worker 1 died".into(),
            },
        ),
        ("heartbeat", Msg::Heartbeat),
        (
            "node-failed",
            Msg::NodeFailed {
                id: NodeId(11),
                reason: "gone".into(),
            },
        ),
        (
            "leaving",
            Msg::Leaving {
                reason: "bye".into(),
            },
        ),
        (
            "command-optimizer",
            Msg::Command {
                ts: 3,
                kind: CommandKind::SetOptimizer,
                body: OptimizerSpec::Sgd(SgdParams {
                    momentum: 0.9,
                    clip_gradient: Some(5.0),
                    ..SgdParams::default()
                })
                .to_json(),
            },
        ),
        (
            "command-compression",
            Msg::Command {
                ts: 4,
                kind: CommandKind::SetCompression,
                body: CompressionParams::two_bit(0.5).unwrap().to_string(),
            },
        ),
        (
            "push",
            Msg::Push {
                ts: 1,
                key: 42,
                flags: PushFlags {
                    init: false,
                    compressed: true,
                    pull_back: true,
                    retry: None,
                    dtype: psnet_kv::Dtype::F32,
                    have: None,
                    packed: true,
                },
                n_elems: 1000,
                priority: 0,
            },
        ),
        (
            "pull",
            Msg::Pull {
                ts: 2,
                key: 7,
                n_elems: 9,
                have: None,
                priority: 0,
            },
        ),
        (
            "pull-with-copy",
            Msg::Pull {
                ts: 3,
                key: 7,
                n_elems: 9,
                have: Some(4),
                priority: 0,
            },
        ),
        (
            "pull-ranges",
            Msg::PullRanges {
                ts: 4,
                n_ranges: 2,
                priority: -1,
            },
        ),
        (
            "push-ranges",
            Msg::PushRanges {
                ts: 4,
                key: 7,
                dtype: psnet_kv::Dtype::F32,
                retry: Some(1),
                n_ranges: 2,
                priority: 0,
            },
        ),
        (
            "pulled-delta",
            Msg::Pulled {
                ts: 3,
                version: 5,
                form: psnet_kv::proto::pulled::Form::Delta { scale: 0.25 },
            },
        ),
        (
            "pulled-packed",
            Msg::Pulled {
                ts: 3,
                version: 6,
                form: psnet_kv::proto::pulled::Form::Packed { scale: 0.5 },
            },
        ),
        ("done", Msg::Done { ts: 5 }),
        (
            "push-retry",
            Msg::Push {
                ts: 11,
                key: 42,
                flags: PushFlags {
                    init: false,
                    compressed: false,
                    pull_back: true,
                    retry: Some(17),
                    dtype: psnet_kv::Dtype::BF16,
                    have: Some(16),
                    packed: false,
                },
                n_elems: 1000,
                priority: 0,
            },
        ),
        (
            "rejoined",
            Msg::Rejoined {
                node: NodeInfo {
                    id: NodeId(8),
                    role: Role::Server,
                    rank: 0,
                    addr,
                    identity: psnet_transport::PublicIdentity([5; 32]),
                },
            },
        ),
        (
            "reassign",
            Msg::Reassign {
                your_id: NodeId(8),
                nodes: vec![NodeInfo {
                    id: NodeId(8),
                    role: Role::Server,
                    rank: 0,
                    addr,
                    identity: psnet_transport::PublicIdentity([6; 32]),
                }],
            },
        ),
        (
            "failed",
            Msg::Failed {
                ts: 6,
                reason: "nope".into(),
            },
        ),
    ];
    let mut seeds = Vec::new();
    for (name, m) in &msgs {
        seeds.push(seed(T, format!("msg-{name}"), cat(&[0], &m.encode())));
    }
    let env = Envelope {
        seq: Some(7),
        ack: Some(3),
    };
    seeds.push(seed(
        T,
        "envelope-push",
        cat(&[0], &env.encode(&msgs[9].1.encode())),
    ));
    let ack = Envelope {
        seq: None,
        ack: Some(12),
    };
    seeds.push(seed(T, "envelope-ack", cat(&[0], &ack.encode(&[]))));
    // Packed codes of 1,000 elements (250 bytes of 2-bit codes) in each of their forms.
    let mut sparse = vec![0u8; 250];
    sparse[3] = 0b1100_0000;
    sparse[200] = 0b0000_0010;
    let dense: Vec<u8> = (0..250u32)
        .map(|i| [0, 0, 0b1100_0010, 0][(i % 4) as usize])
        .collect();
    // A field of 0b01, which the planes cannot say.
    let odd: Vec<u8> = (0..250u32)
        .map(|i| [0, 0, 0b1100_0001, 0][(i % 4) as usize])
        .collect();
    let noise: Vec<u8> = (0..250u32).map(|i| (i * 97 + 13) as u8).collect();
    let forms = [
        ("sparse", sparse),
        ("planes", dense),
        ("zstd", odd),
        ("raw", noise),
    ];
    for (name, codes) in forms {
        let packed = psnet_kv::proto::packed::pack(&codes).unwrap();
        let mut input = vec![2u8];
        input.extend_from_slice(&250u16.to_le_bytes());
        input.extend_from_slice(&packed);
        seeds.push(seed(T, format!("packed-{name}"), input));
    }
    let specs = [
        ("sgd", OptimizerSpec::Sgd(SgdParams::default())),
        ("adam", OptimizerSpec::Adam(AdamParams::default())),
        ("test", OptimizerSpec::Test(TestParams::default())),
    ];
    for (name, spec) in specs {
        seeds.push(seed(
            T,
            format!("optimizer-{name}"),
            cat(&[1], spec.to_json().as_bytes()),
        ));
    }
    seeds.push(seed(
        T,
        "optimizer-python-dict",
        cat(
            &[1],
            b"{'type': 'adam', 'learning_rate': 0.001, 'clip_gradient': None}",
        ),
    ));
    seeds
}
