//! Compression parameters as users write them in MXNet, and their kvstore wire encoding.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::compressor::{Compressor, Scheme};
use crate::error::ParamsError;
use crate::{one_bit, two_bit, OneBitCompressor, TwoBitCompressor};

/// MXNet's default threshold when `threshold` is absent.
pub const DEFAULT_THRESHOLD: f32 = 0.5;

/// Gradient compression settings, as given to MXNet's `kv.set_gradient_compression(...)`.
///
/// Parse them from MXNet's dict form with [`CompressionParams::parse`] (or [`FromStr`], or
/// serde): `{"type": "2bit", "threshold": 0.5}`, `{"type": "1bit"}`, `{"type": "none"}`.
/// `threshold` defaults to [`DEFAULT_THRESHOLD`] and may be a number or a numeric string (MXNet's
/// C API passes strings). Python's single-quoted dict syntax is accepted too.
///
/// Thresholds: `2bit` needs a finite value `> 0`; `1bit` accepts anything but NaN (MXNet 2.x
/// only checks `2bit`); `none` ignores it.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(try_from = "Value", into = "Value")]
pub enum CompressionParams {
    /// No compression (MXNet `"none"`, the default).
    #[default]
    None,
    /// MXNet `"2bit"`.
    TwoBit {
        /// Finite and `> 0`.
        threshold: f32,
    },
    /// MXNet 2.x `"1bit"`.
    OneBit {
        /// Decision point (not NaN).
        threshold: f32,
    },
}

/// The MXNet release whose kvstore wire encoding of the parameters to use
/// (the numeric compression type changed between them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MxnetVersion {
    /// MXNet 1.x (1.9.1): `none` = 0, `2bit` = 1; no `1bit`.
    V1,
    /// MXNet 2.x: `none` = 0, `1bit` = 1, `2bit` = 2.
    V2,
}

impl CompressionParams {
    /// `2bit` with a validated threshold.
    pub fn two_bit(threshold: f32) -> Result<Self, ParamsError> {
        Ok(CompressionParams::TwoBit {
            threshold: two_bit::validate_threshold(threshold)?,
        })
    }

    /// `1bit` with a validated threshold.
    pub fn one_bit(threshold: f32) -> Result<Self, ParamsError> {
        Ok(CompressionParams::OneBit {
            threshold: one_bit::validate_threshold(threshold)?,
        })
    }

    /// From a type name (`"2bit"`, `"1bit"`, `"none"`) and an optional threshold
    /// (default [`DEFAULT_THRESHOLD`]).
    pub fn new(kind: &str, threshold: Option<f32>) -> Result<Self, ParamsError> {
        let threshold = threshold.unwrap_or(DEFAULT_THRESHOLD);
        match kind {
            "none" => Ok(CompressionParams::None),
            other => match other.parse::<Scheme>()? {
                Scheme::TwoBit => Self::two_bit(threshold),
                Scheme::OneBit => Self::one_bit(threshold),
            },
        }
    }

    /// Parses MXNet's dict form: JSON (`{"type": "2bit", "threshold": 0.5}`) or the same with
    /// Python's single quotes. Keys other than `type` and `threshold` are refused.
    pub fn parse(text: &str) -> Result<Self, ParamsError> {
        let value = match serde_json::from_str::<Value>(text) {
            Ok(value) => value,
            Err(first) if text.contains('\'') && !text.contains('"') => {
                serde_json::from_str::<Value>(&text.replace('\'', "\""))
                    .map_err(|_| ParamsError::Malformed(format!("{first} in {text:?}")))?
            }
            Err(e) => return Err(ParamsError::Malformed(format!("{e} in {text:?}"))),
        };
        Self::from_json(&value)
    }

