use super::*;
use crate::message::Segment;
use proptest::prelude::*;

fn frame_bytes(meta: &[u8], segs: &[Vec<u8>]) -> Vec<u8> {
    let segments: Vec<Segment<'_>> = segs.iter().map(Segment::from).collect();
    encode_frame(
        FrameKind::Data,
        &OutMessage::new(meta, &segments),
        &Limits::default(),
    )
    .unwrap()
}

#[test]
fn layout_is_little_endian_and_versioned() {
    let bytes = frame_bytes(b"m", &[vec![7, 8], vec![]]);
    assert_eq!(&bytes[..2], b"PN");
    assert_eq!(bytes[2], 2, "wire version 2");
    assert_eq!(bytes[3], 0);
    assert_eq!(&bytes[4..6], &[2, 0]);
    assert_eq!(&bytes[6..8], &[0, 0]);
    assert_eq!(&bytes[8..12], &[1, 0, 0, 0]);
    assert_eq!(&bytes[12..20], &[2, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(&bytes[20..28], &[0; 8]);
    assert_eq!(&bytes[28..], &[b'm', 7, 8]);
}

#[test]
fn rejects_bad_magic_version_kind_and_reserved() {
    let good = frame_bytes(b"", &[]);
    let limits = Limits::default();
    let mut b = good.clone();
    b[0] = b'X';
    assert!(matches!(
        FrameHeader::decode(&b, &limits),
        Err(CodecError::BadMagic(_))
    ));
    let mut b = good.clone();
    b[2] = 9;
    assert_eq!(
        FrameHeader::decode(&b, &limits),
        Err(CodecError::UnsupportedVersion(9))
    );
    let mut b = good.clone();
    b[3] = 200;
    assert_eq!(
        FrameHeader::decode(&b, &limits),
        Err(CodecError::UnknownKind(200))
    );
    let mut b = good.clone();
    b[6] = 2;
    assert_eq!(
        FrameHeader::decode(&b, &limits),
        Err(CodecError::Reserved(2))
    );
    // The sealed flag: a data frame's, never another kind's.
    let mut b = good.clone();
    b[6] = 1;
    let (header, _) = FrameHeader::decode(&b, &limits).unwrap().unwrap();
    assert!(header.sealed);
    // A whole frame cut off a buffer is read in clear: a sealed one is refused, untouched.
    let mut buf = BytesMut::from(&b[..]);
    assert_eq!(decode_frame(&mut buf, &limits), Err(CodecError::SealedHere));
    assert_eq!(&buf[..], &b[..]);
    let mut again = HeaderBuf::new();
    header.encode_into(&mut again);
    assert_eq!(&again[..], &b[..again.len()]);
    let mut b = good;
    b[6] = 1;
    b[3] = FrameKind::Close as u8;
    assert_eq!(
        FrameHeader::decode(&b, &limits),
        Err(CodecError::SealedKind(FrameKind::Close))
    );
}

#[test]
fn bounds_lengths_before_allocation() {
    let limits = Limits {
        max_meta: 16,
        max_segments: 2,
        max_message: 100,
    };
    let mut b = frame_bytes(b"", &[]);
    b[8..12].copy_from_slice(&17u32.to_le_bytes());
    assert!(matches!(
        FrameHeader::decode(&b, &limits),
        Err(CodecError::MetaTooLarge { len: 17, .. })
    ));

    let b = frame_bytes(b"", &[vec![], vec![], vec![]]);
    assert!(matches!(
        FrameHeader::decode(&b, &limits),
        Err(CodecError::TooManySegments { count: 3, .. })
    ));

    // A length near u64::MAX must not overflow the total.
    let mut b = frame_bytes(b"", &[vec![], vec![]]);
    b[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
    b[20..28].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        FrameHeader::decode(&b, &limits),
        Err(CodecError::MessageTooLarge { len: u64::MAX, .. })
    ));
}

#[test]
fn encoder_refuses_oversize_messages() {
    let limits = Limits {
        max_meta: 4,
        max_segments: 1,
        max_message: 8,
    };
    let data = [0u8; 9];
    let segs = [Segment::new(&data)];
    assert!(matches!(
        encode_frame(FrameKind::Data, &OutMessage::new(b"", &segs), &limits),
        Err(CodecError::MessageTooLarge { len: 9, limit: 8 })
    ));
    assert!(matches!(
        encode_frame(FrameKind::Data, &OutMessage::new(b"12345", &[]), &limits),
        Err(CodecError::MetaTooLarge { len: 5, .. })
    ));
}

#[test]
fn hello_round_trip_and_bad_length() {
    for path in [DataPath::Tcp, DataPath::Rdma] {
        assert_eq!(
            decode_hello(&encode_hello(NodeId(42), path)),
            Ok(Hello {
                id: NodeId(42),
                path,
                proof: None
            })
        );
        let proof = crate::Proof([9; crate::PROOF_LEN]);
        let proved = decode_hello(&encode_hello_proved(NodeId(42), path, Some(&proof))).unwrap();
        assert_eq!(proved.proof, Some(proof));
    }
    assert!(decode_hello(&[0u8; HELLO_LEN + 1]).is_err());
    assert!(decode_hello(b"short").is_err());
    assert!(decode_hello(&NodeId(42).0.to_le_bytes()).is_err());
    let mut unknown = encode_hello(NodeId(42), DataPath::Rdma);
    unknown[8] = 7;
    assert!(decode_hello(&unknown).is_err());
}

#[test]
fn partial_frames_ask_for_more() {
    let bytes = frame_bytes(b"meta", &[vec![1; 100], vec![2; 3]]);
    for cut in 0..bytes.len() {
        let mut buf = BytesMut::from(&bytes[..cut]);
        assert_eq!(
            decode_frame(&mut buf, &Limits::default()),
            Ok(None),
            "cut {cut}"
        );
        assert_eq!(buf.len(), cut, "partial input must stay buffered");
    }
}

fn arb_message() -> impl Strategy<Value = (Vec<u8>, Vec<Vec<u8>>)> {
    (
        proptest::collection::vec(any::<u8>(), 0..64),
        proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..20),
    )
}

