use proptest::prelude::*;

use super::*;

fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..len).map(|_| rng.f32() * 2.0 - 1.0).collect()
}

#[test]
fn settings_parse_with_pull_and_print_mxnets_form_without_it() {
    let k = KvCompression::parse("{'type': '2bit', 'threshold': 0.5, 'pull': true}").unwrap();
    assert_eq!(k.pull_scheme(), Some(Scheme::TwoBit));
    assert_eq!(KvCompression::parse(&k.to_string()).unwrap(), k);
    let plain = KvCompression::parse(r#"{"type": "1bit", "threshold": 0}"#).unwrap();
    assert!(!plain.pull);
    assert_eq!(plain.to_string(), plain.params.to_string());
    assert!(!plain.to_string().contains("pull"));
    for bad in [
        r#"{"type": "2bit", "pull": 1}"#,
        r#"{"type": "none", "pull": true}"#,
        r#"{"type": "2bit", "pulls": true}"#,
    ] {
        assert!(KvCompression::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn a_worker_applying_the_codes_holds_the_servers_copy_bit_for_bit() {
    for scheme in [Scheme::TwoBit, Scheme::OneBit] {
        let len = 1001;
        let mut master = values(len, 1);
        let mut shadow = Shadow::new(&master, 0);
        let mut worker = master.clone();
        for round in 0..50u64 {
            for (w, g) in master.iter_mut().zip(values(len, 100 + round)) {
                *w -= 0.01 * g;
            }
            shadow.advance(scheme, &master);
            let d = shadow.last.as_ref().expect("a finite change");
            assert_eq!(
                shadow.answer(Some(shadow.version - 1)),
                Form::Delta { scale: d.scale }
            );
            apply(scheme, &d.codes, d.scale, &mut worker).unwrap();
            assert!(
                worker
                    .iter()
                    .zip(shadow.copy.iter())
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{scheme:?} round {round}"
            );
            assert_eq!(d.codes.len(), scheme.compressed_size(len));
        }
        // Error feedback: the copy trails the master by about one round's change, not by
        // the sum of what the codes left out.
        let gap: f32 = master
            .iter()
            .zip(shadow.copy.iter())
            .map(|(m, c)| (m - c).abs())
            .sum::<f32>()
            / len as f32;
        assert!(gap < 0.02, "{scheme:?}: mean gap {gap}");
    }
}

#[test]
fn the_answer_depends_on_the_version_the_worker_holds() {
    let mut s = Shadow::new(&[1.0, 2.0], 7);
    assert_eq!(s.answer(None), Form::Full);
    assert_eq!(s.answer(Some(7)), Form::Same);
    // Version 7 came whole: a worker at 6 cannot build it from codes.
    assert_eq!(s.answer(Some(6)), Form::Full);
    s.advance(Scheme::TwoBit, &[1.5, 2.0]);
    assert_eq!(s.version, 8);
    assert!(matches!(s.answer(Some(7)), Form::Delta { .. }));
    assert_eq!(s.answer(Some(6)), Form::Full);
    assert_eq!(s.answer(Some(9)), Form::Full);
    assert_eq!(s.answer(Some(u64::MAX)), Form::Full);
    // A NaN goes whole, and the next answer to the version before is the whole copy.
    s.advance(Scheme::TwoBit, &[f32::NAN, 2.0]);
    assert!(s.last.is_none() && s.copy[0].is_nan());
    assert_eq!(s.answer(Some(8)), Form::Full);
}

#[test]
fn bad_codes_and_scales_are_errors() {
    let mut copy = vec![0.0f32; 20];
    let e = apply(Scheme::TwoBit, &[0; 3], 1.0, &mut copy).unwrap_err();
    assert!(matches!(e, ApplyError::Length { got: 3, .. }), "{e}");
    assert!(e.to_string().contains("3 bytes"), "{e}");
    let codes = vec![0xffu8; Scheme::TwoBit.compressed_size(20)];
    for scale in [f32::NAN, f32::INFINITY, -1.0] {
        assert!(matches!(
            apply(Scheme::TwoBit, &codes, scale, &mut copy),
            Err(ApplyError::Scale(_))
        ));
    }
    assert!(
        copy.iter().all(|&x| x == 0.0),
        "nothing applied on an error"
    );
}

proptest! {
    /// Over any changes, the codes never move the copy away from the master on average:
    /// the residual `W - W'` stays bounded by the largest single change plus one scale.
    #[test]
    fn the_residual_stays_bounded(
        seed in any::<u64>(),
        len in 1usize..300,
        rounds in 1usize..40,
        one_bit in any::<bool>(),
    ) {
        let scheme = if one_bit { Scheme::OneBit } else { Scheme::TwoBit };
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut master: Vec<f32> = (0..len).map(|_| rng.f32()).collect();
        let mut shadow = Shadow::new(&master, 0);
        let mut worst_step = 0.0f32;
        for _ in 0..rounds {
            for w in master.iter_mut() {
                let step = (rng.f32() - 0.5) * 0.1;
                worst_step = worst_step.max(step.abs());
                *w += step;
            }
            shadow.advance(scheme, &master);
        }
        let mean_gap = master.iter().zip(shadow.copy.iter()).map(|(m, c)| (m - c).abs()).sum::<f32>()
            / len as f32;
        prop_assert!(mean_gap <= 10.0 * worst_step + 1e-6, "mean gap {} after {} rounds", mean_gap, rounds);
        prop_assert!(mean_gap.is_finite());
    }
}

#[test]
fn one_bit_codes_add_their_sign_times_the_scale_as_mxnets_decoder_reads_them() {
    let len = 77;
    let change = values(len, 5);
    let mut codes = vec![0u8; Scheme::OneBit.compressed_size(len)];
    let c = OneBitCompressor::new(0.0).unwrap();
    c.quantize(&change, &mut vec![0.0; len], &mut codes)
        .unwrap();
    let mut signs = vec![0.0f32; len];
    c.dequantize(&codes, &mut signs).unwrap();
    let start = values(len, 6);
    let mut copy = start.clone();
    apply(Scheme::OneBit, &codes, 0.375, &mut copy).unwrap();
    for i in 0..len {
        assert_eq!(
            copy[i].to_bits(),
            (start[i] + 0.375 * signs[i]).to_bits(),
            "{i}"
        );
        assert_eq!(signs[i] > 0.0, change[i] > 0.0, "{i}");
    }
}

/// The pull's quantization as first written, pass by pass: the change written out, its
/// magnitudes summed twice, quantized as a residual with a zero gradient, then applied.
fn quantize_by_passes(scheme: Scheme, value: &[f32], copy: &mut [f32]) -> Option<Delta> {
    use psnet_compression::scale::{magnitudes_from, mean_magnitude_from};
    let n = value.len();
    let mut change: Vec<f32> = value.iter().zip(copy.iter()).map(|(w, c)| w - c).collect();
    let (sum, _) = magnitudes_from(&change, 0.0);
    let mean = if n == 0 { 0.0 } else { (sum / n as f64) as f32 };
    if !mean.is_finite() {
        return None;
    }
    let scale = match scheme {
        Scheme::OneBit => mean,
        Scheme::TwoBit => mean_magnitude_from(&change, mean),
    };
    if !scale.is_finite() {
        return None;
    }
    let mut codes = vec![0u8; scheme.compressed_size(n)];
    if scale > 0.0 && mean > 0.0 {
        let zeros = vec![0.0f32; n];
        match scheme {
            Scheme::TwoBit => TwoBitCompressor::new(mean)
                .unwrap()
                .quantize(&zeros, &mut change, &mut codes)
                .unwrap(),
            Scheme::OneBit => OneBitCompressor::new(0.0)
                .unwrap()
                .quantize(&zeros, &mut change, &mut codes)
                .unwrap(),
        }
    }
    apply(scheme, &codes, scale, copy).ok()?;
    Some(Delta::new(scale, codes))
}

proptest! {
    #[test]
    fn one_pass_codes_are_those_of_the_passes_bit_for_bit(
        len in 0usize..300,
        seed: u64,
        special in 0usize..6,
        two_bit: bool,
    ) {
        let scheme = if two_bit { Scheme::TwoBit } else { Scheme::OneBit };
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut value: Vec<f32> = (0..len).map(|_| rng.f32() * 4.0 - 2.0).collect();
        let mut copy: Vec<f32> = value.iter().map(|v| v - (rng.f32() - 0.5) * 0.1).collect();
        if len > 0 {
            let at = rng.usize(0..len);
            match special {
                0 => value[at] = f32::NAN,
                1 => value[at] = f32::INFINITY,
                2 => (value[at], copy[at]) = (-0.0, 0.0),
                3 => copy.clone_from(&value),
                4 => copy[at] = -0.0,
                _ => {}
            }
        }
        let mut fast_copy = copy.clone();
        let fast = quantize(scheme, &value, &mut fast_copy);
        let slow = quantize_by_passes(scheme, &value, &mut copy);
        prop_assert_eq!(fast.as_ref().map(|d| (d.scale.to_bits(), d.codes.clone())),
            slow.as_ref().map(|d| (d.scale.to_bits(), d.codes.clone())));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&fast_copy), bits(&copy));
    }
}
