//! Compressed pulls (`{"type": "2bit", "threshold": 0.5, "pull": true}`), as BytePS
//! compresses both ways. Lossy, `dist_sync` only, `float32` keys only.
//!
//! Every worker holds a copy of each key's value; the server keeps the same copy (the
//! *shadow*, `W'`) beside its master value `W`. Each completed round the server quantizes
//! the change `W - W'` into the job's codes (2-bit or 1-bit) with a scale chosen for that
//! answer, and adds what the codes stand for to `W'`: version `v + 1` of the copy. What the
//! codes leave out stays in `W - W'`, the server's residual (error feedback), and goes out in
//! later rounds. A worker whose copy is at `v` gets the codes and applies them the same way,
//! so every worker's copy is `W'` bit for bit; a worker at any other version (a first pull,
//! a missed round) gets `W'` whole. Nothing here reads a clock or a socket.
//!
//! Weights change on another scale than gradients, so the gradients' threshold is not used
//! here; each answer's codes are chosen from the change `r = W - W'` itself. 2-bit codes
//! mark the elements where `|r|` is at least its mean, and carry `+-scale` there, the scale
//! being the mean `|r|` of those elements (as ternary weight networks choose theirs: it
//! moves the copy by as much as those elements changed, where the mean itself moved it by
//! about 40% of it and left the rest to later rounds); 0 elsewhere. 1-bit codes carry the
//! sign of every element times the mean `|r|` (the scale that leaves the least error).

use std::sync::{Arc, OnceLock};

use psnet_compression::scale::magnitudes_of_difference;
use psnet_compression::two_bit;
use psnet_compression::{
    CompressionError, CompressionParams, OneBitCompressor, ParamsError, Scheme, TwoBitCompressor,
};
use serde_json::Value;

/// A kv store's compression: the gradients' (pushes) and, opt-in, compressed pulls.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KvCompression {
    /// The pushes' codes (MXNet's settings).
    pub params: CompressionParams,
    /// Pulls answered with codes of the weights' change too (see the module docs).
    pub pull: bool,
    /// Codes travel packed ([`crate::proto::packed`]): `"pack": true`. A worker's setting
    /// packs its own pushes; worker 0's, the one servers keep, packs their answers too.
    pub pack: bool,
}

impl From<CompressionParams> for KvCompression {
    fn from(params: CompressionParams) -> Self {
        KvCompression {
            params,
            pull: false,
            pack: false,
        }
    }
}

impl KvCompression {
    /// Parses MXNet's dict form with psnet's `"pull"` and `"pack"` (booleans) beside `type`
    /// and `threshold`: `{"type": "2bit", "threshold": 0.5, "pull": true, "pack": true}`.
    pub fn parse(text: &str) -> Result<Self, ParamsError> {
        let normalised;
        let text = if text.contains('\'') && !text.contains('"') {
            normalised = text.replace('\'', "\"");
            &normalised
        } else {
            text
        };
        let mut value: Value = serde_json::from_str(text)
            .map_err(|e| ParamsError::Malformed(format!("{e} in {text:?}")))?;
        let mut flag = |name: &str| match value.as_object_mut().and_then(|m| m.remove(name)) {
            None | Some(Value::Bool(false)) => Ok(false),
            Some(Value::Bool(true)) => Ok(true),
            Some(other) => Err(ParamsError::Malformed(format!(
                "\"{name}\" must be true or false, got {other}"
            ))),
        };
        let pull = flag("pull")?;
        let pack = flag("pack")?;
        let params = CompressionParams::from_json(&value)?;
        if pull && params.scheme().is_none() {
            return Err(ParamsError::Malformed(
                "\"pull\": true needs a compression type (\"2bit\" or \"1bit\")".into(),
            ));
        }
        if pack && params.scheme().is_none() {
            return Err(ParamsError::Malformed(
                "\"pack\": true needs a compression type (\"2bit\" or \"1bit\")".into(),
            ));
        }
        Ok(KvCompression { params, pull, pack })
    }

    /// The scheme of compressed pulls, if they are on.
    pub fn pull_scheme(&self) -> Option<Scheme> {
        self.params.scheme().filter(|_| self.pull)
    }
}

