//! The flight recorder of real communicators (on the in-memory network): what the ranks'
//! dumps let `psnet-doctor` say of a rank that skipped a call and of ranks that made
//! different calls.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{runtime, world};
use psnet_collectives::{CollectiveError, Config, ReduceOp};
use psnet_memnet::MemNet;
use psnet_recorder::doctor::ReadOp;
use psnet_recorder::{doctor, DumpPolicy, Settings, State};

fn config(name: &str) -> (Config, PathBuf) {
    let dir =
        std::env::temp_dir().join(format!("psnet-coll-recorder-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = Config {
        call_timeout: Some(Duration::from_secs(20)),
        recorder: Settings {
            entries: 64,
            policy: DumpPolicy::Failure,
            dir: dir.clone(),
            timeline: None,
        },
        ..Config::default()
    };
    (config, dir)
}

fn verdict(dir: &std::path::Path) -> String {
    let (dumps, skipped) = doctor::read_dir(dir).expect("the dumps");
    assert!(skipped.is_empty(), "{skipped:?}");
    let text = doctor::report(&dumps);
    let _ = std::fs::remove_dir_all(dir);
    text
}

#[test]
fn a_rank_that_skips_a_call_is_named_with_its_last_call() {
    let rt = runtime();
    rt.block_on(async {
        let (config, dir) = config("skip");
        let comms = world(&MemNet::reliable(), 4, config).await;
        // Every rank: an allreduce and a broadcast, together.
        let calls = comms.iter().map(|c| async move {
            let mut v = vec![1.0f32; 1000];
            c.allreduce(&mut v, ReduceOp::Sum).await?;
            c.broadcast(&mut v, 0).await
        });
        for r in futures_util::future::join_all(calls).await {
            r.expect("the calls every rank makes");
        }
        // Ranks 0-2 allreduce once more; rank 3 does not: they time out.
        let waits = comms[..3].iter().map(|c| async move {
            let mut v = vec![1.0f32; 4096];
            c.allreduce(&mut v, ReduceOp::Sum).await
        });
        for r in futures_util::future::join_all(waits).await {
            assert!(matches!(r, Err(CollectiveError::Timeout { .. })), "{r:?}");
        }
        // Rank 3 dumps as SIGUSR1 would make it.
        assert!(comms[3].dump_flight_recorder("SIGUSR1").is_some());
        drop(comms);
        let text = verdict(&dir);
        assert!(text.contains("ranks 0-2 failed in allreduce #"), "{text}");
        assert!(text.contains("(float, 4,096 elements)"), "{text}");
        assert!(
            text.contains("rank 3 never entered it: its last operation is broadcast #"),
            "{text}"
        );
    });
}

#[test]
fn ranks_that_make_different_calls_are_named_with_both() {
    let rt = runtime();
    rt.block_on(async {
        let (config, dir) = config("disagree");
        let comms = world(&MemNet::reliable(), 3, config).await;
        let calls = comms.iter().enumerate().map(|(r, c)| async move {
            if r == 2 {
                let input = vec![1.0f32; 30];
                let mut out = vec![0.0f32; 10];
                c.reduce_scatter(&input, &mut out, ReduceOp::Sum).await
            } else {
                let input = vec![1.0f32; 10];
                let mut out = vec![0.0f32; 30];
                c.allgather(&input, &mut out).await
            }
        });
        for r in futures_util::future::join_all(calls).await {
            assert!(r.is_err(), "different calls cannot both succeed");
        }
        drop(comms);
        let text = verdict(&dir);
        assert!(
            text.contains("rank 2 called reduce_scatter, the others allgather"),
            "{text}"
        );
    });
}

#[test]
fn a_receive_whose_message_was_never_sent_is_named_with_the_senders_side() {
    let rt = runtime();
    rt.block_on(async {
        let (config, dir) = config("p2p");
        let comms = world(&MemNet::reliable(), 2, config).await;
        // Message #0 with tag 5 goes through; rank 1 then waits for #1, which rank 0 never
        // sends: the receive times out and dumps.
        let (sent, got) = tokio::join!(comms[0].send(1, 5, &[1.0f32; 100]), async {
            let mut buf = vec![0.0f32; 100];
            comms[1].recv(0, 5, &mut buf).await
        });
        sent.expect("send #0");
        got.expect("recv #0");
        let mut buf = vec![0.0f32; 100];
        let err = comms[1].recv(0, 5, &mut buf).await.unwrap_err();
        assert!(matches!(err, CollectiveError::Timeout { .. }), "{err}");
        assert!(comms[0].dump_flight_recorder("SIGUSR1").is_some());
        drop(comms);
        let text = verdict(&dir);
        assert!(
            text.contains("rank 1 failed in recv #1 from rank 0 (tag 5) (float, 100 elements)"),
            "{text}"
        );
        assert!(
            text.contains(
                "rank 0 never sent message #1 (of those with tag 5, its dump holds only #0); \
                 its last operation is send #0 to rank 1 (tag 5), done at"
            ),
            "{text}"
        );
    });
}

/// Connection events are recorded as they happen: a rank killed while the others are idle is
/// in their dumps as "lost" before the call that then fails, after their "connected" events.
#[test]
fn a_rank_lost_between_calls_is_recorded_when_its_connection_goes() {
    let rt = runtime();
    rt.block_on(async {
        let (config, dir) = config("lost");
        let net = MemNet::reliable();
        let comms = world(&net, 3, config).await;
        let calls = comms.iter().map(|c| async move {
            let mut v = vec![1.0f32; 64];
            c.allreduce(&mut v, ReduceOp::Sum).await
        });
        for r in futures_util::future::join_all(calls).await {
            r.expect("the call every rank makes");
        }
        assert!(net.kill(psnet_collectives::node_of(2)));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let waits = comms[..2].iter().map(|c| async move {
            let mut v = vec![1.0f32; 64];
            c.allreduce(&mut v, ReduceOp::Sum).await
        });
        for r in futures_util::future::join_all(waits).await {
            // One rank finds rank 2 lost and tells the other (an abort naming it).
            let e = r.expect_err("rank 2 is gone").to_string();
            assert!(e.contains("rank 2"), "{e}");
        }
        drop(comms);
        let (dumps, _) = doctor::read_dir(&dir).expect("the dumps");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(dumps.len(), 2, "ranks 0 and 1 dump on the failed call");
        for d in &dumps {
            let ops: Vec<&ReadOp> = d.records.iter().map(|r| &r.op).collect();
            let at = |what: &str, peer: u64| {
                ops.iter().position(|op| {
                    matches!(op, ReadOp::Event { what: w, peer: p } if w == what && *p == peer)
                })
            };
            let lost = at("lost", 2).unwrap_or_else(|| panic!("no loss of rank 2: {ops:?}"));
            assert!(at("connected", 2).is_some_and(|c| c < lost), "{ops:?}");
            // The failed allreduce comes after the loss.
            let failed = d
                .records
                .iter()
                .position(|r| r.state == State::Failed)
                .expect("the failed call");
            assert!(lost < failed, "{ops:?}");
        }
    });
}

/// A call made while an earlier one runs is recorded queued, then started in its turn: a dump
/// taken meanwhile shows the running call and the one waiting behind it.
#[test]
fn a_call_waiting_behind_another_is_recorded_queued_then_run() {
    let rt = runtime();
    rt.block_on(async {
        let (config, dir) = config("queued");
        let comms = world(&MemNet::reliable(), 2, config).await;
        let (c0, c1) = (&comms[0], &comms[1]);
        let (mut a, mut b) = (vec![1.0f32; 64], vec![2.0f32; 64]);
        // Rank 0 makes both calls at once; rank 1 makes them later.
        let first = c0.allreduce(&mut a, ReduceOp::Sum);
        let second = c0.allreduce(&mut b, ReduceOp::Sum);
        let both = futures_util::future::join(first, second);
        tokio::pin!(both);
        tokio::select! {
            biased;
            _ = &mut both => panic!("the calls ended without rank 1"),
            () = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
        let path = c0.dump_flight_recorder("SIGUSR1").expect("a dump");
        let (dumps, _) = doctor::read_dir(path.parent().unwrap()).unwrap();
        let states: Vec<State> = dumps[0]
            .records
            .iter()
            .filter(
                |r| matches!(&r.op, ReadOp::Call { coll, count: 64, .. } if coll == "allreduce"),
            )
            .map(|r| r.state)
            .collect();
        assert_eq!(states, [State::Started, State::Queued]);
        let (mut x, mut y) = (vec![1.0f32; 64], vec![2.0f32; 64]);
        let (r0, r1) = futures_util::future::join(both, async {
            c1.allreduce(&mut x, ReduceOp::Sum).await?;
            c1.allreduce(&mut y, ReduceOp::Sum).await
        })
        .await;
        assert!(r0.0.is_ok() && r0.1.is_ok() && r1.is_ok());
        let path = c0.dump_flight_recorder("SIGUSR1").expect("a dump");
        let (dumps, _) = doctor::read_dir(path.parent().unwrap()).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let done: Vec<(State, bool)> = dumps
            .iter()
            .find(|d| d.records.len() > 1)
            .unwrap()
            .records
            .iter()
            .filter(|r| matches!(&r.op, ReadOp::Call { count: 64, .. }))
            .map(|r| (r.state, r.started_us >= r.made_us && r.started_us > 0))
            .collect();
        assert_eq!(done, [(State::Done, true), (State::Done, true)]);
    });
}

/// A call dropped while it waits behind another (a timeout around it, Ctrl-C) leaves no
/// record queued for good: it is finished as failed, saying so.
#[test]
fn a_call_dropped_before_its_turn_is_recorded_as_such() {
    let rt = runtime();
    rt.block_on(async {
        let (config, dir) = config("dropped");
        let comms = world(&MemNet::reliable(), 2, config).await;
        let (mut a, mut b) = (vec![1.0f32; 64], vec![2.0f32; 64]);
        let first = comms[0].allreduce(&mut a, ReduceOp::Sum);
        tokio::pin!(first);
        {
            let second = comms[0].allreduce(&mut b, ReduceOp::Sum);
            tokio::pin!(second);
            tokio::select! {
                biased;
                _ = &mut first => panic!("the first call ended without rank 1"),
                _ = &mut second => panic!("the second call ran before the first"),
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
        let path = comms[0].dump_flight_recorder("SIGUSR1").expect("a dump");
        let (dumps, _) = doctor::read_dir(path.parent().unwrap()).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let calls: Vec<(State, Option<String>)> = dumps[0]
            .records
            .iter()
            .filter(|r| matches!(&r.op, ReadOp::Call { count: 64, .. }))
            .map(|r| (r.state, r.error.clone()))
            .collect();
        assert_eq!(
            calls,
            [
                (State::Started, None),
                (State::Failed, Some("dropped before its turn came".into()))
            ]
        );
    });
}
