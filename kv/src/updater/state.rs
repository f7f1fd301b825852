//! The updaters' per-key state in checkpoints (format in the parent module's docs): written
//! in ascending key order so that equal states give equal bytes, read with every count and
//! length checked against the bytes left before anything is allocated.

use std::collections::HashMap;

use psnet_transport::le::{LeReader, LeWriter};

use super::{AdamState, UpdaterError};
use crate::proto::sum;

const SGD: u8 = 1;
const ADAM: u8 = 2;
const NONE: u8 = 3;

fn bad(what: impl Into<String>) -> UpdaterError {
    UpdaterError::BadState(what.into())
}

fn truncated(what: &str) -> UpdaterError {
    bad(format!("truncated in {what}"))
}

fn sorted_keys<V>(map: &HashMap<u64, V>) -> Vec<u64> {
    let mut keys: Vec<u64> = map.keys().copied().collect();
    keys.sort_unstable();
    keys
}

fn put_f32s(out: &mut LeWriter, values: &[f32]) {
    out.bytes(sum::as_bytes(values));
}

/// The tag of the optimizer that wrote the state, checked against `want`.
fn tag(input: &mut LeReader<'_>, want: u8, name: &str) -> Result<(), UpdaterError> {
    let got = input.u8().map_err(|_| truncated("the optimizer tag"))?;
    if got != want {
        return Err(bad(format!(
            "written by another optimizer (tag {got}), this one is {name} (tag {want})"
        )));
    }
    Ok(())
}

/// A count of entries each at least `min_entry` bytes long, bounded by the bytes left.
fn count(input: &mut LeReader<'_>, min_entry: usize) -> Result<usize, UpdaterError> {
    let n = input.u64().map_err(|_| truncated("the key count"))?;
    let most = input.remaining() / min_entry;
    if n > most as u64 {
        return Err(bad(format!(
            "{n} keys announced, the {} bytes left hold at most {most}",
            input.remaining()
        )));
    }
    Ok(n as usize)
}

/// A key, strictly above the previous one.
fn key(input: &mut LeReader<'_>, previous: Option<u64>) -> Result<u64, UpdaterError> {
    let key = input.u64().map_err(|_| truncated("a key"))?;
    if previous.is_some_and(|p| key <= p) {
        return Err(bad(format!("key {key} out of order or repeated")));
    }
    Ok(key)
}

/// An element count of `arrays` arrays of `f32` that follow, bounded by the bytes left.
fn length(input: &mut LeReader<'_>, key: u64, arrays: usize) -> Result<usize, UpdaterError> {
    let n = input.u64().map_err(|_| truncated("a length"))?;
    if n > (input.remaining() / (4 * arrays)) as u64 {
        return Err(bad(format!(
            "key {key}: {n} elements announced, only {} bytes left",
            input.remaining()
        )));
    }
    Ok(n as usize)
}

fn f32s(input: &mut LeReader<'_>, n: usize, key: u64) -> Result<Vec<f32>, UpdaterError> {
    let bytes = input
        .take(4 * n)
        .map_err(|_| bad(format!("key {key}: values truncated")))?;
    let mut v = vec![0f32; n];
    sum::copy_from_le(&mut v, bytes);
    Ok(v)
}

pub(super) fn export_sgd(moms: &HashMap<u64, Vec<f32>>, out: &mut LeWriter) {
    out.u8(SGD).u64(moms.len() as u64);
    for key in sorted_keys(moms) {
        let mom = &moms[&key];
        out.u64(key).u64(mom.len() as u64);
        put_f32s(out, mom);
    }
}

pub(super) fn import_sgd(
    input: &mut LeReader<'_>,
    with_momentum: bool,
) -> Result<HashMap<u64, Vec<f32>>, UpdaterError> {
    tag(input, SGD, "sgd")?;
    let n = count(input, 16)?;
    if n > 0 && !with_momentum {
        return Err(bad(format!(
            "momentum of {n} keys for sgd without momentum (which keeps none)"
        )));
    }
    let mut moms = HashMap::with_capacity(n);
    let mut previous = None;
    for _ in 0..n {
        let k = key(input, previous)?;
        previous = Some(k);
        let len = length(input, k, 1)?;
        moms.insert(k, f32s(input, len, k)?);
    }
    Ok(moms)
}

pub(super) fn export_adam(states: &HashMap<u64, AdamState>, out: &mut LeWriter) {
    out.u8(ADAM).u64(states.len() as u64);
    for key in sorted_keys(states) {
        let s = &states[&key];
        debug_assert_eq!(s.mean.len(), s.var.len());
        out.u64(key).u64(s.t).u64(s.mean.len() as u64);
        put_f32s(out, &s.mean);
        put_f32s(out, &s.var);
    }
}

pub(super) fn import_adam(
    input: &mut LeReader<'_>,
) -> Result<HashMap<u64, AdamState>, UpdaterError> {
    tag(input, ADAM, "adam")?;
    let n = count(input, 24)?;
    let mut states = HashMap::with_capacity(n);
    let mut previous = None;
    for _ in 0..n {
        let k = key(input, previous)?;
        previous = Some(k);
        let t = input.u64().map_err(|_| truncated("a step count"))?;
        if t == 0 {
            return Err(bad(format!(
                "key {k}: step count 0 (state exists only after an update)"
            )));
        }
        let len = length(input, k, 2)?;
        let mean = f32s(input, len, k)?;
        let var = f32s(input, len, k)?;
        states.insert(k, AdamState { mean, var, t });
    }
    Ok(states)
}

