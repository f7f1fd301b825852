//! The seed corpus: small valid inputs for every target, made by psnet's own encoders and laid
//! out the way each target reads its input (settings bytes first). `examples/gen_corpus.rs`
//! writes them to `fuzz/corpus/<target>/<name>`.

use std::net::SocketAddr;

use psnet_compression::{CompressionParams, Compressor, OneBitCompressor, TwoBitCompressor};
use psnet_kv::proto::ids::{Group, Role};
use psnet_kv::proto::msg::{CommandKind, Envelope, Msg, NodeInfo, PushFlags};
use psnet_kv::updater::{AdamParams, OptimizerSpec, SgdParams, TestParams};
use psnet_transport::codec::{encode_frame, encode_hello, encode_hello_proved, DataPath};
use psnet_transport::{FrameKind, Limits, NodeId, OutMessage, Proof, Segment};
use psnet_verbs::control::{CmMessage, Control, Refusal};
use psnet_verbs::link::QpInfo;
use psnet_verbs::proto::wire::{put_base, put_cts, put_data_header, Base, Cts, Kind, CTS_LEN};

mod kv;

use kv::kv;

/// One seed: the target it is for, a file name, the bytes.
pub struct Seed {
    /// The fuzz target (a directory of `fuzz/corpus`).
    pub target: &'static str,
    /// File name within it.
    pub name: String,
    /// The input.
    pub bytes: Vec<u8>,
}

fn seed(target: &'static str, name: impl Into<String>, bytes: Vec<u8>) -> Seed {
    Seed {
        target,
        name: name.into(),
        bytes,
    }
}

/// `settings` then `body`.
fn cat(settings: &[u8], body: &[u8]) -> Vec<u8> {
    let mut v = settings.to_vec();
    v.extend_from_slice(body);
    v
}

/// Every seed of every target.
pub fn all() -> Vec<Seed> {
    let mut seeds = Vec::new();
    seeds.extend(transport());
    seeds.extend(kv());
    seeds.extend(verbs_wire());
    seeds.extend(verbs_handshake());
    seeds.extend(compression());
    seeds.extend(kv_checkpoint());
    seeds
}

