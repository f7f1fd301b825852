//! The gradient-compression decoders (`psnet_compression`): 2-bit and 1-bit `dequantize` /
//! `dequantize_add` of arbitrary bytes for an arbitrary element count (what a kv server does
//! with a compressed push), and the compression settings a server reads off the wire
//! (`CompressionParams::parse`, the `SetCompression` body; `decode_mxnet`, MXNet's
//! `kSetGradientCompression` body).
//!
//! Input: `mode u8 | ...`. Mode bits 0-1: 0 = 2-bit, 1 = 1-bit: then `threshold f32 |
//! count u16 | compressed bytes`, where bit 2 set takes `count` as the element count as is
//! (mostly a length mismatch), clear derives it from the bytes' length (`count` only picks
//! the padding); bit 3 also runs the multi-threaded split. 2 = parameter JSON, 3 = MXNet
//! body (bit 4: MXNet 2.x, else 1.x): then text.
//!
//! Invariants: nothing panics; a length mismatch is an error with nothing written; decoded
//! values are exactly those of a plain model of the format; every SIMD level and the
//! threaded split give the same bits; `dequantize_add` adds exactly what `dequantize` gives;
//! quantizing the decoded values (zero residual) gives the canonical bytes back (for 1-bit
//! when the threshold is in [-1, 1)) and leaves a zero residual; decoding allocates nothing
//! in proportion to the claimed count. Parameters that parse give a compressor and read back
//! the same from their own text; MXNet bodies re-encode to a fixed point.
#![no_main]

use libfuzzer_sys::fuzz_target;
use psnet_compression::{
    mxnet_wire_threshold, CompressionError, CompressionParams, Compressor, MxnetVersion,
    OneBitCompressor, Parallelism, Scheme, SimdLevel, TwoBitCompressor,
};
use psnet_fuzz::{largest_allocation, Input, TrackingAlloc};

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

/// Largest element count tried (256 KiB of f32 per buffer).
const MAX_ELEMENTS: usize = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let mode = input.u8();
    match mode & 3 {
        scheme @ (0 | 1) => {
            let threshold = f32::from_bits(input.u32());
            let count = usize::from(input.u16());
            let bytes = input.rest();
            let scheme = if scheme == 0 {
                Scheme::TwoBit
            } else {
                Scheme::OneBit
            };
            let n = if mode & 4 != 0 {
                count
            } else {
                // The largest count whose compressed size fits the bytes, less some padding.
                let words = bytes.len() / 4;
                (words * scheme.factor()).saturating_sub(count % scheme.factor())
            };
            check_dequantize(scheme, threshold, n.min(MAX_ELEMENTS), bytes, mode & 8 != 0);
        }
        kind => {
            if let Ok(text) = std::str::from_utf8(input.rest()) {
                if kind == 2 {
                    check_params(text);
                } else {
                    let version = if mode & 16 != 0 {
                        MxnetVersion::V2
                    } else {
                        MxnetVersion::V1
                    };
                    check_mxnet(text, version);
                }
            }
        }
    }
});

/// Makes a compressor of one scheme and threshold for a SIMD level and thread split.
type Factory = Box<dyn Fn(SimdLevel, Parallelism) -> Box<dyn Compressor>>;

/// The compressor for `scheme` with `threshold`, or with a valid threshold where the
/// constructor refuses it (checking that it refuses exactly what its docs say).
fn compressor(scheme: Scheme, threshold: f32) -> (Factory, f32) {
    match scheme {
        Scheme::TwoBit => {
            let t = match TwoBitCompressor::new(threshold) {
                Ok(_) => threshold,
                Err(_) => {
                    assert!(!threshold.is_finite() || threshold <= 0.0);
                    0.5
                }
            };
            let make = move |level: SimdLevel, par: Parallelism| -> Box<dyn Compressor> {
                Box::new(
                    TwoBitCompressor::new(t)
                        .unwrap()
                        .with_simd(level)
                        .unwrap()
                        .with_parallelism(par),
                )
            };
            (Box::new(make), t)
        }
        Scheme::OneBit => {
            let t = match OneBitCompressor::new(threshold) {
                Ok(_) => threshold,
                Err(_) => {
                    assert!(threshold.is_nan());
                    0.5
                }
            };
            let make = move |level: SimdLevel, par: Parallelism| -> Box<dyn Compressor> {
                Box::new(
                    OneBitCompressor::new(t)
                        .unwrap()
                        .with_simd(level)
                        .unwrap()
                        .with_parallelism(par),
                )
            };
            (Box::new(make), t)
        }
    }
}

/// Element `i` as the format defines it (module docs of `two_bit` and `one_bit`).
fn model(scheme: Scheme, t: f32, bytes: &[u8], i: usize) -> f32 {
    match scheme {
        Scheme::TwoBit => match (bytes[i >> 2] >> (6 - 2 * (i & 3))) & 3 {
            3 => t,
            2 => -t,
            _ => 0.0,
        },
        Scheme::OneBit => {
            if bytes[i >> 3] & (0x80 >> (i & 7)) != 0 {
                1.0
            } else {
                -1.0
            }
        }
    }
}

