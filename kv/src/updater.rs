//! Server-side optimizers: what a server applies to a key's stored value when a round of
//! gradients (or one async push) arrives, with MXNet 1.9.1's arithmetic in `f32`.
//!
//! A worker describes the optimizer as an [`OptimizerSpec`], written the way MXNet users
//! write optimizer arguments (`{"type": "sgd", "learning_rate": 0.1, "momentum": 0.9}`); the
//! kv store sends [`OptimizerSpec::to_json`] to every server, which parses it
//! ([`OptimizerSpec::parse`]) and [`build`](OptimizerSpec::build)s an [`Updater`]. The updater
//! keeps each key's state (momentum, Adam moments and step count) inside.
//!
//! ```
//! use psnet_kv::updater::OptimizerSpec;
//!
//! let spec = OptimizerSpec::parse(r#"{"type": "sgd", "learning_rate": 0.5, "momentum": 0.5}"#)?;
//! let on_the_wire = spec.to_json();
//! let mut updater = OptimizerSpec::parse(&on_the_wire)?.build();
//!
//! let mut weight = [1.0f32, 2.0];
//! updater.update(7, &[1.0, -1.0], &mut weight)?; // mom = -0.5 * g
//! assert_eq!(weight, [0.5, 2.5]);
//! updater.update(7, &[1.0, -1.0], &mut weight)?; // mom = 0.5 * mom - 0.5 * g
//! assert_eq!(weight, [-0.25, 3.25]);
//! # Ok::<(), psnet_kv::updater::UpdaterError>(())
//! ```
//!
//! # Optimizers
//!
//! `lr`, `wd`, ... are the hyper-parameters rounded to `f32`; `clip(x)` clamps to
//! `[-clip_gradient, clip_gradient]` when `clip_gradient` is set and is `x` otherwise. Every
//! operation below is one `f32` operation, evaluated left to right exactly as written.
//!
//! * `"sgd"` ([`Sgd`], MXNet `multi_sgd_update` / `multi_sgd_mom_update`): per element,
//!   `mom = momentum * mom - (lr * wd) * w - step; w = w + mom`, with
//!   `step = lr * clip(rescale_grad * g)` when clipping and `(lr * rescale_grad) * g`
//!   otherwise. Without momentum (`momentum == 0`) there is no state and `mom` starts at 0 on
//!   every update: `w = w + ((0 - (lr * wd) * w) - step)`.
//! * `"adam"` ([`Adam`], MXNet `adam_update` plus the Python-side bias correction): with the
//!   key's step count `t` (1 on its first update), the bias-corrected rate
//!   `lr_t = lr * (sqrt(1 - beta2^t) / (1 - beta1^t))` is computed in `f64` from the `f64`
//!   hyper-parameters and rounded to `f32`; then per element
//!   `g = g * rescale_grad + w * wd; g = clip(g);
//!   mean = beta1 * mean + (1 - beta1) * g; var = beta2 * var + (1 - beta2) * g * g;
//!   w = w - lr_t * mean / (sqrt(var) + epsilon)`.
//! * Row-sparse gradients ([`Updater::update_ranges`], MXNet's `lazy_update=True`) update
//!   the elements they hold only, with the same per-element arithmetic, except SGD without
//!   momentum, where MXNet's row_sparse kernel computes `w = (1 - lr * wd) * w - step`.
//! * `"test"` ([`TestUpdater`], MXNet's `Test` optimizer, used by MXNet's own kvstore tests):
//!   `w = w + g * rescale_grad`.
//!
//! # Determinism
//!
//! The arithmetic is plain sequential `f32` code: no FMA (Rust never contracts), no
//! reassociation, no threads. The same spec applied to the same gradients in the same order
//! gives the same bits, whether in one process or on the servers of a distributed run (each
//! key's state depends only on that key's own updates). [`OptimizerSpec::to_json`] round-trips
//! every hyper-parameter exactly, so a server's updater is bit-identical to the worker's.
//!
//! # Fidelity to MXNet 1.9.1
//!
//! * MXNet 1.9.1's Python `SGD` runs dense updates through the aggregated kernels
//!   `multi_sgd_update` / `multi_sgd_mom_update` (even for one array), not `sgd_update`; this
//!   module uses their operation order. With momentum it is also `sgd_mom_update`'s. Without
//!   momentum it equals `sgd_update`'s `(1 - lr * wd) * w - lr * clip(rescale_grad * g)`
//!   mathematically, and to the last bit for finite weights when `lr * wd == 0`; with weight
//!   decay the two roundings can differ in the last bit.
//! * Adam's bias correction is done in `f64` like MXNet's Python (`beta^t` with `powf`, as
//!   CPython's `float ** int` calls `pow`); MXNet then passes hyper-parameters to its C++
//!   kernels as decimal text parsed to `float`, psnet rounds the `f64` directly. The two can
//!   differ in the last bit of a hyper-parameter for rare values.
//! * `clip_gradient`: MXNet's Python ignores `None`, `0` and negative values (no clipping).
//!   psnet accepts a missing or `null` value for "no clipping" and **rejects** `0` and negative
//!   values instead of silently ignoring them.
//! * MXNet does not check these values; psnet rejects values that cannot be meant (NaN,
//!   infinities, negative learning rates, betas outside `[0, 1)`, ...), see
//!   [`OptimizerSpec::validate`].
//! * Not supported: learning-rate schedulers, `lr_mult` / `wd_mult`, `multi_precision`
//!   (float16 weights), other optimizers. MXNet 2.x rewrote its optimizers; the formulas here
//!   are 1.9.1's.
//!
//! # Checkpoints
//!
//! A server's checkpoint keeps its updater's per-key state: [`Updater::export_state`] writes
//! it, [`Updater::import_state`] reads it into an updater built from the same spec, which then
//! goes on bit-identically. Little-endian, keys in ascending order, `f32` as their bits:
//!
//! * `"sgd"`: tag `1`, `u64` count, then per key `u64` key, `u64` length, the momentum
//!   (none without momentum);
//! * `"adam"`: tag `2`, `u64` count, then per key `u64` key, `u64` step count `t` (`>= 1`),
//!   `u64` length, the mean, the variance;
//! * `"test"`: tag `3`, `u64` count `0` (no state).