    /// From a parsed JSON object.
    pub fn from_json(value: &Value) -> Result<Self, ParamsError> {
        let Value::Object(map) = value else {
            return Err(ParamsError::Malformed(format!(
                "expected an object like {{\"type\": \"2bit\", \"threshold\": 0.5}}, got {value}"
            )));
        };
        let kind = match map.get("type") {
            Some(Value::String(kind)) => kind.as_str(),
            Some(other) => {
                return Err(ParamsError::Malformed(format!(
                    "\"type\" must be a string, got {other}"
                )))
            }
            None => {
                return Err(ParamsError::Malformed(
                    "missing \"type\" (\"2bit\", \"1bit\" or \"none\")".into(),
                ))
            }
        };
        check_keys(map.keys().map(String::as_str))?;
        let threshold = match map.get("threshold") {
            None | Some(Value::Null) => None,
            // The shortest decimal that round-trips the f64 is what the user wrote (for up to
            // 15 significant digits); parsing it as f32 rounds once, like MXNet's parser.
            Some(Value::Number(n)) => Some(parse_threshold(&n.to_string())?),
            Some(Value::String(s)) => Some(parse_threshold(s)?),
            Some(other) => {
                return Err(ParamsError::Malformed(format!(
                    "\"threshold\" must be a number, got {other}"
                )))
            }
        };
        Self::new(kind, threshold)
    }

    /// From MXNet C-API style keyword arguments (keys and values as strings), e.g.
    /// `[("type", "2bit"), ("threshold", "0.5")]`.
    pub fn from_kwargs<'a, I>(kwargs: I) -> Result<Self, ParamsError>
    where
        I: IntoIterator<Item = (&'a str, &'a str)>,
    {
        let (mut kind, mut threshold) = (None, None);
        for (key, value) in kwargs {
            match key {
                "type" => kind = Some(value),
                "threshold" => threshold = Some(parse_threshold(value)?),
                other => check_keys([other])?,
            }
        }
        let kind = kind.ok_or_else(|| {
            ParamsError::Malformed("missing \"type\" (\"2bit\", \"1bit\" or \"none\")".into())
        })?;
        Self::new(kind, threshold)
    }

    /// The scheme, or `None` for no compression.
    pub fn scheme(&self) -> Option<Scheme> {
        match self {
            CompressionParams::None => None,
            CompressionParams::TwoBit { .. } => Some(Scheme::TwoBit),
            CompressionParams::OneBit { .. } => Some(Scheme::OneBit),
        }
    }

    /// The threshold, or `None` for no compression.
    pub fn threshold(&self) -> Option<f32> {
        match *self {
            CompressionParams::None => None,
            CompressionParams::TwoBit { threshold } | CompressionParams::OneBit { threshold } => {
                Some(threshold)
            }
        }
    }

    /// The MXNet type name: `"none"`, `"2bit"` or `"1bit"`.
    pub fn type_name(&self) -> &'static str {
        self.scheme().map_or("none", Scheme::name)
    }

    /// Size in bytes of `n` elements on the wire (`4 * n` without compression).
    pub fn compressed_size(&self, n: usize) -> usize {
        self.scheme().map_or(4 * n, |s| s.compressed_size(n))
    }

    /// A compressor for these settings (detected SIMD level, automatic parallelism), or
    /// `Ok(None)` for no compression. Fails only for a threshold that the variant's
    /// constructor would have refused (possible when the variant was built by hand).
    pub fn compressor(&self) -> Result<Option<Box<dyn Compressor>>, ParamsError> {
        Ok(match *self {
            CompressionParams::None => None,
            CompressionParams::TwoBit { threshold } => {
                Some(Box::new(TwoBitCompressor::new(threshold)?))
            }
            CompressionParams::OneBit { threshold } => {
                Some(Box::new(OneBitCompressor::new(threshold)?))
            }
        })
    }

    /// The body of MXNet's `kSetGradientCompression` command (`EncodeParams`):
    /// `"<type id>,<threshold printed with %f>"`, e.g. `"1,0.500000"` (1.x) or `"2,0.500000"`
    /// (2.x) for `2bit`. `1bit` does not exist in MXNet 1.x.
    ///
    /// The server decodes the *rounded* threshold (see [`mxnet_wire_threshold`]).
    pub fn encode_mxnet(&self, version: MxnetVersion) -> Result<String, ParamsError> {
        let id = match (self, version) {
            (CompressionParams::None, _) => 0,
            (CompressionParams::TwoBit { .. }, MxnetVersion::V1) => 1,
            (CompressionParams::TwoBit { .. }, MxnetVersion::V2) => 2,
            (CompressionParams::OneBit { .. }, MxnetVersion::V2) => 1,
            (CompressionParams::OneBit { .. }, MxnetVersion::V1) => {
                return Err(ParamsError::UnknownType(
                    "1bit (MXNet 1.x only knows \"2bit\" and \"none\")".into(),
                ))
            }
        };
        let threshold = self.threshold().unwrap_or(DEFAULT_THRESHOLD);
        Ok(format!("{id},{}", format_percent_f(threshold)))
    }

    /// Decodes a `kSetGradientCompression` body (`DecodeParams`), as an MXNet server would:
    /// the threshold is the rounded one that was printed. A `2bit` threshold that printed as
    /// `0.000000` (below `5e-7`) is refused: MXNet would decode every value to zero.
    pub fn decode_mxnet(body: &str, version: MxnetVersion) -> Result<Self, ParamsError> {
        let malformed = || {
            ParamsError::Malformed(format!(
                "expected \"<type id>,<threshold>\" from kSetGradientCompression, got {body:?}"
            ))
        };
        let (id, threshold) = body.split_once(',').ok_or_else(malformed)?;
        let id: i32 = id.trim().parse().map_err(|_| malformed())?;
        let threshold: f32 = threshold.trim().parse().map_err(|_| malformed())?;
        match (id, version) {
            (0, _) => Ok(CompressionParams::None),
            (1, MxnetVersion::V1) | (2, MxnetVersion::V2) => Self::two_bit(threshold),
            (1, MxnetVersion::V2) => Self::one_bit(threshold),
            (other, _) => Err(ParamsError::UnknownType(format!(
                "type id {other} in kSetGradientCompression body {body:?}"
            ))),
        }
    }
}

