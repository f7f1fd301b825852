//! Row-sparse pushes (`Worker::push_rows`, MXNet's push of a row_sparse gradient) in whole
//! jobs over 127.0.0.1: an embedding table split over two servers (MXNet's element split,
//! whose boundaries fall inside rows, and psnet's pieces), pushed by random row sets
//! (none, all, one server's rows only, any order) for several rounds, against a model of the
//! job: the rank-order sum of each touched row, applied to that row alone.

mod common;

use std::sync::Arc;

use common::{cluster_with, Worker};
use half::f16;
use psnet_kv::updater::OptimizerSpec;
use psnet_kv::{KvError, Mode};

const ROWS: usize = 97;
const WIDTH: usize = 6;
const ROUNDS: usize = 6;
const SGD: &str = r#"{"type":"sgd","learning_rate":0.05,"momentum":0.9,"wd":0.01}"#;

/// The rows worker `rank` pushes in `round`, in the order it lists them (no repeats).
fn rows_of(rank: u32, round: usize) -> Vec<u64> {
    let all: Vec<u64> = (0..ROWS as u64).collect();
    match (round, rank) {
        (0, 0) => vec![],
        (0, _) => all.iter().rev().copied().collect(),
        // The first rows only: the first server's part (element split).
        (1, _) => (0..10).rev().collect(),
        _ => {
            let mut x = (rank as u64 + 1) * 7919 + round as u64 * 104_729;
            let mut rows: Vec<u64> = all
                .into_iter()
                .filter(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (x >> 60) < 3
                })
                .collect();
            // Any order.
            let third = rows.len() / 3;
            rows.rotate_left(third);
            rows
        }
    }
}

/// Worker `rank`'s gradient of row `row` in `round`.
fn grad(rank: u32, round: usize, row: u64) -> Vec<f32> {
    (0..WIDTH)
        .map(|c| ((row as usize * 3 + c + round * 5 + rank as usize) % 11) as f32 * 0.25 - 1.0)
        .collect()
}

/// The model: every row its own key in an updater of the same spec (SGD's and the test
/// optimizer's arithmetic is per element), updated only when some worker touched it, with
/// the workers' rows summed in rank order.
struct Model {
    table: Vec<f32>,
    updater: Option<Box<dyn psnet_kv::updater::Updater>>,
}

impl Model {
    fn round(&mut self, workers: u32, round: usize) {
        for row in 0..ROWS as u64 {
            let mut sum: Option<Vec<f32>> = None;
            for rank in 0..workers {
                if rows_of(rank, round).contains(&row) {
                    let g = grad(rank, round, row);
                    sum = Some(match sum {
                        None => g,
                        Some(s) => s.iter().zip(&g).map(|(a, b)| a + b).collect(),
                    });
                }
            }
            let r = row as usize * WIDTH..(row as usize + 1) * WIDTH;
            match (&mut self.updater, sum) {
                (Some(u), Some(g)) => u.update(row, &g, &mut self.table[r]).unwrap(),
                (Some(_), None) => {}
                (None, g) => {
                    let g = g.unwrap_or_else(|| vec![0.0; WIDTH]);
                    self.table[r].copy_from_slice(&g);
                }
            }
        }
    }
}

async fn on_all<F, Fut>(workers: &[Arc<Worker>], f: F)
where
    F: Fn(Arc<Worker>) -> Fut,
    Fut: std::future::Future<Output = Result<(), KvError>> + Send + 'static,
{
    let tasks: Vec<_> = workers.iter().map(|w| tokio::spawn(f(w.clone()))).collect();
    for t in tasks {
        t.await.unwrap().expect("call");
    }
}

