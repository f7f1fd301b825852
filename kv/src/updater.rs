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

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use psnet_transport::le::{LeReader, LeWriter};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use thiserror::Error;

mod state;

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
    fn update(&mut self, key: u64, grad: &[f32], weight: &mut [f32]) -> Result<(), UpdaterError>;

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

/// Hyper-parameters of [`Sgd`], with MXNet's names and defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdParams {
    /// Default 0.01. Finite, `>= 0`.
    pub learning_rate: f64,
    /// Default 0 (no momentum, no state). In `[0, 1)`.
    pub momentum: f64,
    /// Weight decay. Default 0. Finite, `>= 0`.
    pub wd: f64,
    /// Factor applied to the gradient before anything else. Default 1. Finite, `> 0`.
    pub rescale_grad: f64,
    /// Clip the rescaled gradient to `[-c, c]`. Default `None` (no clipping). Finite, `> 0`.
    pub clip_gradient: Option<f64>,
}

impl Default for SgdParams {
    fn default() -> Self {
        SgdParams {
            learning_rate: 0.01,
            momentum: 0.0,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: None,
        }
    }
}

/// Hyper-parameters of [`Adam`], with MXNet's names and defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamParams {
    /// Default 0.001. Finite, `>= 0`.
    pub learning_rate: f64,
    /// Decay of the first moment. Default 0.9. In `[0, 1)`.
    pub beta1: f64,
    /// Decay of the second moment. Default 0.999. In `[0, 1)`.
    pub beta2: f64,
    /// Added to `sqrt(var)`. Default 1e-8. Finite, `> 0`.
    pub epsilon: f64,
    /// Weight decay (added to the gradient). Default 0. Finite, `>= 0`.
    pub wd: f64,
    /// Factor applied to the gradient. Default 1. Finite, `> 0`.
    pub rescale_grad: f64,
    /// Clip `rescale_grad * g + wd * w` to `[-c, c]`. Default `None`. Finite, `> 0`.
    pub clip_gradient: Option<f64>,
}

impl Default for AdamParams {
    fn default() -> Self {
        AdamParams {
            learning_rate: 0.001,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: None,
        }
    }
}

/// Hyper-parameters of [`TestUpdater`] (MXNet's `test` optimizer).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TestParams {
    /// Factor applied to the gradient. Default 1. Finite, `> 0`.
    pub rescale_grad: f64,
}

impl Default for TestParams {
    fn default() -> Self {
        TestParams { rescale_grad: 1.0 }
    }
}

/// An optimizer and its hyper-parameters, as sent from a worker to the servers.
///
/// The text form is a JSON object tagged by `"type"` with MXNet's parameter names:
/// `{"type": "sgd", "learning_rate": 0.1, "momentum": 0.9}`, `{"type": "adam"}`,
/// `{"type": "test", "rescale_grad": 2}`. Missing parameters take MXNet's defaults, unknown
/// ones are refused, `type` is matched case-insensitively (as MXNet's `create_optimizer`),
/// numbers may also be numeric strings (`"0.1"`), `clip_gradient` may be `null`, and Python's
/// single-quoted dict syntax is accepted. Serde (de)serializes the same form; deserializing
/// validates like [`parse`](Self::parse).
///
/// Parameters are `f64`, like the Python floats MXNet users give; the kernels use them rounded
/// to `f32` (Adam's bias correction uses the `f64` values, as MXNet's Python does).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "Value", into = "Value")]
pub enum OptimizerSpec {
    /// `"sgd"`: SGD with optional momentum, weight decay and clipping.
    Sgd(SgdParams),
    /// `"adam"`: Adam with MXNet's bias correction.
    Adam(AdamParams),
    /// `"test"`: MXNet's test optimizer, `w += rescale_grad * g`.
    Test(TestParams),
}

impl Default for OptimizerSpec {
    /// SGD with MXNet's defaults.
    fn default() -> Self {
        OptimizerSpec::Sgd(SgdParams::default())
    }
}

const SGD_FIELDS: &[&str] = &[
    "learning_rate",
    "momentum",
    "wd",
    "rescale_grad",
    "clip_gradient",
];
const ADAM_FIELDS: &[&str] = &[
    "learning_rate",
    "beta1",
    "beta2",
    "epsilon",
    "wd",
    "rescale_grad",
    "clip_gradient",
];
const TEST_FIELDS: &[&str] = &["rescale_grad"];

