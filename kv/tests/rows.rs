//! Row-sparse pulls (`Worker::pull_rows`, MXNet's `row_sparse_pull`) in whole jobs over
//! 127.0.0.1: an embedding table split over two servers (MXNet's element split, whose
//! boundaries fall inside rows, and psnet's pieces), pulled by random row sets (repeats, any
//! order, none, all, one server's only) against the values a model of the job holds.

mod common;

use common::cluster_with;
use half::f16;
use psnet_kv::KvError;

const ROWS: usize = 301;
const WIDTH: usize = 7;

/// Row sets drawn from `seed`: repeats and any order included.
fn row_sets(seed: u64) -> Vec<Vec<u64>> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move |n: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) % n
    };
    let mut sets = vec![
        vec![],
        (0..ROWS as u64).collect(),
        (0..ROWS as u64).rev().collect(),
        vec![ROWS as u64 - 1, 0, ROWS as u64 - 1, 0],
        // The first rows only: the first server's part.
        (0..20).collect(),
    ];
    for _ in 0..40 {
        let n = next(60) as usize;
        sets.push((0..n).map(|_| next(ROWS as u64)).collect());
    }
    sets
}

async fn rows_match_the_model(partition_bytes: usize) {
    let c = cluster_with(2, 2, |mut k| {
        // Split over both servers by elements (MXNet's split), or into pieces.
        k.bigarray_bound = 100;
        k.partition_bytes = Some(partition_bytes);
        k
    })
    .await;
    let table: Vec<f32> = (0..ROWS * WIDTH).map(|i| i as f32 * 0.5).collect();
    let halves: Vec<f16> = table.iter().map(|&v| f16::from_f32(v)).collect();
    let inits: Vec<_> = c
        .workers
        .iter()
        .map(|w| {
            let (w, t, h) = (w.clone(), table.clone(), halves.clone());
            tokio::spawn(async move {
                w.init(&[3], &[&t[..]]).await?;
                w.init(&[4], &[&h[..]]).await
            })
        })
        .collect();
    for i in inits {
        i.await.unwrap().expect("init");
    }
    // One dist_sync round without an optimizer: the sum of the workers' pushes replaces it.
    let pushes: Vec<_> = c
        .workers
        .iter()
        .map(|w| {
            let w = w.clone();
            tokio::spawn(async move {
                let grad: Vec<f32> = (0..ROWS * WIDTH)
                    .map(|i| (i % 5) as f32 + w.rank() as f32)
                    .collect();
                w.push(3, &grad).await
            })
        })
        .collect();
    for p in pushes {
        p.await.unwrap().expect("push");
    }
    let model: Vec<f32> = (0..ROWS * WIDTH)
        .map(|i| 2.0 * (i % 5) as f32 + 1.0)
        .collect();
    let pulls: Vec<_> = c
        .workers
        .iter()
        .map(|w| {
            let (w, model, halves) = (w.clone(), model.clone(), halves.clone());
            tokio::spawn(async move {
                for (n, ids) in row_sets(w.rank() as u64).into_iter().enumerate() {
                    let mut out = vec![-1.0f32; ids.len() * WIDTH];
                    w.pull_rows(3, WIDTH, &ids, &mut out)
                        .await
                        .expect("row pull");
                    let mut halves_out = vec![f16::ZERO; ids.len() * WIDTH];
                    w.pull_rows(4, WIDTH, &ids, &mut halves_out)
                        .await
                        .expect("f16 row pull");
                    for (i, &r) in ids.iter().enumerate() {
                        let r = r as usize;
                        assert_eq!(
                            out[i * WIDTH..(i + 1) * WIDTH],
                            model[r * WIDTH..(r + 1) * WIDTH],
                            "set {n}: row {r}"
                        );
                        assert_eq!(
                            halves_out[i * WIDTH..(i + 1) * WIDTH],
                            halves[r * WIDTH..(r + 1) * WIDTH],
                            "set {n}: f16 row {r}"
                        );
                    }
                }
            })
        })
        .collect();
    for p in pulls {
        p.await.unwrap();
    }
    // What does not add up is refused, naming it, and the job goes on.
    let w = &c.workers[0];
    let mut out = vec![0.0f32; WIDTH];
    let past = w
        .pull_rows(3, WIDTH, &[ROWS as u64], &mut out)
        .await
        .unwrap_err();
    assert!(
        past.to_string().contains(&format!("row {ROWS} asked for")),
        "{past}"
    );
    let width = w.pull_rows(3, 10, &[0], &mut [0.0; 10]).await.unwrap_err();
    assert!(width.to_string().contains("do not divide"), "{width}");
    let short = w.pull_rows(3, WIDTH, &[0, 1], &mut out).await.unwrap_err();
    assert!(
        short.to_string().contains("go into 14 elements, not 7"),
        "{short}"
    );
    let unknown = w.pull_rows(99, WIDTH, &[0], &mut out).await.unwrap_err();
    assert!(matches!(unknown, KvError::UnknownKey(99)), "{unknown}");
    let dtype = w.pull_rows(4, WIDTH, &[0], &mut out).await.unwrap_err();
    assert!(dtype.to_string().contains("float16"), "{dtype}");
    w.pull_rows(3, WIDTH, &[5], &mut out)
        .await
        .expect("still served");
    assert_eq!(out, model[5 * WIDTH..6 * WIDTH]);
    c.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_pulls_of_a_table_split_by_elements_over_two_servers_match_the_model() {
    rows_match_the_model(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_pulls_of_a_table_in_pieces_match_the_model() {
    // 512-byte pieces: 128 elements each, spread over the servers in turn.
    rows_match_the_model(512).await;
}