impl std::fmt::Display for KvCompression {
    /// The gradients' settings as MXNet writes them, with `"pull": true` and `"pack": true`
    /// added when on (so that a store without them sends exactly MXNet's form).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut value = Value::from(self.params);
        if let Some(map) = value.as_object_mut() {
            for (name, on) in [("pull", self.pull), ("pack", self.pack)] {
                if on {
                    map.insert(name.into(), Value::Bool(true));
                }
            }
        }
        write!(f, "{value}")
    }
}

/// How a compressed-pull answer's value is to be read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Form {
    /// The copy itself, `f32` values.
    Full,
    /// Codes to add to the copy of the version before, with this scale.
    Delta {
        /// What a code's unit stands for.
        scale: f32,
    },
    /// No value: the worker's copy is this version already.
    Same,
    /// As [`Form::Delta`], the codes packed ([`crate::proto::packed`]).
    Packed {
        /// What a code's unit stands for.
        scale: f32,
    },
}

/// The codes that made a version of the copy from the one before.
#[derive(Clone, Debug, PartialEq)]
pub struct Delta {
    /// What a code's unit stands for.
    pub scale: f32,
    /// The codes.
    pub codes: Arc<Vec<u8>>,
    /// The codes packed, made by the first answer that sends them so (every worker's is the
    /// same bytes).
    pub packed: OnceLock<Arc<Vec<u8>>>,
}

impl Delta {
    /// Codes with `scale`, not packed yet.
    pub fn new(scale: f32, codes: Vec<u8>) -> Delta {
        Delta {
            scale,
            codes: Arc::new(codes),
            packed: OnceLock::new(),
        }
    }

    /// The codes packed; None where packing fails (the answer then carries the codes
    /// themselves, as [`Form::Delta`]).
    pub fn packed(&self) -> Option<Arc<Vec<u8>>> {
        if let Some(p) = self.packed.get() {
            return Some(p.clone());
        }
        match super::packed::pack(&self.codes) {
            Ok(p) => Some(self.packed.get_or_init(|| Arc::new(p)).clone()),
            Err(e) => {
                tracing::warn!("compressed pull's codes go unpacked: {e}");
                None
            }
        }
    }
}

/// The workers' copy of one key's value as its server keeps it.
#[derive(Clone, Debug, PartialEq)]
pub struct Shadow {
    /// `W'`: what every up-to-date worker holds.
    pub copy: Arc<Vec<f32>>,
    /// How many times it changed since it was made (or made again by an init).
    pub version: u64,
    /// The codes that made `version` from `version - 1`; `None` where that change went
    /// whole (the first version, or a change whose scale was not finite).
    pub last: Option<Delta>,
}

impl Shadow {
    /// A copy of `value`, version `version`, that workers get whole.
    pub fn new(value: &[f32], version: u64) -> Shadow {
        Shadow {
            copy: Arc::new(value.to_vec()),
            version,
            last: None,
        }
    }

    /// The next version after the master value became `value`: its change quantized with
    /// `scheme`'s codes and added to the copy.
    pub fn advance(&mut self, scheme: Scheme, value: &[f32]) {
        let copy = Arc::make_mut(&mut self.copy);
        self.last = quantize(scheme, value, copy);
        if self.last.is_none() {
            copy.copy_from_slice(value);
        }
        self.version += 1;
    }

    /// What to answer a worker whose copy is at `have`.
    pub fn answer(&self, have: Option<u64>) -> Form {
        match (have, &self.last) {
            (Some(v), _) if v == self.version => Form::Same,
            (Some(v), Some(d)) if v.checked_add(1) == Some(self.version) => {
                Form::Delta { scale: d.scale }
            }
            _ => Form::Full,
        }
    }
}

thread_local! {
    /// A server's scratch space for 1-bit [`quantize`]: the change, and zeros as long as it
    /// (the codes are taken from the change as a residual with nothing added). One per
    /// thread, kept across keys and rounds, so that no round allocates a key's worth.
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const {
        std::cell::RefCell::new((Vec::new(), Vec::new()))
    };
}

