//! The verbs connection handshakes' wire messages and the decisions taken on them
//! (`psnet_verbs::control`, `psnet_verbs::proto::handshake`): the socket handshake's
//! request / reply / ready over the TCP control connection, and psnet's rdma_cm private data
//! (connect request, accept, reject). No RDMA device is needed.
//!
//! Input: `flags u8 | bytes`; flag bit 0: whether the requesting node's control connection
//! is up (for `admit_hello`). `bytes` is read both as a control message and as private data.
//!
//! Invariants: nothing panics; a control message that decodes encodes back to exactly the
//! same bytes, private data to the same bytes before its zero padding; what the handshake
//! functions decide agrees with what the bytes decode to (a psnet connect request is admitted
//! exactly when its node's control connection is up, a refusal for now is retried, an accept
//! connects the requesting link with the peer's buffers); each decision's reply encodes and
//! decodes back.
#![no_main]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use psnet_fuzz::{Input, TrackingAlloc};
use psnet_transport::NodeId;
use psnet_verbs::control::{CmMessage, Control, Refusal};
use psnet_verbs::link::QpInfo;
use psnet_verbs::proto::handshake::connect::{Connect, Poll, Step};
use psnet_verbs::proto::handshake::rdma_cm::{admit_hello, handle_rejected, OnWelcome};
use psnet_verbs::proto::handshake::socket::{Answered, OnReply, OnRequest};
use psnet_verbs::proto::handshake::{LinkHandle, Links};

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

const PEER: NodeId = NodeId(7);

/// A link as the handshakes see it, without a queue pair.
#[derive(Clone, Debug, PartialEq)]
struct FakeLink {
    id: u32,
    nonce: u64,
}

impl LinkHandle for FakeLink {
    fn id(&self) -> u32 {
        self.id
    }
    fn nonce(&self) -> u64 {
        self.nonce
    }
    fn local_info(&self) -> QpInfo {
        QpInfo {
            qpn: self.id,
            psn: 1,
            lid: 2,
            gid: [3; 16],
            mtu: 4,
            recv_depth: 64,
            slot_size: 8192,
        }
    }
    fn is_ready(&self) -> bool {
        false
    }
    fn failure(&self) -> Option<String> {
        None
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let control_up = input.u8() & 1 != 0;
    let bytes = input.rest();
    check_control(bytes);
    check_private_data(bytes, control_up);
});

/// Links holding one request of ours, made by a `connect` call (through rdma_cm if `via_cm`).
fn requested(nonce: u64, via_cm: bool) -> (Links<FakeLink>, FakeLink) {
    let mut links = Links::new();
    let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let mut call = Connect::new(
        PEER,
        addr,
        Instant::now(),
        Duration::from_secs(5),
        via_cm,
        false,
    );
    let poll = call.poll(&mut links, Instant::now(), |_| false, || true);
    assert!(matches!(poll, Poll::NewLink));
    let link = FakeLink { id: 1, nonce };
    match call.handle_new_link(&mut links, link.clone()) {
        Step::StartCm(l) => assert!(via_cm && l == link),
        Step::Send {
            msg: Control::Request { nonce: n, .. },
            ..
        } => assert!(!via_cm && n == nonce),
        other => panic!("a new link's first step: {other:?}"),
    }
    (links, link)
}

fn round_trips(c: Control) {
    assert_eq!(Control::decode(&c.encode()), Some(c));
}

