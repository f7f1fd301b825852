//! Scales chosen from the values being quantized, for codes whose magnitude is not the
//! job's threshold (psnet's compressed pulls and the second phase of its compressed
//! allreduce): sums of magnitudes that every rank or node computes to the same bits.

/// The sum of `|x|` over the elements of `xs` with `|x| >= from` (a NaN counts, so that it
/// shows in the sum), in `f64`, and how many there are. Element i goes to lane `i % 8` and
/// the lanes are added as `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`: independent
/// lanes vectorize (one running sum is bound by the latency of each addition), and the order
/// is fixed, so that a model elsewhere finds the same bits.
pub fn magnitudes_from(xs: &[f32], from: f32) -> (f64, u64) {
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    let mut lanes = Lanes::default();
    for c in chunks {
        lanes.add(std::array::from_fn(|lane| c[lane]), from);
    }
    lanes.finish(rest.iter().copied(), from)
}

/// [`magnitudes_from`] of the element-wise difference `a - b` (each an `f32` subtraction),
/// the same bits, without writing the difference anywhere.
pub fn magnitudes_of_difference(a: &[f32], b: &[f32], from: f32) -> (f64, u64) {
    match crate::SimdLevel::detect() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `detect` only returns levels this CPU supports.
        crate::SimdLevel::Avx2 => unsafe { x86::magnitudes_of_difference_avx2(a, b, from) },
        _ => magnitudes_of_difference_portable(a, b, from),
    }
}

/// [`magnitudes_of_difference`] in portable code, which the AVX2 kernel compiles for
/// 256-bit vectors: each lane's sum is the same sequence of additions either way.
#[inline(always)]
fn magnitudes_of_difference_portable(a: &[f32], b: &[f32], from: f32) -> (f64, u64) {
    assert_eq!(a.len(), b.len());
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let rest = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x - y);
    let mut lanes = Lanes::default();
    for (x, y) in ca.zip(cb) {
        lanes.add(std::array::from_fn(|lane| x[lane] - y[lane]), from);
    }
    lanes.finish(rest, from)
}

/// [`magnitudes_from`]'s eight running sums and counts.
#[derive(Default)]
pub(crate) struct Lanes {
    sums: [f64; 8],
    counts: [u64; 8],
}

impl Lanes {
    /// Takes the next eight elements, one a lane.
    #[inline(always)]
    pub(crate) fn add(&mut self, xs: [f32; 8], from: f32) {
        for (lane, x) in xs.iter().enumerate() {
            self.take(lane, *x, from);
        }
    }

    #[inline(always)]
    fn take(&mut self, lane: usize, x: f32, from: f32) {
        let a = x.abs();
        let taken = a >= from || a.is_nan();
        self.sums[lane] += if taken { f64::from(a) } else { 0.0 };
        self.counts[lane] += u64::from(taken);
    }

    /// Takes the last (fewer than eight) elements from lane 0 on; the sum in the fixed
    /// order, and the count.
    pub(crate) fn finish(mut self, rest: impl Iterator<Item = f32>, from: f32) -> (f64, u64) {
        for (lane, x) in rest.enumerate() {
            self.take(lane, x, from);
        }
        let s = &self.sums;
        let sum = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
        (sum, self.counts.iter().sum())
    }
}

/// The mean `|x|` of the elements of `xs` with `|x| >= from`, as `f32` (0 where there are
/// none): [`magnitudes_from`]'s sum over its count.
pub fn mean_magnitude_from(xs: &[f32], from: f32) -> f32 {
    match magnitudes_from(xs, from) {
        (_, 0) => 0.0,
        (sum, count) => (sum / count as f64) as f32,
    }
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_difference_has_the_magnitudes_of_the_difference_written_out() {
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let mut b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.11).cos()).collect();
        b[5] = f32::NAN;
        b[9] = -0.0;
        let change: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
        for from in [0.0, 0.5, 2.0] {
            let want = magnitudes_from(&change, from);
            let mut got = vec![magnitudes_of_difference_portable(&a, &b, from)];
            #[cfg(target_arch = "x86_64")]
            if crate::SimdLevel::Avx2.is_supported() {
                // SAFETY: the CPU supports AVX2 (checked just above).
                got.push(unsafe { x86::magnitudes_of_difference_avx2(&a, &b, from) });
            }
            for g in got {
                assert_eq!((g.0.to_bits(), g.1), (want.0.to_bits(), want.1), "{from}");
            }
        }
    }

    #[test]
    fn lanes_add_in_a_fixed_order_and_count_what_they_take() {
        let xs: Vec<f32> = (0..21).map(|i| (i as f32 - 10.0) * 0.1).collect();
        let (sum, count) = magnitudes_from(&xs, 0.5);
        let want: Vec<f32> = xs.iter().map(|x| x.abs()).filter(|&a| a >= 0.5).collect();
        assert_eq!(count, want.len() as u64);
        assert!((sum - want.iter().map(|&a| f64::from(a)).sum::<f64>()).abs() < 1e-12);
        let mut lanes = [0.0f64; 8];
        for (i, x) in xs.iter().enumerate() {
            if x.abs() >= 0.5 {
                lanes[i % 8] += f64::from(x.abs());
            }
        }
        let l = &lanes;
        assert_eq!(
            sum.to_bits(),
            (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))).to_bits()
        );
        assert_eq!(mean_magnitude_from(&xs, 5.0), 0.0);
        assert!(mean_magnitude_from(&[f32::NAN, 1.0], 0.0).is_nan());
    }
}
