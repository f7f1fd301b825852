use proptest::prelude::*;

use super::*;

/// Every kernel this CPU runs.
fn kernels() -> Vec<(&'static str, SplitFn, JoinFn)> {
    let mut k: Vec<(&'static str, SplitFn, JoinFn)> =
        vec![("portable", split_with::<Portable>, join_with::<Portable>)];
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("bmi2") && std::arch::is_x86_feature_detected!("popcnt")
    {
        k.push((
            "bmi2",
            // SAFETY: the CPU has BMI2 and POPCNT (checked just above).
            |c, o| unsafe { x86::split_bmi2(c, o) },
            // SAFETY: as above.
            |p, l| unsafe { x86::join_bmi2(p, l) },
        ));
    }
    k
}

type SplitFn = fn(&[u8], &mut Vec<u8>) -> bool;
type JoinFn = fn(&[u8], usize) -> Result<Vec<u8>, PlanesError>;

/// Codes of 2-bit fields, each 0 with probability `zero_in_8` / 8, else `0b11` or `0b10`.
fn codes(len: usize, zero_in_8: u32, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            (0..4).fold(0u8, |byte, f| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let field = match (state >> 20) % 16 {
                    r if r < u64::from(2 * zero_in_8) => 0,
                    r if r % 2 == 0 => 0b11,
                    _ => 0b10,
                };
                byte | (field << (2 * f))
            })
        })
        .collect()
}

#[test]
fn planes_are_a_mask_then_the_low_bits_of_the_nonzero_fields() {
    // Fields (little-endian, two bits each): byte 0 = 0b10_00_11_00 is fields 0, 3, 0, 2.
    let codes = [0b1000_1100u8, 0b0000_0011, 0b1100_0000];
    for (name, split, join) in kernels() {
        let mut out = vec![7];
        assert!(split(&codes, &mut out), "{name}");
        // Mask bits: fields 1, 3 (byte 0), 4 (byte 1), 11 (byte 2): 0b0001_1010, 0b0000_1000.
        // Low bits of those fields in order: 1, 0, 1, 1.
        assert_eq!(out, [7, 0b0001_1010, 0b0000_1000, 0b0000_1101], "{name}");
        assert_eq!(join(&out[1..], 3).unwrap(), codes, "{name}");
    }
}

#[test]
fn a_field_of_0b01_cannot_be_split_and_leaves_the_output_alone() {
    for (name, split, _) in kernels() {
        let mut out = vec![1, 2];
        assert!(
            !split(&[0, 0, 0, 0, 0, 0, 0, 0, 0b0100_0000], &mut out),
            "{name}"
        );
        assert_eq!(out, [1, 2], "{name}");
    }
}

#[test]
fn malformed_planes_are_refused_by_name() {
    for (name, _, join) in kernels() {
        let short = join(&[0xff], 4).unwrap_err();
        assert_eq!(
            short,
            PlanesError::ShortMask {
                len: 4,
                mask: 2,
                got: 1
            },
            "{name}"
        );
        // 3 nonzero fields need 1 byte of low bits.
        let missing = join(&[0b111, 0], 4).unwrap_err();
        assert!(matches!(
            missing,
            PlanesError::LowBits {
                nonzero: 3,
                want: 1,
                got: 0
            }
        ));
        let extra = join(&[0b111, 0, 0, 0], 4).unwrap_err();
        assert!(
            matches!(extra, PlanesError::LowBits { got: 2, .. }),
            "{name}"
        );
        assert_eq!(
            join(&[0b111, 0, 0b1000], 4).unwrap_err(),
            PlanesError::Padding("low bits")
        );
        // 3 bytes of codes: 12 fields, the mask's last 4 bits are padding.
        assert_eq!(
            join(&[0, 0x10], 3).unwrap_err(),
            PlanesError::Padding("mask")
        );
        assert_eq!(join(&[], 0).unwrap(), Vec::<u8>::new(), "{name}");
    }
}

proptest! {
    /// Any codes of 0, `0b10` and `0b11` fields come back whole through every kernel, each
    /// kernel makes the same bytes, and the planes take `ceil(fields / 8) + ceil(nonzero / 8)`.
    #[test]
    fn codes_come_back_whole_and_every_kernel_agrees(
        len in 0usize..200,
        zero_in_8 in 0u32..9,
        seed in any::<u64>(),
    ) {
        let codes = codes(len, zero_in_8, seed);
        let nonzero: usize = codes
            .iter()
            .map(|b| ((b | (b >> 1)) & 0x55).count_ones() as usize)
            .sum();
        let mut first: Option<Vec<u8>> = None;
        for (name, split, join) in kernels() {
            let mut out = Vec::new();
            prop_assert!(split(&codes, &mut out), "{}", name);
            prop_assert_eq!(out.len(), (4 * len).div_ceil(8) + nonzero.div_ceil(8));
            prop_assert_eq!(&join(&out, len).unwrap(), &codes);
            match &first {
                None => first = Some(out),
                Some(f) => prop_assert_eq!(f, &out),
            }
        }
    }

    /// Any bytes at all, joined for any length: the codes of that length or an error, never
    /// a panic.
    #[test]
    fn any_bytes_join_to_codes_of_the_length_or_an_error(
        planes in proptest::collection::vec(any::<u8>(), 0..64),
        len in 0usize..100,
    ) {
        for (_, split, join) in kernels() {
            if let Ok(codes) = join(&planes, len) {
                prop_assert_eq!(codes.len(), len);
                let mut again = Vec::new();
                prop_assert!(split(&codes, &mut again));
                prop_assert_eq!(&again, &planes);
            }
        }
    }
}