fn check_control(bytes: &[u8]) {
    let Some(msg) = Control::decode(bytes) else {
        return;
    };
    assert_eq!(msg.encode(), bytes, "control message does not encode back");
    match msg {
        Control::Request { nonce, info } => {
            assert_eq!(
                Control::decode(&msg.encode()),
                Some(Control::Request { nonce, info })
            );
            // Nothing of ours: answered; once answered, a repeat gets the same reply again.
            let mut links: Links<FakeLink> = Links::new();
            assert_eq!(links.handle_request(PEER, nonce), OnRequest::Answer);
            let ours = FakeLink {
                id: 2,
                nonce: nonce ^ 1,
            };
            let reply = match links.handle_answer_built(PEER, nonce, ours) {
                Answered::Installed {
                    retired: None,
                    reply,
                } => reply,
                other => panic!("answering with no link of ours: {other:?}"),
            };
            round_trips(reply);
            assert!(matches!(reply, Control::Reply { request, .. } if request == nonce));
            assert_eq!(links.handle_request(PEER, nonce), OnRequest::Resend(reply));
            // Crossing our own request: exactly one side answers.
            let (links, _) = requested(nonce ^ 0x8000_0000_0000_0000, false);
            let ours_wins = nonce ^ 0x8000_0000_0000_0000 > nonce;
            let answered = links.handle_request(PEER, nonce) == OnRequest::Answer;
            assert_eq!(answered, !ours_wins);
        }
        Control::Reply { request, nonce, .. } => {
            let (mut links, link) = requested(request, false);
            let ready = match links.handle_reply(PEER, request, nonce) {
                OnReply::Connect { link: l, ready } => {
                    assert_eq!(l, link);
                    ready
                }
                other => panic!("reply to our request: {other:?}"),
            };
            assert_eq!(ready, Control::Ready { nonce });
            round_trips(ready);
            links.handle_connected(PEER, link.id);
            assert_eq!(
                links.handle_reply(PEER, request, nonce),
                OnReply::Resend(ready)
            );
            // A reply to a request we never made is ignored.
            assert_eq!(
                links.handle_reply(PEER, request.wrapping_add(1), nonce),
                OnReply::Ignore
            );
        }
        Control::Ready { nonce } => {
            let links: Links<FakeLink> = Links::new();
            assert_eq!(links.handle_ready(PEER, nonce), None);
        }
    }
}

fn check_private_data(bytes: &[u8], control_up: bool) {
    let decoded = CmMessage::decode(bytes);
    if let Some(m) = decoded {
        let encoded = m.encode();
        assert!(
            encoded.len() <= 56,
            "private data of a connect request is 56 bytes at most"
        );
        assert_eq!(
            &bytes[..encoded.len()],
            &encoded[..],
            "private data does not encode back"
        );
        assert_eq!(CmMessage::decode(&encoded), Some(m));
    }

    // Passive side: the connect request's admission.
    let admitted = admit_hello(bytes, |peer| {
        assert!(matches!(decoded, Some(CmMessage::Hello { from, .. }) if from == peer.0));
        control_up
    });
    match (decoded, admitted) {
        (
            Some(CmMessage::Hello {
                from,
                nonce,
                recv_depth,
                slot_size,
            }),
            Ok(h),
        ) => {
            assert!(control_up);
            assert_eq!(
                (h.peer, h.nonce, h.recv_depth, h.slot_size),
                (NodeId(from), nonce, recv_depth, slot_size)
            );
        }
        (Some(CmMessage::Hello { .. }), Err(why)) => {
            assert!(!control_up);
            assert_eq!(why, Refusal::NoControlConnection);
        }
        (_, Err(why)) => assert_eq!(why, Refusal::Malformed),
        (other, Ok(_)) => panic!("admitted a connect request that is not a hello: {other:?}"),
    }

    // Active side: the peer refused.
    let refused = handle_rejected(PEER, "fuzz", bytes, 28);
    let for_now = matches!(
        decoded,
        Some(CmMessage::Refused(
            Refusal::Crossed | Refusal::NoControlConnection
        ))
    );
    assert_eq!(refused.is_ok(), for_now, "{refused:?}");

    // Active side: the peer accepted our request.
    let (links, link) = requested(5, true);
    let welcome = links.handle_welcome(PEER, link.id, bytes);
    match (decoded, welcome) {
        (
            Some(CmMessage::Welcome {
                recv_depth,
                slot_size,
                nonce,
            }),
            Ok(OnWelcome::Connect {
                recv_depth: d,
                slot_size: s,
                nonce: n,
            }),
        ) => assert_eq!((d, s, n), (recv_depth, slot_size, nonce)),
        (Some(CmMessage::Welcome { .. }), other) => panic!("accept of our request: {other:?}"),
        (_, r) => assert!(r.is_err(), "an accept without psnet's welcome: {r:?}"),
    }
    // An accept for a link that is not ours any more lets the connection go.
    if matches!(decoded, Some(CmMessage::Welcome { .. })) {
        assert_eq!(
            links.handle_welcome(PEER, link.id + 1, bytes).ok(),
            Some(OnWelcome::LetGo)
        );
    }
}
