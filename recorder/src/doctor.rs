//! Reading a job's dumps and saying what went wrong: `psnet-doctor DIR`.
//!
//! The verdict comes first, in a paragraph per communicator or kv job: which call the ranks
//! disagree on, which call some ranks wait in and which ranks never entered it (with their
//! last operation), which rank left no dump, which kv request was never answered and what
//! its server did last. The evidence per node follows: each dump's reason and last records.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::{PeerCount, Scope, State, DUMP_FORMAT};

mod verdict;

pub use verdict::{collectives_verdict, kv_verdict};

/// One node's dump, as read back.
#[derive(Clone, Debug, Deserialize)]
pub struct DumpFile {
    /// [`DUMP_FORMAT`].
    pub format: String,
    /// Whose.
    pub scope: Scope,
    /// The process that wrote it.
    pub pid: u32,
    /// Why it was written.
    pub reason: String,
    /// When, µs since the Unix epoch.
    pub written_us: u64,
    /// Older records its ring let go.
    pub dropped: u64,
    /// Its records, oldest first.
    pub records: Vec<ReadRecord>,
    /// The file it came from.
    #[serde(skip)]
    pub path: PathBuf,
}

/// A record, as read back.
#[derive(Clone, Debug, Deserialize)]
pub struct ReadRecord {
    /// Its number in its recorder.
    pub id: u64,
    /// What it is.
    pub op: ReadOp,
    /// Where it was.
    pub state: State,
    /// When it was made.
    pub made_us: u64,
    /// When it started (0: never).
    pub started_us: u64,
    /// When it ended (0: never).
    pub ended_us: u64,
    /// Pieces per peer.
    #[serde(default)]
    pub peers: Vec<PeerCount>,
    /// Why it failed.
    pub error: Option<String>,
}

/// An operation, as read back ([`crate::Op`]).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[allow(missing_docs)] // the fields are crate::Op's
pub enum ReadOp {
    Call {
        seq: u64,
        coll: String,
        dtype: String,
        count: u64,
        reduce: String,
        root: u32,
    },
    Request {
        req: u64,
        what: String,
        key: u64,
        part: u32,
        server: u32,
        bytes: u64,
    },
    Served {
        req: u64,
        what: String,
        key: u64,
        worker: u32,
    },
    P2p {
        dir: String,
        peer: u32,
        tag: u64,
        msg: u64,
        dtype: String,
        count: u64,
    },
    Event {
        what: String,
        peer: u64,
    },
}

/// Reads every dump (`*.json` written by a recorder) in `dir`; files that are not dumps are
/// skipped with a note in the second list.
pub fn read_dir(dir: &Path) -> std::io::Result<(Vec<DumpFile>, Vec<String>)> {
    let mut dumps = Vec::new();
    let mut skipped = Vec::new();
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        // PSNET_TIMELINE's traces sit beside the dumps.
        .filter(|p| !p.to_string_lossy().ends_with(".trace.json"))
        .collect();
    paths.sort();
    for path in paths {
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) => {
                skipped.push(format!("{}: {e}", path.display()));
                continue;
            }
        };
        match serde_json::from_str::<DumpFile>(&text) {
            Ok(mut d) if d.format == DUMP_FORMAT => {
                d.path = path;
                dumps.push(d);
            }
            Ok(d) => skipped.push(format!("{}: format {:?}", path.display(), d.format)),
            Err(e) => skipped.push(format!("{}: not a psnet dump ({e})", path.display())),
        }
    }
    Ok((dumps, skipped))
}

/// `µs since the epoch` as `HH:MM:SS.mmm` (UTC).
pub fn clock(us: u64) -> String {
    let ms = us / 1000;
    let (s, ms) = (ms / 1000, ms % 1000);
    format!(
        "{:02}:{:02}:{:02}.{ms:03}",
        (s / 3600) % 24,
        (s / 60) % 60,
        s % 60
    )
}

/// `n` with thousands separators.
pub(crate) fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A duration in µs as a person reads it: "3 ms", "12.4 s".
fn seconds(us: u64) -> String {
    if us < 1000 {
        format!("{us} µs")
    } else if us < 1_000_000 {
        format!("{} ms", us / 1000)
    } else {
        format!("{:.1} s", us as f64 / 1e6)
    }
}

