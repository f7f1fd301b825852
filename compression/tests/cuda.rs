//! GPU path (feature `cuda`): same bytes as the CPU path when a device is present; a clear
//! `NoCudaDevice` error (never a panic) when not. GPU tests print why they skipped.
#![cfg(feature = "cuda")]

mod common;

use common::*;
use psnet_compression::cuda::{device_count, CudaCompressor};
use psnet_compression::{CompressionError, CompressionParams};

/// The compressor, or `None` after printing why the GPU test is skipped.
fn gpu(params: CompressionParams, test: &str) -> Option<CudaCompressor> {
    match CudaCompressor::new(0, &params) {
        Ok(c) => Some(c),
        Err(CompressionError::NoCudaDevice(reason)) => {
            eprintln!("{test}: skipped: no CUDA device: {reason}");
            None
        }
        Err(e) => panic!("{test}: unexpected error: {e}"),
    }
}

#[test]
fn absence_is_an_error_not_a_panic() {
    match device_count() {
        Ok(n) => assert!(n > 0),
        Err(e) => {
            assert!(matches!(e, CompressionError::NoCudaDevice(_)), "{e}");
            assert!(e.to_string().starts_with("no CUDA device: "), "{e}");
            let err = CudaCompressor::two_bit(0, 0.5).unwrap_err();
            assert!(matches!(err, CompressionError::NoCudaDevice(_)), "{err}");
            eprintln!("absence_is_an_error_not_a_panic: {err}");
        }
    }
    // A device that cannot exist.
    let err = CudaCompressor::one_bit(1 << 20, 0.5).unwrap_err();
    assert!(matches!(err, CompressionError::NoCudaDevice(_)), "{err}");
}

#[test]
fn bad_parameters_are_refused_before_touching_the_driver() {
    assert!(matches!(
        CudaCompressor::new(0, &CompressionParams::None),
        Err(CompressionError::Params(_))
    ));
    assert!(matches!(
        CudaCompressor::two_bit(0, -1.0),
        Err(CompressionError::Params(_))
    ));
}

// Short lengths cover every partial group; the last spans several passes of the grid.
const SIZES: &[usize] = &[
    0,
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    9,
    15,
    16,
    17,
    31,
    33,
    1000,
    4097,
    (1 << 20) + 3,
    (5 << 20) + 7,
];

#[test]
fn gpu_two_bit_matches_cpu_model() {
    let Some(c) = gpu(CompressionParams::two_bit(0.5).unwrap(), "gpu_two_bit") else {
        return;
    };
    for &n in SIZES {
        let mut model_r = pseudo_random(n, 1, 0.5);
        let mut r = model_r.clone();
        let mut out = vec![0xEEu8; c.compressed_len(n)];
        for round in 0..3 {
            let g = pseudo_random(n, round + 10, 1.0);
            let want = mxnet_quantize_2bit(&g, &mut model_r, 0.5);
            c.quantize_host(&g, &mut r, &mut out).unwrap();
            assert_bytes_eq(&out, &want, &format!("gpu 2bit n={n} round={round}"));
        }
        assert_bits_eq(&r, &model_r, &format!("gpu 2bit residual n={n}"));

        let decoded = mxnet_dequantize_2bit(&out, n, 0.5);
        let mut values = vec![f32::NAN; n];
        c.dequantize_host(&out, &mut values).unwrap();
        assert_bits_eq(&values, &decoded, "gpu 2bit dequantize");
        let acc0 = pseudo_random(n, 99, 3.0);
        let mut acc = acc0.clone();
        c.dequantize_add_host(&out, &mut acc).unwrap();
        let want: Vec<f32> = acc0.iter().zip(&decoded).map(|(a, d)| a + d).collect();
        assert_bits_eq(&acc, &want, "gpu 2bit dequantize_add");
    }
}

#[test]
fn gpu_one_bit_matches_cpu_model() {
    let Some(c) = gpu(CompressionParams::one_bit(0.25).unwrap(), "gpu_one_bit") else {
        return;
    };
    for &n in SIZES {
        let mut model_r = pseudo_random(n, 2, 1.0);
        let mut r = model_r.clone();
        let mut out = vec![0xEEu8; c.compressed_len(n)];
        for round in 0..3 {
            let g = pseudo_random(n, round + 20, 1.0);
            let want = mxnet_quantize_1bit(&g, &mut model_r, 0.25);
            c.quantize_host(&g, &mut r, &mut out).unwrap();
            assert_bytes_eq(&out, &want, &format!("gpu 1bit n={n} round={round}"));
        }
        assert_bits_eq(&r, &model_r, &format!("gpu 1bit residual n={n}"));

        let decoded = mxnet_dequantize_1bit(&out, n);
        let mut values = vec![f32::NAN; n];
        c.dequantize_host(&out, &mut values).unwrap();
        assert_bits_eq(&values, &decoded, "gpu 1bit dequantize");
        let acc0 = pseudo_random(n, 98, 3.0);
        let mut acc = acc0.clone();
        c.dequantize_add_host(&out, &mut acc).unwrap();
        let want: Vec<f32> = acc0.iter().zip(&decoded).map(|(a, d)| a + d).collect();
        assert_bits_eq(&acc, &want, "gpu 1bit dequantize_add");
    }
}

#[test]
fn gpu_wrong_lengths_are_errors() {
    let Some(c) = gpu(
        CompressionParams::two_bit(0.5).unwrap(),
        "gpu_wrong_lengths",
    ) else {
        return;
    };
    let mut residual = vec![0.0f32; 3];
    let mut out = vec![0u8; 4];
    assert!(matches!(
        c.quantize_host(&[1.0; 4], &mut residual, &mut out),
        Err(CompressionError::LengthMismatch { .. })
    ));
}

#[test]
fn gpu_measure_reports_every_kernel_beside_the_copy() {
    use psnet_compression::cuda::measure::{format_gpu_json, format_gpu_table, measure_gpu};
    let Some(c) = gpu(CompressionParams::one_bit(0.5).unwrap(), "gpu_measure") else {
        return;
    };
    let rows = measure_gpu(&c, (1 << 16) + 3, 2).unwrap();
    let ops: Vec<&str> = rows.iter().map(|r| r.op.as_str()).collect();
    assert_eq!(ops, ["quantize", "dequantize", "dequantize_add"]);
    for r in &rows {
        assert_eq!(r.scheme, "1bit");
        assert!(r.kernel_us > 0.0 && r.copy_us > 0.0, "{r:?}");
        assert!(r.vs_copy.is_finite() && r.vs_copy > 0.0, "{r:?}");
    }
    // Quantize moves the gradient, the residual twice and the packed bits (MXNet's padded size).
    let n = (1 << 16) + 3;
    assert_eq!(
        rows[0].kernel_bytes,
        (3 * 4 * n + c.compressed_len(n)) as u64
    );
    assert_eq!(rows[1].kernel_bytes, (4 * n + c.compressed_len(n)) as u64);
    assert_eq!(format_gpu_table(&rows).lines().count(), 4);
    assert!(format_gpu_json(&rows).contains("\"vs_copy\""));
}