async fn rounds_match_the_model(partition_bytes: usize, spec: Option<&'static str>) {
    let c = cluster_with(2, 2, |mut k| {
        k.bigarray_bound = 100;
        k.partition_bytes = Some(partition_bytes);
        k
    })
    .await;
    let table: Vec<f32> = (0..ROWS * WIDTH).map(|i| i as f32 * 0.125 - 4.0).collect();
    let halves: Vec<f16> = table.iter().map(|&v| f16::from_f32(v)).collect();
    let (t, h) = (table.clone(), halves.clone());
    on_all(&c.workers, move |w| {
        let (t, h) = (t.clone(), h.clone());
        async move {
            w.init_rows(3, WIDTH, &t).await?;
            w.init_rows(4, WIDTH, &h).await?;
            if let (Some(spec), 0) = (spec, w.rank()) {
                w.set_optimizer(&OptimizerSpec::parse(spec).unwrap())
                    .await?;
            }
            w.barrier().await
        }
    })
    .await;
    let build = || spec.map(|s| OptimizerSpec::parse(s).unwrap().build());
    let mut model = Model {
        table: table.clone(),
        updater: build(),
    };
    // The f16 key is kept in f32 on the servers and answered rounded.
    let mut half_model = Model {
        table: halves.iter().map(|h| h.to_f32()).collect(),
        updater: build(),
    };
    for round in 0..ROUNDS {
        on_all(&c.workers, move |w| async move {
            let rows = rows_of(w.rank(), round);
            let values: Vec<f32> = rows
                .iter()
                .flat_map(|&r| grad(w.rank(), round, r))
                .collect();
            let halves: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
            w.push_rows(3, WIDTH, &rows, &values).await?;
            w.push_rows(4, WIDTH, &rows, &halves).await
        })
        .await;
        model.round(2, round);
        // The f16 gradients are what the workers sent, widened.
        half_model.round(2, round);
        let all: Vec<u64> = (0..ROWS as u64).collect();
        for w in &c.workers {
            let mut out = vec![0f32; ROWS * WIDTH];
            w.pull_rows(3, WIDTH, &all, &mut out).await.unwrap();
            assert_eq!(out, model.table, "round {round}, worker {}", w.rank());
            let mut dense = vec![0f32; ROWS * WIDTH];
            w.pull(3, &mut dense).await.unwrap();
            assert_eq!(dense, model.table, "round {round}: a dense pull");
            let mut hout = vec![f16::ZERO; ROWS * WIDTH];
            w.pull_rows(4, WIDTH, &all, &mut hout).await.unwrap();
            let want: Vec<f16> = half_model.table.iter().map(|&v| f16::from_f32(v)).collect();
            assert_eq!(hout, want, "round {round}: the f16 key");
        }
    }
    c.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_pushes_to_a_table_split_by_elements_match_the_model_with_sgd() {
    rounds_match_the_model(0, Some(SGD)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_pushes_to_a_table_in_pieces_match_the_model_with_sgd() {
    // 256-byte pieces: 64 f32 each, spread over the servers in turn.
    rounds_match_the_model(256, Some(SGD)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_pushes_without_an_optimizer_replace_the_table_with_their_sum() {
    rounds_match_the_model(256, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_pushes_in_dist_async_apply_each_push_and_bad_calls_are_refused() {
    let c = cluster_with(2, 2, |mut k| {
        k.bigarray_bound = 100;
        k
    })
    .await;
    let table: Vec<f32> = (0..ROWS * WIDTH).map(|i| i as f32).collect();
    let t = table.clone();
    on_all(&c.workers, move |w| {
        let t = t.clone();
        async move {
            w.init_rows(3, WIDTH, &t).await?;
            w.init(&[5], &[&t[..]]).await?;
            if w.rank() == 0 {
                w.set_optimizer(&OptimizerSpec::parse(SGD).unwrap()).await?;
                w.set_mode(Mode::Async).await?;
            }
            w.barrier().await
        }
    })
    .await;
    let mut model = Model {
        table,
        updater: Some(OptimizerSpec::parse(SGD).unwrap().build()),
    };
    // One worker after the other: each push is applied on its own, in that order.
    for round in 2..5 {
        for w in &c.workers {
            let rows = rows_of(w.rank(), round);
            let values: Vec<f32> = rows
                .iter()
                .flat_map(|&r| grad(w.rank(), round, r))
                .collect();
            w.push_rows(3, WIDTH, &rows, &values).await.unwrap();
            for &row in &rows {
                let r = row as usize * WIDTH..(row as usize + 1) * WIDTH;
                let g = grad(w.rank(), round, row);
                let u = model.updater.as_mut().unwrap();
                u.update(row, &g, &mut model.table[r]).unwrap();
            }
        }
    }
    let w = &c.workers[1];
    let mut out = vec![0f32; ROWS * WIDTH];
    w.pull(3, &mut out).await.unwrap();
    assert_eq!(out, model.table);
    // What does not add up is refused, naming it, and the job goes on.
    let twice = w
        .push_rows(3, WIDTH, &[4, 1, 4], &[0.0; 3 * WIDTH])
        .await
        .unwrap_err();
    assert!(
        twice.to_string().contains("row 4 is pushed twice"),
        "{twice}"
    );
    let past = w
        .push_rows(3, WIDTH, &[ROWS as u64], &[0.0; WIDTH])
        .await
        .unwrap_err();
    assert!(
        past.to_string().contains(&format!("row {ROWS} pushed")),
        "{past}"
    );
    let width = w.push_rows(3, 3, &[0], &[0.0; 3]).await.unwrap_err();
    assert!(
        width.to_string().contains("has rows of 6 elements"),
        "{width}"
    );
    let short = w
        .push_rows(3, WIDTH, &[0, 1], &[0.0; WIDTH])
        .await
        .unwrap_err();
    assert!(
        short.to_string().contains("need 12 values, given 6"),
        "{short}"
    );
    let dense = w.push(3, &out).await.unwrap_err();
    assert!(dense.to_string().contains("is row-sparse"), "{dense}");
    let not_rows = w
        .push_rows(5, WIDTH, &[0], &[0.0; WIDTH])
        .await
        .unwrap_err();
    assert!(
        not_rows.to_string().contains("key 5 is dense"),
        "{not_rows}"
    );
    let halves = w
        .push_rows(3, WIDTH, &[0], &[f16::ZERO; WIDTH])
        .await
        .unwrap_err();
    assert!(halves.to_string().contains("float16"), "{halves}");
    let unknown = w
        .push_rows(9, WIDTH, &[0], &[0.0; WIDTH])
        .await
        .unwrap_err();
    assert!(matches!(unknown, KvError::UnknownKey(9)), "{unknown}");
    w.push_rows(3, WIDTH, &[2], &[1.0; WIDTH])
        .await
        .expect("still served");
    c.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_checkpoint_row_pushes_and_their_files_rebuild_the_table() {
    use psnet_kv::checkpoint::load_shard;
    let dir = std::env::temp_dir().join(format!("psnet-row-push-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.clone();
    // Split over both servers by elements; a snapshot every 2 updates, and one asked for.
    let c = cluster_with(2, 2, move |k| {
        k.bigarray_bound(100)
            .checkpoint_dir(Some(d.clone()))
            .checkpoint_every(2)
    })
    .await;
    let table: Vec<f32> = (0..ROWS * WIDTH).map(|i| i as f32 * 0.01).collect();
    let t = table.clone();
    on_all(&c.workers, move |w| {
        let t = t.clone();
        async move {
            let adam = r#"{"type":"adam","learning_rate":0.01,"wd":0.001}"#;
            w.set_optimizer(&OptimizerSpec::parse(adam).unwrap())
                .await?;
            w.init_rows(3, WIDTH, &t).await?;
            for round in 0..ROUNDS {
                let rows = rows_of(w.rank(), round);
                let values: Vec<f32> = rows
                    .iter()
                    .flat_map(|&r| grad(w.rank(), round, r))
                    .collect();
                w.push_rows(3, WIDTH, &rows, &values).await?;
                if round == 2 {
                    w.save_checkpoint().await?;
                }
            }
            Ok(())
        }
    })
    .await;
    let mut pulled = vec![0f32; ROWS * WIDTH];
    c.workers[0].pull(3, &mut pulled).await.unwrap();
    assert_ne!(pulled, table);
    c.finish().await;
    // What a restarted server loads: its snapshot and the journal after it.
    let mut rebuilt = Vec::new();
    for rank in 0..2 {
        let shard = load_shard(&dir, rank, None, 2, u64::MAX)
            .expect("the files load")
            .expect("a shard");
        assert_eq!(shard.updates(3), Some(ROUNDS as u64));
        rebuilt.extend_from_slice(shard.value(3).unwrap());
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&rebuilt), bits(&pulled));
    let _ = std::fs::remove_dir_all(&dir);
}
