//! A synthetic classification task, generated the same way in every process from a seed.

/// SplitMix64: a tiny deterministic generator (no dependency, same stream everywhere).
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Samples with `features` inputs and a label in `0..classes`.
pub struct Dataset {
    /// Inputs, row-major, `len * features`.
    pub x: Vec<f32>,
    /// Labels.
    pub y: Vec<usize>,
    /// Inputs per sample.
    pub features: usize,
}

impl Dataset {
    /// `samples` samples labelled by a hidden linear model (plus noise), from `seed`.
    pub fn generate(samples: usize, features: usize, classes: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let truth: Vec<f32> = (0..features * classes).map(|_| rng.uniform()).collect();
        let mut x = Vec::with_capacity(samples * features);
        let mut y = Vec::with_capacity(samples);
        for _ in 0..samples {
            let row: Vec<f32> = (0..features).map(|_| rng.uniform()).collect();
            let label = (0..classes)
                .map(|c| {
                    let score: f32 = (0..features).map(|d| row[d] * truth[d * classes + c]).sum();
                    score + 0.1 * rng.uniform()
                })
                .enumerate()
                .fold(
                    (0, f32::MIN),
                    |best, (c, s)| if s > best.1 { (c, s) } else { best },
                )
                .0;
            x.extend_from_slice(&row);
            y.push(label);
        }
        Dataset { x, y, features }
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.y.len()
    }

    /// Worker `rank` of `workers` gets a contiguous, equal share (the remainder is unused).
    pub fn shard(&self, rank: usize, workers: usize) -> std::ops::Range<usize> {
        let per = self.len() / workers;
        rank * per..(rank + 1) * per
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_data_and_labels_vary() {
        let a = Dataset::generate(100, 4, 3, 7);
        let b = Dataset::generate(100, 4, 3, 7);
        assert_eq!(a.x, b.x);
        assert_eq!(a.y, b.y);
        assert!(a.y.iter().any(|&l| l != a.y[0]), "all labels equal");
        assert!(a.x.iter().all(|v| (-1.0..1.0).contains(v)));
        assert_eq!(a.shard(1, 3), 33..66);
    }
}
