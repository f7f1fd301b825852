use super::*;
use proptest::prelude::*;

fn call(seq: u64) -> Op {
    Op::Call {
        seq,
        coll: "allreduce",
        dtype: "f32",
        count: 4,
        reduce: "sum",
        root: 0,
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("psnet-recorder-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn recorder(capacity: usize, dir: PathBuf) -> Arc<Recorder> {
    let scope = Scope::Collectives {
        comm: 7,
        rank: 1,
        size: 2,
    };
    Recorder::new(scope, capacity, DumpPolicy::Failure, dir).expect("a recorder")
}

#[test]
fn a_record_goes_through_its_states_in_place() {
    let r = recorder(4, scratch("states"));
    let id = r.begin(call(0));
    r.started(id);
    let mut tally = Tally::default();
    tally.sent(0);
    tally.sent(0);
    tally.received(0);
    r.progress(id, tally.peers());
    r.failed(id, "rank 0 was lost");
    let (records, dropped) = r.snapshot();
    assert_eq!((records.len(), dropped), (1, 0));
    let rec = &records[0];
    assert_eq!(rec.state, State::Failed);
    assert!(rec.made_us > 0 && rec.started_us >= rec.made_us && rec.ended_us >= rec.started_us);
    assert_eq!(
        rec.peers[0],
        PeerCount {
            peer: 0,
            sent: 2,
            received: 1
        }
    );
    assert_eq!(rec.error.as_deref(), Some("rank 0 was lost"));
    assert!(Recorder::new(r.scope().clone(), 0, DumpPolicy::Failure, scratch("none")).is_none());
}

#[test]
fn a_tally_past_its_slots_counts_the_rest_in_the_last() {
    let mut t = Tally::default();
    for peer in 0..(PEERS as u32 + 3) {
        t.sent(peer);
    }
    let sent: u32 = t.peers().iter().map(|p| p.sent).sum();
    assert_eq!(sent, PEERS as u32 + 3);
    assert_eq!(t.peers()[PEERS - 1].sent, 4);
}

#[test]
fn dumps_are_json_the_doctor_reads_back_and_of_bounded_size() {
    let dir = scratch("dump");
    let r = recorder(16, dir.clone());
    for seq in 0..1000 {
        let id = r.begin(call(seq));
        r.started(id);
        r.done(id);
    }
    let path = r.dump("test").expect("written");
    let text = std::fs::read_to_string(&path).unwrap();
    let value: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(value["format"], DUMP_FORMAT);
    assert_eq!(value["records"].as_array().unwrap().len(), 16);
    assert_eq!(value["dropped"], 1000 - 16);
    // A record's size is bounded (fixed fields, at most PEERS counts and one error): the
    // file grows with the ring's capacity, not with the job's length.
    assert!(text.len() < 16 * 600, "{} bytes", text.len());
    let (dumps, skipped) = doctor::read_dir(&dir).unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    assert_eq!(dumps.len(), 1);
    assert_eq!(dumps[0].records.last().unwrap().id, 999);
    let _ = std::fs::remove_dir_all(&dir);
}

proptest! {
    /// The ring keeps exactly the last `capacity` operations, in order, whatever the number
    /// made, and updates reach only records it still holds.
    #[test]
    fn the_ring_keeps_the_last_operations_and_wraps(capacity in 1usize..40, made in 0u64..200) {
        let r = recorder(capacity, scratch("ring"));
        for seq in 0..made {
            let id = r.begin(call(seq));
            r.done(id);
        }
        // An update of a record let go changes nothing (and does not panic).
        r.failed(0, "too late");
        let (records, dropped) = r.snapshot();
        let kept = (made as usize).min(capacity);
        prop_assert_eq!(records.len(), kept);
        prop_assert_eq!(dropped, made - kept as u64);
        let ids: Vec<u64> = records.iter().map(|r| r.id).collect();
        let expected: Vec<u64> = (made - kept as u64..made).collect();
        prop_assert_eq!(ids, expected);
        prop_assert!(records.iter().all(|r| r.state == State::Done || (r.id == 0 && made <= capacity as u64)));
    }
}

#[test]
fn the_timeline_is_a_chrome_trace_with_one_event_per_operation() {
    let dir = scratch("timeline");
    let r = recorder(16, dir.clone());
    for seq in 0..5 {
        let id = r.start(call(seq));
        r.finish(
            id,
            &[PeerCount {
                peer: 0,
                sent: 1,
                received: 1,
            }],
            None,
        );
    }
    let open = r.start(call(5));
    let _ = open;
    r.dump("test").unwrap();
    let (dumps, _) = doctor::read_dir(&dir).unwrap();
    let trace = timeline::chrome_trace(&dumps);
    let events = trace["traceEvents"].as_array().unwrap();
    let complete: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(complete.len(), 6, "one event per operation");
    for e in &complete {
        // The fields chrome://tracing and Perfetto need of a complete event.
        assert!(
            e["name"].is_string() && e["ts"].is_u64() && e["dur"].is_u64(),
            "{e}"
        );
        assert!(e["pid"].is_u64() && !e["tid"].is_null(), "{e}");
    }
    assert_eq!(complete[0]["name"], "allreduce #0");
    assert_eq!(complete[5]["args"]["state"], "started");
    let names: Vec<_> = events.iter().filter(|e| e["ph"] == "M").collect();
    assert_eq!(names.len(), 1, "a process name per dump");
    let _ = std::fs::remove_dir_all(&dir);
}
