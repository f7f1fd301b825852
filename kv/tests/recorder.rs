//! The flight recorder of whole kv jobs (tasks over 127.0.0.1): what the nodes' dumps let
//! `psnet-doctor` say of a round that cannot complete and of a worker that is gone.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use psnet_kv::KvConfig;
use psnet_recorder::doctor::ReadOp;
use psnet_recorder::{doctor, DumpPolicy, Scope, Settings};

mod common;

use common::{cluster_with, on_all, Cluster};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("psnet-kv-recorder-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

async fn cluster(workers: u32, dir: &std::path::Path) -> Cluster {
    let settings = Settings {
        entries: 256,
        policy: DumpPolicy::Failure,
        dir: dir.to_path_buf(),
        timeline: None,
    };
    cluster_with(1, workers, move |c| KvConfig {
        recorder: settings.clone(),
        ..c.heartbeats(
            Some(Duration::from_millis(200)),
            Some(Duration::from_secs(5)),
        )
    })
    .await
}

fn verdict(dir: &std::path::Path) -> String {
    let (dumps, skipped) = doctor::read_dir(dir).expect("the dumps");
    assert!(skipped.is_empty(), "{skipped:?}");
    doctor::report(&dumps)
}

/// Worker 0 pushes key 5 and worker 1 does not: the dist_sync round waits. The dumps (as
/// `SIGUSR1` writes them) show worker 0's push unanswered and the server holding it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_that_waits_is_shown_with_the_request_and_the_server_holding_it() {
    let dir = scratch("round");
    let c = cluster(2, &dir).await;
    let inits = on_all(&c.workers, |w| async move {
        w.init(&[5], &[&[0.0; 4]]).await?;
        Ok(vec![])
    })
    .await;
    assert!(inits.iter().all(|r| r.is_ok()), "{inits:?}");
    let w0 = c.workers[0].clone();
    let push = tokio::spawn(async move { w0.push(5, &[1.0; 4]).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!psnet_recorder::dump_all("SIGUSR1").is_empty());
    let text = verdict(&dir);
    assert!(
        text.contains("worker 0 sent push of key 5 (part 0) to server 0"),
        "{text}"
    );
    assert!(
        text.contains("no answer had come when the worker dumped")
            && text.contains("later: server 0 took it"),
        "{text}"
    );
    // The scheduler dumps too: the job's membership, each node registered, assigned and
    // connected; the server's dump holds its connections.
    let (dumps, _) = doctor::read_dir(&dir).unwrap();
    let events = |role: &str| -> Vec<(String, u64)> {
        let dump = dumps
            .iter()
            .find(|d| matches!(&d.scope, Scope::Kv { role: r, .. } if r == role))
            .unwrap_or_else(|| panic!("no {role} dump"));
        dump.records
            .iter()
            .filter_map(|r| match &r.op {
                ReadOp::Event { what, peer } => Some((what.clone(), *peer)),
                _ => None,
            })
            .collect()
    };
    let scheduler = events("scheduler");
    // Server 0 is node 8, workers 0-1 nodes 9 and 11.
    for node in [8, 9, 11] {
        assert!(
            scheduler.contains(&("assigned".to_string(), node)),
            "node {node}: {scheduler:?}"
        );
    }
    assert_eq!(
        scheduler.iter().filter(|(w, _)| w == "registered").count(),
        3,
        "{scheduler:?}"
    );
    let server = events("server");
    for node in [9, 11] {
        assert!(
            server.contains(&("connected".to_string(), node)),
            "node {node}: {server:?}"
        );
    }
    // The round completes once worker 1 pushes; the job ends well.
    c.workers[1]
        .push(5, &[1.0; 4])
        .await
        .expect("worker 1's push");
    push.await.unwrap().expect("worker 0's push, answered");
    c.finish().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Worker 1 is gone mid-job: worker 0's push fails, and its dump (written on the failure,
/// unasked) names the request and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_failed_by_a_lost_worker_is_dumped_unasked() {
    let dir = scratch("lost");
    let mut c = cluster(2, &dir).await;
    let inits = on_all(&c.workers, |w| async move {
        w.init(&[1], &[&[0.0; 8]]).await?;
        Ok(vec![])
    })
    .await;
    assert!(inits.iter().all(|r| r.is_ok()), "{inits:?}");
    let gone = Arc::try_unwrap(c.workers.pop().unwrap()).unwrap_or_else(|_| panic!("shared"));
    let survivor = c.workers[0].clone();
    let push = survivor.push(1, &[1.0; 8]);
    drop(gone);
    tokio::time::timeout(Duration::from_secs(20), push)
        .await
        .expect("the push must fail, not hang")
        .expect_err("its round can never complete");
    let text = verdict(&dir);
    assert!(
        text.contains("worker 0 sent push of key 1 (part 0) to server 0"),
        "{text}"
    );
    assert!(
        text.contains("it failed: ") && text.contains("worker 1"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A key cut into pieces (`PSNET_PARTITION_BYTES`) is recorded as the key and each piece's
/// number, not as the pieces' slots (numbers past 2^48 that name nothing a user knows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pieces_of_a_partitioned_key_are_recorded_as_the_key_and_their_numbers() {
    let dir = scratch("pieces");
    let settings = Settings {
        entries: 256,
        policy: DumpPolicy::Failure,
        dir: dir.clone(),
        timeline: None,
    };
    // 1,024 floats in pieces of 128 (512 bytes): 8 pieces over 2 servers.
    let c = cluster_with(2, 1, move |c| KvConfig {
        recorder: settings.clone(),
        ..c.partition_bytes(512)
    })
    .await;
    let w = &c.workers[0];
    w.init(&[7], &[&[0.0; 1024]]).await.expect("init");
    w.push(7, &[1.0; 1024]).await.expect("push");
    assert!(!psnet_recorder::dump_all("SIGUSR1").is_empty());
    let (dumps, _) = doctor::read_dir(&dir).unwrap();
    let worker = dumps
        .iter()
        .find(|d| matches!(&d.scope, Scope::Kv { role, .. } if role == "worker"))
        .expect("the worker's dump");
    let mut pushed: Vec<(u64, u32)> = worker
        .records
        .iter()
        .filter_map(|r| match &r.op {
            ReadOp::Request {
                what, key, part, ..
            } if what == "push" => Some((*key, *part)),
            _ => None,
        })
        .collect();
    pushed.sort_unstable();
    assert_eq!(pushed, (0..8).map(|p| (7, p)).collect::<Vec<_>>());
    c.finish().await;
    let _ = std::fs::remove_dir_all(&dir);
}
