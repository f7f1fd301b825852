//! 2-bit codes as two bit planes, for the wire: which fields are nonzero (one bit a field),
//! then the low bit of each nonzero field, in order. 2-bit codes are `0b11`, `0b10` or 0, so
//! a nonzero field's high bit says nothing the mask does not; a change quantized with about
//! 28% of its fields nonzero goes in `1 + 0.28` bits a field, 64% of its bytes, with a few
//! shifts a word where an entropy coder would read every byte twice.
//!
//! Field `k` of the codes is bits `2k, 2k + 1` of the codes read as a little-endian bit
//! string (bits `2 (k mod 4)` of byte `k / 4`); bit `k` of each plane, likewise, is bit
//! `k mod 8` of its byte `k / 8`. Padding bits of a plane's last byte are zero.
//!
//! Where the CPU has BMI2 (and [`crate::SimdLevel`] allows AVX2), bits are gathered and
//! scattered with `pext` and `pdep`; elsewhere with shifts and masks, the same bytes.

use thiserror::Error;

#[cfg(target_arch = "x86_64")]
mod x86;

/// Why planes do not make codes of the length asked.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PlanesError {
    /// Fewer bytes than the mask of that many codes needs.
    #[error("{got} bytes of planes, the mask of {len} bytes of codes alone takes {mask}")]
    ShortMask {
        /// Bytes of codes asked for.
        len: usize,
        /// Bytes the mask takes.
        mask: usize,
        /// Bytes given.
        got: usize,
    },
    /// The low bits' plane is not as long as the mask's nonzero fields need.
    #[error("{got} bytes of low bits after a mask of {nonzero} nonzero fields (want {want})")]
    LowBits {
        /// Nonzero fields in the mask.
        nonzero: usize,
        /// Bytes of low bits they need.
        want: usize,
        /// Bytes given.
        got: usize,
    },
    /// A padding bit of a plane is set.
    #[error("a padding bit of the {0} plane is set")]
    Padding(&'static str),
}

/// Appends the planes of `codes` to `out` and returns true, or leaves `out` as it was and
/// returns false where a nonzero field is `0b01` (its high bit clear), which the planes
/// cannot say.
pub fn split(codes: &[u8], out: &mut Vec<u8>) -> bool {
    #[cfg(target_arch = "x86_64")]
    if x86::bmi2() {
        // SAFETY: `bmi2` checked that the CPU has BMI2 and POPCNT.
        return unsafe { x86::split_bmi2(codes, out) };
    }
    split_with::<Portable>(codes, out)
}

/// The `len` bytes of codes whose planes are `planes`, exactly as long as [`split`] made
/// them (at most `len` bytes are allocated, whatever `planes` holds).
pub fn join(planes: &[u8], len: usize) -> Result<Vec<u8>, PlanesError> {
    #[cfg(target_arch = "x86_64")]
    if x86::bmi2() {
        // SAFETY: `bmi2` checked that the CPU has BMI2 and POPCNT.
        return unsafe { x86::join_bmi2(planes, len) };
    }
    join_with::<Portable>(planes, len)
}

/// The bit gathering and scattering a kernel is built on.
pub(crate) trait Bits {
    /// The bits of `x` where `mask` is set, packed from bit 0 (`pext`).
    fn extract(x: u64, mask: u64) -> u64;
    /// The low bits of `x` placed where `mask` is set, in order (`pdep`).
    fn deposit(x: u64, mask: u64) -> u64;
}

const EVEN: u64 = 0x5555_5555_5555_5555;

/// Shifts and masks.
pub(crate) struct Portable;

impl Bits for Portable {
    #[inline(always)]
    fn extract(x: u64, mask: u64) -> u64 {
        if mask == EVEN {
            return compact_even(x);
        }
        let (mut m, mut out, mut k) = (mask, 0u64, 0);
        while m != 0 {
            let bit = m & m.wrapping_neg();
            out |= u64::from(x & bit != 0) << k;
            k += 1;
            m &= m - 1;
        }
        out
    }

    #[inline(always)]
    fn deposit(x: u64, mask: u64) -> u64 {
        if mask == EVEN {
            return spread_even(x);
        }
        let (mut m, mut out, mut k) = (mask, 0u64, 0);
        while m != 0 {
            let bit = m & m.wrapping_neg();
            if (x >> k) & 1 != 0 {
                out |= bit;
            }
            k += 1;
            m &= m - 1;
        }
        out
    }
}

/// Bits 0, 2, .., 62 of `x` as bits 0..32.
#[inline(always)]
fn compact_even(x: u64) -> u64 {
    let mut x = x & EVEN;
    x = (x | (x >> 1)) & 0x3333_3333_3333_3333;
    x = (x | (x >> 2)) & 0x0f0f_0f0f_0f0f_0f0f;
    x = (x | (x >> 4)) & 0x00ff_00ff_00ff_00ff;
    x = (x | (x >> 8)) & 0x0000_ffff_0000_ffff;
    (x | (x >> 16)) & 0xffff_ffff
}

/// Bits 0..32 of `x` as bits 0, 2, .., 62.
#[inline(always)]
fn spread_even(x: u64) -> u64 {
    let mut x = x & 0xffff_ffff;
    x = (x | (x << 16)) & 0x0000_ffff_0000_ffff;
    x = (x | (x << 8)) & 0x00ff_00ff_00ff_00ff;
    x = (x | (x << 4)) & 0x0f0f_0f0f_0f0f_0f0f;
    x = (x | (x << 2)) & 0x3333_3333_3333_3333;
    (x | (x << 1)) & EVEN
}

