//! Priority scheduling at a server: when answers to a worker wait behind a link the worker
//! does not drain fast enough, they leave by the priority their requests carried (the key's
//! declaration order, first declared first, as BytePS schedules), not in the order they
//! were made. Over real sockets on 127.0.0.1, with a member (`rogue/`) that sends its pulls
//! last key first, as a backward pass produces gradients, and reads nothing until all are
//! sent.

use std::time::Duration;

use psnet_kv::proto::ids::Group;
use psnet_kv::proto::msg::Msg;

mod rogue;

use rogue::job::{Job, Setup};

/// Values of 16 MiB: more than 127.0.0.1's socket buffers hold between the two ends, so the
/// first answer's send waits for the reader and the others queue behind it.
const LEN: usize = 4 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_of_answers_to_a_worker_leaves_highest_priority_first() {
    let mut job = Job::start(Setup::default()).await;
    let keys: Vec<u64> = (10..16).collect();
    let init = {
        let (w, keys) = (job.honest.clone(), keys.clone());
        tokio::spawn(async move {
            let values: Vec<Vec<f32>> = keys.iter().map(|&k| vec![k as f32; LEN]).collect();
            let values: Vec<&[f32]> = values.iter().map(|v| &v[..]).collect();
            w.init(&keys, &values).await
        })
    };
    job.rogue.barrier(Group::WORKERS).await;
    init.await.unwrap().expect("worker 0 initializes the keys");
    let s = job.server();
    let mut asked = Vec::new();
    for &key in keys.iter().rev() {
        let ts = job.rogue.ts();
        let pull = Msg::Pull {
            ts,
            key,
            n_elems: LEN as u64,
            have: None,
            // Declared order: key 10 first.
            priority: -((key - 10) as i32),
        };
        job.rogue.send(s, &pull, &[]).await;
        asked.push((ts, key));
    }
    // Every pull has reached the server's loop before the first answer can finish.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut answered = Vec::new();
    while answered.len() < keys.len() {
        let (_, msg, segments) = job.rogue.next().await;
        let Msg::Done { ts } = msg else { continue };
        let &(_, key) = asked
            .iter()
            .find(|(t, _)| *t == ts)
            .expect("an answer to a pull");
        let value = segments.first().expect("a pulled value");
        assert_eq!(value.len(), 4 * LEN, "key {key}'s whole value");
        assert_eq!(
            &value[..4],
            &(key as f32).to_le_bytes(),
            "key {key}'s value"
        );
        answered.push(key);
    }
    // The first answer may have left before the other pulls arrived; every later one waited
    // in the backlog and must leave by priority.
    let mut after_first = answered[1..].to_vec();
    after_first.sort_unstable();
    assert_eq!(
        answered[1..],
        after_first[..],
        "answers after the first, in the order they left: {answered:?}"
    );
    job.finish().await;
}
