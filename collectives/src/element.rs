//! Element types and the reductions over them.
//!
//! Elements travel in the host's byte order; psnet runs on little-endian hosts only, so that is
//! little-endian everywhere (checked at compile time below).

use std::fmt;
use std::str::FromStr;

use bytemuck::Pod;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

#[cfg(target_endian = "big")]
compile_error!(
    "psnet-collectives sends elements in the host's byte order: little-endian hosts only"
);

/// The type of a buffer's elements, as nccl-tests names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float (`float`).
    F32,
    /// 64-bit IEEE float (`double`).
    F64,
    /// 16-bit IEEE float (`half`).
    F16,
    /// bfloat16 (`bfloat16`).
    BF16,
    /// 32-bit signed integer (`int32`).
    I32,
    /// 64-bit signed integer (`int64`).
    I64,
    /// 8-bit unsigned integer (`uint8`).
    U8,
}

impl DType {
    /// Every type, in wire-code order.
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// Whether the type is a floating-point one (the only ones that can be averaged).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// The name nccl-tests prints.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F64 => "double",
            DType::F16 => "half",
            DType::BF16 => "bfloat16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
        }
    }

    pub(crate) fn code(self) -> u8 {
        DType::ALL.iter().position(|&t| t == self).expect("listed") as u8
    }

    pub(crate) fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    /// nccl-tests' names and the usual aliases (`f32`, `float32`, `fp16`, `bf16`, ...).
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "float" | "float32" | "f32" | "fp32" => DType::F32,
            "double" | "float64" | "f64" | "fp64" => DType::F64,
            "half" | "float16" | "f16" | "fp16" => DType::F16,
            "bfloat16" | "bf16" => DType::BF16,
            "int32" | "i32" | "int" => DType::I32,
            "int64" | "i64" => DType::I64,
            "uint8" | "u8" | "byte" => DType::U8,
            _ => {
                return Err(format!(
                    "unknown data type {s:?} (float, double, half, bfloat16, int32, int64, uint8)"
                ))
            }
        })
    }
}

/// How elements from different ranks are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (integers wrap on overflow).
    Sum,
    /// Product (integers wrap on overflow).
    Prod,
    /// Minimum; a NaN anywhere makes the result NaN.
    Min,
    /// Maximum; a NaN anywhere makes the result NaN.
    Max,
    /// Sum divided by the number of ranks; floating-point types only.
    Avg,
}

impl ReduceOp {
    /// Every operation, in wire-code order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    /// The name nccl-tests prints.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    pub(crate) fn code(self) -> u8 {
        ReduceOp::ALL
            .iter()
            .position(|&o| o == self)
            .expect("listed") as u8
    }

    pub(crate) fn from_code(code: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.get(code as usize).copied()
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "prod" => ReduceOp::Prod,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "avg" | "mean" => ReduceOp::Avg,
            _ => {
                return Err(format!(
                    "unknown reduction {s:?} (sum, prod, min, max, avg)"
                ))
            }
        })
    }
}

/// An element type collectives can move and reduce.
pub trait Element: Pod + Send + Sync + fmt::Debug + 'static {
    /// Its type code.
    const DTYPE: DType;
    /// `a + b` (wrapping for integers).
    fn add(a: Self, b: Self) -> Self;
    /// `a * b` (wrapping for integers).
    fn mul(a: Self, b: Self) -> Self;
    /// The smaller of `a` and `b`; NaN if either is.
    fn min(a: Self, b: Self) -> Self;
    /// The larger of `a` and `b`; NaN if either is.
    fn max(a: Self, b: Self) -> Self;
    /// `self / n`, for averages (floating-point types; integers are refused before reducing).
    fn div_count(self, n: usize) -> Self;
}

macro_rules! float_element {
    ($t:ty, $dtype:expr, $from_count:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dtype;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a + b
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                a * b
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                if b < a || b.is_nan() {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                if b > a || b.is_nan() {
                    b
                } else {
                    a
                }
            }
            fn div_count(self, n: usize) -> Self {
                self / $from_count(n)
            }
        }
    };
}

