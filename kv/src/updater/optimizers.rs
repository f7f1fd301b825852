//! The optimizers themselves: SGD, Adam and MXNet's test optimizer, each an [`Updater`]
//! keeping its per-key state, with the arithmetic the [module](super) documents.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;

use psnet_transport::le::{LeReader, LeWriter};

use super::{state, AdamParams, SgdParams, TestParams, Updater, UpdaterError};

/// MXNet's `mshadow_op::clip`: `bound` above, `-bound` below, `x` otherwise (NaN stays NaN).
#[inline(always)]
fn clip(x: f32, bound: f32) -> f32 {
    if x > bound {
        bound
    } else if x < -bound {
        -bound
    } else {
        x
    }
}

fn check_len(key: u64, grad: &[f32], weight: &[f32]) -> Result<(), UpdaterError> {
    if grad.len() == weight.len() {
        Ok(())
    } else {
        Err(UpdaterError::LengthMismatch {
            key,
            grad_len: grad.len(),
            weight_len: weight.len(),
        })
    }
}

/// A lazy update's ranges: in increasing order, not overlapping, within the weight, and as
/// many elements as the gradient holds.
fn check_ranges(
    key: u64,
    ranges: &[Range<usize>],
    grad: &[f32],
    weight: &[f32],
) -> Result<(), UpdaterError> {
    let mut end = 0;
    let mut covered = 0usize;
    for r in ranges {
        if r.start < end || r.end < r.start || r.end > weight.len() {
            return Err(UpdaterError::Malformed(format!(
                "key {key}: the range {r:?} of a lazy update is out of order or past the \
                 weight's {} elements",
                weight.len()
            )));
        }
        end = r.end;
        covered += r.len();
    }
    if covered != grad.len() {
        return Err(UpdaterError::LengthMismatch {
            key,
            grad_len: grad.len(),
            weight_len: covered,
        });
    }
    Ok(())
}

