//! Wrong lengths and unsupported settings are errors, never panics, and write nothing.

use psnet_compression::{
    CompressionError, Compressor, OneBitCompressor, SimdLevel, TwoBitCompressor,
};

fn compressors() -> Vec<Box<dyn Compressor>> {
    vec![
        Box::new(TwoBitCompressor::new(0.5).unwrap()),
        Box::new(OneBitCompressor::new(0.5).unwrap()),
    ]
}

#[test]
fn wrong_lengths_are_errors_and_touch_nothing() {
    for c in compressors() {
        let grad = vec![1.0f32; 40];
        let good = c.compressed_len(40);

        let mut residual = vec![0.0f32; 39];
        let mut out = vec![0xAAu8; good];
        let err = c.quantize(&grad, &mut residual, &mut out).unwrap_err();
        assert_eq!(
            err,
            CompressionError::LengthMismatch {
                buffer: "residual",
                elements: 40,
                expected: 40,
                actual: 39
            }
        );
        assert_eq!(
            err.to_string(),
            "residual has length 39, expected 40 for 40 elements"
        );
        assert!(residual.iter().all(|&r| r == 0.0) && out.iter().all(|&b| b == 0xAA));

        for bad in [good - 1, good + 1, 0] {
            let mut residual = vec![0.0f32; 40];
            let mut out = vec![0xAAu8; bad];
            let err = c.quantize(&grad, &mut residual, &mut out).unwrap_err();
            assert!(
                matches!(
                    err,
                    CompressionError::LengthMismatch {
                        buffer: "compressed output",
                        ..
                    }
                ),
                "{err}"
            );
            assert!(residual.iter().all(|&r| r == 0.0));
        }

        let compressed = vec![0u8; good + 4];
        let mut values = vec![7.0f32; 40];
        let err = c.dequantize(&compressed, &mut values).unwrap_err();
        assert!(matches!(
            err,
            CompressionError::LengthMismatch {
                buffer: "compressed input",
                ..
            }
        ));
        assert!(c.dequantize_add(&compressed, &mut values).is_err());
        assert!(values.iter().all(|&v| v == 7.0));
    }
}

#[test]
fn empty_arrays_are_fine() {
    for c in compressors() {
        c.quantize(&[], &mut [], &mut []).unwrap();
        c.dequantize(&[], &mut []).unwrap();
        c.dequantize_add(&[], &mut []).unwrap();
    }
}

#[test]
fn unsupported_simd_level_is_an_error() {
    for level in SimdLevel::ALL {
        let result = TwoBitCompressor::new(0.5).unwrap().with_simd(level);
        if level.is_supported() {
            assert!(result.is_ok());
        } else {
            assert_eq!(
                result.unwrap_err(),
                CompressionError::UnsupportedSimd(level)
            );
        }
    }
}
