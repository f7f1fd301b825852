//! The header of every message on a verbs queue pair (`psnet_verbs::proto::wire`): the common
//! header, eager / request-to-send / direct headers (checked against the transport limits),
//! clear-to-send (whole, or placing a segment elsewhere) and offers. No RDMA device is needed: these are plain functions over bytes.
//!
//! Input: `settings u8 | message bytes`; settings bits 0-1 choose the limits, the rest the
//! receive depth for the credits check. Every parser runs on every input (the receiver picks
//! one by the kind byte, but none may panic on anything).
//!
//! Invariants: nothing panics; what parses is within the limits and encodes back to the same
//! bytes; parsing allocates in proportion to the limits and the input, not to the counts the
//! bytes claim; the credits a header returns are taken exactly when the peer's buffers were
//! used that many times, and the count never exceeds the peer's receive depth.
#![no_main]

use libfuzzer_sys::fuzz_target;
use psnet_fuzz::{largest_allocation, limits, Input, TrackingAlloc};
use psnet_verbs::proto::credits::{Class, Credits};
use psnet_verbs::proto::wire::{
    parse_base, parse_cts, parse_data_header, parse_placed_cts, put_base, put_cts, put_data_header,
    put_placed_cts, Base, DataHeader, Kind, WireError, BASE_LEN, CTS_LEN, CTS_PLACED_LEN,
    DATA_HEADER_LEN, VERSION,
};

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let settings = input.u8();
    let limits = limits(settings);
    let bytes = input.rest();

    let base = parse_base(bytes);
    match &base {
        Ok(base) => {
            let mut encoded = [0u8; BASE_LEN];
            put_base(&mut encoded, *base);
            assert_eq!(
                &encoded[..],
                &bytes[..BASE_LEN],
                "base does not encode back"
            );
            // The credits it returns, applied as the receiver does; `seq` picks how many of
            // the peer's buffers this side has used.
            let depth = 4 + u32::from(settings >> 2);
            let used = base.seq % (depth + 1);
            let mut credits = Credits::new(depth);
            assert!(credits.try_take(Class::CreditReturn, used));
            let granted = credits.granted(base.credits);
            assert_eq!(
                granted.is_ok(),
                u32::from(base.credits) <= used,
                "{granted:?}"
            );
            assert!(credits.available() <= depth);
        }
        Err(WireError::Truncated { got, need }) => {
            assert_eq!((*got, *need), (bytes.len(), BASE_LEN));
        }
        Err(WireError::Version(v)) => assert!(*v != VERSION),
        Err(WireError::UnknownKind(k)) => assert!(!(1..=7).contains(k)),
        Err(WireError::Limit(_)) => panic!("the common header has no limits"),
    }
    // Any kind byte, so that put_* can write a header whatever the input's.
    let kind_base = Base {
        kind: Kind::Eager,
        credits: 0,
        seq: 0,
    };

    let (header, largest) = largest_allocation(|| parse_data_header(bytes, &limits));
    let bound = 4096 + 64 * bytes.len().min(8 * usize::from(limits.max_segments));
    assert!(
        largest <= bound,
        "parse_data_header allocated {largest} (bound {bound})"
    );
    if let Ok((h, end)) = &header {
        let (h, end) = (h, *end);
        assert_eq!(end, DataHeader::encoded_len(h.seg_lens.len()));
        assert!(end <= bytes.len());
        assert!(h.meta_len <= limits.max_meta);
        assert!(h.seg_lens.len() <= usize::from(limits.max_segments));
        assert!(h.payload_len() <= limits.max_message);
        let mut encoded = vec![0u8; end];
        let written = put_data_header(
            &mut encoded,
            *base.as_ref().unwrap_or(&kind_base),
            h.meta_len,
            h.flags,
            h.seg_lens.iter().copied(),
        );
        assert_eq!(written, end);
        let from = if base.is_ok() { 0 } else { BASE_LEN };
        assert_eq!(
            &encoded[from..],
            &bytes[from..end],
            "data header does not encode back"
        );
    } else if bytes.len() < DATA_HEADER_LEN {
        assert!(matches!(header, Err(WireError::Truncated { .. })));
    }

    match parse_cts(bytes) {
        Ok(cts) => {
            let mut encoded = [0u8; CTS_LEN];
            put_cts(&mut encoded, *base.as_ref().unwrap_or(&kind_base), cts);
            let from = if base.is_ok() { 0 } else { BASE_LEN };
            assert_eq!(
                &encoded[from..],
                &bytes[from..CTS_LEN],
                "cts does not encode back"
            );
        }
        Err(e) => assert!(bytes.len() < CTS_LEN, "{e}"),
    }

    match parse_placed_cts(bytes) {
        Ok(cts) => {
            let mut encoded = [0u8; CTS_PLACED_LEN];
            put_placed_cts(&mut encoded, *base.as_ref().unwrap_or(&kind_base), cts);
            let from = if base.is_ok() { 0 } else { BASE_LEN };
            assert_eq!(
                &encoded[from..],
                &bytes[from..CTS_PLACED_LEN],
                "placed cts does not encode back"
            );
        }
        Err(e) => assert!(bytes.len() < CTS_PLACED_LEN, "{e}"),
    }
});
