//! The kv store's message codec (`psnet_kv::proto::msg`): bare messages (`Msg::decode`, what a
//! node without `PS_RESEND` reads), `PS_RESEND` envelopes (`decode_frame`), and the command
//! bodies a server parses (`OptimizerSpec::parse` for `SetOptimizer`; `SetCompression`'s are
//! the compression target's).
//!
//! Input: `mode u8 | bytes`; mode bit 1 set: `bytes` is `len u16 | packed codes`
//! (`psnet_kv::proto::packed::unpack`, for `len` bytes of codes); else mode bit 0 clear:
//! `bytes` is a message's metadata, set: it is a `SetOptimizer` body.
//!
//! Invariants: nothing panics; what decodes is within the codec's bounds, encodes to bytes
//! that decode to the same message and encode the same again (the encoding is canonical);
//! an optimizer spec that parses is valid and reads back the same from its JSON; decoding
//! allocates in proportion to the input, not to the counts and lengths it claims; packed
//! codes unpack to exactly the length asked or fail, allocating at most that (and zstd's
//! context), and codes that unpack pack back to codes that unpack the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use psnet_fuzz::{largest_allocation, Input, TrackingAlloc};
use psnet_kv::proto::msg::{decode_frame, CommandKind, Msg, MAX_NODES, MAX_STRING};
use psnet_kv::updater::OptimizerSpec;

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let mode = input.u8();
    if mode & 2 != 0 {
        let len = usize::from(input.u16());
        return check_packed(input.rest(), len);
    }
    let bytes = input.rest();
    if mode & 1 == 0 {
        check_msg(bytes);
        check_frame(bytes);
    } else if let Ok(text) = std::str::from_utf8(bytes) {
        check_optimizer(text);
    }
});

/// The most decoding `len` bytes of metadata may allocate: one string of the longest
/// allowed length, or node tables and JSON values in proportion to the input.
fn allocation_bound(len: usize) -> usize {
    MAX_STRING + 64 * len + 4096
}

fn check_bounds(msg: &Msg) {
    match msg {
        Msg::Assign { nodes, .. } => assert!(nodes.len() <= MAX_NODES),
        Msg::BarrierFailed { reason, .. }
        | Msg::NodeFailed { reason, .. }
        | Msg::Leaving { reason }
        | Msg::Failed { reason, .. }
        | Msg::PeerFailed { reason, .. } => assert!(reason.len() <= MAX_STRING),
        Msg::Command { body, .. } => assert!(body.len() <= MAX_STRING),
        _ => {}
    }
}

fn check_msg(bytes: &[u8]) {
    let (decoded, largest) = largest_allocation(|| Msg::decode(bytes));
    assert!(
        largest <= allocation_bound(bytes.len()),
        "decoding {} bytes allocated {largest}",
        bytes.len()
    );
    let Ok(msg) = decoded else { return };
    check_bounds(&msg);
    let encoded = msg.encode();
    assert_eq!(
        Msg::decode(&encoded).as_ref(),
        Ok(&msg),
        "does not decode back"
    );
    assert_eq!(
        Msg::decode(&encoded).map(|m| m.encode()).as_ref(),
        Ok(&encoded),
        "encoding is not canonical"
    );
    if let Msg::Command { kind, body, .. } = &msg {
        match kind {
            CommandKind::SetOptimizer => check_optimizer(body),
            CommandKind::SetCompression => {
                let _ = psnet_compression::CompressionParams::parse(body);
            }
            CommandKind::SetMode | CommandKind::Checkpoint => {}
        }
    }
}

fn check_frame(bytes: &[u8]) {
    let (decoded, largest) = largest_allocation(|| decode_frame(bytes));
    assert!(largest <= allocation_bound(bytes.len()));
    let Ok((envelope, msg)) = decoded else { return };
    if let Some(m) = &msg {
        check_bounds(m);
    }
    let body = msg.as_ref().map(Msg::encode).unwrap_or_default();
    let encoded = match envelope {
        Some(env) => {
            // A message is there exactly when the envelope has a sequence number.
            assert_eq!(env.seq.is_some(), msg.is_some());
            assert!(env.seq != Some(0) && env.ack != Some(0));
            assert!(env.seq.is_some() || env.ack.is_some());
            env.encode(&body)
        }
        None => {
            assert!(msg.is_some());
            assert_eq!(Msg::decode(bytes).as_ref(), Ok(msg.as_ref().unwrap()));
            body
        }
    };
    assert_eq!(
        decode_frame(&encoded),
        Ok((envelope, msg)),
        "does not decode back"
    );
}

fn check_optimizer(text: &str) {
    let (parsed, largest) = largest_allocation(|| OptimizerSpec::parse(text));
    assert!(largest <= allocation_bound(text.len()));
    let Ok(spec) = parsed else { return };
    spec.validate().expect("a parsed spec is valid");
    let json = spec.to_json();
    let again = OptimizerSpec::parse(&json).expect("the spec's JSON parses");
    assert_eq!(again, spec, "spec does not read back from {json}");
    assert_eq!(again.to_json(), json);
}

/// Packed codes: exactly `len` bytes or an error, within `len` plus zstd's context, and what
/// unpacks packs back to the same codes.
fn check_packed(bytes: &[u8], len: usize) {
    use psnet_kv::proto::packed::{pack, unpack};
    let (codes, largest) = largest_allocation(|| unpack(bytes, len));
    assert!(
        largest <= len + (1 << 20),
        "unpacking allocated {largest} bytes for {len}"
    );
    if let Ok(codes) = codes {
        assert_eq!(codes.len(), len);
        let again = pack(&codes).expect("codes pack");
        assert_eq!(unpack(&again, len).expect("packed codes unpack"), codes);
    }
}