float_element!(f32, DType::F32, |n: usize| n as f32);
float_element!(f64, DType::F64, |n: usize| n as f64);
float_element!(f16, DType::F16, |n: usize| f16::from_f64(n as f64));
float_element!(bf16, DType::BF16, |n: usize| bf16::from_f64(n as f64));

macro_rules! int_element {
    ($t:ty, $dtype:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dtype;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                a.wrapping_mul(b)
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                Ord::min(a, b)
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                Ord::max(a, b)
            }
            fn div_count(self, _n: usize) -> Self {
                unreachable!("averages of integers are refused before reducing")
            }
        }
    };
}

int_element!(i32, DType::I32);
int_element!(i64, DType::I64);
int_element!(u8, DType::U8);

/// Which operand comes first when combining: the one of the lower rank, so that two ranks
/// combining each other's values compute the same expression (min(+0, -0) and min(-0, +0)
/// differ in their bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Order {
    /// `dst = op(dst, src)`.
    LocalFirst,
    /// `dst = op(src, dst)`.
    RemoteFirst,
}

/// `dst[i] = op(dst[i], src[i])` (or with the operands swapped), where `src` holds `dst.len()`
/// elements in wire order at any alignment. An average reduces as a sum (divided at the end).
pub(crate) fn reduce_bytes<T: Element>(op: ReduceOp, order: Order, dst: &mut [T], src: &[u8]) {
    // Half-precision values convert one at a time unless whole slices are converted (with
    // F16C where the CPU has it): the same bits, several times faster.
    match T::DTYPE {
        DType::F16 => return reduce_halves::<f16>(op, order, bytemuck::cast_slice_mut(dst), src),
        DType::BF16 => return reduce_halves::<bf16>(op, order, bytemuck::cast_slice_mut(dst), src),
        _ => {}
    }
    match (op, order) {
        (ReduceOp::Sum | ReduceOp::Avg, Order::LocalFirst) => zip_with(dst, src, T::add),
        (ReduceOp::Sum | ReduceOp::Avg, Order::RemoteFirst) => {
            zip_with(dst, src, |d, s| T::add(s, d))
        }
        (ReduceOp::Prod, Order::LocalFirst) => zip_with(dst, src, T::mul),
        (ReduceOp::Prod, Order::RemoteFirst) => zip_with(dst, src, |d, s| T::mul(s, d)),
        (ReduceOp::Min, Order::LocalFirst) => zip_with(dst, src, T::min),
        (ReduceOp::Min, Order::RemoteFirst) => zip_with(dst, src, |d, s| T::min(s, d)),
        (ReduceOp::Max, Order::LocalFirst) => zip_with(dst, src, T::max),
        (ReduceOp::Max, Order::RemoteFirst) => zip_with(dst, src, |d, s| T::max(s, d)),
    }
}

/// [`reduce_bytes`] for half-precision types: both operands widened to f32 a block at a
/// time, combined there and narrowed back, which is what one element's `a + b` does.
fn reduce_halves<H>(op: ReduceOp, order: Order, dst: &mut [H], src: &[u8])
where
    H: Pod,
    [H]: HalfFloatSliceExt,
{
    const BLOCK: usize = 1024;
    assert_eq!(
        src.len(),
        std::mem::size_of_val(dst),
        "a reduction's operands have the same length"
    );
    let f: fn(f32, f32) -> f32 = match op {
        ReduceOp::Sum | ReduceOp::Avg => <f32 as Element>::add,
        ReduceOp::Prod => <f32 as Element>::mul,
        ReduceOp::Min => <f32 as Element>::min,
        ReduceOp::Max => <f32 as Element>::max,
    };
    let mut stage = [H::zeroed(); BLOCK];
    let (mut local, mut remote) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (d, s) in dst
        .chunks_mut(BLOCK)
        .zip(src.chunks(BLOCK * std::mem::size_of::<H>()))
    {
        let k = d.len();
        bytemuck::cast_slice_mut::<H, u8>(&mut stage[..k]).copy_from_slice(s);
        d.convert_to_f32_slice(&mut local[..k]);
        stage[..k].convert_to_f32_slice(&mut remote[..k]);
        for (l, &r) in local[..k].iter_mut().zip(&remote[..k]) {
            *l = match order {
                Order::LocalFirst => f(*l, r),
                Order::RemoteFirst => f(r, *l),
            };
        }
        d.convert_from_f32_slice(&local[..k]);
    }
}