impl OptimizerSpec {
    /// Parses and validates a spec: a JSON object (or a Python dict literal with single
    /// quotes) such as `{"type": "sgd", "learning_rate": 0.1, "momentum": 0.9}`.
    pub fn parse(text: &str) -> Result<Self, UpdaterError> {
        let value = match serde_json::from_str::<Value>(text) {
            Ok(value) => value,
            Err(first) if text.contains('\'') && !text.contains('"') => {
                serde_json::from_str::<Value>(&text.replace('\'', "\""))
                    .map_err(|_| UpdaterError::Malformed(format!("{first} in {text:?}")))?
            }
            Err(e) => return Err(UpdaterError::Malformed(format!("{e} in {text:?}"))),
        };
        Self::from_json(&value)
    }

    /// Reads and validates a spec from a parsed JSON object.
    pub fn from_json(value: &Value) -> Result<Self, UpdaterError> {
        let Value::Object(map) = value else {
            return Err(UpdaterError::Malformed(format!(
                "expected an object like {{\"type\": \"sgd\", \"learning_rate\": 0.1}}, \
                 got {value}"
            )));
        };
        let kind = match map.get("type") {
            Some(Value::String(kind)) => kind,
            Some(other) => {
                return Err(UpdaterError::Malformed(format!(
                    "\"type\" must be a string, got {other}"
                )))
            }
            None => {
                return Err(UpdaterError::Malformed(
                    "missing \"type\" (\"sgd\", \"adam\" or \"test\")".into(),
                ))
            }
        };
        let spec = match kind.to_ascii_lowercase().as_str() {
            "sgd" => {
                let mut p = SgdParams::default();
                for (name, value) in fields(map, "sgd", SGD_FIELDS)? {
                    match name {
                        "learning_rate" => p.learning_rate = number("sgd", name, value)?,
                        "momentum" => p.momentum = number("sgd", name, value)?,
                        "wd" => p.wd = number("sgd", name, value)?,
                        "rescale_grad" => p.rescale_grad = number("sgd", name, value)?,
                        _ => p.clip_gradient = optional_number("sgd", name, value)?,
                    }
                }
                OptimizerSpec::Sgd(p)
            }
            "adam" => {
                let mut p = AdamParams::default();
                for (name, value) in fields(map, "adam", ADAM_FIELDS)? {
                    match name {
                        "learning_rate" => p.learning_rate = number("adam", name, value)?,
                        "beta1" => p.beta1 = number("adam", name, value)?,
                        "beta2" => p.beta2 = number("adam", name, value)?,
                        "epsilon" => p.epsilon = number("adam", name, value)?,
                        "wd" => p.wd = number("adam", name, value)?,
                        "rescale_grad" => p.rescale_grad = number("adam", name, value)?,
                        _ => p.clip_gradient = optional_number("adam", name, value)?,
                    }
                }
                OptimizerSpec::Adam(p)
            }
            "test" => {
                let mut p = TestParams::default();
                for (name, value) in fields(map, "test", TEST_FIELDS)? {
                    p.rescale_grad = number("test", name, value)?;
                }
                OptimizerSpec::Test(p)
            }
            _ => return Err(UpdaterError::UnknownType(kind.clone())),
        };
        spec.validate()?;
        Ok(spec)
    }

    /// The JSON text sent to the servers, e.g.
    /// `{"learning_rate":0.1,"momentum":0.9,"rescale_grad":1.0,"type":"sgd","wd":0.0}`.
    ///
    /// Every parameter is written out (defaults included) and [`parse`](Self::parse) reads
    /// back exactly the same `f64` bits. (serde_json, without its `float_roundtrip` feature,
    /// can misread some 16–17 digit numbers by one ulp; such a value is written as a decimal
    /// string, which is read with Rust's correctly rounded parser.)
    pub fn to_json(&self) -> String {
        Value::from(*self).to_string()
    }

    /// The MXNet type name: `"sgd"`, `"adam"` or `"test"`.
    pub fn type_name(&self) -> &'static str {
        match self {
            OptimizerSpec::Sgd(_) => "sgd",
            OptimizerSpec::Adam(_) => "adam",
            OptimizerSpec::Test(_) => "test",
        }
    }

    /// Checks every hyper-parameter (done by [`parse`](Self::parse); call it for specs built
    /// by hand):
    ///
    /// * `learning_rate`, `wd`: finite and `>= 0`;
    /// * `rescale_grad`, `epsilon`: finite and `> 0`;
    /// * `momentum`, `beta1`, `beta2`: in `[0, 1)`;
    /// * `clip_gradient`: absent, or finite and `> 0`.
    pub fn validate(&self) -> Result<(), UpdaterError> {
        let opt = self.type_name();
        match *self {
            OptimizerSpec::Sgd(p) => {
                non_negative(opt, "learning_rate", p.learning_rate)?;
                unit_interval(opt, "momentum", p.momentum)?;
                non_negative(opt, "wd", p.wd)?;
                positive(opt, "rescale_grad", p.rescale_grad)?;
                clip_bound(opt, p.clip_gradient)
            }
            OptimizerSpec::Adam(p) => {
                non_negative(opt, "learning_rate", p.learning_rate)?;
                unit_interval(opt, "beta1", p.beta1)?;
                unit_interval(opt, "beta2", p.beta2)?;
                positive(opt, "epsilon", p.epsilon)?;
                non_negative(opt, "wd", p.wd)?;
                positive(opt, "rescale_grad", p.rescale_grad)?;
                clip_bound(opt, p.clip_gradient)
            }
            OptimizerSpec::Test(p) => positive(opt, "rescale_grad", p.rescale_grad),
        }
    }

    /// A fresh updater (no per-key state yet) for this spec.
    ///
    /// Does not validate: a spec built by hand with, say, a NaN learning rate gives an updater
    /// that writes NaNs. Specs from [`parse`](Self::parse) or serde are valid.
    pub fn build(&self) -> Box<dyn Updater> {
        match *self {
            OptimizerSpec::Sgd(p) => Box::new(Sgd::new(p)),
            OptimizerSpec::Adam(p) => Box::new(Adam::new(p)),
            OptimizerSpec::Test(p) => Box::new(TestUpdater::new(p)),
        }
    }
}