/// A fresh server's snapshot, read as a snapshot (mode 0) and as a journal file (mode 1);
/// and a server with compressed pulls after one round of a key (its workers' copy, version
/// and last codes in the snapshot).
fn kv_checkpoint() -> Vec<Seed> {
    use psnet_kv::proto::server::{Push, ServerState};
    let snapshot = ServerState::new(2).snapshot();
    let mut s = ServerState::new(2);
    s.handle_command(
        CommandKind::SetCompression,
        r#"{"type":"2bit","threshold":0.5,"pull":true}"#,
    )
    .expect("compressed pulls");
    let values: Vec<u8> = [1.0f32, -2.0, 0.5, 3.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    for (rank, ts, init) in [(0, 1, true), (0, 2, false), (1, 3, false)] {
        s.handle_push(Push {
            rank,
            ts,
            key: 3,
            flags: PushFlags {
                init,
                ..PushFlags::default()
            },
            n_elems: 4,
            payload: values.clone().into(),
        });
    }
    let pulled = s.snapshot();
    vec![
        seed("kv_checkpoint", "snapshot-fresh", cat(&[0], &snapshot)),
        seed("kv_checkpoint", "journal-file-guess", cat(&[1], &snapshot)),
        seed(
            "kv_checkpoint",
            "snapshot-compressed-pulls",
            cat(&[0], &pulled),
        ),
    ]
}

fn frame(kind: FrameKind, meta: &[u8], segments: &[&[u8]], limits: &Limits) -> Vec<u8> {
    let segs: Vec<Segment<'_>> = segments.iter().map(|s| Segment::new(s)).collect();
    encode_frame(kind, &OutMessage::new(meta, &segs), limits).expect("seed within the limits")
}

fn transport() -> Vec<Seed> {
    const T: &str = "transport_codec";
    let default = Limits::default();
    let small = crate::limits(1);
    // Settings: limits choice, then the split point (u16) of the two-piece decode.
    let data = frame(
        FrameKind::Data,
        b"meta",
        &[b"segment zero", b"", b"two"],
        &default,
    );
    let hello = frame(
        FrameKind::Hello,
        &encode_hello(NodeId(9), DataPath::Tcp),
        &[],
        &default,
    );
    let proof = Proof([0x5a; psnet_transport::PROOF_LEN]);
    let ack = frame(
        FrameKind::HelloAck,
        &encode_hello_proved(NodeId(8), DataPath::Rdma, Some(&proof)),
        &[],
        &default,
    );
    let reject = frame(
        FrameKind::HelloReject,
        b"simultaneous connect",
        &[],
        &default,
    );
    let free = frame(
        FrameKind::ShmFree,
        &[1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0],
        &[],
        &default,
    );
    let mut stream = data.clone();
    stream.extend_from_slice(&hello);
    stream.extend_from_slice(&data[..20]);
    let tiny = frame(FrameKind::Data, b"m", &[b"abc", b"de"], &small);
    // A sealed data frame (PSNET_ENCRYPT): its header's flag set (byte 6), its body as
    // anything; a header decodes it, a whole-frame decode (in clear only) refuses it.
    let mut sealed = data.clone();
    sealed[6] |= 1;
    vec![
        seed(T, "sealed-data", cat(&[0, 9, 0], &sealed)),
        seed(T, "data", cat(&[0, 7, 0], &data)),
        seed(T, "hello", cat(&[0, 3, 0], &hello)),
        seed(T, "hello-ack-proof", cat(&[0, 30, 0], &ack)),
        seed(T, "hello-reject", cat(&[0, 0, 0], &reject)),
        seed(T, "shm-free", cat(&[0, 13, 0], &free)),
        seed(T, "stream", cat(&[0, 40, 0], &stream)),
        seed(T, "small-limits", cat(&[1, 5, 0], &tiny)),
    ]
}

fn verbs_wire() -> Vec<Seed> {
    const T: &str = "verbs_wire";
    let base = |kind, seq| Base {
        kind,
        credits: 3,
        seq,
    };
    let data_header = |kind, meta: &[u8], flags, segs: &[&[u8]], with_payload: bool| {
        let mut buf = vec![0u8; 16 + 8 * segs.len()];
        put_data_header(
            &mut buf,
            base(kind, 1),
            meta.len() as u32,
            flags,
            segs.iter().map(|s| s.len() as u64),
        );
        if with_payload || flags & 1 != 0 {
            buf.extend_from_slice(meta);
        }
        if with_payload {
            for s in segs {
                buf.extend_from_slice(s);
            }
        }
        buf
    };
    let cts = |kind| {
        let mut buf = vec![0u8; CTS_LEN];
        put_cts(
            &mut buf,
            base(kind, 2),
            Cts {
                addr: 0x7f00_0000_1000,
                rkey: 0x1234,
                len: 1 << 20,
            },
        );
        buf
    };
    let mut credit = vec![0u8; 8];
    put_base(&mut credit, base(Kind::Credit, 0));
    vec![
        seed(
            T,
            "eager",
            cat(
                &[0],
                &data_header(Kind::Eager, b"meta", 0, &[b"abc", b"defg"], true),
            ),
        ),
        seed(
            T,
            "rts-inline-meta",
            cat(
                &[0],
                &data_header(Kind::Rts, b"meta", 1, &[&[0; 300]], false),
            ),
        ),
        seed(
            T,
            "direct",
            cat(
                &[1],
                &data_header(Kind::Direct, b"m", 0, &[b"x", b"y"], false),
            ),
        ),
        seed(T, "cts", cat(&[0], &cts(Kind::Cts))),
        seed(T, "offer", cat(&[0], &cts(Kind::Offer))),
        seed(T, "credit", cat(&[0], &credit)),
    ]
}

fn verbs_handshake() -> Vec<Seed> {
    const T: &str = "verbs_handshake";
    let info = QpInfo {
        qpn: 0x11,
        psn: 0x22,
        lid: 3,
        gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
        mtu: 4,
        recv_depth: 64,
        slot_size: 8192,
    };
    let hello = CmMessage::Hello {
        from: 9,
        nonce: 0xdead_beef,
        recv_depth: 64,
        slot_size: 8192,
    };
    let mut padded = hello.encode();
    padded.resize(56, 0);
    vec![
        seed(
            T,
            "request",
            cat(&[1], &Control::Request { nonce: 5, info }.encode()),
        ),
        seed(
            T,
            "reply",
            cat(
                &[1],
                &Control::Reply {
                    request: 5,
                    nonce: 6,
                    info,
                }
                .encode(),
            ),
        ),
        seed(T, "ready", cat(&[1], &Control::Ready { nonce: 6 }.encode())),
        seed(T, "cm-hello", cat(&[1], &hello.encode())),
        seed(T, "cm-hello-padded", cat(&[0], &padded)),
        seed(
            T,
            "cm-welcome",
            cat(
                &[1],
                &CmMessage::Welcome {
                    nonce: 6,
                    recv_depth: 32,
                    slot_size: 8192,
                }
                .encode(),
            ),
        ),
        seed(
            T,
            "cm-refused-crossed",
            cat(&[1], &CmMessage::Refused(Refusal::Crossed).encode()),
        ),
        seed(
            T,
            "cm-refused-cannot",
            cat(&[1], &CmMessage::Refused(Refusal::CannotConnect).encode()),
        ),
    ]
}

fn compression() -> Vec<Seed> {
    const T: &str = "compression";
    let grad: Vec<f32> = (0..100)
        .map(|i| ((i * 37) % 11) as f32 / 5.0 - 1.0)
        .collect();
    let compressed = |c: &dyn Compressor, n: usize| {
        let mut residual = vec![0.0; n];
        let mut out = vec![0u8; c.compressed_len(n)];
        c.quantize(&grad[..n], &mut residual, &mut out).unwrap();
        out
    };
    let two = TwoBitCompressor::new(0.5).unwrap();
    let one = OneBitCompressor::new(0.0).unwrap();
    // Settings: mode, threshold (f32), count (u16; with mode bit 2 clear it picks the padding).
    let settings = |mode: u8, t: f32, count: u16| {
        let mut s = vec![mode];
        s.extend_from_slice(&t.to_le_bytes());
        s.extend_from_slice(&count.to_le_bytes());
        s
    };
    // 100 elements: 7 words of 2-bit (112 slots, 12 padding), 4 words of 1-bit (128, 28).
    vec![
        seed(
            T,
            "two-bit",
            cat(&settings(0, 0.5, 12), &compressed(&two, 100)),
        ),
        seed(
            T,
            "two-bit-threaded",
            cat(&settings(8, 0.5, 12), &compressed(&two, 100)),
        ),
        seed(
            T,
            "two-bit-claimed-count",
            cat(&settings(4, 0.5, 100), &compressed(&two, 100)),
        ),
        seed(
            T,
            "one-bit",
            cat(&settings(1, 0.0, 28), &compressed(&one, 100)),
        ),
        seed(
            T,
            "one-bit-claimed-count",
            cat(&settings(5, 0.0, 99), &compressed(&one, 100)),
        ),
        seed(
            T,
            "params-2bit",
            cat(
                &[2],
                CompressionParams::two_bit(0.5)
                    .unwrap()
                    .to_string()
                    .as_bytes(),
            ),
        ),
        seed(
            T,
            "params-1bit",
            cat(
                &[2],
                CompressionParams::one_bit(0.25)
                    .unwrap()
                    .to_string()
                    .as_bytes(),
            ),
        ),
        seed(
            T,
            "params-python",
            cat(&[2], b"{'type': '2bit', 'threshold': '0.5'}"),
        ),
        seed(
            T,
            "mxnet-v1",
            cat(
                &[3],
                CompressionParams::two_bit(0.5)
                    .unwrap()
                    .encode_mxnet(psnet_compression::MxnetVersion::V1)
                    .unwrap()
                    .as_bytes(),
            ),
        ),
        seed(
            T,
            "mxnet-v2",
            cat(
                &[3 | 16],
                CompressionParams::one_bit(0.5)
                    .unwrap()
                    .encode_mxnet(psnet_compression::MxnetVersion::V2)
                    .unwrap()
                    .as_bytes(),
            ),
        ),
    ]
}
