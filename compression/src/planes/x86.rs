//! The planes' kernels with BMI2's `pext` and `pdep`.

use std::arch::x86_64::{__cpuid, _pdep_u64, _pext_u64};
use std::sync::OnceLock;

use super::{Bits, PlanesError};

/// Whether the BMI2 kernels may run: the CPU has BMI2 and POPCNT and runs `pext` in
/// hardware, and the SIMD level in force (`PSNET_COMPRESSION_SIMD`) is AVX2.
pub(super) fn bmi2() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::arch::is_x86_feature_detected!("bmi2")
            && std::arch::is_x86_feature_detected!("popcnt")
            && !microcoded_pext()
            && crate::SimdLevel::detect() == crate::SimdLevel::Avx2
    })
}

/// AMD's CPUs before Zen 3 (family 0x19), and Hygon's, run `pext` and `pdep` in microcode,
/// tens to hundreds of cycles each: there the shifts and masks are faster.
// `__cpuid` became safe after the workspace's minimum Rust version, which still needs the
// block.
#[allow(unused_unsafe)]
fn microcoded_pext() -> bool {
    // SAFETY: every x86-64 CPU has CPUID.
    let (vendor, signature) = unsafe { (__cpuid(0), __cpuid(1)) };
    let name: Vec<u8> = [vendor.ebx, vendor.edx, vendor.ecx]
        .iter()
        .flat_map(|r| r.to_le_bytes())
        .collect();
    if name != *b"AuthenticAMD" && name != *b"HygonGenuine" {
        return false;
    }
    let eax = signature.eax;
    let base = (eax >> 8) & 0xf;
    let family = if base == 0xf {
        base + ((eax >> 20) & 0xff)
    } else {
        base
    };
    family < 0x19
}

struct Bmi2;

impl Bits for Bmi2 {
    #[inline(always)]
    fn extract(x: u64, mask: u64) -> u64 {
        // SAFETY: only instantiated in the `bmi2` functions below, which run where the CPU
        // has BMI2.
        unsafe { _pext_u64(x, mask) }
    }

    #[inline(always)]
    fn deposit(x: u64, mask: u64) -> u64 {
        // SAFETY: as `extract`.
        unsafe { _pdep_u64(x, mask) }
    }
}

/// [`super::split`] with BMI2.
///
/// # Safety
/// The CPU must support BMI2 and POPCNT.
#[target_feature(enable = "bmi2,popcnt")]
pub(super) unsafe fn split_bmi2(codes: &[u8], out: &mut Vec<u8>) -> bool {
    super::split_with::<Bmi2>(codes, out)
}

/// [`super::join`] with BMI2.
///
/// # Safety
/// The CPU must support BMI2 and POPCNT.
#[target_feature(enable = "bmi2,popcnt")]
pub(super) unsafe fn join_bmi2(planes: &[u8], len: usize) -> Result<Vec<u8>, PlanesError> {
    super::join_with::<Bmi2>(planes, len)
}
