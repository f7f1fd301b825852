//! Packed codes come back bit for bit in every form, and bad input is refused by name.

use super::*;
use proptest::prelude::*;

/// Codes with about `nonzero` of 1,000 fields nonzero (1, 2 or 3), as a quantizer makes them.
fn codes(n: usize, nonzero: u32, seed: u64) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut out = vec![0u8; n.div_ceil(4)];
    for i in 0..n {
        let code = if rng.u32(0..1000) < nonzero {
            rng.u8(1..4)
        } else {
            0
        };
        out[i / 4] |= code << (2 * (i % 4));
    }
    out
}

proptest! {
    #[test]
    fn codes_come_back_bit_for_bit(n in 0usize..40_000, nonzero in 0u32..1000, seed: u64) {
        let c = codes(n, nonzero, seed);
        let packed = pack(&c).unwrap();
        prop_assert!(packed.len() <= c.len() + 1);
        prop_assert_eq!(unpack(&packed, c.len()).unwrap(), c);
    }

    #[test]
    fn any_bytes_come_back_bit_for_bit(c in proptest::collection::vec(any::<u8>(), 0..3000)) {
        prop_assert_eq!(unpack(&pack(&c).unwrap(), c.len()).unwrap(), c);
    }

    #[test]
    fn any_bytes_unpack_to_the_length_asked_or_fail(
        form in 0u8..4,
        body in proptest::collection::vec(any::<u8>(), 0..300),
        len in 0usize..5000,
    ) {
        let mut packed = vec![form];
        packed.extend_from_slice(&body);
        if let Ok(codes) = unpack(&packed, len) {
            prop_assert_eq!(codes.len(), len);
        }
    }
}

#[test]
fn each_density_takes_its_form_and_its_size() {
    // 32,768 fields: a 128 KiB piece's 2-bit codes.
    let push = codes(32_768, 20, 1);
    let pull = codes(32_768, 280, 2);
    let noise = codes(32_768, 1000, 3);
    let (p, q, r) = (
        pack(&push).unwrap(),
        pack(&pull).unwrap(),
        pack(&noise).unwrap(),
    );
    assert_eq!((p[0], q[0], r[0]), (SPARSE, ZSTD, RAW));
    // About 655 nonzero fields, 1 or 2 bytes each.
    assert!(p.len() * 6 < push.len(), "{} of {}", p.len(), push.len());
    assert!(
        q.len() * 10 < pull.len() * 8,
        "{} of {}",
        q.len(),
        pull.len()
    );
    assert_eq!(r.len(), noise.len() + 1);
    assert_eq!(pack(&[]).unwrap(), [SPARSE]);
    assert_eq!(unpack(&[SPARSE], 5).unwrap(), [0; 5]);
}

#[test]
fn a_field_at_each_place_of_a_word_and_of_the_tail_comes_back() {
    for len in [1usize, 7, 8, 9, 17] {
        for k in 0..len * 4 {
            for field in 1..4u8 {
                let mut c = vec![0u8; len];
                c[k / 4] |= field << (2 * (k % 4));
                let packed = pack_sparse(&c, 1);
                assert_eq!(unpack(&packed, len).unwrap(), c, "{len} {k} {field}");
                assert_eq!(unpack(&pack(&c).unwrap(), len).unwrap(), c);
            }
        }
    }
}

#[test]
fn bad_packed_codes_are_refused_by_name() {
    let c = codes(1000, 300, 3);
    let packed = pack(&c).unwrap();
    assert_eq!(packed[0], ZSTD);
    let short = unpack(&packed, c.len() - 1).unwrap_err();
    assert!(short.contains("do not unpack"), "{short}");
    let long = unpack(&packed, c.len() + 1).unwrap_err();
    assert!(long.contains("expected"), "{long}");
    assert!(unpack(&packed[..packed.len() - 2], c.len()).is_err());
    let cases: [(&[u8], usize, &str); 7] = [
        (&[], 4, "0 bytes"),
        (&[9, 1], 4, "unknown form 9"),
        (&[RAW, 1, 2], 4, "expected 4"),
        (&[SPARSE, 0x81], 4, "inside a number"),
        (&[SPARSE, 0x04], 4, "a zero field"),
        // Gap 16 puts the field at 16, past a 4-byte stream's 16 fields.
        (&[SPARSE, 0x41], 4, "run past 4 bytes"),
        (
            &[
                SPARSE, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f,
            ],
            4,
            "past 64 bits",
        ),
    ];
    for (bytes, len, why) in cases {
        let e = unpack(bytes, len).unwrap_err();
        assert!(e.contains(why), "{bytes:?}: {e}");
    }
    // Two fields may not land on one place: the second's gap counts after the first.
    assert_eq!(unpack(&[SPARSE, 0x01, 0x02], 1).unwrap(), [0b1001]);
}