/// "ranks 0-2 and 4-7", "rank 3".
pub fn ranks(list: &[u32]) -> String {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &r in list {
        match runs.last_mut() {
            Some((_, end)) if *end + 1 == r => *end = r,
            _ => runs.push((r, r)),
        }
    }
    let parts: Vec<String> = runs
        .iter()
        .map(|&(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect();
    let word = if list.len() == 1 { "rank" } else { "ranks" };
    match parts.len() {
        0 => "no rank".into(),
        1 => format!("{word} {}", parts[0]),
        n => format!("{word} {} and {}", parts[..n - 1].join(", "), parts[n - 1]),
    }
}

pub(crate) fn describe_call(op: &ReadOp) -> String {
    match op {
        ReadOp::Call {
            seq,
            coll,
            dtype,
            count,
            ..
        } => format!("{coll} #{seq} ({dtype}, {} elements)", grouped(*count)),
        other => format!("{other:?}"),
    }
}

pub(crate) fn short_call(op: &ReadOp) -> String {
    match op {
        ReadOp::Call { seq, coll, .. } => format!("{coll} #{seq}"),
        ReadOp::P2p { .. } => p2p::short(op),
        other => format!("{other:?}"),
    }
}

/// The verdict and the evidence for every communicator and kv job in `dumps`.
pub fn report(dumps: &[DumpFile]) -> String {
    let mut out = String::new();
    let mut comms: BTreeMap<u32, Vec<&DumpFile>> = BTreeMap::new();
    let mut kv: BTreeMap<&str, Vec<&DumpFile>> = BTreeMap::new();
    for d in dumps {
        match &d.scope {
            Scope::Collectives { comm, .. } => comms.entry(*comm).or_default().push(d),
            Scope::Kv { job, .. } => kv.entry(job.as_str()).or_default().push(d),
        }
    }
    if dumps.is_empty() {
        out.push_str("No psnet flight recorder dumps here.\n");
        return out;
    }
    for (comm, dumps) in &comms {
        let _ = writeln!(
            out,
            "Communicator {comm:08x}: {}\n",
            collectives_verdict(dumps)
        );
        if let Some(text) = p2p::verdict(dumps) {
            let _ = writeln!(out, "Communicator {comm:08x}, point-to-point: {text}\n");
        }
    }
    // Each kv job apart (dumps of several jobs share the default folder); one job is just
    // "kv job".
    let several = kv.len() > 1;
    for (job, dumps) in &kv {
        let name = match (several, job.is_empty()) {
            (false, _) => "kv job".to_string(),
            (true, true) => "kv job (no id: an older build)".to_string(),
            (true, false) => format!("kv job {job}"),
        };
        let _ = writeln!(out, "{name}: {}\n", kv_verdict(dumps));
    }
    out.push_str("Evidence per node:\n");
    for d in dumps {
        let _ = writeln!(
            out,
            "- {} (pid {}, {}): dumped at {} because {}; {} records{}",
            scope_name(&d.scope),
            d.pid,
            d.path.display(),
            clock(d.written_us),
            d.reason,
            d.records.len(),
            if d.dropped > 0 {
                format!(" ({} older ones let go)", d.dropped)
            } else {
                String::new()
            }
        );
        for r in d.records.iter().rev().take(5).rev() {
            let _ = writeln!(out, "    {}", record_line(&d.scope, r));
        }
    }
    out
}

fn scope_name(s: &Scope) -> String {
    match s {
        Scope::Collectives { comm, rank, size } => {
            format!("rank {rank} of {size} (communicator {comm:08x})")
        }
        // The job is in the dump's file name, beside it.
        Scope::Kv { role, rank, .. } => format!("{role} {rank}"),
    }
}

/// The peer of a connection event as its scope names it: a rank of a communicator, or a kv
/// node by its role (kv's ids: the scheduler is node 1, server r node 8 + 2r, worker r node
/// 9 + 2r; other numbers are nodes not assigned yet).
fn peer_name(scope: &Scope, peer: u64) -> String {
    match scope {
        Scope::Collectives { .. } => format!("rank {peer}"),
        // Ids from 2^62 up are provisional (a node that registers): its address, not a rank.
        Scope::Kv { .. } => match peer {
            1 => "the scheduler".into(),
            n if !(8..1 << 62).contains(&n) => format!("node {n} (not assigned)"),
            n if n % 2 == 0 => format!("server {} (node {n})", (n - 8) / 2),
            n => format!("worker {} (node {n})", (n - 9) / 2),
        },
    }
}

fn record_line(scope: &Scope, r: &ReadRecord) -> String {
    let what = match &r.op {
        ReadOp::Call { .. } => describe_call(&r.op),
        ReadOp::Request {
            req,
            what,
            key,
            part,
            server,
            bytes,
        } => format!("request {req}: {what} key {key} part {part} to server {server} ({bytes} B)"),
        ReadOp::Served {
            req,
            what,
            key,
            worker,
        } => format!("served worker {worker}'s request {req}: {what} key {key}"),
        ReadOp::P2p { .. } => p2p::describe(&r.op),
        ReadOp::Event { what, peer } => format!("{what}: {}", peer_name(scope, *peer)),
    };
    let when = match r.state {
        State::Queued => format!("queued at {}", clock(r.made_us)),
        State::Started => format!("started at {}", clock(r.started_us)),
        State::Done => format!("done at {}", clock(r.ended_us)),
        State::Failed => format!("failed at {}", clock(r.ended_us)),
    };
    let peers: Vec<String> = r
        .peers
        .iter()
        .map(|p| format!("rank {} {}/{}", p.peer, p.sent, p.received))
        .collect();
    let mut line = format!("{what}: {when}");
    if !peers.is_empty() {
        let _ = write!(line, "; pieces sent/received {}", peers.join(", "));
    }
    if let Some(e) = &r.error {
        let _ = write!(line, "; error: {e}");
    }
    line
}

mod p2p;
#[cfg(test)]
mod tests;
