//! Keys of half types: an `f32` master copy, pulls rounded to the key's type, pushes of
//! another type or compressed pushes refused, the type kept by snapshots and journals.

use super::tests::{drain, failed_reason as reason, push};
use super::*;
use crate::value::{bf16, f16};

fn halves(values: &[f32], dtype: Dtype) -> Bytes {
    Bytes::from(dtype.narrow(values))
}

fn typed(rank: u32, ts: u64, key: u64, values: &[f32], dtype: Dtype) -> Push {
    let mut p = push(rank, ts, key, &[]);
    p.payload = halves(values, dtype);
    p.n_elems = values.len() as u64;
    p.flags.dtype = dtype;
    p
}

#[test]
fn a_half_key_sums_in_f32_and_answers_in_its_type() {
    for dtype in [Dtype::F16, Dtype::BF16] {
        let mut s = ServerState::new(2).with_checkpoints(0);
        let mut init = typed(0, 1, 3, &[1.0, 2.0], dtype);
        init.flags.init = true;
        s.handle_push(init);
        s.handle_push(typed(0, 2, 3, &[0.5, 0.25], dtype));
        s.handle_push(typed(1, 2, 3, &[0.125, 1.0 / 1024.0], dtype));
        let out = drain(&mut s);
        assert_eq!(
            out.iter()
                .filter(|o| matches!(o, Output::Done { .. }))
                .count(),
            3
        );
        // No updater: the round's f32 sum replaces the value.
        let sum = [0.625f32, 0.25 + 1.0 / 1024.0];
        assert_eq!(s.value(3), Some(&sum[..]), "{dtype}");
        assert_eq!(s.dtype(3), Some(dtype));
        let (AnswerValue::Narrow(bytes), None) = s.answer_value(3, None).unwrap() else {
            panic!("a half key answers in its type");
        };
        assert_eq!(bytes, dtype.narrow(&sum));
        let rounded = match dtype {
            Dtype::F16 => f16::from_f32(sum[1]).to_f32(),
            _ => bf16::from_f32(sum[1]).to_f32(),
        };
        let mut back = [0f32; 2];
        dtype.widen_into(&mut back, &bytes, false);
        assert_eq!(back[1].to_bits(), rounded.to_bits());
        // The type survives a snapshot and the journal's init record.
        let restored = ServerState::restore(&s.snapshot(), 2, u64::MAX).unwrap();
        assert_eq!(restored.dtype(3), Some(dtype));
        let journal: Vec<Vec<u8>> = out
            .into_iter()
            .filter_map(|o| match o {
                Output::Journal(r) => Some(r),
                _ => None,
            })
            .collect();
        let mut replayed = ServerState::new(2);
        for r in &journal {
            replayed.apply_journal(r).unwrap();
        }
        assert_eq!(replayed.snapshot(), s.snapshot());
    }
}

#[test]
fn pushes_of_another_type_compressed_or_of_the_wrong_size_are_refused() {
    let mut s = ServerState::new(1);
    s.handle_command(
        CommandKind::SetCompression,
        r#"{"type":"2bit","threshold":0.5}"#,
    )
    .unwrap();
    let mut init = typed(0, 1, 3, &[1.0; 8], Dtype::F16);
    init.flags.init = true;
    s.handle_push(init);
    drain(&mut s);
    s.handle_push(push(0, 2, 3, &[1.0; 8]));
    let r = reason(&drain(&mut s));
    assert!(r.contains("float16") && r.contains("float32"), "{r}");
    let mut p = typed(0, 3, 3, &[1.0; 8], Dtype::F16);
    p.flags.compressed = true;
    p.payload = Bytes::from(vec![0u8; 2]);
    s.handle_push(p);
    let r = reason(&drain(&mut s));
    assert!(
        r.contains("compress") && r.contains("float32 values only"),
        "{r}"
    );
    let mut p = typed(0, 4, 3, &[1.0; 8], Dtype::F16);
    p.payload = p.payload.slice(..14);
    s.handle_push(p);
    let r = reason(&drain(&mut s));
    assert!(
        r.contains("14 bytes") && r.contains("16 (8 float16)"),
        "{r}"
    );
    let mut odd = typed(0, 5, 4, &[1.0; 3], Dtype::BF16);
    odd.flags.init = true;
    odd.payload = odd.payload.slice(..5);
    s.handle_push(odd);
    assert!(reason(&drain(&mut s)).contains("not bfloat16 values"));
    assert_eq!(s.value(3), Some(&[1.0; 8][..]), "nothing changed");
}