/// Each of `ranges` with its gradients from `grad` (the ranges' gradients one after
/// another); checked by [`check_ranges`].
fn in_ranges<'a>(
    ranges: &'a [Range<usize>],
    grad: &'a [f32],
) -> impl Iterator<Item = (Range<usize>, &'a [f32])> + 'a {
    let mut at = 0;
    ranges.iter().map(move |r| {
        let g = &grad[at..at + r.len()];
        at += r.len();
        (r.clone(), g)
    })
}

fn check_state_len(key: u64, state_len: usize, weight_len: usize) -> Result<(), UpdaterError> {
    if state_len == weight_len {
        Ok(())
    } else {
        Err(UpdaterError::StateLengthMismatch {
            key,
            state_len,
            weight_len,
        })
    }
}

/// SGD with momentum, weight decay and clipping (`"sgd"`), MXNet 1.9.1's
/// `multi_sgd_mom_update` / `multi_sgd_update` arithmetic (see the [module](super) docs).
///
/// The per-key momentum exists only when `momentum > 0` (as in MXNet, whose `SGD` creates no
/// state for momentum 0).
pub struct Sgd {
    params: SgdParams,
    kernel: SgdKernel,
    moms: HashMap<u64, Vec<f32>>,
}

/// The `f32` constants of the SGD kernel.
#[derive(Debug, Clone, Copy)]
struct SgdKernel {
    lr: f32,
    lr_wd: f32,
    lr_rescale: f32,
    rescale: f32,
    /// 0 without momentum (MXNet's `multi_sgd_update` sets it so).
    momentum: f32,
    clip: Option<f32>,
    /// `1.f - lr * wd`: the weight's factor in MXNet's lazy `sgd_update` of a row_sparse
    /// gradient (`SGDDnsRspKernel`).
    keep: f32,
}

impl SgdKernel {
    /// The new momentum of one element (the kernel's `mom`); the weight becomes `w + mom`.
    #[inline(always)]
    fn mom(&self, w: f32, g: f32, mom: f32) -> f32 {
        let step = match self.clip {
            Some(c) => self.lr * clip(self.rescale * g, c),
            None => self.lr_rescale * g,
        };
        self.momentum * mom - self.lr_wd * w - step
    }

    /// MXNet's lazy `sgd_update` of one element without momentum (its row_sparse kernel,
    /// not `multi_sgd_update`'s): `(1 - lr * wd) * w - step`.
    #[inline(always)]
    fn lazy(&self, w: f32, g: f32) -> f32 {
        let step = match self.clip {
            Some(c) => self.lr * clip(self.rescale * g, c),
            None => self.lr_rescale * g,
        };
        self.keep * w - step
    }
}

impl Sgd {
    /// An SGD updater without any per-key state yet. See [`OptimizerSpec::validate`](super::OptimizerSpec::validate) for the
    /// accepted values (not checked here).
    pub fn new(params: SgdParams) -> Self {
        let lr = params.learning_rate as f32;
        let rescale = params.rescale_grad as f32;
        let kernel = SgdKernel {
            lr,
            lr_wd: lr * params.wd as f32,
            lr_rescale: lr * rescale,
            rescale,
            momentum: if params.momentum > 0.0 {
                params.momentum as f32
            } else {
                0.0
            },
            clip: params.clip_gradient.map(|c| c as f32),
            keep: 1.0 - lr * params.wd as f32,
        };
        Sgd {
            params,
            kernel,
            moms: HashMap::new(),
        }
    }

    /// The hyper-parameters.
    pub fn params(&self) -> &SgdParams {
        &self.params
    }
}

impl SgdKernel {
    /// Updates `weight` with `grad` (and the momentum `moms` when there is one), element by
    /// element; the three have one length.
    #[inline(always)]
    fn apply(&self, weight: &mut [f32], grad: &[f32], moms: Option<&mut [f32]>, lazy: bool) {
        match moms {
            Some(moms) => {
                for ((w, &g), m) in weight.iter_mut().zip(grad).zip(moms.iter_mut()) {
                    *m = self.mom(*w, g, *m);
                    *w += *m;
                }
            }
            None if lazy => {
                for (w, &g) in weight.iter_mut().zip(grad) {
                    *w = self.lazy(*w, g);
                }
            }
            None => {
                for (w, &g) in weight.iter_mut().zip(grad) {
                    let m = self.mom(*w, g, 0.0);
                    *w += m;
                }
            }
        }
    }
}

impl Sgd {
    /// Updates the elements of `ranges` (checked), with MXNet's dense kernels or (`lazy`) its
    /// row_sparse ones; they differ only without momentum.
    fn run(
        &mut self,
        key: u64,
        ranges: &[Range<usize>],
        grad: &[f32],
        weight: &mut [f32],
        lazy: bool,
    ) -> Result<(), UpdaterError> {
        check_ranges(key, ranges, grad, weight)?;
        self.fits(key, weight.len())?;
        let k = self.kernel;
        let mut moms = (self.params.momentum > 0.0).then(|| {
            self.moms
                .entry(key)
                .or_insert_with(|| vec![0.0; weight.len()])
        });
        for (r, g) in in_ranges(ranges, grad) {
            let m = moms.as_mut().map(|m| &mut m[r.clone()]);
            k.apply(&mut weight[r], g, m, lazy);
        }
        Ok(())
    }
}

impl Updater for Sgd {
    fn update(&mut self, key: u64, grad: &[f32], weight: &mut [f32]) -> Result<(), UpdaterError> {
        check_len(key, grad, weight)?;
        let all = 0..weight.len();
        self.run(key, std::slice::from_ref(&all), grad, weight, false)
    }

    fn update_ranges(
        &mut self,
        key: u64,
        ranges: &[Range<usize>],
        grad: &[f32],
        weight: &mut [f32],
    ) -> Result<(), UpdaterError> {
        self.run(key, ranges, grad, weight, true)
    }

    fn fits(&self, key: u64, len: usize) -> Result<(), UpdaterError> {
        match self.moms.get(&key) {
            Some(m) => check_state_len(key, m.len(), len),
            None => Ok(()),
        }
    }

    fn export_state(&self, out: &mut LeWriter) {
        state::export_sgd(&self.moms, out);
    }

    fn import_state(&mut self, input: &mut LeReader<'_>) -> Result<(), UpdaterError> {
        self.moms = state::import_sgd(input, self.params.momentum > 0.0)?;
        Ok(())
    }
}

impl fmt::Debug for Sgd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sgd")
            .field("params", &self.params)
            .field("keys_with_momentum", &self.moms.len())
            .finish()
    }
}

/// Adam's state for one key.
pub(super) struct AdamState {
    pub(super) mean: Vec<f32>,
    pub(super) var: Vec<f32>,
    /// Updates applied so far.
    pub(super) t: u64,
}

/// Adam (`"adam"`): MXNet 1.9.1's `adam_update` kernel with the Python optimizer's bias
/// correction (see the [module](super) docs). Mean, variance and step count are per key.
pub struct Adam {
    params: AdamParams,
    kernel: AdamKernel,
    states: HashMap<u64, AdamState>,
}

/// The `f32` constants of the Adam kernel (all but the per-step `lr_t`).
#[derive(Debug, Clone, Copy)]
struct AdamKernel {
    rescale: f32,
    wd: f32,
    beta1: f32,
    beta2: f32,
    /// `1.f - beta1`, as the kernel computes it.
    one_minus_beta1: f32,
    /// `1.f - beta2`.
    one_minus_beta2: f32,
    epsilon: f32,
    clip: Option<f32>,
}

impl Adam {
    /// An Adam updater without any per-key state yet. See [`OptimizerSpec::validate`](super::OptimizerSpec::validate) for the
    /// accepted values (not checked here).
    pub fn new(params: AdamParams) -> Self {
        let beta1 = params.beta1 as f32;
        let beta2 = params.beta2 as f32;
        let kernel = AdamKernel {
            rescale: params.rescale_grad as f32,
            wd: params.wd as f32,
            beta1,
            beta2,
            one_minus_beta1: 1.0 - beta1,
            one_minus_beta2: 1.0 - beta2,
            epsilon: params.epsilon as f32,
            clip: params.clip_gradient.map(|c| c as f32),
        };
        Adam {
            params,
            kernel,
            states: HashMap::new(),
        }
    }

