//! Half-precision keys (`f16`, `bf16`) in a real job over TCP: pushes travel as halves, the
//! servers sum and update an `f32` master copy, and pulls answer it rounded to the key's type.
//! The values must be bit-identical to that computation, which differs from rounding after
//! every round (the increments here are below a half's resolution at 1.0).

mod common;

use common::{cluster_with, on_all};
use psnet_kv::updater::OptimizerSpec;
use psnet_kv::{bf16, f16, KvError};

const ROUNDS: u32 = 4;
/// Sharded over both servers (the bound is 100 elements).
const LEN_F16: usize = 250;
const LEN_BF16: usize = 7;

fn grad_f16(rank: u32, i: usize) -> f16 {
    f16::from_f32((rank + 1) as f32 * 2f32.powi(-13) * (1 + i % 3) as f32)
}

fn grad_bf16(rank: u32, i: usize) -> bf16 {
    bf16::from_f32(-((rank + 1) as f32) * 2f32.powi(-10) * (1 + i % 2) as f32)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_keys_follow_an_f32_master_copy_rounded_when_pulled() {
    let c = cluster_with(2, 2, |c| c.bigarray_bound(100)).await;
    let results = on_all(&c.workers, |w| async move {
        w.set_optimizer(&OptimizerSpec::parse(r#"{"type":"test","rescale_grad":1.0}"#).unwrap())
            .await?;
        let one_h = vec![f16::ONE; LEN_F16];
        let one_b = [bf16::ONE; LEN_BF16];
        w.init(&[1], &[&one_h[..]]).await?;
        w.init(&[2], &[&one_b[..]]).await?;
        let mut seen = Vec::new();
        for _ in 0..ROUNDS {
            let g: Vec<f16> = (0..LEN_F16).map(|i| grad_f16(w.rank(), i)).collect();
            let mut out = vec![f16::ZERO; LEN_F16];
            w.pushpull(1, &g, &mut out).await?;
            seen.extend(out.iter().map(|v| v.to_f32()));
            let g: Vec<bf16> = (0..LEN_BF16).map(|i| grad_bf16(w.rank(), i)).collect();
            w.push(2, &g).await?;
            let mut out = vec![bf16::ZERO; LEN_BF16];
            w.pull(2, &mut out).await?;
            seen.extend(out.iter().map(|v| v.to_f32()));
        }
        // A key keeps its type: other types and compression are refused, naming them.
        let wrong = w.push(1, &[0f32; LEN_F16]).await.unwrap_err().to_string();
        assert!(
            wrong.contains("float16") && wrong.contains("float32"),
            "{wrong}"
        );
        let mut out = vec![0f32; LEN_BF16];
        let wrong = w.pull(2, &mut out).await.unwrap_err().to_string();
        assert!(wrong.contains("bfloat16"), "{wrong}");
        Ok::<_, KvError>(seen)
    })
    .await;
    // The reference: the f32 master copy, rounded when read.
    let mut master_h = vec![1f32; LEN_F16];
    let mut master_b = [1f32; LEN_BF16];
    let mut expected = Vec::new();
    for _ in 0..ROUNDS {
        for (i, m) in master_h.iter_mut().enumerate() {
            *m += grad_f16(0, i).to_f32() + grad_f16(1, i).to_f32();
        }
        expected.extend(master_h.iter().map(|m| f16::from_f32(*m).to_f32()));
        for (i, m) in master_b.iter_mut().enumerate() {
            *m += grad_bf16(0, i).to_f32() + grad_bf16(1, i).to_f32();
        }
        expected.extend(master_b.iter().map(|m| bf16::from_f32(*m).to_f32()));
    }
    // Each round's increment is below half an f16 step at 1.0: rounding after every round
    // would keep the value at 1.0 for ever; the master copy moves it by the last round.
    let last = (ROUNDS as usize - 1) * (LEN_F16 + LEN_BF16);
    assert_eq!(expected[0], 1.0);
    assert!(
        expected[last] > 1.0,
        "the increments must show through the master copy"
    );
    for r in results {
        let got = r.unwrap();
        assert_eq!(got.len(), expected.len());
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g.to_bits(), e.to_bits(), "element {i}: {g} != {e}");
        }
    }
    c.finish().await;
}