pub(super) fn export_none(out: &mut LeWriter) {
    out.u8(NONE).u64(0);
}

pub(super) fn import_none(input: &mut LeReader<'_>) -> Result<(), UpdaterError> {
    tag(input, NONE, "test")?;
    match input.u64().map_err(|_| truncated("the key count"))? {
        0 => Ok(()),
        n => Err(bad(format!(
            "{n} keys of state for an optimizer without state"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{OptimizerSpec, Updater, UpdaterError};
    use psnet_transport::le::{LeReader, LeWriter};

    const SPECS: &[&str] = &[
        r#"{"type":"sgd","learning_rate":0.1}"#,
        r#"{"type":"sgd","learning_rate":0.1,"momentum":0.9,"wd":0.01,"clip_gradient":0.5}"#,
        r#"{"type":"adam","wd":0.01,"clip_gradient":0.5}"#,
        r#"{"type":"test","rescale_grad":2}"#,
    ];

    fn export(u: &dyn Updater) -> Vec<u8> {
        let mut w = LeWriter::default();
        u.export_state(&mut w);
        w.into_vec()
    }

    /// An updater of `spec` after updates of keys 3, 1 and 2 (of different sizes).
    fn trained(spec: &str, rounds: usize) -> (Box<dyn Updater>, Vec<Vec<f32>>) {
        let mut u = OptimizerSpec::parse(spec).unwrap().build();
        let mut weights = vec![vec![0.5f32; 3], vec![-1.0; 1], vec![2.0; 17]];
        for r in 0..rounds {
            for (i, key) in [3u64, 1, 2].into_iter().enumerate() {
                let w = &mut weights[i];
                let g: Vec<f32> = (0..w.len())
                    .map(|j| (r * 7 + j) as f32 * 0.1 - 0.8)
                    .collect();
                u.update(key, &g, w).unwrap();
            }
        }
        (u, weights)
    }

    #[test]
    fn imported_state_goes_on_bit_identically() {
        for spec in SPECS {
            let (mut a, weights) = trained(spec, 4);
            let bytes = export(&*a);
            let mut b = OptimizerSpec::parse(spec).unwrap().build();
            let mut r = LeReader::new(&bytes);
            b.import_state(&mut r).unwrap();
            assert!(r.is_empty(), "{spec}: reads exactly its bytes");
            assert_eq!(export(&*b), bytes, "{spec}");
            let (mut wa, mut wb) = (weights.clone(), weights);
            for (i, key) in [3u64, 1, 2].into_iter().enumerate() {
                let g = vec![0.3f32; wa[i].len()];
                a.update(key, &g, &mut wa[i]).unwrap();
                b.update(key, &g, &mut wb[i]).unwrap();
            }
            let bits = |w: &Vec<Vec<f32>>| -> Vec<u32> {
                w.concat().iter().map(|x| x.to_bits()).collect()
            };
            assert_eq!(bits(&wa), bits(&wb), "{spec}");
            assert_eq!(export(&*a), export(&*b), "{spec}");
        }
        // With state, the bytes are not empty of it: the test above compares something.
        let (u, _) = trained(SPECS[2], 2);
        assert!(export(&*u).len() > 2 * 4 * (3 + 1 + 17));
    }

    #[test]
    fn damaged_or_foreign_state_is_refused_and_changes_nothing() {
        for spec in SPECS {
            let (a, _) = trained(spec, 3);
            let bytes = export(&*a);
            let (mut b, _) = trained(spec, 1);
            let before = export(&*b);
            for cut in 0..bytes.len() {
                let err = b.import_state(&mut LeReader::new(&bytes[..cut]));
                assert!(
                    matches!(err, Err(UpdaterError::BadState(_))),
                    "{spec} cut at {cut}"
                );
                assert_eq!(export(&*b), before);
            }
            for at in 0..bytes.len() {
                let mut bad = bytes.clone();
                bad[at] ^= 0xA5;
                let _ = b.import_state(&mut LeReader::new(&bad));
            }
        }
        // Another optimizer's state.
        let (adam, _) = trained(SPECS[2], 1);
        let mut sgd = OptimizerSpec::parse(SPECS[1]).unwrap().build();
        let err = sgd
            .import_state(&mut LeReader::new(&export(&*adam)))
            .unwrap_err();
        assert!(err.to_string().contains("another optimizer"), "{err}");
        // Momentum for sgd without momentum.
        let (with, _) = trained(SPECS[1], 1);
        let mut without = OptimizerSpec::parse(SPECS[0]).unwrap().build();
        let err = without
            .import_state(&mut LeReader::new(&export(&*with)))
            .unwrap_err();
        assert!(err.to_string().contains("without momentum"), "{err}");
        // Counts beyond the bytes.
        let mut w = LeWriter::default();
        w.u8(2).u64(u64::MAX);
        let mut adam = OptimizerSpec::parse(SPECS[2]).unwrap().build();
        let err = adam
            .import_state(&mut LeReader::new(&w.into_vec()))
            .unwrap_err();
        assert!(err.to_string().contains("keys announced"), "{err}");
    }
}
