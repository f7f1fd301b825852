use super::*;
use proptest::prelude::*;

fn base(b: u8) -> SessionBase {
    SessionBase::from_bytes([b; BASE_LEN])
}

/// A frame as it crosses the wire, and its tag: in clear, or sealed by a sealer that
/// encrypts.
fn tagged(sealer: &mut Sealer, frame: &[u8]) -> (Vec<u8>, [u8; TAG_LEN]) {
    let mut mac = sealer.frame(sealer.encrypts());
    let mut wire = frame.to_vec();
    // Sealed in two pieces, the way a segment follows the metadata.
    let cut = wire.len() / 2;
    let (a, b) = wire.split_at_mut(cut);
    mac.seal(a);
    mac.seal(b);
    (wire, mac.tag())
}

/// Feeds `received` to an opener (every frame `sealed` or none); returns the frames accepted
/// (opened) before the first failure, and whether one failed.
fn receive(
    opener: &mut Opener,
    received: &[(Vec<u8>, [u8; TAG_LEN])],
    sealed: bool,
) -> (Vec<Vec<u8>>, bool) {
    let mut accepted = Vec::new();
    for (bytes, tag) in received {
        let mut mac = opener.frame(sealed);
        // Opened in other pieces than it was sealed in: the split must not matter.
        let mut plain = bytes.clone();
        let cut = plain.len() / 3;
        let peeked = mac.peek(&plain[..cut]);
        let (a, b) = plain.split_at_mut(cut);
        mac.open(a);
        assert_eq!(peeked, a, "a peek sees what opening gives");
        mac.open(b);
        if mac.check(tag).is_err() {
            return (accepted, true);
        }
        accepted.push(plain);
    }
    (accepted, false)
}

#[derive(Clone, Debug)]
enum Attack {
    FlipBody { frame: usize, byte: usize, bit: u8 },
    FlipTag { frame: usize, byte: usize, bit: u8 },
    Drop { frame: usize },
    Replay { frame: usize, at: usize },
    Swap { a: usize, b: usize },
}

fn attack() -> impl Strategy<Value = Attack> {
    prop_oneof![
        (any::<usize>(), any::<usize>(), 0u8..8).prop_map(|(frame, byte, bit)| Attack::FlipBody {
            frame,
            byte,
            bit
        }),
        (any::<usize>(), any::<usize>(), 0u8..8).prop_map(|(frame, byte, bit)| Attack::FlipTag {
            frame,
            byte,
            bit
        }),
        any::<usize>().prop_map(|frame| Attack::Drop { frame }),
        (any::<usize>(), any::<usize>()).prop_map(|(frame, at)| Attack::Replay { frame, at }),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Attack::Swap { a, b }),
    ]
}

/// Does `attack` to `wire` (frames or messages as sent, with their tags; `sent` their bodies
/// as sent); returns whether the receiver must notice.
fn apply(attack: &Attack, wire: &mut Vec<(Vec<u8>, [u8; TAG_LEN])>, sent: &[Vec<u8>]) -> bool {
    let n = wire.len();
    match *attack {
        Attack::FlipBody { frame, byte, bit } => {
            let f = &mut wire[frame % n].0;
            let i = byte % f.len();
            f[i] ^= 1 << bit;
            true
        }
        Attack::FlipTag { frame, byte, bit } => {
            wire[frame % n].1[byte % TAG_LEN] ^= 1 << bit;
            true
        }
        Attack::Drop { frame } => {
            // A dropped last frame is indistinguishable from one not yet sent; the next
            // frame reveals the gap, so drop one that has a successor.
            wire.remove(frame % (n - 1));
            true
        }
        Attack::Replay { frame, at } => {
            let f = frame % n;
            let at = f + 1 + at % (n - f);
            let copy = wire[f].clone();
            wire.insert(at, copy);
            true
        }
        Attack::Swap { a, b } => {
            let (a, b) = (a % n, b % n);
            wire.swap(a, b);
            a != b && sent[a] != sent[b]
        }
    }
}

