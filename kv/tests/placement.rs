//! Key placement and sharding: MXNet's worked examples, the overflow fix, and properties
//! (exact tiling, word alignment, agreement with MXNet's formulas) over many sizes.

use proptest::prelude::*;
use psnet_kv::placement::{
    CompressedPart, Part, Placement, PlacementError, DEFAULT_BIGARRAY_BOUND,
};

const TWO_BIT: usize = 16;
const ONE_BIT: usize = 32;

fn placement(num_servers: usize, bound: usize) -> Placement {
    Placement::new(num_servers, bound).expect("valid placement")
}

fn lens(parts: &[Part]) -> Vec<usize> {
    parts.iter().map(|p| p.len).collect()
}

/// (elements, words) per part.
fn shares(parts: &[CompressedPart]) -> Vec<(usize, usize)> {
    parts.iter().map(|p| (p.len, p.words())).collect()
}

/// MXNet's `EncodeDefaultKey` split, written as in `kvstore_dist.h`.
fn mxnet_split(n: usize, ns: usize) -> Vec<usize> {
    (0..ns)
        .map(|i| {
            let hi = (n as f64 / ns as f64 * (i + 1) as f64).round() as usize;
            let lo = (n as f64 / ns as f64 * i as f64).round() as usize;
            hi - lo
        })
        .collect()
}

/// MXNet's `EncodeCompressedKey` split as `(elements, words)` per server, written as in
/// `kvstore_dist.h`; `None` where MXNet's element counts go wrong (the last server's count
/// would be negative, an unsigned underflow in C++).
fn mxnet_compressed_split(n: usize, ns: usize, per_word: usize) -> Option<Vec<(usize, usize)>> {
    let c = n.div_ceil(per_word);
    let (mut sum_words, mut sum_elems) = (0usize, 0usize);
    let mut out = Vec::new();
    for i in 0..ns {
        let (words, elems) = if i == ns - 1 {
            (c - sum_words, n.checked_sub(sum_elems)?)
        } else {
            let hi = (c as f64 / ns as f64 * (i + 1) as f64).round() as usize;
            let lo = (c as f64 / ns as f64 * i as f64).round() as usize;
            (hi - lo, (hi - lo) * per_word)
        };
        sum_words += words;
        sum_elems += elems;
        out.push((elems, words));
    }
    Some(out)
}

#[test]
fn new_rejects_zero_servers_and_zero_bound() {
    assert_eq!(Placement::new(0, 10), Err(PlacementError::NoServers));
    assert_eq!(Placement::new(3, 0), Err(PlacementError::ZeroBound));
    assert_eq!(Placement::new(0, 0), Err(PlacementError::NoServers));
    let message = PlacementError::NoServers.to_string();
    assert!(message.contains("at least 1"), "{message}");
    let message = PlacementError::ZeroBound.to_string();
    assert!(
        message.contains("MXNET_KVSTORE_BIGARRAY_BOUND"),
        "{message}"
    );
}

#[test]
fn getters_return_the_configuration() {
    let p = placement(3, DEFAULT_BIGARRAY_BOUND);
    assert_eq!(p.num_servers(), 3);
    assert_eq!(p.bigarray_bound(), 1_000_000);
    assert!(!p.is_sharded(999_999));
    assert!(p.is_sharded(1_000_000));
}

#[test]
fn small_keys_match_mxnet_int_arithmetic() {
    // MXNet: `int server = (key * 9973) % num_servers;` is exact in i32 up to key 215,329.
    for ns in 1..=9usize {
        let p = placement(ns, DEFAULT_BIGARRAY_BOUND);
        for key in 0..=215_329i32 {
            let mxnet = key.checked_mul(9973).expect("no overflow below 215,330") % ns as i32;
            assert_eq!(
                p.server_for(key as u64),
                mxnet as usize,
                "key {key} ns {ns}"
            );
        }
    }
    // The first key where MXNet's C `int` product overflows.
    assert_eq!(215_330i32.checked_mul(9973), None);
}