impl FromStr for OptimizerSpec {
    type Err = UpdaterError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<Value> for OptimizerSpec {
    type Error = UpdaterError;

    fn try_from(value: Value) -> Result<Self, Self::Error> {
        Self::from_json(&value)
    }
}

impl From<OptimizerSpec> for Value {
    fn from(spec: OptimizerSpec) -> Value {
        let mut map = Map::new();
        map.insert("type".into(), Value::String(spec.type_name().into()));
        let mut put = |name: &str, x: f64| {
            map.insert(name.into(), exact_number(x));
        };
        match spec {
            OptimizerSpec::Sgd(p) => {
                put("learning_rate", p.learning_rate);
                put("momentum", p.momentum);
                put("wd", p.wd);
                put("rescale_grad", p.rescale_grad);
                if let Some(c) = p.clip_gradient {
                    put("clip_gradient", c);
                }
            }
            OptimizerSpec::Adam(p) => {
                put("learning_rate", p.learning_rate);
                put("beta1", p.beta1);
                put("beta2", p.beta2);
                put("epsilon", p.epsilon);
                put("wd", p.wd);
                put("rescale_grad", p.rescale_grad);
                if let Some(c) = p.clip_gradient {
                    put("clip_gradient", c);
                }
            }
            OptimizerSpec::Test(p) => put("rescale_grad", p.rescale_grad),
        }
        Value::Object(map)
    }
}

/// The JSON form, as [`OptimizerSpec::to_json`].
impl fmt::Display for OptimizerSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_json())
    }
}

