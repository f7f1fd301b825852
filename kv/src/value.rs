//! The element types of kv values: `f32`, and the halves `f16` and `bf16` (the `half`
//! crate's types, re-exported).
//!
//! A key holds the type it was initialized with. Pushes and pulls of a half key move half
//! the bytes of an `f32` key. The servers keep every key as an `f32` master copy, as MXNet's
//! `multi_precision` optimizers do: pushes are widened to `f32`, summed and applied in
//! `f32`, and a pull answers the master copy rounded to the key's type (to nearest, ties
//! to even). So a half key's value follows exactly the `f32` computation of the same
//! pushes, rounded once when it is read. Gradient compression takes `f32` values only.

pub use half::{bf16, f16};

/// A key's element type, as it travels in push flags, journals and snapshots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// 32-bit float (MXNet's `float32`).
    #[default]
    F32,
    /// IEEE 754 half (MXNet's `float16`).
    F16,
    /// bfloat16.
    BF16,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
        }
    }

    /// The type's code (push flags, journals, snapshots).
    pub fn code(self) -> u8 {
        match self {
            Dtype::F32 => 0,
            Dtype::F16 => 1,
            Dtype::BF16 => 2,
        }
    }

    /// The type of a code, if any.
    pub fn from_code(code: u8) -> Option<Dtype> {
        [Dtype::F32, Dtype::F16, Dtype::BF16]
            .into_iter()
            .find(|d| d.code() == code)
    }

    /// NumPy's and MXNet's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "float32",
            Dtype::F16 => "float16",
            Dtype::BF16 => "bfloat16",
        }
    }

    /// Elements in `bytes` of this type, or None if it is not a whole number of them.
    pub fn count(self, bytes: usize) -> Option<usize> {
        (bytes % self.size() == 0).then_some(bytes / self.size())
    }

    /// `dst = bytes` (`add`: `dst += bytes`), `bytes` holding `dst.len()` elements of this
    /// type, little-endian, at any alignment; widened to `f32` exactly.
    pub fn widen_into(self, dst: &mut [f32], bytes: &[u8], add: bool) {
        debug_assert_eq!(dst.len() * self.size(), bytes.len());
        let widen = |c: &[u8]| -> f32 {
            let bits = u16::from_le_bytes([c[0], c[1]]);
            match self {
                Dtype::F16 => f16::from_bits(bits).to_f32(),
                _ => bf16::from_bits(bits).to_f32(),
            }
        };
        match (self, add) {
            (Dtype::F32, false) => crate::proto::sum::copy_from_le(dst, bytes),
            (Dtype::F32, true) => crate::proto::sum::add_from_le(dst, bytes),
            (_, false) => {
                for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = widen(c);
                }
            }
            (_, true) => {
                for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                    *d += widen(c);
                }
            }
        }
    }

    /// `values` as little-endian elements of this type (rounded to nearest, ties to even).
    pub fn narrow(self, values: &[f32]) -> Vec<u8> {
        match self {
            Dtype::F32 => crate::proto::sum::as_bytes(values).to_vec(),
            Dtype::F16 => values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
            Dtype::BF16 => values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
        }
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for super::f16 {}
    impl Sealed for super::bf16 {}
}

/// An element type a worker can push and pull: `f32`, [`f16`], [`bf16`].
pub trait Value: bytemuck::Pod + sealed::Sealed + Send + Sync {
    /// Its [`Dtype`].
    const DTYPE: Dtype;
}

impl Value for f32 {
    const DTYPE: Dtype = Dtype::F32;
}

impl Value for f16 {
    const DTYPE: Dtype = Dtype::F16;
}

impl Value for bf16 {
    const DTYPE: Dtype = Dtype::BF16;
}

/// The wire bytes of `values` (no copy; little-endian hosts, as `proto::sum`).
pub fn as_bytes<V: Value>(values: &[V]) -> &[u8] {
    bytemuck::cast_slice(values)
}

/// `dst = bytes`, `bytes` holding `dst.len()` little-endian elements at any alignment.
pub fn copy_from_le<V: Value>(dst: &mut [V], bytes: &[u8]) {
    bytemuck::cast_slice_mut::<V, u8>(dst).copy_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_widen_exactly_and_narrow_to_nearest_even() {
        for d in [Dtype::F16, Dtype::BF16] {
            assert_eq!(Dtype::from_code(d.code()), Some(d));
            let values = [1.0f32, -2.5, 0.1, 65504.0, 1e-3, 3.0e38];
            let narrow = d.narrow(&values);
            assert_eq!(narrow.len(), values.len() * 2);
            let mut wide = vec![0f32; values.len()];
            d.widen_into(&mut wide, &narrow, false);
            for (w, v) in wide.iter().zip(values) {
                let expected = match d {
                    Dtype::F16 => f16::from_f32(v).to_f32(),
                    _ => bf16::from_f32(v).to_f32(),
                };
                assert_eq!(w.to_bits(), expected.to_bits(), "{d} {v}");
            }
            // Widening adds in f32, element by element.
            let mut acc = vec![1.0f32; values.len()];
            d.widen_into(&mut acc, &narrow, true);
            for (a, w) in acc.iter().zip(&wide) {
                assert_eq!(a.to_bits(), (1.0 + w).to_bits());
            }
        }
        // Ties go to even: 1 + 2^-11 lies halfway between two halves.
        let tie = 1.0 + 2f32.powi(-11);
        assert_eq!(
            Dtype::F16.narrow(&[tie]),
            f16::from_f32(1.0).to_bits().to_le_bytes()
        );
        assert_eq!(Dtype::F16.count(6), Some(3));
        assert_eq!(Dtype::F32.count(6), None);
        assert_eq!(Dtype::from_code(3), None);
    }

    #[test]
    fn values_round_trip_through_their_bytes() {
        let v = [f16::from_f32(1.5), f16::from_f32(-0.25)];
        let mut out = [f16::ZERO; 2];
        copy_from_le(&mut out, as_bytes(&v));
        assert_eq!(out, v);
    }
}
