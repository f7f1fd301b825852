//! The transport's frame codec (`psnet_transport::codec`): frame headers, whole frames cut
//! off a receive buffer, hello bodies.
//!
//! Input: `limits choice u8 | split u16 | stream bytes`.
//!
//! Invariants: nothing panics; what decodes is within the limits and encodes back to the
//! same bytes; a decoded header's every prefix asks for more bytes (never an error);
//! decoding the stream in two pieces gives what decoding it whole gives; a failed or
//! incomplete decode leaves the buffer as it was; decoding allocates no more than the limits
//! allow, whatever lengths the bytes claim.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use psnet_fuzz::{largest_allocation, limits, Input, TrackingAlloc};
use psnet_transport::codec::{
    decode_frame, decode_hello, encode_frame, encode_hello_proved, Frame, FrameHeader, HeaderBuf,
    PREFIX_LEN,
};
use psnet_transport::{CodecError, FrameKind, Limits, OutMessage, Segment};

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let limits = limits(input.u8());
    let split = input.u16() as usize;
    let bytes = input.rest();
    check_header(bytes, &limits);
    check_stream(bytes, split, &limits);
    check_hello(bytes);
    if bytes.len() > PREFIX_LEN {
        check_hello(&bytes[PREFIX_LEN..]);
    }
});

/// The most a decode may allocate under `limits`: segment lengths and segment handles.
fn allocation_bound(limits: &Limits) -> usize {
    4096 + 64 * usize::from(limits.max_segments)
}

fn check_header(bytes: &[u8], limits: &Limits) {
    let (decoded, largest) = largest_allocation(|| FrameHeader::decode(bytes, limits));
    assert!(
        largest <= allocation_bound(limits),
        "header decode allocated {largest} bytes"
    );
    match decoded {
        Ok(Some((header, n))) => {
            assert!(n <= bytes.len());
            assert_eq!(n, header.encoded_len());
            assert!(header.meta_len <= limits.max_meta);
            assert!(header.seg_lens.len() <= usize::from(limits.max_segments));
            assert!(header.body_len() <= limits.max_message);
            let mut encoded = HeaderBuf::new();
            header.encode_into(&mut encoded);
            assert_eq!(&encoded[..], &bytes[..n], "header does not encode back");
            for cut in [0, 1, 2, PREFIX_LEN - 1, PREFIX_LEN, n / 2, n - 1] {
                if cut < n {
                    assert_eq!(
                        FrameHeader::decode(&bytes[..cut], limits),
                        Ok(None),
                        "prefix of {cut} bytes of a valid header"
                    );
                }
            }
        }
        Ok(None) => {
            assert!(bytes.len() < PREFIX_LEN + 8 * usize::from(limits.max_segments));
        }
        Err(_) => {}
    }
}

/// How decoding a stream ended: an error, or more bytes needed with this many left over.
#[derive(Debug, PartialEq)]
enum End {
    Error(CodecError),
    Incomplete(usize),
}

/// Decodes every frame of `chunks` arriving one after the other, as a connection's reader
/// does, checking each frame.
fn decode_stream(chunks: &[&[u8]], limits: &Limits) -> (Vec<Frame>, End) {
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    for chunk in chunks {
        buf.extend_from_slice(chunk);
        loop {
            let before = buf.clone();
            let (decoded, largest) = largest_allocation(|| decode_frame(&mut buf, limits));
            assert!(
                largest <= allocation_bound(limits),
                "frame decode allocated {largest} bytes"
            );
            match decoded {
                Ok(Some(frame)) => {
                    let used = before.len() - buf.len();
                    check_frame(&frame, &before[..used], limits);
                    frames.push(frame);
                }
                Ok(None) => {
                    assert_eq!(buf, before, "an incomplete frame changed the buffer");
                    break;
                }
                Err(e) => {
                    assert_eq!(buf, before, "a failed decode changed the buffer");
                    return (frames, End::Error(e));
                }
            }
        }
    }
    let left = buf.len();
    (frames, End::Incomplete(left))
}

fn check_stream(bytes: &[u8], split: usize, limits: &Limits) {
    let whole = decode_stream(&[bytes], limits);
    let at = split % (bytes.len() + 1);
    let pieces = decode_stream(&[&bytes[..at], &bytes[at..]], limits);
    assert_eq!(whole, pieces, "decoding in two pieces (at {at}) differs");
}

fn check_frame(frame: &Frame, wire: &[u8], limits: &Limits) {
    assert!(frame.meta.len() as u64 <= u64::from(limits.max_meta));
    assert!(frame.segments.len() <= usize::from(limits.max_segments));
    let total =
        frame.meta.len() as u64 + frame.segments.iter().map(|s| s.len() as u64).sum::<u64>();
    assert!(total <= limits.max_message);
    let segments: Vec<Segment<'_>> = frame.segments.iter().map(Segment::from).collect();
    let encoded = encode_frame(frame.kind, &OutMessage::new(&frame.meta, &segments), limits)
        .expect("a decoded frame is within the limits");
    assert_eq!(encoded, wire, "frame does not encode back");
    if matches!(frame.kind, FrameKind::Hello | FrameKind::HelloAck) {
        check_hello(&frame.meta);
    }
}

fn check_hello(meta: &[u8]) {
    if let Ok(hello) = decode_hello(meta) {
        let encoded = encode_hello_proved(hello.id, hello.path, hello.proof.as_ref());
        assert_eq!(encoded, meta, "hello does not encode back");
    }
}
