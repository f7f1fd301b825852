//! Scales chosen from the values being quantized, for codes whose magnitude is not the
//! job's threshold (psnet's compressed pulls and the second phase of its compressed
//! allreduce): sums of magnitudes that every rank or node computes to the same bits.

/// The sum of `|x|` over the elements of `xs` with `|x| >= from` (a NaN counts, so that it
/// shows in the sum), in `f64`, and how many there are. Element i goes to lane `i % 8` and
/// the lanes are added as `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`: independent
/// lanes vectorize (one running sum is bound by the latency of each addition), and the order
/// is fixed, so that a model elsewhere finds the same bits.
pub fn magnitudes_from(xs: &[f32], from: f32) -> (f64, u64) {
    let mut sums = [0.0f64; 8];
    let mut counts = [0u64; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for lane in 0..8 {
            let a = c[lane].abs();
            let taken = a >= from || a.is_nan();
            sums[lane] += if taken { f64::from(a) } else { 0.0 };
            counts[lane] += u64::from(taken);
        }
    }
    for (lane, x) in rest.iter().enumerate() {
        let a = x.abs();
        let taken = a >= from || a.is_nan();
        sums[lane] += if taken { f64::from(a) } else { 0.0 };
        counts[lane] += u64::from(taken);
    }
    let s = &sums;
    let sum = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    (sum, counts.iter().sum())
}

/// The mean `|x|` of the elements of `xs` with `|x| >= from`, as `f32` (0 where there are
/// none): [`magnitudes_from`]'s sum over its count.
pub fn mean_magnitude_from(xs: &[f32], from: f32) -> f32 {
    match magnitudes_from(xs, from) {
        (_, 0) => 0.0,
        (sum, count) => (sum / count as f64) as f32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