#[test]
fn hand_worked_server_examples() {
    let two = placement(2, 10);
    assert_eq!(two.server_for(0), 0);
    assert_eq!(two.server_for(1), 1); // 9973 is odd
    assert_eq!(two.server_for(2), 0);
    let three = placement(3, 10);
    assert_eq!(three.server_for(1), 9973 % 3); // = 1
    assert_eq!(three.server_for(2), 19_946 % 3); // = 2
    assert_eq!(three.server_for(3), 0);
    let one = placement(1, 10);
    assert_eq!(one.server_for(u64::MAX), 0);
}

#[test]
fn large_keys_do_not_overflow() {
    for ns in 1..=9usize {
        let p = placement(ns, 1);
        for key in [
            215_327u64,
            215_329,
            215_330,
            1 << 31,
            u64::from(u32::MAX),
            1 << 40,
            (1 << 63) + 12_345,
            u64::MAX - 1,
            u64::MAX,
        ] {
            let expected = (u128::from(key) * 9973 % ns as u128) as usize;
            assert_eq!(p.server_for(key), expected, "key {key} ns {ns}");
        }
    }
    // A few done by hand: 2^64 - 1 = 3 * 5 * 17 * 257 * 641 * 65537 * 6700417.
    assert_eq!(placement(5, 1).server_for(u64::MAX), 0);
    // 2^3 = 1 (mod 7), so 2^64 = 2 and 2^64 - 1 = 1 (mod 7); 9973 = 5 (mod 7).
    assert_eq!(placement(7, 1).server_for(u64::MAX), 5);
    assert_eq!(placement(2, 1).server_for(u64::MAX), 1);
}

#[test]
fn small_array_goes_whole_to_server_for_key() {
    let p = placement(4, 100);
    for key in 0..50u64 {
        let parts = p.parts(key, 99);
        assert_eq!(
            parts.as_slice(),
            &[Part {
                server: p.server_for(key),
                offset: 0,
                len: 99
            }]
        );
    }
    // An empty array too.
    assert_eq!(lens(&p.parts(3, 0)), [0]);
}

#[test]
fn an_array_of_exactly_bound_elements_is_sharded() {
    let p = placement(2, 5);
    assert_eq!(lens(&p.parts(1, 4)), [4]); // 4 < 5: whole
    assert_eq!(lens(&p.parts(1, 5)), [3, 2]); // 5 == bound: split, round(2.5) = 3
}