proptest! {
    /// Whatever the path does to a stream of frames (a bit flipped in a frame or its tag, a
    /// frame dropped, replayed or two swapped), the receiver accepts an unchanged prefix of
    /// what was sent and then detects it: never a changed frame, never a silent gap.
    /// The same with sealed frames (`PSNET_ENCRYPT`), which open to exactly what was sent
    /// and do not cross the wire in clear.
    #[test]
    fn any_change_on_the_path_is_detected(
        frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..300), 2..12),
        attack in attack(),
        key in any::<u8>(),
        sealed in any::<bool>(),
    ) {
        let (sealer, _) = Session::bound(&base(key), Role::Dialler, NodeId(1), NodeId(2));
        let mut sealer = sealer.encrypting(sealed);
        let (_, mut opener) = Session::bound(&base(key), Role::Acceptor, NodeId(1), NodeId(2));
        let sent: Vec<_> = frames.iter().map(|f| tagged(&mut sealer, f)).collect();
        for (frame, (wire, _)) in frames.iter().zip(&sent) {
            // A frame of 16 bytes or more equal to its ciphertext: a chance of 2^-128.
            if sealed && frame.len() >= 16 {
                prop_assert_ne!(frame, wire, "a sealed frame crossed the wire in clear");
            }
            if !sealed {
                prop_assert_eq!(frame, wire);
            }
        }
        let mut wire = sent.clone();
        let changed = apply(&attack, &mut wire, &frames);
        let (accepted, failed) = receive(&mut opener, &wire, sealed);
        prop_assert!(accepted.len() <= frames.len());
        prop_assert_eq!(&accepted[..], &frames[..accepted.len()], "only frames as sent are accepted");
        if changed {
            prop_assert!(failed, "the change was detected");
        }
    }

    #[test]
    fn a_sealed_hello_opens_only_as_sent(
        plain in proptest::collection::vec(any::<u8>(), 1..100),
        flip in any::<(usize, u8)>(),
    ) {
        let (mut sealer, _) = Session::opening(&base(3), Role::Dialler);
        let (_, mut opener) = Session::opening(&base(3), Role::Acceptor);
        let mut bytes = sealer.seal_handshake(FrameKind::Hello, &plain).unwrap();
        let (body, tag) = bytes[codec::PREFIX_LEN..].split_at(plain.len());
        prop_assert_ne!(body, &plain[..], "the body is not sent in clear");
        prop_assert_eq!(opener.open_handshake(FrameKind::Hello, body, tag).unwrap(), plain.clone());
        // Any bit of the frame or its tag flipped: refused.
        let i = codec::PREFIX_LEN + flip.0 % (bytes.len() - codec::PREFIX_LEN);
        bytes[i] ^= 1 << (flip.1 % 8);
        let (_, mut fresh) = Session::opening(&base(3), Role::Acceptor);
        let (body, tag) = bytes[codec::PREFIX_LEN..].split_at(plain.len());
        prop_assert!(fresh.open_handshake(FrameKind::Hello, body, tag).is_err());
    }
}

#[test]
fn keys_differ_by_direction_by_ids_and_by_base() {
    let frame = b"the same frame".as_slice();
    let (mut d_send, mut d_recv) = Session::bound(&base(1), Role::Dialler, NodeId(1), NodeId(2));
    // Reflected back to its sender: refused.
    let reflected = tagged(&mut d_send, frame);
    assert!(receive(&mut d_recv, &[reflected], false).1);
    // Bound to other ids: refused (a session cannot be moved to another pair of nodes).
    let (mut other_ids, _) = Session::bound(&base(1), Role::Dialler, NodeId(1), NodeId(3));
    let (_, mut a_recv) = Session::bound(&base(1), Role::Acceptor, NodeId(1), NodeId(2));
    assert!(receive(&mut a_recv, &[tagged(&mut other_ids, frame)], false).1);
    // Another connection's base: refused.
    let (mut other_base, _) = Session::bound(&base(2), Role::Dialler, NodeId(1), NodeId(2));
    let (_, mut a_recv) = Session::bound(&base(1), Role::Acceptor, NodeId(1), NodeId(2));
    assert!(receive(&mut a_recv, &[tagged(&mut other_base, frame)], false).1);
    // The opening keys are not the bound ones.
    let (mut opening, _) = Session::opening(&base(1), Role::Dialler);
    let (_, mut a_recv) = Session::bound(&base(1), Role::Acceptor, NodeId(1), NodeId(2));
    assert!(receive(&mut a_recv, &[tagged(&mut opening, frame)], false).1);
    // And the right keys pass, with the failure naming the frame's number.
    let (mut d_send, _) = Session::bound(&base(1), Role::Dialler, NodeId(1), NodeId(2));
    let (_, mut a_recv) = Session::bound(&base(1), Role::Acceptor, NodeId(1), NodeId(2));
    let first = tagged(&mut d_send, frame);
    let second = tagged(&mut d_send, frame);
    assert_eq!(
        receive(&mut a_recv, &[first.clone(), second], false)
            .0
            .len(),
        2
    );
    let mut mac = a_recv.frame(false);
    mac.update(&first.0);
    assert_eq!(mac.check(&first.1), Err(TagMismatch { seq: 2 }));
    assert_eq!(format!("{:?}", base(9)), "SessionBase(..)");
}

