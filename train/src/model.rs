//! Softmax regression: `p = softmax(x W + b)`, cross-entropy loss.

use crate::data::Dataset;

/// Model parameters: `w` is `features x classes`, row-major; `b` has `classes` entries.
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    /// Weights.
    pub w: Vec<f32>,
    /// Biases.
    pub b: Vec<f32>,
}

/// Gradients summed over a batch (the optimizer's `rescale_grad` turns sums into means).
pub struct Grads {
    /// d loss / d w.
    pub w: Vec<f32>,
    /// d loss / d b.
    pub b: Vec<f32>,
}

impl Params {
    /// All zeros.
    pub fn zeros(features: usize, classes: usize) -> Self {
        Params {
            w: vec![0.0; features * classes],
            b: vec![0.0; classes],
        }
    }

    fn classes(&self) -> usize {
        self.b.len()
    }

    fn probabilities(&self, x: &[f32], out: &mut [f32]) {
        let c = self.classes();
        for (k, o) in out.iter_mut().enumerate() {
            *o = self.b[k]
                + x.iter()
                    .enumerate()
                    .map(|(d, v)| v * self.w[d * c + k])
                    .sum::<f32>();
        }
        let max = out.iter().copied().fold(f32::MIN, f32::max);
        let mut total = 0.0;
        for o in out.iter_mut() {
            *o = (*o - max).exp();
            total += *o;
        }
        for o in out.iter_mut() {
            *o /= total;
        }
    }

    /// Summed gradients over `samples` of `data`.
    pub fn gradients(&self, data: &Dataset, samples: std::ops::Range<usize>) -> Grads {
        let (c, f) = (self.classes(), data.features);
        let mut g = Grads {
            w: vec![0.0; self.w.len()],
            b: vec![0.0; c],
        };
        let mut p = vec![0.0; c];
        for i in samples {
            let x = &data.x[i * f..(i + 1) * f];
            self.probabilities(x, &mut p);
            p[data.y[i]] -= 1.0;
            for (d, v) in x.iter().enumerate() {
                for (gw, pk) in g.w[d * c..(d + 1) * c].iter_mut().zip(&p) {
                    *gw += v * pk;
                }
            }
            for (gb, pk) in g.b.iter_mut().zip(&p) {
                *gb += pk;
            }
        }
        g
    }

    /// Mean cross-entropy and accuracy over `samples`.
    pub fn evaluate(&self, data: &Dataset, samples: std::ops::Range<usize>) -> (f32, f32) {
        let (c, f) = (self.classes(), data.features);
        let mut p = vec![0.0; c];
        let (mut loss, mut right) = (0.0f64, 0usize);
        let n = samples.len().max(1);
        for i in samples {
            self.probabilities(&data.x[i * f..(i + 1) * f], &mut p);
            loss -= f64::from(p[data.y[i]].max(1e-12).ln());
            let guess = (0..c).fold(0, |best, k| if p[k] > p[best] { k } else { best });
            right += usize::from(guess == data.y[i]);
        }
        ((loss / n as f64) as f32, right as f32 / n as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gradient_matches_finite_differences() {
        let data = Dataset::generate(8, 3, 2, 1);
        let mut params = Params::zeros(3, 2);
        params.w[1] = 0.3;
        let g = params.gradients(&data, 0..8);
        let eps = 1e-2;
        let loss = |p: &Params| p.evaluate(&data, 0..8).0 * 8.0;
        for i in 0..params.w.len() {
            let (mut plus, mut minus) = (params.clone(), params.clone());
            plus.w[i] += eps;
            minus.w[i] -= eps;
            let numeric = (loss(&plus) - loss(&minus)) / (2.0 * eps);
            assert!(
                (numeric - g.w[i]).abs() < 2e-2,
                "w[{i}]: {numeric} vs {}",
                g.w[i]
            );
        }
    }
}
