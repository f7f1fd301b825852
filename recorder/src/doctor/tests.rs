use std::path::PathBuf;
use std::sync::Arc;

use super::*;
use crate::{DumpPolicy, Op, Recorder, Tally};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("psnet-doctor-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn rank(dir: &Path, rank: u32, size: u32) -> Arc<Recorder> {
    let scope = Scope::Collectives {
        comm: 0xabc,
        rank,
        size,
    };
    Recorder::new(scope, 64, DumpPolicy::Failure, dir.to_path_buf()).unwrap()
}

fn op(seq: u64, coll: &'static str) -> Op {
    Op::Call {
        seq,
        coll,
        dtype: "f32",
        count: 4_194_304,
        reduce: "sum",
        root: 0,
    }
}

/// Calls `0..n` of `colls`, all done.
fn done_calls(r: &Recorder, colls: &[&'static str]) {
    for (seq, coll) in colls.iter().enumerate() {
        let id = r.begin(op(seq as u64, coll));
        r.started(id);
        r.done(id);
    }
}

fn verdict(dir: &Path) -> String {
    let (dumps, skipped) = read_dir(dir).unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    let text = report(&dumps);
    let _ = std::fs::remove_dir_all(dir);
    text
}

#[test]
fn a_rank_that_skipped_a_call_is_named_with_its_last_operation() {
    let dir = scratch("skip");
    let ranks: Vec<_> = (0..4).map(|r| rank(&dir, r, 4)).collect();
    for (r, rec) in ranks.iter().enumerate() {
        done_calls(rec, &["allreduce", "broadcast"]);
        if r != 3 {
            let id = rec.begin(op(2, "allreduce"));
            rec.started(id);
            let mut t = Tally::default();
            t.sent(3);
            rec.progress(id, t.peers());
        }
        rec.dump("test");
    }
    let text = verdict(&dir);
    assert!(
        text.contains("ranks 0-2 wait in allreduce #2 (f32, 4,194,304 elements)"),
        "{text}"
    );
    assert!(
        text.contains("rank 3 never entered it: its last operation is broadcast #1, done at"),
        "{text}"
    );
    assert!(text.contains("it made no call since"), "{text}");
}

#[test]
fn ranks_that_disagree_are_named_with_both_calls() {
    let dir = scratch("disagree");
    for r in 0..3 {
        let rec = rank(&dir, r, 3);
        let coll = if r == 2 {
            "reduce_scatter"
        } else {
            "allgather"
        };
        done_calls(&rec, &["allreduce"]);
        let id = rec.begin(op(1, coll));
        rec.started(id);
        rec.failed(
            id,
            "rank 2 called reduce_scatter where this rank called allgather",
        );
        rec.dump("test");
    }
    let text = verdict(&dir);
    assert!(
        text.contains(
            "ranks disagree at call #1: rank 2 called reduce_scatter, the others allgather"
        ),
        "{text}"
    );
}

#[test]
fn a_rank_without_a_dump_is_named_and_the_others_errors_quoted() {
    let dir = scratch("frozen");
    for r in 0..2 {
        let rec = rank(&dir, r, 3);
        done_calls(&rec, &["allreduce"]);
        let id = rec.begin(op(1, "allreduce"));
        rec.started(id);
        let mut t = Tally::default();
        t.sent(2);
        t.sent(2);
        t.received(2);
        rec.progress(id, t.peers());
        rec.failed(id, "rank 2 (node 3) was lost: no heartbeat for 2 s");
        rec.dump("test");
    }
    let text = verdict(&dir);
    assert!(text.contains("ranks 0-1 failed in allreduce #1"), "{text}");
    assert!(text.contains("no heartbeat"), "{text}");
    assert!(text.contains("rank 2 left no dump"), "{text}");
}

#[test]
fn a_healthy_job_says_so() {
    let dir = scratch("healthy");
    for r in 0..2 {
        let rec = rank(&dir, r, 2);
        done_calls(&rec, &["allreduce", "allreduce", "barrier"]);
        rec.dump("test");
    }
    let text = verdict(&dir);
    assert!(
        text.contains("completed every call it recorded (the last is #2)"),
        "{text}"
    );
}

#[test]
fn an_unanswered_kv_request_names_the_server_and_its_last_record() {
    let dir = scratch("kv");
    let node = |role: &str, rank, job: &str| {
        Recorder::new(
            Scope::Kv {
                role: role.into(),
                rank,
                job: job.into(),
            },
            64,
            DumpPolicy::Failure,
            dir.clone(),
        )
        .unwrap()
    };
    let (this, other) = ("00000000000000aa", "00000000000000bb");
    let worker = node("worker", 1, this);
    let server = node("server", 0, this);
    // Another job's worker 1 dumped into the same folder (the default one is shared): its
    // requests are not this job's.
    let stale = node("worker", 1, other);
    let id = stale.start(Op::Request {
        req: 40,
        what: "pull",
        key: 7,
        part: 0,
        server: 0,
        bytes: 0,
    });
    stale.done(id);
    stale.dump("test");
    let push = |req| Op::Request {
        req,
        what: "push",
        key: 7,
        part: 0,
        server: 0,
        bytes: 64,
    };
    let id = worker.begin(push(39));
    worker.done(id);
    let id = server.begin(Op::Served {
        req: 39,
        what: "push",
        key: 7,
        worker: 1,
    });
    server.done(id);
    let id = worker.begin(push(40));
    worker.started(id);
    worker.dump("test");
    server.dump("test");
    let text = verdict(&dir);
    assert!(
        text.contains(
            "kv job 00000000000000aa: worker 1 sent push of key 7 (part 0) to server 0, request 40"
        ),
        "{text}"
    );
    assert!(
        text.contains("kv job 00000000000000bb: no worker has a request left unanswered"),
        "{text}"
    );
    assert!(
        text.contains("no answer had come when the worker dumped")
            && text.contains("later: server 0 has no record of it"),
        "{text}"
    );
    assert!(
        text.contains("server 0's last record is served worker 1's request 39"),
        "{text}"
    );
}

#[test]
fn names_and_ranges_read_as_a_person_writes_them() {
    assert_eq!(ranks(&[0, 1, 2, 4, 5, 6, 7]), "ranks 0-2 and 4-7");
    assert_eq!(ranks(&[3]), "rank 3");
    assert_eq!(ranks(&[1, 3, 5]), "ranks 1, 3 and 5");
    assert_eq!(grouped(4_194_304), "4,194,304");
    assert_eq!(
        clock(((12 * 3600 + 3 * 60 + 7) * 1000 + 114) * 1000),
        "12:03:07.114"
    );
}

#[test]
fn an_unfinished_receive_is_told_what_its_senders_dump_says() {
    let dir = scratch("p2p");
    let p2p = |dir: &'static str, peer, tag, msg| Op::P2p {
        dir,
        peer,
        tag,
        msg,
        dtype: "f32",
        count: 1000,
    };
    let ranks: Vec<_> = (0..3).map(|r| rank(&dir, r, 4)).collect();
    // Rank 0 sent #0 (tag 0) to rank 1, which still waits for it; rank 2 waits for rank 3,
    // which left no dump.
    let id = ranks[0].begin(p2p("send", 1, 0, 0));
    ranks[0].started(id);
    ranks[0].done(id);
    let id = ranks[1].begin(p2p("recv", 0, 0, 0));
    ranks[1].started(id);
    let id = ranks[2].begin(p2p("recv", 3, 7, 2));
    ranks[2].started(id);
    // Rank 0 waits for a message from any rank that none sent.
    let id = ranks[0].begin(p2p("recv_any", u32::MAX, 9, 0));
    ranks[0].started(id);
    for r in &ranks {
        r.dump("test");
    }
    let text = verdict(&dir);
    assert!(
        text.contains(
            "rank 1 waits in recv #0 from rank 0 (tag 0) (f32, 1,000 elements): rank 0 sent it (done at"
        ),
        "{text}"
    );
    assert!(
        text.contains("rank 2 waits in recv #2 from rank 3 (tag 7) (f32, 1,000 elements): rank 3 left no dump"),
        "{text}"
    );
    assert!(
        text.contains("rank 0 waits in recv from any rank (tag 9) (f32, 1,000 elements): no message with tag 9 reached it from any rank"),
        "{text}"
    );
    // The evidence lists them too.
    assert!(
        text.contains("send #0 to rank 1 (tag 0) (f32, 1,000 elements): done at"),
        "{text}"
    );
}

#[test]
fn connection_events_name_their_peer_as_the_scope_does() {
    let kv = Scope::Kv {
        role: "worker".into(),
        rank: 0,
        job: String::new(),
    };
    let comm = Scope::Collectives {
        comm: 1,
        rank: 0,
        size: 4,
    };
    assert_eq!(super::peer_name(&kv, 1), "the scheduler");
    assert_eq!(super::peer_name(&kv, 8), "server 0 (node 8)");
    assert_eq!(super::peer_name(&kv, 13), "worker 2 (node 13)");
    assert_eq!(
        super::peer_name(&kv, (1 << 62) | 5),
        format!("node {} (not assigned)", (1u64 << 62) | 5)
    );
    assert_eq!(super::peer_name(&comm, 3), "rank 3");
}