/// The bytes a quantizer writes for these codes: `01` read as `00`, padding zero.
fn canonical(scheme: Scheme, bytes: &[u8], n: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    for i in 0..n {
        match scheme {
            Scheme::TwoBit => {
                let shift = 6 - 2 * (i & 3);
                let code = (bytes[i >> 2] >> shift) & 3;
                if code >= 2 {
                    out[i >> 2] |= code << shift;
                }
            }
            Scheme::OneBit => out[i >> 3] |= bytes[i >> 3] & (0x80 >> (i & 7)),
        }
    }
    out
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

fn check_dequantize(scheme: Scheme, threshold: f32, n: usize, bytes: &[u8], threaded: bool) {
    let (make, t) = compressor(scheme, threshold);
    let c = make(SimdLevel::Scalar, Parallelism::sequential());
    const SENTINEL: u32 = 0x7fc0_dead;
    let mut out = vec![f32::from_bits(SENTINEL); n];

    if bytes.len() != scheme.compressed_size(n) {
        let r = c.dequantize(bytes, &mut out);
        assert!(
            matches!(r, Err(CompressionError::LengthMismatch { .. })),
            "{r:?}"
        );
        let r = c.dequantize_add(bytes, &mut out);
        assert!(
            matches!(r, Err(CompressionError::LengthMismatch { .. })),
            "{r:?}"
        );
        assert!(
            out.iter().all(|v| v.to_bits() == SENTINEL),
            "written despite an error"
        );
        // The count the bytes do hold (at most one word's padding more) decodes.
        let fits = bytes.len() / 4 * scheme.factor();
        if fits <= MAX_ELEMENTS && bytes.len().is_multiple_of(4) {
            let mut out = vec![0.0f32; fits];
            c.dequantize(bytes, &mut out).expect("matching lengths");
        }
        return;
    }

    let (r, largest) = largest_allocation(|| c.dequantize(bytes, &mut out));
    r.expect("matching lengths");
    assert!(
        largest <= 4096,
        "a sequential dequantize allocated {largest} bytes"
    );
    for (i, v) in out.iter().enumerate() {
        assert_eq!(
            v.to_bits(),
            model(scheme, t, bytes, i).to_bits(),
            "element {i}"
        );
    }

    let mut levels: Vec<Parallelism> = vec![Parallelism::sequential()];
    if threaded {
        levels.push(Parallelism::threads(3).with_min_chunk(1));
    }
    let acc: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 7.25).collect();
    let want_sum: Vec<u32> = acc
        .iter()
        .zip(&out)
        .map(|(a, d)| (a + d).to_bits())
        .collect();
    for level in SimdLevel::supported() {
        for &par in &levels {
            let c = make(level, par);
            let mut other = vec![f32::from_bits(SENTINEL); n];
            c.dequantize(bytes, &mut other).unwrap();
            assert_eq!(
                bits(&other),
                bits(&out),
                "{level:?} {par:?} differs from scalar"
            );
            let mut sum = acc.clone();
            c.dequantize_add(bytes, &mut sum).unwrap();
            assert_eq!(bits(&sum), want_sum, "{level:?} {par:?}: dequantize_add");
        }
    }

    // Quantizing what was decoded gives the codes back, with nothing left over.
    if scheme == Scheme::TwoBit || (-1.0..1.0).contains(&t) {
        let mut residual = vec![0.0f32; n];
        let mut again = vec![0xAAu8; bytes.len()];
        c.quantize(&out, &mut residual, &mut again).unwrap();
        assert_eq!(again, canonical(scheme, bytes, n), "requantized bytes");
        assert!(residual.iter().all(|&r| r == 0.0), "residual left");
    }
}

fn check_params(text: &str) {
    let bound = 64 * text.len() + 65536;
    let (parsed, largest) = largest_allocation(|| CompressionParams::parse(text));
    assert!(
        largest <= bound,
        "parsing {} bytes allocated {largest}",
        text.len()
    );
    let Ok(params) = parsed else { return };
    assert!(
        params.compressor().is_ok(),
        "{params:?} parses but gives no compressor"
    );
    let shown = params.to_string();
    assert_eq!(
        CompressionParams::parse(&shown),
        Ok(params),
        "{params:?} does not read back from {shown}"
    );
    let json = serde_json::to_string(&params).unwrap();
    assert_eq!(
        serde_json::from_str::<CompressionParams>(&json).ok(),
        Some(params),
        "{json}"
    );
}

fn check_mxnet(text: &str, version: MxnetVersion) {
    let bound = 64 * text.len() + 65536;
    let (parsed, largest) = largest_allocation(|| CompressionParams::decode_mxnet(text, version));
    assert!(largest <= bound);
    let Ok(params) = parsed else { return };
    assert!(
        params.compressor().is_ok(),
        "{params:?} decodes but gives no compressor"
    );
    let body = params
        .encode_mxnet(version)
        .expect("a decoded setting encodes");
    // What the server reads back is the printed (rounded) threshold.
    let Ok(again) = CompressionParams::decode_mxnet(&body, version) else {
        return;
    };
    assert_eq!(again.scheme(), params.scheme());
    if let (Some(a), Some(p)) = (again.threshold(), params.threshold()) {
        assert_eq!(a.to_bits(), mxnet_wire_threshold(p).to_bits(), "{body}");
    }
    assert_eq!(
        again.encode_mxnet(version).unwrap(),
        body,
        "not a fixed point"
    );
}