/// A little-endian bit string appended to a vector.
struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    acc: u64,
    bits: u32,
}

impl BitWriter<'_> {
    /// Appends the low `count` (at most 32) bits of `x`, which has no bit above them.
    #[inline(always)]
    fn put(&mut self, x: u64, count: u32) {
        self.acc |= x << self.bits;
        self.bits += count;
        if self.bits >= 32 {
            self.out.extend_from_slice(&(self.acc as u32).to_le_bytes());
            self.acc >>= 32;
            self.bits -= 32;
        }
    }

    fn finish(self) {
        let bytes = self.bits.div_ceil(8) as usize;
        self.out.extend_from_slice(&self.acc.to_le_bytes()[..bytes]);
    }
}

/// Reads a little-endian bit string whose length was checked.
struct BitReader<'a> {
    bytes: &'a [u8],
    acc: u64,
    bits: u32,
}

impl BitReader<'_> {
    /// The next `count` (at most 32) bits; zeros past the end (lengths were checked, so
    /// only a caller's bug reads there).
    #[inline(always)]
    fn take(&mut self, count: u32) -> u64 {
        if self.bits < count {
            let (word, rest) = match self.bytes.split_first_chunk::<4>() {
                Some((w, rest)) => (u32::from_le_bytes(*w), rest),
                None => {
                    let mut w = [0u8; 4];
                    w[..self.bytes.len()].copy_from_slice(self.bytes);
                    (u32::from_le_bytes(w), &[][..])
                }
            };
            self.acc |= u64::from(word) << self.bits;
            self.bits += 32;
            self.bytes = rest;
        }
        let x = self.acc & ((1u64 << count) - 1);
        self.acc >>= count;
        self.bits -= count;
        x
    }
}

/// The mask plane's length for `len` bytes of codes: 4 bits a byte.
fn mask_len(len: usize) -> usize {
    len / 2 + len % 2
}

/// A word of up to 8 code bytes, little-endian, zero past the end.
#[inline(always)]
fn word_of(bytes: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w[..bytes.len()].copy_from_slice(bytes);
    u64::from_le_bytes(w)
}

#[inline(always)]
pub(crate) fn split_with<B: Bits>(codes: &[u8], out: &mut Vec<u8>) -> bool {
    let start = out.len();
    let mask_bytes = mask_len(codes.len());
    out.resize(start + mask_bytes, 0);
    let mut low_bytes = Vec::with_capacity(mask_bytes);
    let mut low = BitWriter {
        out: &mut low_bytes,
        acc: 0,
        bits: 0,
    };
    // Whole words, then the last bytes as a word padded with zero fields.
    let words = codes.chunks_exact(8);
    let tail = words.remainder();
    let mask = &mut out[start..];
    let whole = words.len();
    let mut bad = 0u64;
    for (chunk, m) in words.zip(mask.chunks_exact_mut(4)) {
        let w = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        let (hi, lo) = (B::extract(w >> 1, EVEN), B::extract(w, EVEN));
        bad |= lo & !hi;
        m.copy_from_slice(&(hi as u32).to_le_bytes());
        low.put(B::extract(lo, hi), hi.count_ones());
    }
    if !tail.is_empty() {
        let w = word_of(tail);
        let (hi, lo) = (B::extract(w >> 1, EVEN), B::extract(w, EVEN));
        bad |= lo & !hi;
        let n = (tail.len() * 4).div_ceil(8);
        mask[4 * whole..4 * whole + n].copy_from_slice(&hi.to_le_bytes()[..n]);
        low.put(B::extract(lo, hi), hi.count_ones());
    }
    if bad != 0 {
        out.truncate(start);
        return false;
    }
    low.finish();
    out.extend_from_slice(&low_bytes);
    true
}

#[inline(always)]
pub(crate) fn join_with<B: Bits>(planes: &[u8], len: usize) -> Result<Vec<u8>, PlanesError> {
    let mask_bytes = mask_len(len);
    let Some((mask, low)) = planes.split_at_checked(mask_bytes) else {
        return Err(PlanesError::ShortMask {
            len,
            mask: mask_bytes,
            got: planes.len(),
        });
    };
    if len % 2 == 1 && mask.last().is_some_and(|b| b >> 4 != 0) {
        return Err(PlanesError::Padding("mask"));
    }
    let nonzero: usize = mask.iter().map(|b| b.count_ones() as usize).sum();
    let want = nonzero.div_ceil(8);
    if low.len() != want {
        return Err(PlanesError::LowBits {
            nonzero,
            want,
            got: low.len(),
        });
    }
    if nonzero % 8 != 0 && low.last().is_some_and(|b| b >> (nonzero % 8) != 0) {
        return Err(PlanesError::Padding("low bits"));
    }
    let mut out = vec![0u8; len];
    let mut reader = BitReader {
        bytes: low,
        acc: 0,
        bits: 0,
    };
    let mut word = |hi: u64| {
        let lo = B::deposit(reader.take(hi.count_ones()), hi);
        ((B::deposit(hi, EVEN) << 1) | B::deposit(lo, EVEN)).to_le_bytes()
    };
    let mut words = out.chunks_exact_mut(8);
    for (chunk, m) in (&mut words).zip(mask.chunks_exact(4)) {
        let hi = u32::from_le_bytes(m.try_into().expect("4 bytes"));
        chunk.copy_from_slice(&word(u64::from(hi)));
    }
    let tail = words.into_remainder();
    if !tail.is_empty() {
        let whole = len / 8;
        let hi = word_of(&mask[4 * whole..]);
        let n = tail.len();
        tail.copy_from_slice(&word(hi)[..n]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