/// The spec's parameters other than `type`, each checked against the optimizer's names.
fn fields<'a>(
    map: &'a Map<String, Value>,
    optimizer: &str,
    known: &[&'static str],
) -> Result<Vec<(&'static str, &'a Value)>, UpdaterError> {
    let mut out = Vec::with_capacity(map.len());
    for (name, value) in map {
        if name == "type" {
            continue;
        }
        match known.iter().find(|k| **k == name) {
            Some(k) => out.push((*k, value)),
            None => {
                return Err(UpdaterError::Malformed(format!(
                    "unknown {optimizer} optimizer parameter {name:?}: expected {}",
                    known
                        .iter()
                        .map(|k| format!("{k:?}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )))
            }
        }
    }
    Ok(out)
}

/// A number, or a string holding one (read with Rust's correctly rounded parser).
fn number(optimizer: &str, name: &str, value: &Value) -> Result<f64, UpdaterError> {
    let parsed = match value {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok(),
        _ => None,
    };
    parsed.ok_or_else(|| {
        UpdaterError::Malformed(format!(
            "{optimizer} optimizer parameter {name:?} must be a number, got {value}"
        ))
    })
}

/// Like [`number`], with `null` for "not set".
fn optional_number(
    optimizer: &str,
    name: &str,
    value: &Value,
) -> Result<Option<f64>, UpdaterError> {
    match value {
        Value::Null => Ok(None),
        other => number(optimizer, name, other).map(Some),
    }
}

/// A JSON value that serde_json reads back as exactly `x`: a number when its shortest
/// representation survives serde_json's (not always correctly rounded) float parser, else
/// that representation in a string.
fn exact_number(x: f64) -> Value {
    if let Some(n) = serde_json::Number::from_f64(x) {
        let exact = serde_json::from_str::<f64>(&n.to_string())
            .is_ok_and(|back| back.to_bits() == x.to_bits());
        if exact {
            return Value::Number(n);
        }
    }
    Value::String(format!("{x:?}"))
}

fn invalid(
    optimizer: &'static str,
    param: &'static str,
    value: f64,
    requirement: &'static str,
) -> UpdaterError {
    UpdaterError::InvalidParam {
        optimizer,
        param,
        value,
        requirement,
    }
}

fn non_negative(opt: &'static str, param: &'static str, x: f64) -> Result<(), UpdaterError> {
    if x.is_finite() && x >= 0.0 {
        Ok(())
    } else {
        Err(invalid(opt, param, x, "it must be finite and >= 0"))
    }
}

fn positive(opt: &'static str, param: &'static str, x: f64) -> Result<(), UpdaterError> {
    if x.is_finite() && x > 0.0 {
        Ok(())
    } else {
        Err(invalid(opt, param, x, "it must be finite and > 0"))
    }
}

fn unit_interval(opt: &'static str, param: &'static str, x: f64) -> Result<(), UpdaterError> {
    if (0.0..1.0).contains(&x) {
        Ok(())
    } else {
        Err(invalid(opt, param, x, "it must be in [0, 1)"))
    }
}

fn clip_bound(opt: &'static str, clip: Option<f64>) -> Result<(), UpdaterError> {
    match clip {
        Some(c) if !(c.is_finite() && c > 0.0) => Err(invalid(
            opt,
            "clip_gradient",
            c,
            "it must be finite and > 0; omit it or use null for no clipping (MXNet silently \
             ignores values <= 0)",
        )),
        _ => Ok(()),
    }
}

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
/// `multi_sgd_mom_update` / `multi_sgd_update` arithmetic (see the [module](self) docs).
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
}

impl Sgd {
    /// An SGD updater without any per-key state yet. See [`OptimizerSpec::validate`] for the
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

impl Updater for Sgd {
    fn update(&mut self, key: u64, grad: &[f32], weight: &mut [f32]) -> Result<(), UpdaterError> {
        check_len(key, grad, weight)?;
        let k = self.kernel;
        if self.params.momentum > 0.0 {
            let moms = self
                .moms
                .entry(key)
                .or_insert_with(|| vec![0.0; weight.len()]);
            check_state_len(key, moms.len(), weight.len())?;
            for ((w, &g), m) in weight.iter_mut().zip(grad).zip(moms.iter_mut()) {
                *m = k.mom(*w, g, *m);
                *w += *m;
            }
        } else {
            for (w, &g) in weight.iter_mut().zip(grad) {
                let m = k.mom(*w, g, 0.0);
                *w += m;
            }
        }
        Ok(())
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
struct AdamState {
    mean: Vec<f32>,
    var: Vec<f32>,
    /// Updates applied so far.
    t: u64,
}

/// Adam (`"adam"`): MXNet 1.9.1's `adam_update` kernel with the Python optimizer's bias
/// correction (see the [module](self) docs). Mean, variance and step count are per key.
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
    /// An Adam updater without any per-key state yet. See [`OptimizerSpec::validate`] for the
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

impl Updater for Adam {
    fn update(&mut self, key: u64, grad: &[f32], weight: &mut [f32]) -> Result<(), UpdaterError> {
        check_len(key, grad, weight)?;
        if let Some(state) = self.states.get(&key) {
            check_state_len(key, state.mean.len(), weight.len())?;
        }
        let t = self.step_count(key) + 1;
        let lr_t = self.lr_t(t);
        let k = self.kernel;
        let state = self.states.entry(key).or_insert_with(|| AdamState {
            mean: vec![0.0; weight.len()],
            var: vec![0.0; weight.len()],
            t: 0,
        });
        state.t = t;
        let moments = state.mean.iter_mut().zip(state.var.iter_mut());
        for ((w, &g), (mean, var)) in weight.iter_mut().zip(grad).zip(moments) {
            let mut g = g * k.rescale + *w * k.wd;
            if let Some(c) = k.clip {
                g = clip(g, c);
            }
            *mean = k.beta1 * *mean + k.one_minus_beta1 * g;
            *var = k.beta2 * *var + k.one_minus_beta2 * g * g;
            *w -= lr_t * *mean / (var.sqrt() + k.epsilon);
        }
        Ok(())
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
    /// A test updater. See [`OptimizerSpec::validate`] for the accepted values (not checked
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
    fn update(&mut self, key: u64, grad: &[f32], weight: &mut [f32]) -> Result<(), UpdaterError> {
        check_len(key, grad, weight)?;
        for (w, &g) in weight.iter_mut().zip(grad) {
            *w += g * self.rescale;
        }
        Ok(())
    }

    fn export_state(&self, out: &mut LeWriter) {
        state::export_none(out);
    }

    fn import_state(&mut self, input: &mut LeReader<'_>) -> Result<(), UpdaterError> {
        state::import_none(input)
    }
}