/// Copies `src` (wire order, any alignment) over `dst`.
pub(crate) fn copy_bytes<T: Element>(dst: &mut [T], src: &[u8]) {
    bytemuck::cast_slice_mut::<T, u8>(dst).copy_from_slice(src);
}

/// Divides every element by `n` (the end of an average).
pub(crate) fn divide<T: Element>(buf: &mut [T], n: usize) {
    for x in buf {
        *x = x.div_count(n);
    }
}

/// Elements staged per pass when the received bytes are not aligned for `T`.
const STAGE: usize = 2048;

fn zip_with<T: Element>(dst: &mut [T], src: &[u8], f: impl Fn(T, T) -> T) {
    assert_eq!(
        src.len(),
        std::mem::size_of_val(dst),
        "a reduction's operands have the same length"
    );
    match bytemuck::try_cast_slice::<u8, T>(src) {
        Ok(src) => {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = f(*d, s);
            }
        }
        Err(_) => {
            // Received bytes sit wherever the transport's frame put them: stage them in an
            // aligned buffer so the loop stays a plain (vectorizable) one.
            let mut stage = [T::zeroed(); STAGE];
            let width = std::mem::size_of::<T>();
            for (d, s) in dst.chunks_mut(STAGE).zip(src.chunks(STAGE * width)) {
                let stage = &mut stage[..d.len()];
                bytemuck::cast_slice_mut::<T, u8>(stage).copy_from_slice(s);
                for (d, &s) in d.iter_mut().zip(stage.iter()) {
                    *d = f(*d, s);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_at_offset<T: Element>(values: &[T], offset: usize) -> Vec<u8> {
        let mut v = vec![0u8; offset];
        v.extend_from_slice(bytemuck::cast_slice(values));
        v
    }

    #[test]
    fn aligned_and_unaligned_sources_reduce_alike() {
        let a: Vec<f32> = (0..5000).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..5000).map(|i| 3.0 - i as f32).collect();
        for offset in 0..4 {
            let raw = bytes_at_offset(&b, offset);
            let mut dst = a.clone();
            reduce_bytes(ReduceOp::Sum, Order::LocalFirst, &mut dst, &raw[offset..]);
            let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
            assert_eq!(dst, want, "offset {offset}");
        }
    }

    #[test]
    fn nan_wins_min_and_max_from_either_side() {
        for (a, b) in [(f32::NAN, 1.0), (1.0, f32::NAN)] {
            assert!(<f32 as Element>::min(a, b).is_nan());
            assert!(<f32 as Element>::max(a, b).is_nan());
        }
        assert_eq!(<f32 as Element>::min(2.0, -1.0), -1.0);
        assert_eq!(<f32 as Element>::max(2.0, -1.0), 2.0);
    }

    #[test]
    fn order_makes_both_sides_compute_the_same_bits() {
        let (lo, hi) = (0.0f32, -0.0f32);
        let mut at_lo = [lo];
        reduce_bytes(
            ReduceOp::Min,
            Order::LocalFirst,
            &mut at_lo,
            &hi.to_le_bytes(),
        );
        let mut at_hi = [hi];
        reduce_bytes(
            ReduceOp::Min,
            Order::RemoteFirst,
            &mut at_hi,
            &lo.to_le_bytes(),
        );
        assert_eq!(at_lo[0].to_bits(), at_hi[0].to_bits());
    }

    #[test]
    fn integers_wrap() {
        let mut d = [250u8, 3];
        reduce_bytes(ReduceOp::Sum, Order::LocalFirst, &mut d, &[10, 4]);
        assert_eq!(d, [4, 7]);
        let mut d = [i32::MAX];
        reduce_bytes(
            ReduceOp::Prod,
            Order::LocalFirst,
            &mut d,
            &2i32.to_le_bytes(),
        );
        assert_eq!(d, [i32::MAX.wrapping_mul(2)]);
    }

    #[test]
    fn half_types_reduce_and_average() {
        let mut d = [f16::from_f32(1.5), f16::from_f32(-2.0)];
        let s = [f16::from_f32(0.5), f16::from_f32(4.0)];
        reduce_bytes(
            ReduceOp::Sum,
            Order::LocalFirst,
            &mut d,
            bytemuck::cast_slice(&s),
        );
        divide(&mut d, 2);
        assert_eq!(d, [f16::from_f32(1.0), f16::from_f32(1.0)]);
        let mut d = [bf16::from_f32(3.0)];
        reduce_bytes(
            ReduceOp::Max,
            Order::LocalFirst,
            &mut d,
            bytemuck::cast_slice(&[bf16::from_f32(7.0)]),
        );
        assert_eq!(d, [bf16::from_f32(7.0)]);
    }

    #[test]
    fn half_slices_reduce_to_the_bits_of_one_element_at_a_time() {
        let mut rng = fastrand::Rng::with_seed(3);
        let a: Vec<f16> = (0..3000)
            .map(|_| f16::from_f32(rng.f32() * 200.0 - 100.0))
            .collect();
        let b: Vec<f16> = (0..3000)
            .map(|_| f16::from_f32(rng.f32() * 200.0 - 100.0))
            .collect();
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
            for order in [Order::LocalFirst, Order::RemoteFirst] {
                let mut fast = a.clone();
                reduce_bytes(op, order, &mut fast, bytemuck::cast_slice(&b));
                let mut slow = a.clone();
                // The generic path, element by element.
                match (op, order) {
                    (ReduceOp::Sum, Order::LocalFirst) => {
                        zip_with(&mut slow, bytemuck::cast_slice(&b), f16::add)
                    }
                    (ReduceOp::Sum, Order::RemoteFirst) => {
                        zip_with(&mut slow, bytemuck::cast_slice(&b), |d, s| f16::add(s, d))
                    }
                    (ReduceOp::Prod, Order::LocalFirst) => {
                        zip_with(&mut slow, bytemuck::cast_slice(&b), f16::mul)
                    }
                    (ReduceOp::Prod, Order::RemoteFirst) => {
                        zip_with(&mut slow, bytemuck::cast_slice(&b), |d, s| f16::mul(s, d))
                    }
                    (ReduceOp::Min, Order::LocalFirst) => {
                        zip_with(&mut slow, bytemuck::cast_slice(&b), <f16 as Element>::min)
                    }
                    (ReduceOp::Min, Order::RemoteFirst) => {
                        zip_with(&mut slow, bytemuck::cast_slice(&b), |d, s| {
                            <f16 as Element>::min(s, d)
                        })
                    }
                    (_, Order::LocalFirst) => {
                        zip_with(&mut slow, bytemuck::cast_slice(&b), <f16 as Element>::max)
                    }
                    (_, Order::RemoteFirst) => {
                        zip_with(&mut slow, bytemuck::cast_slice(&b), |d, s| {
                            <f16 as Element>::max(s, d)
                        })
                    }
                }
                let bits = |v: &[f16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&fast), bits(&slow), "{op} {order:?}");
            }
        }
    }

    #[test]
    fn names_and_codes_round_trip() {
        for t in DType::ALL {
            assert_eq!(DType::from_code(t.code()), Some(t));
            assert_eq!(t.name().parse::<DType>(), Ok(t));
        }
        for o in ReduceOp::ALL {
            assert_eq!(ReduceOp::from_code(o.code()), Some(o));
            assert_eq!(o.name().parse::<ReduceOp>(), Ok(o));
        }
        assert!("complex".parse::<DType>().is_err());
        assert_eq!(DType::from_code(200), None);
    }
}
