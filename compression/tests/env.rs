//! `PSNET_COMPRESSION_SIMD` caps the detected level (checked in child processes, since the
//! detection runs once per process).

use std::process::Command;

use psnet_compression::{SimdLevel, TwoBitCompressor, SIMD_ENV_VAR};

const EXPECT: &str = "PSNET_COMPRESSION_TEST_EXPECT_SIMD";

#[test]
fn env_var_caps_the_detected_level() {
    if let Some(expected) = psnet_config::env::harness_var(EXPECT) {
        // Child process: check and report.
        assert_eq!(SimdLevel::detect().name(), expected);
        assert_eq!(TwoBitCompressor::new(0.5).unwrap().simd().name(), expected);
        return;
    }
    let best = SimdLevel::best_supported();
    let sse2 = if SimdLevel::Sse2.is_supported() {
        SimdLevel::Sse2
    } else {
        SimdLevel::Scalar
    };
    let cases = [
        ("scalar", SimdLevel::Scalar),
        ("SSE2", sse2),
        ("avx2", best.min(SimdLevel::Avx2)),
        ("bogus", best),
    ];
    for (value, expected) in cases {
        let output = Command::new(std::env::current_exe().unwrap())
            .args(["env_var_caps_the_detected_level", "--exact", "--nocapture"])
            .env(SIMD_ENV_VAR, value)
            .env(EXPECT, expected.name())
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{SIMD_ENV_VAR}={value}: {}",
            String::from_utf8_lossy(&output.stdout)
        );
    }
}