use std::ops::Range;

use psnet_transport::le::{LeReader, LeWriter};
use thiserror::Error;

mod optimizers;
mod spec;
mod state;

use optimizers::AdamState;
pub use optimizers::{Adam, Sgd, TestUpdater};
pub use spec::{AdamParams, OptimizerSpec, SgdParams, TestParams};

/// A server-side optimizer: applies a (summed) gradient to a key's stored value.
///
/// Implementations keep their per-key state (momentum, moments, step counts) inside and
/// create it, zeroed, on a key's first update.
pub trait Updater: Send {
    /// Updates `weight` in place with `grad` for `key`.
    ///
    /// `grad` and `weight` must have the same length, and the same length as on the key's
    /// earlier updates (its state was sized then). On error nothing is changed: neither
    /// `weight` nor the updater's state.
    ///
    /// Provided as the lazy update of one range over the whole weight, which is the same
    /// arithmetic wherever MXNet's dense and row_sparse kernels agree.
    fn update(&mut self, key: u64, grad: &[f32], weight: &mut [f32]) -> Result<(), UpdaterError> {
        if grad.len() != weight.len() {
            return Err(UpdaterError::LengthMismatch {
                key,
                grad_len: grad.len(),
                weight_len: weight.len(),
            });
        }
        let all = 0..weight.len();
        self.update_ranges(key, std::slice::from_ref(&all), grad, weight)
    }

    /// MXNet's lazy update of a row-sparse gradient (`lazy_update=True`, its default):
    /// updates only the elements of `weight` in `ranges` (in increasing order, not
    /// overlapping, within `weight`), whose gradients `grad` holds one range after another,
    /// with the arithmetic of MXNet's row_sparse kernels: per element that of
    /// [`update`](Self::update), but for SGD without momentum, whose lazy kernel is
    /// `w = (1 - lr * wd) * w - step` (`sgd_update`'s, not `multi_sgd_update`'s). Elements outside the
    /// ranges and their state stay as they are; the key's step count (Adam's `t`) counts it
    /// as one update, as MXNet's does. Errors as [`update`](Self::update)'s, and then
    /// nothing is changed.
    fn update_ranges(
        &mut self,
        key: u64,
        ranges: &[Range<usize>],
        grad: &[f32],
        weight: &mut [f32],
    ) -> Result<(), UpdaterError>;

    /// Whether an update of `key` holding `len` elements would be taken: the state kept for
    /// it has that length, or there is none. Checked before updating several keys at once,
    /// so that one refused changes none of them.
    fn fits(&self, key: u64, len: usize) -> Result<(), UpdaterError>;

    /// Appends the per-key state (momentum, moments, step counts) to `out`, in the format
    /// of the [module](self)'s "Checkpoints": deterministic, keys in ascending order.
    fn export_state(&self, out: &mut LeWriter);

    /// Replaces the per-key state with the one [`export_state`](Self::export_state) wrote for
    /// an updater of the same spec, read from the front of `input` (exactly its bytes).
    /// Malformed or foreign state is an error, never a panic, and then nothing is changed;
    /// no length read from `input` allocates more than `input` holds.
    fn import_state(&mut self, input: &mut LeReader<'_>) -> Result<(), UpdaterError>;
}

/// Errors of updaters and of optimizer specs.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum UpdaterError {
    /// The gradient and the weight have different lengths.
    #[error("key {key}: the gradient has {grad_len} elements but the weight has {weight_len}")]
    LengthMismatch {
        /// The key being updated.
        key: u64,
        /// Elements in the gradient.
        grad_len: usize,
        /// Elements in the weight.
        weight_len: usize,
    },
    /// The key's optimizer state was created for another length (a key's size cannot change).
    #[error(
        "key {key}: the weight has {weight_len} elements but the optimizer state kept for \
         this key has {state_len} (a key's size cannot change)"
    )]
    StateLengthMismatch {
        /// The key being updated.
        key: u64,
        /// Elements in the key's existing state.
        state_len: usize,
        /// Elements in the weight passed now.
        weight_len: usize,
    },
    /// The spec's `type` is not an optimizer psnet implements.
    #[error("unknown optimizer type {0:?}: expected \"sgd\", \"adam\" or \"test\"")]
    UnknownType(String),
    /// A hyper-parameter has a value that cannot be meant.
    #[error("invalid {optimizer} optimizer parameter {param} = {value}: {requirement}")]
    InvalidParam {
        /// The optimizer's type name (`"sgd"`, `"adam"`, `"test"`).
        optimizer: &'static str,
        /// The parameter's MXNet name.
        param: &'static str,
        /// The rejected value.
        value: f64,
        /// What the value must be.
        requirement: &'static str,
    },
    /// The spec text is not a valid spec: bad JSON, not an object, missing `type`, unknown
    /// parameter, a parameter that is not a number, ...
    #[error("invalid optimizer spec: {0}")]
    Malformed(String),
    /// Optimizer state given to [`Updater::import_state`] that is malformed or was written by
    /// another optimizer.
    #[error("invalid optimizer state: {0}")]
    BadState(String),
}
