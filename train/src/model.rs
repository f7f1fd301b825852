//! A multi-layer perceptron: ReLU hidden layers, a softmax output, cross-entropy loss. With
//! no hidden layer it is softmax regression.
//!
//! The parameters are a list of tensors, two per layer (weights, `inputs x outputs`
//! row-major, then biases), each one kv key: tensor `i` is key `i`.

use crate::data::{Dataset, Rng};

/// Model parameters, or gradients of the same shapes.
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    /// Layer widths, input first, classes last.
    pub widths: Vec<usize>,
    /// Per layer: weights then biases.
    pub tensors: Vec<Vec<f32>>,
}

impl Params {
    /// All zeros for layers of `widths` (`[features, hidden..., classes]`).
    pub fn zeros(widths: &[usize]) -> Self {
        let tensors = widths
            .windows(2)
            .flat_map(|w| [vec![0.0; w[0] * w[1]], vec![0.0; w[1]]])
            .collect();
        Params {
            widths: widths.to_vec(),
            tensors,
        }
    }

    /// Weights drawn uniformly in Glorot's range from `seed` (the same in every process),
    /// biases zero. Softmax regression (no hidden layer) starts at zero, as it always did.
    pub fn init(widths: &[usize], seed: u64) -> Self {
        let mut p = Params::zeros(widths);
        if widths.len() > 2 {
            let mut rng = Rng::new(seed ^ 0x5EED_1417);
            for (l, w) in widths.windows(2).enumerate() {
                let limit = (6.0 / (w[0] + w[1]) as f32).sqrt();
                for v in &mut p.tensors[2 * l] {
                    *v = rng.uniform() * limit;
                }
            }
        }
        p
    }

    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.widths.len() - 1
    }

    /// Parameters in all.
    pub fn len(&self) -> usize {
        self.tensors.iter().map(Vec::len).sum()
    }

    /// Every layer's output for `x` (the last one the class probabilities).
    fn forward(&self, x: &[f32], acts: &mut Vec<Vec<f32>>) {
        acts.resize(self.layers(), Vec::new());
        for l in 0..self.layers() {
            let (w, b) = (&self.tensors[2 * l], &self.tensors[2 * l + 1]);
            let out_n = self.widths[l + 1];
            let (done, rest) = acts.split_at_mut(l);
            let input: &[f32] = if l == 0 { x } else { &done[l - 1] };
            let out = &mut rest[0];
            out.clear();
            out.extend_from_slice(b);
            for (d, &v) in input.iter().enumerate() {
                if v != 0.0 {
                    for (o, wk) in out.iter_mut().zip(&w[d * out_n..(d + 1) * out_n]) {
                        *o += v * wk;
                    }
                }
            }
            if l + 1 < self.layers() {
                out.iter_mut().for_each(|o| *o = o.max(0.0));
            } else {
                softmax(out);
            }
        }
    }

    /// Gradients summed over `samples` of `data` (the optimizer's `rescale_grad` turns sums
    /// into means).
    pub fn gradients(&self, data: &Dataset, samples: std::ops::Range<usize>) -> Params {
        let f = data.features;
        let mut g = Params::zeros(&self.widths);
        let mut acts = Vec::new();
        let mut delta: Vec<f32> = Vec::new();
        let mut below: Vec<f32> = Vec::new();
        for i in samples {
            let x = &data.x[i * f..(i + 1) * f];
            self.forward(x, &mut acts);
            delta.clear();
            delta.extend_from_slice(&acts[self.layers() - 1]);
            delta[data.y[i]] -= 1.0;
            for l in (0..self.layers()).rev() {
                let input: &[f32] = if l == 0 { x } else { &acts[l - 1] };
                let out_n = self.widths[l + 1];
                let (gw, gb) = g.tensors.split_at_mut(2 * l + 1);
                for (d, &v) in input.iter().enumerate() {
                    if v != 0.0 {
                        for (gk, dk) in gw[2 * l][d * out_n..(d + 1) * out_n].iter_mut().zip(&delta)
                        {
                            *gk += v * dk;
                        }
                    }
                }
                for (gk, dk) in gb[0].iter_mut().zip(&delta) {
                    *gk += dk;
                }
                if l > 0 {
                    // Back through the weights, then through the ReLU of the layer below.
                    let w = &self.tensors[2 * l];
                    below.clear();
                    below.extend(input.iter().enumerate().map(|(d, &a)| {
                        if a > 0.0 {
                            w[d * out_n..(d + 1) * out_n]
                                .iter()
                                .zip(&delta)
                                .map(|(wk, dk)| wk * dk)
                                .sum()
                        } else {
                            0.0
                        }
                    }));
                    std::mem::swap(&mut delta, &mut below);
                }
            }
        }
        g
    }

    /// Mean cross-entropy and accuracy over `samples`.
    pub fn evaluate(&self, data: &Dataset, samples: std::ops::Range<usize>) -> (f32, f32) {
        let f = data.features;
        let mut acts = Vec::new();
        let (mut loss, mut right) = (0.0f64, 0usize);
        let n = samples.len().max(1);
        for i in samples {
            self.forward(&data.x[i * f..(i + 1) * f], &mut acts);
            let p = &acts[self.layers() - 1];
            loss -= f64::from(p[data.y[i]].max(1e-12).ln());
            let guess = (0..p.len()).fold(0, |best, k| if p[k] > p[best] { k } else { best });
            right += usize::from(guess == data.y[i]);
        }
        ((loss / n as f64) as f32, right as f32 / n as f32)
    }
}

fn softmax(out: &mut [f32]) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn check_gradient(widths: &[usize], seed: u64) {
        let data = Dataset::generate(6, widths[0], *widths.last().unwrap(), seed);
        let mut params = Params::init(widths, seed);
        if widths.len() == 2 {
            params.tensors[0][1] = 0.3;
        }
        let g = params.gradients(&data, 0..6);
        let eps = 1e-2;
        let loss = |p: &Params| p.evaluate(&data, 0..6).0 * 6.0;
        for t in 0..params.tensors.len() {
            for i in (0..params.tensors[t].len()).step_by(3) {
                let (mut plus, mut minus) = (params.clone(), params.clone());
                plus.tensors[t][i] += eps;
                minus.tensors[t][i] -= eps;
                let numeric = (loss(&plus) - loss(&minus)) / (2.0 * eps);
                assert!(
                    (numeric - g.tensors[t][i]).abs() < 3e-2,
                    "{widths:?} tensor {t}[{i}]: {numeric} vs {}",
                    g.tensors[t][i]
                );
            }
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        check_gradient(&[3, 2], 1);
        check_gradient(&[4, 5, 3], 2);
        check_gradient(&[3, 4, 4, 2], 3);
    }

    #[test]
    fn shapes_and_initialisation() {
        let p = Params::init(&[8, 16, 4], 1);
        let lens: Vec<usize> = p.tensors.iter().map(Vec::len).collect();
        assert_eq!(lens, [128, 16, 64, 4]);
        assert_eq!(p.len(), 212);
        assert!(p.tensors[0].iter().any(|&v| v != 0.0), "weights are random");
        assert!(
            p.tensors[1].iter().all(|&v| v == 0.0),
            "biases start at zero"
        );
        assert_eq!(p, Params::init(&[8, 16, 4], 1), "the same in every process");
        assert!(Params::init(&[8, 4], 1)
            .tensors
            .iter()
            .flatten()
            .all(|&v| v == 0.0));
    }
}