proptest! {
    #[test]
    fn round_trip((meta, segs) in arb_message()) {
        let bytes = frame_bytes(&meta, &segs);
        let mut buf = BytesMut::from(&bytes[..]);
        let frame = decode_frame(&mut buf, &Limits::default()).unwrap().unwrap();
        prop_assert!(buf.is_empty());
        prop_assert_eq!(frame.kind, FrameKind::Data);
        prop_assert_eq!(&frame.meta[..], &meta[..]);
        prop_assert_eq!(frame.segments.len(), segs.len());
        for (got, want) in frame.segments.iter().zip(&segs) {
            prop_assert_eq!(&got[..], &want[..]);
        }
    }

    #[test]
    fn back_to_back_frames_decode_in_order(msgs in proptest::collection::vec(arb_message(), 1..6)) {
        let mut buf = BytesMut::new();
        for (meta, segs) in &msgs {
            buf.extend_from_slice(&frame_bytes(meta, segs));
        }
        for (meta, segs) in &msgs {
            let frame = decode_frame(&mut buf, &Limits::default()).unwrap().unwrap();
            prop_assert_eq!(&frame.meta[..], &meta[..]);
            prop_assert_eq!(frame.segments.len(), segs.len());
        }
        prop_assert!(buf.is_empty());
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let limits = Limits { max_meta: 256, max_segments: 16, max_message: 4096 };
        let mut buf = BytesMut::from(&bytes[..]);
        // Either an error, a request for more, or frames whose parts fit the input.
        while let Ok(Some(frame)) = decode_frame(&mut buf, &limits) {
            let total: usize = frame.meta.len() + frame.segments.iter().map(|s| s.len()).sum::<usize>();
            prop_assert!(total <= bytes.len());
        }
    }

    #[test]
    fn valid_prefix_with_corrupted_byte_never_panics(
        (meta, segs) in arb_message(),
        pos in any::<prop::sample::Index>(),
        value in any::<u8>(),
    ) {
        let mut bytes = frame_bytes(&meta, &segs);
        let i = pos.index(bytes.len());
        bytes[i] = value;
        let mut buf = BytesMut::from(&bytes[..]);
        let _ = decode_frame(&mut buf, &Limits::default());
    }
}