/// A sealed frame read as if it were not (its header's flag changed on the path) or the
/// other way round: the bytes do not open, and the tag is what says so (the header, with
/// the flag, is tagged too; here the body alone is enough).
#[test]
fn a_sealed_frame_opens_only_as_sealed() {
    let frame = b"weights of layer 7, in clear".as_slice();
    let (sealer, _) = Session::bound(&base(4), Role::Dialler, NodeId(1), NodeId(2));
    let mut sealer = sealer.encrypting(true);
    assert!(sealer.encrypts());
    let sent = tagged(&mut sealer, frame);
    assert_ne!(&sent.0[..], frame);
    let (_, mut as_clear) = Session::bound(&base(4), Role::Acceptor, NodeId(1), NodeId(2));
    let (accepted, failed) = receive(&mut as_clear, std::slice::from_ref(&sent), false);
    // Tagged over the wire bytes, so it checks; but it is not the plain frame: a receiver
    // knows from the tagged header flag which it is.
    assert!(!failed && accepted[0] != frame);
    let (_, mut right) = Session::bound(&base(4), Role::Acceptor, NodeId(1), NodeId(2));
    assert_eq!(receive(&mut right, &[sent], true).0, vec![frame.to_vec()]);
    // The same frame number under another direction's keys never opens.
    let (_, mut reflected) = Session::bound(&base(4), Role::Dialler, NodeId(1), NodeId(2));
    let again = tagged(
        &mut Session::bound(&base(4), Role::Dialler, NodeId(1), NodeId(2))
            .0
            .encrypting(true),
        frame,
    );
    assert!(receive(&mut reflected, &[again], true).1);
}

proptest! {
    /// A channel beside a connection (an RDMA queue pair's messages): whatever the path does
    /// to its messages, the receiver accepts an unchanged prefix and then detects it; and a
    /// channel of another name, or of another connection's session, accepts nothing.
    #[test]
    fn a_channels_messages_are_checked_like_frames(
        messages in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..200), 2..10),
        attack in attack(),
        key in any::<u8>(),
    ) {
        let (mut sealer, _) = Session::channel(&base(key), Role::Dialler, "rdma 1 2");
        let sent: Vec<(Vec<u8>, [u8; TAG_LEN])> =
            messages.iter().map(|m| (m.clone(), sealer.tag_message(m))).collect();
        let receive_all = |opener: &mut Opener, wire: &[(Vec<u8>, [u8; TAG_LEN])]| {
            let mut accepted = Vec::new();
            for (m, tag) in wire {
                if opener.check_message(m, tag).is_err() {
                    return (accepted, true);
                }
                accepted.push(m.clone());
            }
            (accepted, false)
        };
        for (other_key, name) in [(key.wrapping_add(1), "rdma 1 2"), (key, "rdma 1 3")] {
            let (_, mut elsewhere) = Session::channel(&base(other_key), Role::Acceptor, name);
            prop_assert!(receive_all(&mut elsewhere, &sent).0.is_empty());
        }
        let mut wire = sent.clone();
        let changed = apply(&attack, &mut wire, &messages);
        let (_, mut opener) = Session::channel(&base(key), Role::Acceptor, "rdma 1 2");
        let (accepted, failed) = receive_all(&mut opener, &wire);
        prop_assert_eq!(&accepted[..], &messages[..accepted.len()]);
        if changed {
            prop_assert!(failed, "the change was detected");
        }
    }
}