#[test]
fn plain_split_examples() {
    // n = 5, NS = 2: round(2.5) = 3 (half away from zero), then 5 - 3.
    let parts = placement(2, 5).parts(0, 5);
    assert_eq!(
        parts.as_slice(),
        &[
            Part {
                server: 0,
                offset: 0,
                len: 3
            },
            Part {
                server: 1,
                offset: 3,
                len: 2
            }
        ]
    );
    // n = 10, NS = 3: round(3.33) = 3, round(6.67) = 7.
    assert_eq!(lens(&placement(3, 1).parts(0, 10)), [3, 4, 3]);
    // n = 1, NS = 2: round(0.5) = 1 (banker's rounding would give [0, 1]).
    assert_eq!(lens(&placement(2, 1).parts(0, 1)), [1, 0]);
    // n = 1, NS = 4: round(0.25) = 0, round(0.5) = 1, round(0.75) = 1.
    assert_eq!(lens(&placement(4, 1).parts(0, 1)), [0, 1, 0, 0]);
    // MXNet's default bound, 3 servers: round(333333.33) = 333333, round(666666.67) = 666667.
    let parts = placement(3, DEFAULT_BIGARRAY_BOUND).parts(42, 1_000_000);
    assert_eq!(lens(&parts), [333_333, 333_334, 333_333]);
    assert_eq!(
        parts.iter().map(|p| p.server).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    // The split does not depend on the key.
    assert_eq!(placement(3, 1).parts(0, 10), placement(3, 1).parts(7, 10));
}

#[test]
fn compressed_two_bit_35_elements_two_servers() {
    // The spec's verified MXNet example: C = 3 words, round(1.5) = 2 words (32 elements) on
    // server 0, the remaining 1 word (3 elements) on server 1.
    let parts = placement(2, 35).compressed_parts(1, 35, TWO_BIT);
    assert_eq!(
        parts.as_slice(),
        &[
            CompressedPart {
                server: 0,
                offset: 0,
                len: 32,
                byte_offset: 0,
                byte_len: 8
            },
            CompressedPart {
                server: 1,
                offset: 32,
                len: 3,
                byte_offset: 8,
                byte_len: 4
            },
        ]
    );
    assert_eq!(parts[0].range(), 0..32);
    assert_eq!(parts[1].byte_range(), 8..12);
    assert_eq!(parts[1].words(), 1);
    // Any bound <= 35 gives the same; 36 keeps it whole.
    assert_eq!(placement(2, 1).compressed_parts(1, 35, TWO_BIT), parts);
    assert_eq!(
        shares(&placement(2, 36).compressed_parts(1, 35, TWO_BIT)),
        [(35, 3)]
    );
}

#[test]
fn compressed_one_bit_examples() {
    // 1-bit, n = 35: C = 2 words; round(1) = 1 word (32 elements), the last 1 word (3).
    let parts = placement(2, 1).compressed_parts(0, 35, ONE_BIT);
    assert_eq!(shares(&parts), [(32, 1), (3, 1)]);
    assert_eq!(parts[1].byte_range(), 4..8);
    // n = 100, NS = 3: C = 4; round(1.33) = 1, round(2.67) = 3 → 1, 2, 1 words.
    let parts = placement(3, 1).compressed_parts(0, 100, ONE_BIT);
    assert_eq!(shares(&parts), [(32, 1), (64, 2), (4, 1)]);
}

#[test]
fn compressed_default_bound_example() {
    // 1,000,000 elements, 3 servers, 2-bit: C = 62,500 words; round(20833.33) = 20833,
    // round(41666.67) = 41667 → 20833, 20834, 20833 words = 333,328, 333,344 and the rest.
    let parts = placement(3, DEFAULT_BIGARRAY_BOUND).compressed_parts(9, 1_000_000, TWO_BIT);
    assert_eq!(
        shares(&parts),
        [(333_328, 20_833), (333_344, 20_834), (333_328, 20_833)]
    );
    assert_eq!(parts[2].byte_range(), 4 * 41_667..4 * 62_500);
    assert_eq!(
        mxnet_compressed_split(1_000_000, 3, TWO_BIT).unwrap(),
        shares(&parts)
    );
    // Note that the uncompressed split differs (333,333 / 333,334 / 333,333).
}

#[test]
fn compressed_tiny_array_many_servers_is_clamped() {
    // n = 5, NS = 4, 2-bit: C = 1 word; word boundaries round(0.25) = 0, round(0.5) = 1,
    // round(0.75) = 1. MXNet would give server 1 sixteen elements (of 5) and the last server
    // 5 - 16 (an unsigned underflow). psnet: server 1 gets the word and all 5 elements.
    assert_eq!(mxnet_compressed_split(5, 4, TWO_BIT), None);
    let parts = placement(4, 5).compressed_parts(3, 5, TWO_BIT);
    assert_eq!(shares(&parts), [(0, 0), (5, 1), (0, 0), (0, 0)]);
    assert_eq!(
        parts.iter().map(|p| p.range()).collect::<Vec<_>>(),
        [0..0, 0..5, 5..5, 5..5]
    );
    assert_eq!(
        parts.iter().map(|p| p.byte_range()).collect::<Vec<_>>(),
        [0..0, 0..4, 4..4, 4..4]
    );
}

#[test]
fn small_compressed_array_goes_whole_to_server_for_key() {
    let p = placement(3, 1000);
    let parts = p.compressed_parts(5, 999, TWO_BIT);
    assert_eq!(
        parts.as_slice(),
        &[CompressedPart {
            server: p.server_for(5),
            offset: 0,
            len: 999,
            byte_offset: 0,
            byte_len: 4 * 63
        }]
    );
    let empty = p.compressed_parts(5, 0, TWO_BIT);
    assert_eq!(shares(&empty), [(0, 0)]);
}

#[test]
#[should_panic(expected = "elems_per_word")]
fn compressed_parts_needs_a_word_size() {
    let _ = placement(2, 1).compressed_parts(0, 10, 0);
}

#[test]
fn huge_arrays_are_still_tiled() {
    // Beyond 2^53 elements f64 cannot represent n; the parts must still cover [0, n).
    for n in [(1usize << 53) + 1, usize::MAX / 8, usize::MAX / 4] {
        for ns in [1usize, 3, 7] {
            let parts = placement(ns, 1).parts(0, n);
            assert_eq!(parts.iter().map(|p| p.len).sum::<usize>(), n);
            assert_eq!(parts.last().unwrap().range().end, n);
        }
    }
}

/// Checks that `ranges` tile `[0, total)` in order.
fn assert_tiles(ranges: impl IntoIterator<Item = std::ops::Range<usize>>, total: usize) {
    let mut next = 0;
    for r in ranges {
        assert_eq!(r.start, next, "gap or overlap at {next}");
        assert!(r.end >= r.start);
        next = r.end;
    }
    assert_eq!(next, total, "ranges end at {next}, not {total}");
}

fn bound_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![Just(1usize), 1..6000usize, Just(usize::MAX)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn plain_parts_tile_the_array(
        n in 0..5000usize,
        ns in 1..9usize,
        bound in bound_strategy(),
        key in any::<u64>(),
    ) {
        let p = placement(ns, bound);
        let parts = p.parts(key, n);
        assert_tiles(parts.iter().map(Part::range), n);
        if n < bound {
            prop_assert_eq!(parts.as_slice(), &[Part { server: p.server_for(key), offset: 0, len: n }]);
        } else {
            prop_assert_eq!(parts.len(), ns);
            for (i, part) in parts.iter().enumerate() {
                prop_assert_eq!(part.server, i);
            }
            prop_assert_eq!(lens(&parts), mxnet_split(n, ns));
        }
    }

    #[test]
    fn compressed_parts_tile_elements_and_bytes(
        n in 0..5000usize,
        ns in 1..9usize,
        bound in bound_strategy(),
        per_word in prop_oneof![Just(TWO_BIT), Just(ONE_BIT), 1..40usize],
        key in any::<u64>(),
    ) {
        let p = placement(ns, bound);
        let parts = p.compressed_parts(key, n, per_word);
        let words = n.div_ceil(per_word);
        assert_tiles(parts.iter().map(CompressedPart::range), n);
        assert_tiles(parts.iter().map(CompressedPart::byte_range), 4 * words);
        for part in &parts {
            prop_assert_eq!(part.byte_offset % 4, 0);
            prop_assert_eq!(part.byte_len % 4, 0);
            // The bytes encode exactly the part's elements, starting on a word boundary.
            prop_assert_eq!(part.words(), part.len.div_ceil(per_word));
            if part.len > 0 {
                prop_assert_eq!(part.offset, per_word * part.byte_offset / 4);
            }
        }
        if n < bound {
            prop_assert_eq!(parts.len(), 1);
            prop_assert_eq!(parts[0].server, p.server_for(key));
        } else {
            prop_assert_eq!(parts.len(), ns);
            for (i, part) in parts.iter().enumerate() {
                prop_assert_eq!(part.server, i);
            }
            // Identical to MXNet wherever MXNet's counts are valid.
            if let Some(mxnet) = mxnet_compressed_split(n, ns, per_word) {
                prop_assert_eq!(shares(&parts), mxnet);
            }
        }
    }

    #[test]
    fn server_for_is_the_mathematical_remainder(key in any::<u64>(), ns in 1..100_000usize) {
        let p = placement(ns, 1);
        let server = p.server_for(key);
        prop_assert!(server < ns);
        // (key * 9973) mod ns, computed another way.
        let other = ((key % ns as u64) as u128 * (9973 % ns as u128) % ns as u128) as usize;
        prop_assert_eq!(server, other);
        if key <= 215_329 {
            prop_assert_eq!(server, (key as i32 * 9973 % ns as i32) as usize);
        }
    }
}
