//! A job's dumps as one Chrome trace (the JSON that `chrome://tracing` and Perfetto load),
//! as Horovod's timeline: a process per node, a track per communicator or kv peer, and one
//! complete event per operation, from its start to its end (or to the dump, if it never
//! ended). `psnet-doctor --timeline DIR -o job.json`.

use serde_json::{json, Value};

use crate::doctor::{DumpFile, ReadOp};
use crate::State;

/// The trace of `dumps`: `{"traceEvents": [...], "displayTimeUnit": "ms"}`.
pub fn chrome_trace(dumps: &[DumpFile]) -> Value {
    let mut events = Vec::new();
    for (pid, d) in dumps.iter().enumerate() {
        let name = match &d.scope {
            crate::Scope::Collectives { comm, rank, size } => {
                format!("rank {rank} of {size} (communicator {comm:08x})")
            }
            crate::Scope::Kv { role, rank, .. } => format!("{role} {rank}"),
        };
        events.push(json!({
            "name": "process_name", "ph": "M", "pid": pid, "tid": 0,
            "args": { "name": format!("{name}, pid {}", d.pid) }
        }));
        for r in &d.records {
            let start = if r.started_us > 0 {
                r.started_us
            } else {
                r.made_us
            };
            let end = if r.ended_us > 0 {
                r.ended_us
            } else {
                d.written_us.max(start)
            };
            let (name, track, args) = match &r.op {
                ReadOp::Call {
                    seq,
                    coll,
                    dtype,
                    count,
                    reduce,
                    root,
                } => (
                    format!("{coll} #{seq}"),
                    "calls".to_string(),
                    json!({ "dtype": dtype, "count": count, "reduce": reduce, "root": root, "peers": r.peers }),
                ),
                ReadOp::Request {
                    req,
                    what,
                    key,
                    part,
                    server,
                    bytes,
                } => (
                    format!("{what} key {key}"),
                    format!("server {server}"),
                    json!({ "request": req, "part": part, "bytes": bytes }),
                ),
                ReadOp::Served {
                    req,
                    what,
                    key,
                    worker,
                } => (
                    format!("{what} key {key}"),
                    format!("worker {worker}"),
                    json!({ "request": req }),
                ),
                ReadOp::P2p {
                    dir,
                    peer,
                    tag,
                    msg,
                    dtype,
                    count,
                } => (
                    format!("{dir} #{msg} rank {peer}"),
                    "p2p".to_string(),
                    json!({ "tag": tag, "dtype": dtype, "count": count, "peers": r.peers }),
                ),
                ReadOp::Event { what, peer } => {
                    (what.clone(), "events".to_string(), json!({ "peer": peer }))
                }
            };
            let mut args = args;
            args["state"] = json!(r.state);
            if let Some(e) = &r.error {
                args["error"] = json!(e);
            }
            if r.state == State::Queued && r.started_us == 0 {
                args["queued_only"] = json!(true);
            }
            events.push(json!({
                "name": name, "cat": track, "ph": "X", "pid": pid, "tid": track,
                "ts": start, "dur": end.saturating_sub(start), "args": args
            }));
        }
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}