    /// The hyper-parameters.
    pub fn params(&self) -> &AdamParams {
        &self.params
    }

    /// How many updates were applied to `key` (its `t`); 0 for a key never updated.
    pub fn step_count(&self, key: u64) -> u64 {
        self.states.get(&key).map_or(0, |s| s.t)
    }

    /// The bias-corrected learning rate of step `t`, as MXNet's Python computes it in `f64`:
    /// `lr * (sqrt(1 - beta2**t) / (1 - beta1**t))`, then rounded to `f32`.
    fn lr_t(&self, t: u64) -> f32 {
        let t = t as f64;
        let coef1 = 1.0 - self.params.beta1.powf(t);
        let coef2 = 1.0 - self.params.beta2.powf(t);
        (self.params.learning_rate * (coef2.sqrt() / coef1)) as f32
    }
}

impl AdamKernel {
    /// Updates `weight` with `grad` and the moments `mean` and `var` at the step's rate
    /// `lr_t`, element by element; the four have one length.
    #[inline(always)]
    fn apply(
        &self,
        lr_t: f32,
        weight: &mut [f32],
        grad: &[f32],
        mean: &mut [f32],
        var: &mut [f32],
    ) {
        let moments = mean.iter_mut().zip(var.iter_mut());
        for ((w, &g), (mean, var)) in weight.iter_mut().zip(grad).zip(moments) {
            let mut g = g * self.rescale + *w * self.wd;
            if let Some(c) = self.clip {
                g = clip(g, c);
            }
            *mean = self.beta1 * *mean + self.one_minus_beta1 * g;
            *var = self.beta2 * *var + self.one_minus_beta2 * g * g;
            *w -= lr_t * *mean / (var.sqrt() + self.epsilon);
        }
    }
}

impl Updater for Adam {
    fn update_ranges(
        &mut self,
        key: u64,
        ranges: &[Range<usize>],
        grad: &[f32],
        weight: &mut [f32],
    ) -> Result<(), UpdaterError> {
        check_ranges(key, ranges, grad, weight)?;
        self.fits(key, weight.len())?;
        let t = self.step_count(key) + 1;
        let lr_t = self.lr_t(t);
        let k = self.kernel;
        let state = self.states.entry(key).or_insert_with(|| AdamState {
            mean: vec![0.0; weight.len()],
            var: vec![0.0; weight.len()],
            t: 0,
        });
        state.t = t;
        for (r, g) in in_ranges(ranges, grad) {
            let (mean, var) = (&mut state.mean[r.clone()], &mut state.var[r.clone()]);
            k.apply(lr_t, &mut weight[r], g, mean, var);
        }
        Ok(())
    }

    fn fits(&self, key: u64, len: usize) -> Result<(), UpdaterError> {
        match self.states.get(&key) {
            Some(s) => check_state_len(key, s.mean.len(), len),
            None => Ok(()),
        }
    }

    fn export_state(&self, out: &mut LeWriter) {
        state::export_adam(&self.states, out);
    }

    fn import_state(&mut self, input: &mut LeReader<'_>) -> Result<(), UpdaterError> {
        self.states = state::import_adam(input)?;
        Ok(())
    }
}

impl fmt::Debug for Adam {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Adam")
            .field("params", &self.params)
            .field("keys", &self.states.len())
            .finish()
    }
}

/// MXNet's `test` optimizer (`"test"`): `w = w + g * rescale_grad`. No state.
#[derive(Debug, Clone)]
pub struct TestUpdater {
    params: TestParams,
    rescale: f32,
}

impl TestUpdater {
    /// A test updater. See [`OptimizerSpec::validate`](super::OptimizerSpec::validate) for the accepted values (not checked
    /// here).
    pub fn new(params: TestParams) -> Self {
        TestUpdater {
            params,
            rescale: params.rescale_grad as f32,
        }
    }

    /// The hyper-parameters.
    pub fn params(&self) -> &TestParams {
        &self.params
    }
}

impl Updater for TestUpdater {
    fn update_ranges(
        &mut self,
        key: u64,
        ranges: &[Range<usize>],
        grad: &[f32],
        weight: &mut [f32],
    ) -> Result<(), UpdaterError> {
        check_ranges(key, ranges, grad, weight)?;
        for (r, g) in in_ranges(ranges, grad) {
            for (w, &g) in weight[r].iter_mut().zip(g) {
                *w += g * self.rescale;
            }
        }
        Ok(())
    }

    fn fits(&self, _key: u64, _len: usize) -> Result<(), UpdaterError> {
        Ok(())
    }

    fn export_state(&self, out: &mut LeWriter) {
        state::export_none(out);
    }

    fn import_state(&mut self, input: &mut LeReader<'_>) -> Result<(), UpdaterError> {
        state::import_none(input)
    }
}