/// The threshold an MXNet server uses after the worker's threshold went through
/// `std::to_string` (`%f`, 6 decimals) and `stof`: `0.1234567` → `0.123457`, `1e-7` → `0.0`.
/// Workers quantize (and keep residuals) with the exact threshold; servers dequantize with this.
pub fn mxnet_wire_threshold(threshold: f32) -> f32 {
    format_percent_f(threshold).parse().unwrap_or(threshold)
}

/// C's `printf("%f", (double)x)`: exact decimal expansion rounded to 6 decimals, ties to even.
fn format_percent_f(x: f32) -> String {
    if x.is_nan() {
        "nan".into()
    } else if x.is_infinite() {
        if x > 0.0 { "inf" } else { "-inf" }.into()
    } else {
        format!("{:.6}", f64::from(x))
    }
}

fn parse_threshold(text: &str) -> Result<f32, ParamsError> {
    text.trim()
        .parse::<f32>()
        .map_err(|_| ParamsError::Malformed(format!("threshold {text:?} is not a number")))
}

fn check_keys<'a>(keys: impl IntoIterator<Item = &'a str>) -> Result<(), ParamsError> {
    for key in keys {
        if key != "type" && key != "threshold" {
            return Err(ParamsError::Malformed(format!(
                "unknown key {key:?}: expected \"type\" and optionally \"threshold\""
            )));
        }
    }
    Ok(())
}

impl FromStr for CompressionParams {
    type Err = ParamsError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<Value> for CompressionParams {
    type Error = ParamsError;

    fn try_from(value: Value) -> Result<Self, Self::Error> {
        Self::from_json(&value)
    }
}

impl From<CompressionParams> for Value {
    fn from(params: CompressionParams) -> Value {
        let mut map = Map::new();
        map.insert("type".into(), Value::String(params.type_name().into()));
        if let Some(t) = params.threshold() {
            // Shortest decimal that round-trips the f32 (0.1, not 0.10000000149011612). JSON
            // has no number for an infinite threshold (which `1bit` accepts): it is written as
            // the string "inf" / "-inf", which `parse` reads back, rather than as `null`,
            // which would read back as the default threshold.
            let number = t
                .to_string()
                .parse::<f64>()
                .ok()
                .and_then(serde_json::Number::from_f64);
            map.insert(
                "threshold".into(),
                number.map_or_else(|| Value::String(t.to_string()), Value::Number),
            );
        }
        Value::Object(map)
    }
}

/// The JSON dict form, e.g. `{"type":"2bit","threshold":0.5}`.
impl fmt::Display for CompressionParams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", Value::from(*self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_f_matches_c() {
        assert_eq!(format_percent_f(0.5), "0.500000");
        assert_eq!(format_percent_f(0.1234567), "0.123457");
        assert_eq!(format_percent_f(1e-7), "0.000000");
        // Exact tie: glibc rounds half to even.
        assert_eq!(format_percent_f(0.0078125), "0.007812");
        assert_eq!(format_percent_f(3.0), "3.000000");
        assert_eq!(format_percent_f(1e10), "10000000000.000000");
    }
}
