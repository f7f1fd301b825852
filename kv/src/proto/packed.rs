//! Packed codes: the 2-bit and 1-bit codes of a compressed push or pull answer, entropy-coded
//! on the wire (a zstd frame), where the link and not the CPU is what a step waits for.
//!
//! The codes are far from uniform. On `psnet-train`'s model, 2-bit gradient codes with
//! MXNet's threshold of 0.5 are 98% zeros, and the codes of a compressed pull's change are
//! about 72% zeros (the elements below the change's mean magnitude). zstd's entropy coder
//! takes a 2-bit push to about a seventh of its bytes and a pull's codes to about 60%.
//! Packing is lossless: the codes a server sums and a worker applies are exactly those that
//! were packed, so every value stays bit for bit what it is unpacked (MXNet's, for its
//! one-way 2-bit mode).
//!
//! Whether a job packs is the compression setting's `"pack"` (`PSNET_PACK_CODES`; by default
//! on for a job across hosts, off on one host, where packing costs CPU and saves nothing).
//! A push says whether its payload is packed ([`crate::proto::msg::PushFlags::packed`]),
//! and an answer says so in its form ([`crate::proto::pulled::Form::Packed`]).

use std::cell::RefCell;

/// zstd's level for codes: its fastest that still entropy-codes single bytes (level 1 took
/// a pull's codes to 59% of their size, negative levels left them whole).
const LEVEL: i32 = 1;

thread_local! {
    /// One compression context per thread: making one costs more than packing a piece.
    static PACKER: RefCell<Option<zstd::bulk::Compressor<'static>>> = const { RefCell::new(None) };
    /// One decompression context per thread.
    static UNPACKER: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
}

/// `codes` packed. Never fails on codes of any size: where the context cannot be made, the
/// error says so.
pub fn pack(codes: &[u8]) -> Result<Vec<u8>, String> {
    PACKER.with_borrow_mut(|slot| {
        if slot.is_none() {
            *slot = Some(
                zstd::bulk::Compressor::new(LEVEL)
                    .map_err(|e| format!("packing codes: zstd context: {e}"))?,
            );
        }
        let packer = slot.as_mut().expect("made above");
        packer
            .compress(codes)
            .map_err(|e| format!("packing {} bytes of codes: {e}", codes.len()))
    })
}

/// The codes in `packed`, which must be exactly `len` bytes of them: at most `len` bytes are
/// ever allocated, whatever `packed` says, and anything else (a malformed frame, more or
/// fewer bytes) is an error naming it.
pub fn unpack(packed: &[u8], len: usize) -> Result<Vec<u8>, String> {
    UNPACKER.with_borrow_mut(|slot| {
        if slot.is_none() {
            *slot = Some(
                zstd::bulk::Decompressor::new()
                    .map_err(|e| format!("unpacking codes: zstd context: {e}"))?,
            );
        }
        let unpacker = slot.as_mut().expect("made above");
        let codes = unpacker.decompress(packed, len).map_err(|e| {
            format!(
                "packed codes ({} bytes) do not unpack to {len} bytes: {e}",
                packed.len()
            )
        })?;
        if codes.len() != len {
            return Err(format!(
                "packed codes ({} bytes) unpack to {} bytes, expected {len}",
                packed.len(),
                codes.len()
            ));
        }
        Ok(codes)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Codes with about `nonzero` of 1,000 elements nonzero, as a quantizer makes them.
    fn codes(n: usize, nonzero: u32, seed: u64) -> Vec<u8> {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut out = vec![0u8; n.div_ceil(4)];
        for i in 0..n {
            let code = match rng.u32(0..1000) {
                x if x < nonzero / 2 => 1,
                x if x < nonzero => 2,
                _ => 0,
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
            prop_assert_eq!(unpack(&packed, c.len()).unwrap(), c);
        }

        #[test]
        fn any_bytes_unpack_to_the_length_asked_or_fail(bytes in proptest::collection::vec(any::<u8>(), 0..300), len in 0usize..5000) {
            if let Ok(codes) = unpack(&bytes, len) {
                prop_assert_eq!(codes.len(), len);
            }
        }
    }

    #[test]
    fn sparse_codes_pack_small_and_dense_ones_smaller() {
        // 32,768 elements: a 128 KiB piece's 2-bit codes.
        let push = codes(32_768, 20, 1);
        let pull = codes(32_768, 280, 2);
        let (p, q) = (pack(&push).unwrap(), pack(&pull).unwrap());
        assert!(p.len() * 5 < push.len(), "{} of {}", p.len(), push.len());
        assert!(
            q.len() * 10 < pull.len() * 7,
            "{} of {}",
            q.len(),
            pull.len()
        );
    }

    #[test]
    fn a_length_other_than_the_packed_one_is_refused() {
        let c = codes(1000, 300, 3);
        let packed = pack(&c).unwrap();
        let short = unpack(&packed, c.len() - 1).unwrap_err();
        assert!(short.contains("do not unpack"), "{short}");
        let long = unpack(&packed, c.len() + 1).unwrap_err();
        assert!(long.contains("expected"), "{long}");
        assert!(unpack(&[1, 2, 3], 10).is_err());
        assert!(unpack(&packed[..packed.len() - 2], c.len()).is_err());
    }
}
