//! Packed codes come back bit for bit in every form, and bad input is refused by name.

use super::*;
use proptest::prelude::*;

/// Codes with about `nonzero` of 1,000 fields nonzero (`0b10` or `0b11`), as a quantizer
/// makes them.
fn codes(n: usize, nonzero: u32, seed: u64) -> Vec<u8> {
    fields(n, nonzero, seed, 2)
}

/// As [`codes`], nonzero fields 1, 2 or 3: codes no quantizer makes, which still pack.
fn any_codes(n: usize, nonzero: u32, seed: u64) -> Vec<u8> {
    fields(n, nonzero, seed, 1)
}

fn fields(n: usize, nonzero: u32, seed: u64, lowest: u8) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut out = vec![0u8; n.div_ceil(4)];
    for i in 0..n {
        let code = if rng.u32(0..1000) < nonzero {
            rng.u8(lowest..4)
        } else {
            0
        };
        out[i / 4] |= code << (2 * (i % 4));
    }
    out
}

proptest! {
    #[test]
    fn codes_come_back_bit_for_bit(
        n in 0usize..40_000,
        nonzero in 0u32..1000,
        seed: u64,
        quantized: bool,
    ) {
        let c = if quantized { codes(n, nonzero, seed) } else { any_codes(n, nonzero, seed) };
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
        form in 0u8..5,
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
    let odd = any_codes(32_768, 280, 2);
    let noise = any_codes(32_768, 1000, 3);
    let (p, q, o, r) = (
        pack(&push).unwrap(),
        pack(&pull).unwrap(),
        pack(&odd).unwrap(),
        pack(&noise).unwrap(),
    );
    assert_eq!((p[0], q[0], o[0], r[0]), (SPARSE, PLANES, ZSTD, RAW));
    // About 655 nonzero fields, 1 or 2 bytes each.
    assert!(p.len() * 6 < push.len(), "{} of {}", p.len(), push.len());
    // A bit a field, and one more for each of the 28% nonzero: 64%.
    let want = 1
        + 32_768 / 8
        + (q[1..(1 + 32_768 / 8)].iter())
            .map(|b| b.count_ones() as usize)
            .sum::<usize>()
            .div_ceil(8);
    assert_eq!(q.len(), want);
    assert!(
        q.len() * 100 < pull.len() * 66,
        "{} of {}",
        q.len(),
        pull.len()
    );
    assert!(o.len() * 10 < odd.len() * 8, "{} of {}", o.len(), odd.len());
    assert_eq!(r.len(), noise.len() + 1);
    // Every nonzero field: the planes would take 9 bits a field, more than the codes.
    let full = vec![0xffu8; 1024];
    assert_eq!(pack(&full).unwrap()[0], RAW);
    // One odd byte with 3 nonzero fields: planes of 3 bytes would pass raw's 2.
    assert_eq!(pack(&[0xfc]).unwrap(), [RAW, 0xfc]);
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
    let c = any_codes(1000, 300, 3);
    let packed = pack(&c).unwrap();
    assert_eq!(packed[0], ZSTD);
    let short = unpack(&packed, c.len() - 1).unwrap_err();
    assert!(matches!(short, PackedError::Frame { .. }), "{short}");
    assert!(short.to_string().contains("do not unpack"), "{short}");
    let long = unpack(&packed, c.len() + 1).unwrap_err();
    assert!(long.to_string().contains("expected"), "{long}");
    assert!(unpack(&packed[..packed.len() - 2], c.len()).is_err());
    let cases: [(&[u8], usize, &str); 10] = [
        // 4 bytes of codes: a mask of 2 bytes, then 3 nonzero fields' bits in 1 byte.
        (&[PLANES, 0xff], 4, "the mask of 4 bytes"),
        (&[PLANES, 0b111, 0], 4, "3 nonzero fields"),
        (
            &[PLANES, 0b111, 0, 0b1000],
            4,
            "padding bit of the low bits",
        ),
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
    assert_eq!(unpack(&[9, 1], 4), Err(PackedError::UnknownForm(9)));
    assert_eq!(
        unpack(&[SPARSE, 0x41], 4),
        Err(PackedError::SparsePastEnd { len: 4 })
    );
    for (bytes, len, why) in cases {
        let e = unpack(bytes, len).unwrap_err();
        assert!(e.to_string().contains(why), "{bytes:?}: {e}");
    }
    // Two fields may not land on one place: the second's gap counts after the first.
    assert_eq!(unpack(&[SPARSE, 0x01, 0x02], 1).unwrap(), [0b1001]);
}