thread_local! {
    /// Decoded 1-bit signs, for [`apply`].
    static SIGNS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The codes of `value - copy` and their scale, added to `copy`; `None` (copy unchanged)
/// where the scale is not finite (a NaN or infinite weight goes whole instead). The scale is
/// chosen as the module docs say; its sums are taken in order in `f64`, so that a model
/// elsewhere finds the same bits. 2-bit codes and their scale come from one pass over the
/// value and the copy, after the pass that finds the mean.
pub fn quantize(scheme: Scheme, value: &[f32], copy: &mut [f32]) -> Option<Delta> {
    debug_assert_eq!(value.len(), copy.len());
    let n = value.len();
    let (sum, _) = magnitudes_of_difference(value, copy, 0.0);
    let mean = if n == 0 { 0.0 } else { (sum / n as f64) as f32 };
    if !mean.is_finite() {
        return None;
    }
    let mut codes = vec![0u8; scheme.compressed_size(n)];
    let scale = match scheme {
        // The elements at or past the mean, and their mean magnitude (none: all zero).
        Scheme::TwoBit if mean > 0.0 => {
            match two_bit::quantize_difference(value, copy, mean, &mut codes) {
                (_, 0) => 0.0,
                (sum, count) => (sum / count as f64) as f32,
            }
        }
        Scheme::TwoBit => 0.0,
        Scheme::OneBit => {
            if mean > 0.0 {
                one_bit_codes(value, copy, &mut codes)?;
            }
            mean
        }
    };
    if !scale.is_finite() {
        return None;
    }
    apply(scheme, &codes, scale, copy).ok()?;
    Some(Delta::new(scale, codes))
}

/// 1-bit codes of `value - copy`: the sign of each element.
fn one_bit_codes(value: &[f32], copy: &[f32], codes: &mut [u8]) -> Option<()> {
    SCRATCH.with_borrow_mut(|(change, zeros)| {
        change.clear();
        change.extend(value.iter().zip(copy.iter()).map(|(w, c)| w - c));
        zeros.resize(value.len().max(zeros.len()), 0.0);
        OneBitCompressor::new(0.0)
            .ok()?
            .quantize(&zeros[..value.len()], change, codes)
            .ok()
    })
}

/// Codes a copy cannot take.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ApplyError {
    /// Codes of the wrong length for the copy.
    #[error("{got} bytes of {scheme} codes for {elems} elements (want {want})")]
    Length {
        /// Their length.
        got: usize,
        /// The scheme's name.
        scheme: &'static str,
        /// The copy's elements.
        elems: usize,
        /// The length they should have.
        want: usize,
    },
    /// A scale that is negative or not finite.
    #[error("a scale of {0}")]
    Scale(f32),
    /// The codes do not decode.
    #[error(transparent)]
    Codes(#[from] CompressionError),
    /// The scale makes no compressor.
    #[error(transparent)]
    Params(#[from] psnet_compression::ParamsError),
}

/// Adds what `codes` with `scale` stand for to `copy`: the server's shadow and every
/// worker's copy change by the same `f32` operations.
pub fn apply(scheme: Scheme, codes: &[u8], scale: f32, copy: &mut [f32]) -> Result<(), ApplyError> {
    if codes.len() != scheme.compressed_size(copy.len()) {
        return Err(ApplyError::Length {
            got: codes.len(),
            scheme: scheme.name(),
            elems: copy.len(),
            want: scheme.compressed_size(copy.len()),
        });
    }
    if !scale.is_finite() || scale < 0.0 {
        return Err(ApplyError::Scale(scale));
    }
    if scale == 0.0 {
        return Ok(());
    }
    match scheme {
        Scheme::TwoBit => Ok(TwoBitCompressor::new(scale)?.dequantize_add(codes, copy)?),
        // The codes decode to +-1 (MXNet's decoder, vectorized); times the scale, that is
        // exactly +-scale.
        Scheme::OneBit => SIGNS.with_borrow_mut(|signs| {
            signs.resize(copy.len(), 0.0);
            OneBitCompressor::new(0.0)?.dequantize(codes, signs)?;
            for (c, s) in copy.iter_mut().zip(signs.iter()) {
                *c += scale * s;
            }
            Ok(())
        }),
    }
}

#[cfg(test)]
mod tests;
