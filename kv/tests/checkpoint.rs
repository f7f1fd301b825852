//! Servers of a real job (scheduler, servers and workers over 127.0.0.1) with
//! `PSNET_CHECKPOINT_DIR`: the files appear, and `load_shard` rebuilds each server's final
//! state bit for bit.

use std::path::PathBuf;
use std::time::Duration;

use psnet_kv::checkpoint::{journal_path, load_shard, snapshot_path};
use psnet_kv::updater::OptimizerSpec;

mod common;

use common::{cluster_with, on_all};

const ADAM: &str = r#"{"type":"adam","learning_rate":0.01,"wd":0.001}"#;
const ROUNDS: usize = 5;
const SMALL: usize = 5;
const BIG: usize = 40;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("psnet-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Worker `rank`'s gradient of round `round` for a key of `n` elements.
fn grad(rank: u32, round: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 31 + round * 7 + rank as usize * 13) % 17) as f32 * 0.1 - 0.8)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_checkpoint_and_load_shard_rebuilds_their_state() {
    let dir = temp_dir("checkpoint-job");
    let d = dir.clone();
    // Key 1 lives on one server, key 2 (>= 16 elements) is split over both.
    let c = cluster_with(2, 2, move |c| {
        c.bigarray_bound(16)
            .heartbeats(
                Some(Duration::from_millis(200)),
                Some(Duration::from_secs(5)),
            )
            .checkpoint_dir(Some(d.clone()))
            .checkpoint_every(2)
    })
    .await;
    let results = on_all(&c.workers, |w| async move {
        w.set_optimizer(&OptimizerSpec::parse(ADAM).unwrap())
            .await?;
        w.init(&[1, 2], &[&[0.5; SMALL], &[1.0; BIG]]).await?;
        let (mut small, mut big) = (vec![0.0; SMALL], vec![0.0; BIG]);
        for round in 0..ROUNDS {
            w.pushpull(1, &grad(w.rank(), round, SMALL), &mut small)
                .await?;
            w.pushpull(2, &grad(w.rank(), round, BIG), &mut big).await?;
            if round == 2 {
                w.save_checkpoint().await?;
            }
        }
        small.extend(big);
        Ok(small)
    })
    .await;
    let values: Vec<Vec<f32>> = results.into_iter().map(|r| r.expect("worker")).collect();
    assert_eq!(values[0], values[1]);
    c.finish().await;

    // What the servers computed: Adam (elementwise) on the rank-ordered sums.
    let mut expected = vec![0.5f32; SMALL];
    expected.extend([1.0f32; BIG]);
    let mut updater = OptimizerSpec::parse(ADAM).unwrap().build();
    for round in 0..ROUNDS {
        for (key, range) in [(1, 0..SMALL), (2, SMALL..SMALL + BIG)] {
            let n = range.len();
            let mut sum = grad(0, round, n);
            for (s, g) in sum.iter_mut().zip(grad(1, round, n)) {
                *s += g;
            }
            updater.update(key, &sum, &mut expected[range]).unwrap();
        }
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&values[0]), bits(&expected));

    // The files, and the shards they hold.
    let mut big = Vec::new();
    let mut small = None;
    for rank in 0..2 {
        assert!(
            snapshot_path(&dir, rank).exists(),
            "server {rank}'s snapshot"
        );
        assert!(journal_path(&dir, rank).exists(), "server {rank}'s journal");
        let shard = load_shard(&dir, rank, None, 2, u64::MAX)
            .expect("the files load")
            .expect("a shard");
        assert_eq!(shard.updates(2), Some(ROUNDS as u64));
        big.extend_from_slice(shard.value(2).unwrap());
        if let Some(v) = shard.value(1) {
            assert!(small.is_none(), "key 1 lives on one server");
            assert_eq!(shard.updates(1), Some(ROUNDS as u64));
            small = Some(v.to_vec());
        }
        // A rebuilt shard is whole: its snapshot restores to itself.
        let bytes = shard.snapshot();
        let again = psnet_kv::proto::server::ServerState::restore(&bytes, 2, u64::MAX).unwrap();
        assert_eq!(again.snapshot(), bytes);
    }
    let mut stored = small.expect("key 1 is stored");
    stored.extend(big);
    assert_eq!(bits(&stored), bits(&expected));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn save_checkpoint_without_a_directory_names_the_variable() {
    let c = cluster_with(1, 1, |c| c).await;
    let err = c.workers[0]
        .save_checkpoint()
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("PSNET_CHECKPOINT_DIR"), "{err}");
    assert!(err.contains("server 0"), "{err}");
    c.finish().await;
}
