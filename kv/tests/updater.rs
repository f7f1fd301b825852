//! Server-side optimizers: hand-computed steps, errors, spec parsing, and properties
//! (exact JSON round trip, per-key state, bit-exact agreement with a plain model of the
//! MXNet kernels).

use proptest::prelude::*;
use psnet_kv::updater::{
    Adam, AdamParams, OptimizerSpec, Sgd, SgdParams, TestParams, TestUpdater, Updater, UpdaterError,
};

fn sgd(params: SgdParams) -> Box<dyn Updater> {
    OptimizerSpec::Sgd(params).build()
}

fn spec(text: &str) -> OptimizerSpec {
    OptimizerSpec::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn spec_err(text: &str) -> UpdaterError {
    match OptimizerSpec::parse(text) {
        Ok(spec) => panic!("{text} was accepted as {spec:?}"),
        Err(e) => e,
    }
}

fn bits(xs: &[f32]) -> Vec<u32> {
    xs.iter().map(|x| x.to_bits()).collect()
}

// ---------------------------------------------------------------------------------------
// SGD, hand-computed (all values exact in f32)

#[test]
fn sgd_plain_step() {
    let mut u = sgd(SgdParams {
        learning_rate: 0.5,
        ..SgdParams::default()
    });
    let mut w = [1.0f32, 2.0, -3.0];
    u.update(0, &[1.0, -2.0, 0.5], &mut w).unwrap();
    assert_eq!(w, [0.5, 3.0, -3.25]);
}

#[test]
fn sgd_defaults_are_mxnet_defaults() {
    let OptimizerSpec::Sgd(p) = spec(r#"{"type": "sgd"}"#) else {
        panic!("not sgd")
    };
    assert_eq!(
        p,
        SgdParams {
            learning_rate: 0.01,
            momentum: 0.0,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: None
        }
    );
    assert_eq!(p, SgdParams::default());
    // lr = 0.01: w = 1 - 0.01 * 1 (one f32 rounding of the product, one of the sum).
    let mut w = [1.0f32];
    sgd(p).update(3, &[1.0], &mut w).unwrap();
    assert_eq!(w, [1.0f32 + ((0.0 - 0.0) - 0.01f32 * 1.0)]);
    assert!((w[0] - 0.99).abs() < 1e-7);
}

#[test]
fn sgd_weight_decay() {
    // (1 - lr * wd) * w - lr * g = (1 - 0.25) * 2 - 0.5 * 1 = 1.
    let mut u = sgd(SgdParams {
        learning_rate: 0.5,
        wd: 0.5,
        ..SgdParams::default()
    });
    let mut w = [2.0f32, -4.0];
    u.update(0, &[1.0, 0.0], &mut w).unwrap();
    assert_eq!(w, [1.0, -3.0]);
}

#[test]
fn sgd_rescale_grad() {
    // step = lr * rescale * g = 0.5 * 0.25 * 4 = 0.5.
    let mut u = sgd(SgdParams {
        learning_rate: 0.5,
        rescale_grad: 0.25,
        ..SgdParams::default()
    });
    let mut w = [1.0f32];
    u.update(0, &[4.0], &mut w).unwrap();
    assert_eq!(w, [0.5]);
}

#[test]
fn sgd_clip_applies_to_the_rescaled_gradient() {
    // rescale * g = [0.5, 6, -6, 1] → clip to [-1, 1] → [0.5, 1, -1, 1]; step = 0.5 * that.
    let mut u = sgd(SgdParams {
        learning_rate: 0.5,
        rescale_grad: 2.0,
        clip_gradient: Some(1.0),
        ..SgdParams::default()
    });
    let mut w = [0.0f32; 4];
    u.update(0, &[0.25, 3.0, -3.0, 0.5], &mut w).unwrap();
    assert_eq!(w, [-0.25, -0.5, 0.5, -0.5]);
}

#[test]
fn sgd_momentum_steps() {
    let mut u = sgd(SgdParams {
        learning_rate: 0.5,
        momentum: 0.5,
        ..SgdParams::default()
    });
    let mut w = [1.0f32];
    u.update(0, &[1.0], &mut w).unwrap(); // mom = -0.5
    assert_eq!(w, [0.5]);
    u.update(0, &[1.0], &mut w).unwrap(); // mom = 0.5 * -0.5 - 0.5 = -0.75
    assert_eq!(w, [-0.25]);
    u.update(0, &[0.0], &mut w).unwrap(); // mom = -0.375
    assert_eq!(w, [-0.625]);
}

#[test]
fn sgd_momentum_with_weight_decay_and_clip() {
    // lr 0.5, momentum 0.5, wd 0.5, clip 1:
    // step 1: w = 4, g = 10 → clip 1: mom = 0 - 0.25 * 4 - 0.5 * 1 = -1.5; w = 2.5
    // step 2: g = 0: mom = 0.5 * -1.5 - 0.25 * 2.5 - 0 = -1.375; w = 1.125
    let mut u = sgd(SgdParams {
        learning_rate: 0.5,
        momentum: 0.5,
        wd: 0.5,
        clip_gradient: Some(1.0),
        ..SgdParams::default()
    });
    let mut w = [4.0f32];
    u.update(0, &[10.0], &mut w).unwrap();
    assert_eq!(w, [2.5]);
    u.update(0, &[0.0], &mut w).unwrap();
    assert_eq!(w, [1.125]);
}

#[test]
fn sgd_without_momentum_uses_mxnet_multi_sgd_operation_order() {
    // MXNet 1.9.1's Python SGD runs `multi_sgd_update`: w + ((0 - (lr*wd)*w) - (lr*rs)*g),
    // not sgd_update's (1 - lr*wd)*w - (lr*rs)*g. Same value in exact arithmetic; this pins
    // the rounding.
    let (lr, wd, rs) = (0.1f32, 0.3f32, 0.7f32);
    let (w0, g) = (8.546438f32, 7.35332f32);
    let mxnet_multi_sgd = w0 + ((0.0 - (lr * wd) * w0) - (lr * rs) * g);
    let sgd_update = (1.0 - lr * wd) * w0 - (lr * rs) * g;
    assert_ne!(
        mxnet_multi_sgd.to_bits(),
        sgd_update.to_bits(),
        "values do not discriminate"
    );
    let mut u = sgd(SgdParams {
        learning_rate: f64::from(lr),
        wd: f64::from(wd),
        rescale_grad: f64::from(rs),
        ..SgdParams::default()
    });
    let mut w = [w0];
    u.update(0, &[g], &mut w).unwrap();
    assert_eq!(w[0].to_bits(), mxnet_multi_sgd.to_bits());
}

// ---------------------------------------------------------------------------------------
// Adam, hand-computed

/// beta1 = 0.5, beta2 = 0.75, lr = 1 (and the default epsilon, which vanishes next to 1 in
/// f32) keep every moment exact:
/// step 1, g = 2: mean = 0.5 * 2 = 1, var = 0.25 * 4 = 1,
///   lr_1 = 1 * sqrt(1 - 0.75) / (1 - 0.5) = 1 → w = 0 - 1 * 1 / (1 + eps) = -1.
/// step 2, g = 1: mean = 0.5 + 0.5 = 1, var = 0.75 + 0.25 = 1,
///   lr_2 = sqrt(1 - 0.5625) / (1 - 0.25) = sqrt(0.4375) / 0.75 ≈ 0.8819 → w = -1 - lr_2.
fn exact_adam() -> AdamParams {
    AdamParams {
        learning_rate: 1.0,
        beta1: 0.5,
        beta2: 0.75,
        ..AdamParams::default()
    }
}

fn lr_2() -> f32 {
    (0.4375f64.sqrt() / 0.75) as f32
}

#[test]
fn adam_first_two_steps_with_bias_correction() {
    let mut u = Adam::new(exact_adam());
    let mut w = [0.0f32, 0.0];
    u.update(0, &[2.0, -2.0], &mut w).unwrap();
    assert_eq!(w, [-1.0, 1.0]);
    assert_eq!(u.step_count(0), 1);
    u.update(0, &[1.0, -1.0], &mut w).unwrap();
    assert_eq!(w, [-1.0 - lr_2(), 1.0 + lr_2()]);
    assert_eq!(u.step_count(0), 2);
    // Textbook Adam: mhat = 1 / 0.75, vhat = 1 / 0.4375, step = mhat / sqrt(vhat).
    let textbook = (1.0 / 0.75) / (1.0f64 / 0.4375).sqrt();
    assert!((f64::from(lr_2()) - textbook).abs() < 1e-7);
}

#[test]
fn adam_weight_decay_rescale_and_clip_shape_the_gradient() {
    // g' = g * rescale + w * wd, then clipped: all three give g' = 2 on the first step, like
    // `adam_first_two_steps_with_bias_correction`.
    // wd: w = 1, g = 1.5, wd = 0.5 → 1.5 + 0.5 = 2 → w = 1 - 1 = 0.
    let mut u = Adam::new(AdamParams {
        wd: 0.5,
        ..exact_adam()
    });
    let mut w = [1.0f32];
    u.update(0, &[1.5], &mut w).unwrap();
    assert_eq!(w, [0.0]);
    // rescale: g = 8 * 0.25 = 2.
    let mut u = Adam::new(AdamParams {
        rescale_grad: 0.25,
        ..exact_adam()
    });
    let mut w = [0.0f32];
    u.update(0, &[8.0], &mut w).unwrap();
    assert_eq!(w, [-1.0]);
    // clip: g = 10 → 2 (and -10 → -2).
    let mut u = Adam::new(AdamParams {
        clip_gradient: Some(2.0),
        ..exact_adam()
    });
    let mut w = [0.0f32, 0.0];
    u.update(0, &[10.0, -10.0], &mut w).unwrap();
    assert_eq!(w, [-1.0, 1.0]);
    // Clipping happens after weight decay: w = 1, g = 0, wd = 8 → g' = 8 → clip 2.
    let mut u = Adam::new(AdamParams {
        wd: 8.0,
        clip_gradient: Some(2.0),
        ..exact_adam()
    });
    let mut w = [1.0f32];
    u.update(0, &[0.0], &mut w).unwrap();
    assert_eq!(w, [0.0]);
}

#[test]
fn adam_defaults_first_step_moves_by_about_lr() {
    let OptimizerSpec::Adam(p) = spec(r#"{"type": "adam"}"#) else {
        panic!("not adam")
    };
    assert_eq!(
        p,
        AdamParams {
            learning_rate: 0.001,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            wd: 0.0,
            rescale_grad: 1.0,
            clip_gradient: None
        }
    );
    // Bias correction makes the first step lr * g / (|g| + eps) whatever the gradient's size.
    let mut u = OptimizerSpec::Adam(p).build();
    let mut w = [0.0f32, 1.0, 5.0];
    u.update(1, &[3.0, -0.01, 100.0], &mut w).unwrap();
    for (got, want) in w.iter().zip([-0.001f32, 1.001, 4.999]) {
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }
    // Second step, textbook Adam in f64: g1 = 1, g2 = 2.
    let mut u = Adam::new(p);
    let mut w = [0.0f32];
    u.update(1, &[1.0], &mut w).unwrap();
    u.update(1, &[2.0], &mut w).unwrap();
    let m = 0.9 * 0.1 + 0.1 * 2.0;
    let v = 0.999 * 0.001 + 0.001 * 4.0;
    let step2 = 0.001 * (m / (1.0 - 0.81)) / ((v / (1.0 - 0.998001f64)).sqrt() + 1e-8);
    let want = -0.001 - step2;
    assert!((f64::from(w[0]) - want).abs() < 1e-7, "{} vs {want}", w[0]);
}

#[test]
fn adam_step_count_is_per_key() {
    let mut u = Adam::new(exact_adam());
    let mut a = [0.0f32];
    u.update(1, &[2.0], &mut a).unwrap();
    u.update(1, &[1.0], &mut a).unwrap();
    // Key 2's first update uses t = 1, not 3.
    let mut b = [0.0f32];
    u.update(2, &[2.0], &mut b).unwrap();
    assert_eq!(b, [-1.0]);
    assert_eq!(
        (u.step_count(1), u.step_count(2), u.step_count(3)),
        (2, 1, 0)
    );
}

// ---------------------------------------------------------------------------------------
// The test optimizer

#[test]
fn test_optimizer_adds_the_rescaled_gradient() {
    let mut u = spec(r#"{"type": "test", "rescale_grad": 2}"#).build();
    let mut w = [1.0f32, -1.0];
    u.update(0, &[0.5, 0.25], &mut w).unwrap();
    assert_eq!(w, [2.0, -0.5]);
    u.update(0, &[1.0, 1.0], &mut w).unwrap();
    assert_eq!(w, [4.0, 1.5]);
    // Default rescale 1: a plain sum, as MXNet's kvstore tests expect.
    let mut u = TestUpdater::new(TestParams::default());
    let mut w = [3.0f32];
    u.update(9, &[4.0], &mut w).unwrap();
    assert_eq!(w, [7.0]);
}

// ---------------------------------------------------------------------------------------
// Update errors

fn all_updaters() -> Vec<(&'static str, Box<dyn Updater>)> {
    vec![
        ("sgd", sgd(SgdParams::default())),
        (
            "sgd+momentum",
            sgd(SgdParams {
                momentum: 0.9,
                ..SgdParams::default()
            }),
        ),
        ("adam", OptimizerSpec::Adam(AdamParams::default()).build()),
        ("test", OptimizerSpec::Test(TestParams::default()).build()),
    ]
}

#[test]
fn length_mismatch_is_an_error_naming_key_and_lengths() {
    for (name, mut u) in all_updaters() {
        let mut w = [1.0f32, 2.0, 3.0];
        let err = u.update(42, &[1.0, 1.0], &mut w).unwrap_err();
        assert_eq!(
            err,
            UpdaterError::LengthMismatch {
                key: 42,
                grad_len: 2,
                weight_len: 3
            },
            "{name}"
        );
        let message = err.to_string();
        for part in ["42", "2", "3"] {
            assert!(message.contains(part), "{name}: {message}");
        }
        assert_eq!(w, [1.0, 2.0, 3.0], "{name}: weight changed");
    }
}

#[test]
fn a_key_whose_state_has_another_length_is_an_error() {
    for (name, mut u) in all_updaters() {
        let stateful = name == "adam" || name == "sgd+momentum";
        let mut w = [1.0f32, 2.0, 3.0];
        u.update(7, &[0.5; 3], &mut w).unwrap();
        let before = w;
        let mut short = [1.0f32, 2.0];
        let result = u.update(7, &[0.5; 2], &mut short);
        if stateful {
            let err = result.unwrap_err();
            assert_eq!(
                err,
                UpdaterError::StateLengthMismatch {
                    key: 7,
                    state_len: 3,
                    weight_len: 2
                },
                "{name}"
            );
            assert!(err.to_string().contains("key 7"), "{err}");
            assert_eq!(short, [1.0, 2.0], "{name}: weight changed");
        } else {
            // No per-key state: nothing ties the key to a length.
            result.unwrap();
        }
        // Other keys are unaffected, and the failed call left no trace: the next update of
        // key 7 matches a run that never saw it.
        u.update(8, &[1.0; 2], &mut [0.0; 2]).unwrap();
        u.update(7, &[0.25; 3], &mut w).unwrap();
        let mut reference = all_updaters()
            .into_iter()
            .find(|(n, _)| *n == name)
            .unwrap()
            .1;
        let mut expected = [1.0f32, 2.0, 3.0];
        reference.update(7, &[0.5; 3], &mut expected).unwrap();
        assert_eq!(expected, before);
        reference.update(7, &[0.25; 3], &mut expected).unwrap();
        assert_eq!(bits(&w), bits(&expected), "{name}");
    }
}

#[test]
fn empty_arrays_are_fine() {
    for (name, mut u) in all_updaters() {
        u.update(0, &[], &mut [])
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

// ---------------------------------------------------------------------------------------
// Specs

#[test]
fn parse_reads_mxnet_style_arguments() {
    assert_eq!(
        spec(r#"{"type": "sgd", "learning_rate": 0.1, "momentum": 0.9}"#),
        OptimizerSpec::Sgd(SgdParams {
            learning_rate: 0.1,
            momentum: 0.9,
            ..SgdParams::default()
        })
    );
    assert_eq!(
        spec(
            r#"{"type": "adam", "learning_rate": 0.01, "beta1": 0.8, "beta2": 0.99,
                "epsilon": 1e-6, "wd": 0.0001, "rescale_grad": 0.125, "clip_gradient": 5}"#
        ),
        OptimizerSpec::Adam(AdamParams {
            learning_rate: 0.01,
            beta1: 0.8,
            beta2: 0.99,
            epsilon: 1e-6,
            wd: 0.0001,
            rescale_grad: 0.125,
            clip_gradient: Some(5.0),
        })
    );
    assert_eq!(
        spec(r#"{"type": "test"}"#),
        OptimizerSpec::Test(TestParams { rescale_grad: 1.0 })
    );
}

#[test]
fn parse_accepts_case_python_dicts_numeric_strings_and_null_clip() {
    let sgd = OptimizerSpec::Sgd(SgdParams {
        learning_rate: 0.1,
        ..SgdParams::default()
    });
    assert_eq!(spec(r#"{"type": "SGD", "learning_rate": 0.1}"#), sgd);
    assert_eq!(spec("{'type': 'sgd', 'learning_rate': 0.1}"), sgd);
    assert_eq!(spec(r#"{"type": "sgd", "learning_rate": " 0.1"}"#), sgd);
    assert_eq!(
        spec(r#"{"type": "sgd", "learning_rate": 0.1, "clip_gradient": null}"#),
        sgd
    );
    assert_eq!(spec(r#"{"type": "Adam"}"#).type_name(), "adam");
    assert_eq!(
        "{\"type\": \"test\"}"
            .parse::<OptimizerSpec>()
            .unwrap()
            .type_name(),
        "test"
    );
}

#[test]
fn unknown_type_is_refused() {
    assert_eq!(
        spec_err(r#"{"type": "rmsprop"}"#),
        UpdaterError::UnknownType("rmsprop".into())
    );
    let message = spec_err(r#"{"type": "nag"}"#).to_string();
    assert!(
        message.contains("\"nag\"") && message.contains("\"sgd\""),
        "{message}"
    );
}

#[test]
fn malformed_specs_are_refused_with_the_reason() {
    for (text, needle) in [
        (r#"{"learning_rate": 0.1}"#, "missing \"type\""),
        (r#"{"type": 3}"#, "\"type\" must be a string"),
        (r#"["sgd"]"#, "expected an object"),
        (r#"{"type": "sgd""#, "EOF"),
        ("", "EOF"),
        (r#"{"type": "sgd", "lr": 0.1}"#, "\"lr\""),
        (r#"{"type": "sgd", "lr": 0.1}"#, "\"learning_rate\""),
        (r#"{"type": "test", "learning_rate": 0.1}"#, "unknown test"),
        (r#"{"type": "sgd", "beta1": 0.9}"#, "unknown sgd"),
        (r#"{"type": "adam", "momentum": 0.9}"#, "unknown adam"),
        (r#"{"type": "sgd", "momentum": true}"#, "must be a number"),
        (r#"{"type": "sgd", "momentum": "fast"}"#, "must be a number"),
        (r#"{"type": "sgd", "momentum": null}"#, "must be a number"),
    ] {
        let err = spec_err(text);
        assert!(matches!(err, UpdaterError::Malformed(_)), "{text}: {err:?}");
        assert!(err.to_string().contains(needle), "{text}: {err}");
    }
}

#[test]
fn out_of_range_parameters_are_refused() {
    for (text, param) in [
        (r#"{"type": "sgd", "learning_rate": -0.1}"#, "learning_rate"),
        (
            r#"{"type": "sgd", "learning_rate": "NaN"}"#,
            "learning_rate",
        ),
        (
            r#"{"type": "sgd", "learning_rate": "inf"}"#,
            "learning_rate",
        ),
        (r#"{"type": "sgd", "learning_rate": 1e999}"#, ""),
        (r#"{"type": "sgd", "momentum": 1.0}"#, "momentum"),
        (r#"{"type": "sgd", "momentum": -0.5}"#, "momentum"),
        (r#"{"type": "sgd", "wd": -1e-4}"#, "wd"),
        (r#"{"type": "sgd", "rescale_grad": 0}"#, "rescale_grad"),
        (r#"{"type": "sgd", "clip_gradient": 0}"#, "clip_gradient"),
        (r#"{"type": "sgd", "clip_gradient": -1}"#, "clip_gradient"),
        (r#"{"type": "adam", "beta1": 1}"#, "beta1"),
        (r#"{"type": "adam", "beta1": -0.1}"#, "beta1"),
        (r#"{"type": "adam", "beta2": 1.5}"#, "beta2"),
        (r#"{"type": "adam", "beta2": "nan"}"#, "beta2"),
        (r#"{"type": "adam", "epsilon": 0}"#, "epsilon"),
        (r#"{"type": "adam", "learning_rate": -1}"#, "learning_rate"),
        (
            r#"{"type": "adam", "clip_gradient": "-inf"}"#,
            "clip_gradient",
        ),
        (r#"{"type": "test", "rescale_grad": -2}"#, "rescale_grad"),
    ] {
        let err = spec_err(text);
        let message = err.to_string();
        assert!(message.contains(param), "{text}: {message}");
        if !param.is_empty() {
            assert!(
                matches!(err, UpdaterError::InvalidParam { param: p, .. } if p == param),
                "{text}: {err:?}"
            );
        }
    }
    let message = spec_err(r#"{"type": "sgd", "clip_gradient": 0}"#).to_string();
    assert!(
        message.contains("null"),
        "should say how to disable clipping: {message}"
    );
    let message = spec_err(r#"{"type": "adam", "beta1": 1}"#).to_string();
    assert!(
        message.contains("[0, 1)") && message.contains("adam"),
        "{message}"
    );
}

#[test]
fn validate_checks_hand_built_specs() {
    let bad = OptimizerSpec::Sgd(SgdParams {
        learning_rate: f64::NAN,
        ..SgdParams::default()
    });
    assert!(matches!(
        bad.validate(),
        Err(UpdaterError::InvalidParam {
            optimizer: "sgd",
            param: "learning_rate",
            ..
        })
    ));
    // Serialized, it does not come back.
    assert!(OptimizerSpec::parse(&bad.to_json()).is_err());
    assert!(OptimizerSpec::default().validate().is_ok());
}

#[test]
fn to_json_writes_every_parameter() {
    let s = OptimizerSpec::Sgd(SgdParams {
        learning_rate: 0.1,
        momentum: 0.9,
        ..SgdParams::default()
    });
    assert_eq!(
        s.to_json(),
        r#"{"learning_rate":0.1,"momentum":0.9,"rescale_grad":1.0,"type":"sgd","wd":0.0}"#
    );
    assert_eq!(s.to_string(), s.to_json());
    let a = spec(r#"{"type": "adam", "clip_gradient": 10}"#).to_json();
    for field in [
        "\"type\":\"adam\"",
        "\"learning_rate\":0.001",
        "\"beta1\":0.9",
        "\"beta2\":0.999",
        "\"epsilon\":1e-8",
        "\"clip_gradient\":10.0",
    ] {
        assert!(a.contains(field), "{field} not in {a}");
    }
}

#[test]
fn to_json_is_exact_where_serde_json_would_round_wrongly() {
    // serde_json (without `float_roundtrip`) reads this 17-digit number one ulp low.
    let x = 0.097_459_630_547_230_17_f64;
    let misread: f64 = serde_json::from_str(&serde_json::to_string(&x).unwrap()).unwrap();
    assert_ne!(
        misread.to_bits(),
        x.to_bits(),
        "serde_json got exact: test is moot"
    );
    let s = OptimizerSpec::Sgd(SgdParams {
        learning_rate: x,
        ..SgdParams::default()
    });
    let text = s.to_json();
    assert!(
        text.contains(r#""learning_rate":"0.09745963054723017""#),
        "{text}"
    );
    let OptimizerSpec::Sgd(back) = spec(&text) else {
        panic!("not sgd")
    };
    assert_eq!(back.learning_rate.to_bits(), x.to_bits());
}

#[test]
fn serde_uses_the_same_form_and_validation() {
    let s = spec(r#"{"type": "adam", "beta1": 0.8}"#);
    let via_serde: OptimizerSpec =
        serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
    assert_eq!(via_serde, s);
    assert_eq!(serde_json::to_string(&s).unwrap(), s.to_json());
    assert!(serde_json::from_str::<OptimizerSpec>(r#"{"type": "adam", "beta1": 2}"#).is_err());
    assert!(serde_json::from_str::<OptimizerSpec>(r#"{"type": "lbfgs"}"#).is_err());
}

// ---------------------------------------------------------------------------------------
// Properties

/// A plain model of MXNet's `multi_sgd_(mom_)update` kernel for one element.
fn model_sgd(p: &SgdParams, w: f32, g: f32, mom: f32) -> (f32, f32) {
    let lr = p.learning_rate as f32;
    let rs = p.rescale_grad as f32;
    let wd = p.wd as f32;
    let momentum = if p.momentum > 0.0 {
        p.momentum as f32
    } else {
        0.0
    };
    let mom = match p.clip_gradient {
        Some(c) => {
            let x = rs * g;
            let c = c as f32;
            let clipped = if x > c {
                c
            } else if x < -c {
                -c
            } else {
                x
            };
            momentum * mom - lr * wd * w - lr * clipped
        }
        None => momentum * mom - lr * wd * w - lr * rs * g,
    };
    (w + mom, mom)
}

/// A plain model of MXNet's `adam_update` kernel plus the Python bias correction.
fn model_adam(p: &AdamParams, t: u64, w: f32, g: f32, mean: f32, var: f32) -> (f32, f32, f32) {
    let lr_t = (p.learning_rate
        * ((1.0 - p.beta2.powf(t as f64)).sqrt() / (1.0 - p.beta1.powf(t as f64))))
        as f32;
    let (b1, b2) = (p.beta1 as f32, p.beta2 as f32);
    let mut g = g * p.rescale_grad as f32 + w * p.wd as f32;
    if let Some(c) = p.clip_gradient {
        g = g.clamp(-(c as f32), c as f32);
    }
    let mean = b1 * mean + (1.0 - b1) * g;
    let var = b2 * var + (1.0 - b2) * g * g;
    (w - lr_t * mean / (var.sqrt() + p.epsilon as f32), mean, var)
}

fn finite_f32(range: f32) -> impl Strategy<Value = f32> {
    -range..range
}

fn clip_strategy() -> impl Strategy<Value = Option<f64>> {
    prop_oneof![Just(None), (1e-3..10.0f64).prop_map(Some)]
}

fn sgd_params() -> impl Strategy<Value = SgdParams> {
    (
        0.0..2.0f64,
        prop_oneof![Just(0.0), 0.0..1.0f64],
        prop_oneof![Just(0.0), 0.0..0.1f64],
        1e-3..4.0f64,
        clip_strategy(),
    )
        .prop_map(
            |(learning_rate, momentum, wd, rescale_grad, clip_gradient)| SgdParams {
                learning_rate,
                momentum,
                wd,
                rescale_grad,
                clip_gradient,
            },
        )
}

fn adam_params() -> impl Strategy<Value = AdamParams> {
    (
        0.0..0.5f64,
        0.0..1.0f64,
        0.0..1.0f64,
        1e-10..1e-3f64,
        prop_oneof![Just(0.0), 0.0..0.1f64],
        1e-3..4.0f64,
        clip_strategy(),
    )
        .prop_map(
            |(learning_rate, beta1, beta2, epsilon, wd, rescale_grad, clip_gradient)| AdamParams {
                learning_rate,
                beta1,
                beta2,
                epsilon,
                wd,
                rescale_grad,
                clip_gradient,
            },
        )
}

fn any_spec() -> impl Strategy<Value = OptimizerSpec> {
    prop_oneof![
        sgd_params().prop_map(OptimizerSpec::Sgd),
        adam_params().prop_map(OptimizerSpec::Adam),
        (1e-3..1e3f64).prop_map(|rescale_grad| OptimizerSpec::Test(TestParams { rescale_grad })),
    ]
}

/// Bit patterns of every parameter, for exact comparison.
fn spec_bits(s: &OptimizerSpec) -> (&'static str, Vec<Option<u64>>) {
    let v = match *s {
        OptimizerSpec::Sgd(p) => vec![
            Some(p.learning_rate.to_bits()),
            Some(p.momentum.to_bits()),
            Some(p.wd.to_bits()),
            Some(p.rescale_grad.to_bits()),
            p.clip_gradient.map(f64::to_bits),
        ],
        OptimizerSpec::Adam(p) => vec![
            Some(p.learning_rate.to_bits()),
            Some(p.beta1.to_bits()),
            Some(p.beta2.to_bits()),
            Some(p.epsilon.to_bits()),
            Some(p.wd.to_bits()),
            Some(p.rescale_grad.to_bits()),
            p.clip_gradient.map(f64::to_bits),
        ],
        OptimizerSpec::Test(p) => vec![Some(p.rescale_grad.to_bits())],
    };
    (s.type_name(), v)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn sgd_with_zero_lr_and_wd_leaves_weights_unchanged(
        momentum in prop_oneof![Just(0.0), 0.0..1.0f64],
        rescale_grad in 1e-3..100.0f64,
        clip_gradient in clip_strategy(),
        steps in prop::collection::vec(
            prop::collection::vec((finite_f32(1e6), finite_f32(1e6)), 8), 1..4),
    ) {
        let mut u = sgd(SgdParams { learning_rate: 0.0, momentum, wd: 0.0, rescale_grad, clip_gradient });
        let start: Vec<f32> = steps[0].iter().map(|(w, _)| *w).collect();
        let mut w = start.clone();
        for step in &steps {
            let g: Vec<f32> = step.iter().map(|(_, g)| *g).collect();
            u.update(5, &g, &mut w).unwrap();
        }
        prop_assert_eq!(w, start);
    }

    #[test]
    fn clipping_bounds_the_step_to_lr_times_clip(
        learning_rate in 1e-4..10.0f64,
        clip in 1e-3..10.0f64,
        rescale_grad in 1e-3..100.0f64,
        w0 in prop::collection::vec(finite_f32(100.0), 16),
        g in prop::collection::vec(finite_f32(1e4), 16),
    ) {
        let params = SgdParams {
            learning_rate, rescale_grad, clip_gradient: Some(clip), ..SgdParams::default()
        };
        let bound = learning_rate as f32 * clip as f32;
        // From zero the step is exactly the applied update.
        let mut w = vec![0.0f32; 16];
        sgd(params).update(0, &g, &mut w).unwrap();
        for x in &w {
            prop_assert!(x.abs() <= bound, "{} > {}", x.abs(), bound);
        }
        // From anywhere, up to the rounding of the final addition.
        let mut w = w0.clone();
        sgd(params).update(0, &g, &mut w).unwrap();
        for (new, old) in w.iter().zip(&w0) {
            let slack = old.abs().max(bound) * f32::EPSILON;
            prop_assert!((new - old).abs() <= bound + slack, "{} -> {}", old, new);
        }
    }

    #[test]
    fn spec_json_round_trip_is_exact(s in any_spec()) {
        let text = s.to_json();
        let back = OptimizerSpec::parse(&text).unwrap();
        prop_assert_eq!(spec_bits(&back), spec_bits(&s));
        prop_assert_eq!(back, s);
        let via_serde: OptimizerSpec = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        prop_assert_eq!(spec_bits(&via_serde), spec_bits(&s));
    }

    #[test]
    fn spec_json_round_trip_is_exact_for_any_f64(
        learning_rate in 0.0..f64::MAX,
        momentum in 0.0..1.0f64,
        clip in prop::option::of(f64::MIN_POSITIVE..f64::MAX),
    ) {
        let s = OptimizerSpec::Sgd(SgdParams {
            learning_rate, momentum, clip_gradient: clip, ..SgdParams::default()
        });
        let back = OptimizerSpec::parse(&s.to_json()).unwrap();
        prop_assert_eq!(spec_bits(&back), spec_bits(&s));
    }

    #[test]
    fn state_is_per_key(
        s in any_spec(),
        a in prop::collection::vec(finite_f32(10.0), 1..6),
        b in prop::collection::vec(finite_f32(10.0), 1..6),
        grads in prop::collection::vec((any::<bool>(), finite_f32(10.0)), 1..12),
    ) {
        // Interleaved updates of keys 1 and 2 on one updater give, for each key, the bits of
        // an updater that only ever saw that key.
        let mut shared = s.build();
        let (mut alone_a, mut alone_b) = (s.build(), s.build());
        let (mut wa, mut wb) = (a.clone(), b.clone());
        let (mut ra, mut rb) = (a.clone(), b.clone());
        for (to_a, g) in grads {
            if to_a {
                let grad: Vec<f32> = wa.iter().map(|x| g * 0.5 + x * 0.25).collect();
                shared.update(1, &grad, &mut wa).unwrap();
                alone_a.update(1, &grad, &mut ra).unwrap();
            } else {
                let grad = vec![g; wb.len()];
                shared.update(2, &grad, &mut wb).unwrap();
                alone_b.update(2, &grad, &mut rb).unwrap();
            }
        }
        prop_assert_eq!(bits(&wa), bits(&ra));
        prop_assert_eq!(bits(&wb), bits(&rb));
    }

    #[test]
    fn sgd_matches_the_kernel_model_bit_for_bit(
        p in sgd_params(),
        steps in prop::collection::vec(prop::collection::vec(finite_f32(1e3), 8), 1..5),
        w0 in prop::collection::vec(finite_f32(1e3), 8),
    ) {
        let mut u = Sgd::new(p);
        let mut w = w0.clone();
        let (mut mw, mut mom) = (w0, vec![0.0f32; 8]);
        for g in &steps {
            u.update(0, g, &mut w).unwrap();
            for i in 0..8 {
                let prev = if p.momentum > 0.0 { mom[i] } else { 0.0 };
                (mw[i], mom[i]) = model_sgd(&p, mw[i], g[i], prev);
            }
        }
        prop_assert_eq!(bits(&w), bits(&mw));
    }

    #[test]
    fn adam_matches_the_kernel_model_bit_for_bit(
        p in adam_params(),
        steps in prop::collection::vec(prop::collection::vec(finite_f32(1e3), 8), 1..5),
        w0 in prop::collection::vec(finite_f32(1e3), 8),
    ) {
        let mut u = Adam::new(p);
        let mut w = w0.clone();
        let (mut mw, mut mean, mut var) = (w0, vec![0.0f32; 8], vec![0.0f32; 8]);
        for (t, g) in steps.iter().enumerate() {
            u.update(0, g, &mut w).unwrap();
            for i in 0..8 {
                (mw[i], mean[i], var[i]) =
                    model_adam(&p, t as u64 + 1, mw[i], g[i], mean[i], var[i]);
            }
        }
        prop_assert_eq!(bits(&w), bits(&mw));
    }
}
