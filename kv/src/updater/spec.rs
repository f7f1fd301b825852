//! [`OptimizerSpec`]: an optimizer and its hyper-parameters as MXNet users write them, parsed,
//! checked, written back to JSON exactly, and built into an [`Updater`].

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{Adam, Sgd, TestUpdater, Updater, UpdaterError};

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
