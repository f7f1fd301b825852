//! Parsing of MXNet-style parameters and their kvstore wire encoding.

use psnet_compression::{
    mxnet_wire_threshold, CompressionParams, MxnetVersion, ParamsError, Scheme,
};

#[test]
fn parses_what_users_write() {
    let p: CompressionParams = r#"{"type": "2bit", "threshold": 0.5}"#.parse().unwrap();
    assert_eq!(p, CompressionParams::TwoBit { threshold: 0.5 });
    assert_eq!(
        CompressionParams::parse(r#"{"type": "2bit"}"#).unwrap(),
        CompressionParams::TwoBit { threshold: 0.5 }
    );
    assert_eq!(
        CompressionParams::parse(r#"{"type": "1bit", "threshold": 0}"#).unwrap(),
        CompressionParams::OneBit { threshold: 0.0 }
    );
    assert_eq!(
        CompressionParams::parse(r#"{"type": "none"}"#).unwrap(),
        CompressionParams::None
    );
    // Python dict syntax and string values (MXNet's C API passes strings).
    assert_eq!(
        CompressionParams::parse("{'type': '2bit', 'threshold': '0.25'}").unwrap(),
        CompressionParams::TwoBit { threshold: 0.25 }
    );
    assert_eq!(
        CompressionParams::from_kwargs([("type", "2bit"), ("threshold", "1")]).unwrap(),
        CompressionParams::TwoBit { threshold: 1.0 }
    );
}

#[test]
fn threshold_is_rounded_once_from_the_decimal() {
    // 0.1 as f32 directly, not via a differently-rounded path.
    let p = CompressionParams::parse(r#"{"type": "2bit", "threshold": 0.1}"#).unwrap();
    assert_eq!(p.threshold(), Some(0.1f32));
    let p = CompressionParams::parse(r#"{"type": "2bit", "threshold": 1e-7}"#).unwrap();
    assert_eq!(p.threshold(), Some(1e-7f32));
}

#[test]
fn clear_errors() {
    let err = CompressionParams::parse(r#"{"type": "3bit"}"#).unwrap_err();
    assert_eq!(err, ParamsError::UnknownType("3bit".into()));
    assert_eq!(
        err.to_string(),
        "unknown gradient compression type \"3bit\": expected \"2bit\", \"1bit\" or \"none\""
    );

    for bad in ["0", "-1", "nan", "inf"] {
        let text = format!(r#"{{"type": "2bit", "threshold": "{bad}"}}"#);
        let err = CompressionParams::parse(&text).unwrap_err();
        assert!(
            matches!(err, ParamsError::InvalidThreshold { scheme: "2bit", .. }),
            "{bad}: {err}"
        );
    }
    assert!(matches!(
        CompressionParams::parse(r#"{"type": "1bit", "threshold": "nan"}"#),
        Err(ParamsError::InvalidThreshold { scheme: "1bit", .. })
    ));
    // 1-bit accepts zero and negative thresholds, like MXNet 2.x.
    assert!(CompressionParams::parse(r#"{"type": "1bit", "threshold": -1}"#).is_ok());

    for malformed in [
        r#"{"threshold": 0.5}"#,
        r#"{"type": 2}"#,
        r#"{"type": "2bit", "threshold": "abc"}"#,
        r#"{"type": "2bit", "threshold": [1]}"#,
        r#"{"type": "2bit", "treshold": 0.5}"#,
        r#"["2bit"]"#,
        "2bit",
        "",
    ] {
        let err = CompressionParams::parse(malformed).unwrap_err();
        assert!(
            matches!(err, ParamsError::Malformed(_)),
            "{malformed}: {err}"
        );
    }
    let msg = CompressionParams::parse(r#"{"type": "2bit", "treshold": 0.5}"#)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("unknown key \"treshold\""), "{msg}");
}

#[test]
fn accessors_and_builder() {
    let p = CompressionParams::two_bit(0.5).unwrap();
    assert_eq!(p.scheme(), Some(Scheme::TwoBit));
    assert_eq!(p.type_name(), "2bit");
    assert_eq!(p.compressed_size(17), 8);
    assert_eq!(CompressionParams::None.compressed_size(17), 68);
    assert_eq!(CompressionParams::None.type_name(), "none");
    assert!(CompressionParams::None.compressor().unwrap().is_none());
    let c = p.compressor().unwrap().unwrap();
    assert_eq!((c.scheme(), c.threshold()), (Scheme::TwoBit, 0.5));
    let c = CompressionParams::one_bit(0.0)
        .unwrap()
        .compressor()
        .unwrap()
        .unwrap();
    assert_eq!(c.scheme(), Scheme::OneBit);
    // A hand-built invalid variant is caught when building the compressor.
    assert!(CompressionParams::TwoBit { threshold: -1.0 }
        .compressor()
        .is_err());
}

#[test]
fn display_and_serde_round_trip() {
    for p in [
        CompressionParams::None,
        CompressionParams::TwoBit { threshold: 0.1 },
        CompressionParams::OneBit { threshold: -0.5 },
    ] {
        let text = p.to_string();
        assert_eq!(CompressionParams::parse(&text).unwrap(), p, "{text}");
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<CompressionParams>(&json).unwrap(), p);
    }
    assert_eq!(
        CompressionParams::TwoBit { threshold: 0.1 }.to_string(),
        r#"{"threshold":0.1,"type":"2bit"}"#
    );
    assert!(serde_json::from_str::<CompressionParams>(r#"{"type":"4bit"}"#).is_err());
}

/// Found by fuzzing (`fuzz/corpus/compression/regression-1bit-infinite-threshold`): an infinite
/// `1bit` threshold (accepted, e.g. `"1e39"` overflowing f32) was written as `null`, so a
/// server reading a worker's `SetCompression` body got the default 0.5 instead.
#[test]
fn infinite_one_bit_threshold_round_trips() {
    for t in [f32::INFINITY, f32::NEG_INFINITY] {
        let p = CompressionParams::one_bit(t).unwrap();
        let text = p.to_string();
        assert_eq!(CompressionParams::parse(&text).unwrap(), p, "{text}");
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<CompressionParams>(&json).unwrap(), p);
    }
    assert_eq!(
        CompressionParams::OneBit {
            threshold: f32::INFINITY
        }
        .to_string(),
        r#"{"threshold":"inf","type":"1bit"}"#
    );
    let p = CompressionParams::parse(r#"{"type": "1bit", "threshold": "1e39"}"#).unwrap();
    assert_eq!(CompressionParams::parse(&p.to_string()).unwrap(), p);
}

#[test]
fn mxnet_wire_encoding() {
    let p = CompressionParams::two_bit(0.5).unwrap();
    assert_eq!(p.encode_mxnet(MxnetVersion::V1).unwrap(), "1,0.500000");
    assert_eq!(p.encode_mxnet(MxnetVersion::V2).unwrap(), "2,0.500000");
    let one = CompressionParams::one_bit(0.5).unwrap();
    assert_eq!(one.encode_mxnet(MxnetVersion::V2).unwrap(), "1,0.500000");
    assert!(one.encode_mxnet(MxnetVersion::V1).is_err());

    assert_eq!(
        CompressionParams::decode_mxnet("1,0.500000", MxnetVersion::V1).unwrap(),
        p
    );
    assert_eq!(
        CompressionParams::decode_mxnet("2,0.500000", MxnetVersion::V2).unwrap(),
        p
    );
    assert_eq!(
        CompressionParams::decode_mxnet("1,0.500000", MxnetVersion::V2).unwrap(),
        one
    );
    assert_eq!(
        CompressionParams::decode_mxnet("0,0.500000", MxnetVersion::V2).unwrap(),
        CompressionParams::None
    );
    assert!(CompressionParams::decode_mxnet("7,0.5", MxnetVersion::V2).is_err());
    assert!(CompressionParams::decode_mxnet("garbage", MxnetVersion::V2).is_err());
    // The server's threshold is the %f-rounded one.
    let p = CompressionParams::two_bit(0.123_456_7).unwrap();
    let body = p.encode_mxnet(MxnetVersion::V1).unwrap();
    assert_eq!(body, "1,0.123457");
    assert_eq!(
        CompressionParams::decode_mxnet(&body, MxnetVersion::V1)
            .unwrap()
            .threshold(),
        Some(0.123457)
    );
    assert_eq!(mxnet_wire_threshold(0.123_456_7), 0.123457);
    assert_eq!(mxnet_wire_threshold(1e-7), 0.0);
    assert_eq!(mxnet_wire_threshold(0.5), 0.5);
    // 1e-7 prints as 0.000000: an MXNet server would decode zeros; psnet refuses it.
    let tiny = CompressionParams::two_bit(1e-7).unwrap();
    let body = tiny.encode_mxnet(MxnetVersion::V2).unwrap();
    assert_eq!(body, "2,0.000000");
    assert!(CompressionParams::decode_mxnet(&body, MxnetVersion::V2).is_err());
}
