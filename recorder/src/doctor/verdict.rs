//! The verdicts: for a communicator's dumps, who waits for whom and where the ranks disagree; for a
//! kv job's, what each node waited on.

use super::*;

/// The collectives verdict for one communicator's dumps (one per rank that wrote one).
pub fn collectives_verdict(dumps: &[&DumpFile]) -> String {
    let size = dumps
        .iter()
        .find_map(|d| match d.scope {
            Scope::Collectives { size, .. } => Some(size),
            _ => None,
        })
        .unwrap_or(0);
    // rank -> seq -> record (the latest dump of a rank wins).
    let mut calls: BTreeMap<u32, BTreeMap<u64, &ReadRecord>> = BTreeMap::new();
    for d in dumps {
        let Scope::Collectives { rank, .. } = d.scope else {
            continue;
        };
        let mine = calls.entry(rank).or_default();
        for r in &d.records {
            if let ReadOp::Call { seq, .. } = r.op {
                mine.insert(seq, r);
            }
        }
    }
    let present: Vec<u32> = calls.keys().copied().collect();
    let missing: Vec<u32> = (0..size).filter(|r| !calls.contains_key(r)).collect();
    let mut verdict = Vec::new();
    let disagree = disagreement(&calls);
    if let Some(text) = &disagree {
        verdict.push(text.clone());
    }
    let first_open = |r: u32| -> u64 {
        let mine = &calls[&r];
        mine.iter()
            .find(|(_, rec)| rec.state != State::Done)
            .map(|(s, _)| *s)
            .unwrap_or_else(|| mine.keys().next_back().map_or(0, |s| s + 1))
    };
    let stuck = present.iter().map(|&r| first_open(r)).min();
    if let Some(seq) = stuck {
        let holders: Vec<(u32, &ReadRecord)> = present
            .iter()
            .filter_map(|&r| calls[&r].get(&seq).map(|rec| (r, *rec)))
            .collect();
        if holders.is_empty() {
            verdict.push(format!(
                "every rank that left a dump completed every call it recorded (the last is #{})",
                seq.saturating_sub(1)
            ));
        } else {
            let call = describe_call(&holders[0].1.op);
            let waiting: Vec<u32> = holders
                .iter()
                .filter(|(_, r)| matches!(r.state, State::Queued | State::Started))
                .map(|(r, _)| *r)
                .collect();
            let failed: Vec<(u32, &ReadRecord)> = holders
                .iter()
                .filter(|(_, r)| r.state == State::Failed)
                .copied()
                .collect();
            let done: Vec<u32> = holders
                .iter()
                .filter(|(_, r)| r.state == State::Done)
                .map(|(r, _)| *r)
                .collect();
            let mut parts = Vec::new();
            if !waiting.is_empty() {
                parts.push(format!("{} wait in {call}", ranks(&waiting)));
            }
            if !failed.is_empty() {
                let who: Vec<u32> = failed.iter().map(|(r, _)| *r).collect();
                let why = failed[0].1.error.clone().unwrap_or_default();
                parts.push(format!(
                    "{} failed in {call}{}",
                    ranks(&who),
                    if why.is_empty() {
                        String::new()
                    } else {
                        format!(" (rank {}: {why})", failed[0].0)
                    }
                ));
            }
            if !done.is_empty() {
                parts.push(format!("{} completed it", ranks(&done)));
            }
            let mut text = parts.join("; ");
            let absent: Vec<u32> = present
                .iter()
                .copied()
                .filter(|r| !calls[r].contains_key(&seq))
                .collect();
            for r in &absent {
                let last = calls[r].values().next_back();
                let _ = match last {
                    Some(rec) => write!(
                        text,
                        "; rank {r} never entered it: its last operation is {}, {} at {}, and it made no call since",
                        short_call(&rec.op),
                        if rec.state == State::Done { "done" } else { "left" },
                        clock(if rec.ended_us > 0 { rec.ended_us } else { rec.made_us })
                    ),
                    None => write!(text, "; rank {r} never entered it: it recorded no call at all"),
                };
            }
            let behind = waited_on(&holders);
            if !behind.is_empty() && absent.is_empty() && disagree.is_none() {
                let _ = write!(
                    text,
                    "; they received fewer pieces than they sent from {}",
                    ranks(&behind)
                );
            }
            verdict.push(text);
        }
    }
    if !missing.is_empty() {
        verdict.push(format!(
            "{} left no dump (stopped, killed, or writing elsewhere: a process that is frozen \
             writes none; PSNET_RECORDER_DIR must be the same for every rank)",
            ranks(&missing)
        ));
    }
    verdict.join(". ") + "."
}

/// The first call number the ranks disagree on, said as "rank 2 called reduce_scatter, the
/// others allgather".
pub(super) fn disagreement(calls: &BTreeMap<u32, BTreeMap<u64, &ReadRecord>>) -> Option<String> {
    let seqs: BTreeSet<u64> = calls.values().flat_map(|m| m.keys().copied()).collect();
    for seq in seqs {
        let mut by_kind: BTreeMap<(String, String), Vec<u32>> = BTreeMap::new();
        for (rank, mine) in calls {
            if let Some(ReadOp::Call { coll, dtype, .. }) = mine.get(&seq).map(|r| &r.op) {
                by_kind
                    .entry((coll.clone(), dtype.clone()))
                    .or_default()
                    .push(*rank);
            }
        }
        if by_kind.len() < 2 {
            continue;
        }
        let mut groups: Vec<((String, String), Vec<u32>)> = by_kind.into_iter().collect();
        groups.sort_by_key(|(_, ranks)| std::cmp::Reverse(ranks.len()));
        let ((major, major_dtype), _) = &groups[0];
        let same_kind = groups.iter().all(|((k, _), _)| k == major);
        let others: Vec<String> = groups[1..]
            .iter()
            .map(|((kind, dtype), who)| {
                if same_kind {
                    format!("{} called {kind} of {dtype}", ranks(who))
                } else {
                    format!("{} called {kind}", ranks(who))
                }
            })
            .collect();
        return Some(format!(
            "ranks disagree at call #{seq}: {}, the others {}",
            others.join("; "),
            if same_kind {
                format!("{major} of {major_dtype}")
            } else {
                major.clone()
            }
        ));
    }
    None
}

/// Peers that the ranks holding a call received fewer pieces from than they sent them.
pub(super) fn waited_on(holders: &[(u32, &ReadRecord)]) -> Vec<u32> {
    let mut behind = BTreeSet::new();
    for (_, rec) in holders {
        if rec.state == State::Done {
            continue;
        }
        for p in &rec.peers {
            if p.received < p.sent {
                behind.insert(p.peer);
            }
        }
    }
    behind.into_iter().collect()
}

/// The kv verdict: requests sent and never answered, and what their servers did last.
pub fn kv_verdict(dumps: &[&DumpFile]) -> String {
    let server_of = |rank: u32| {
        dumps.iter().find(
            |d| matches!(&d.scope, Scope::Kv { role, rank: r, .. } if role == "server" && *r == rank),
        )
    };
    let mut verdict = Vec::new();
    for d in dumps {
        let Scope::Kv { role, rank, .. } = &d.scope else {
            continue;
        };
        if role != "worker" {
            continue;
        }
        let open = d.records.iter().find(|r| {
            matches!(r.op, ReadOp::Request { .. })
                && matches!(r.state, State::Queued | State::Started)
        });
        let failed = d
            .records
            .iter()
            .find(|r| matches!(r.op, ReadOp::Request { .. }) && r.state == State::Failed);
        // A failure says why; an unanswered request, where nothing failed, says where.
        let Some(rec) = failed.or(open) else {
            continue;
        };
        let ReadOp::Request {
            req,
            what,
            key,
            part,
            server,
            ..
        } = &rec.op
        else {
            continue;
        };
        let waited = d.written_us.saturating_sub(rec.made_us);
        let mut text = format!(
            "worker {rank} sent {what} of key {key} (part {part}) to server {server}, request {req}, at {}, and {}",
            clock(rec.made_us),
            match &rec.error {
                Some(e) => format!("it failed: {e}"),
                None => format!(
                    "no answer had come when the worker dumped, {} later",
                    seconds(waited)
                ),
            }
        );
        match server_of(*server) {
            Some(s) => {
                let served = s.records.iter().rev().find(|r| {
                    matches!(&r.op, ReadOp::Served { req: q, worker, .. } if q == req && worker == rank)
                });
                match served {
                    Some(r) => {
                        let _ = write!(
                            text,
                            ": server {server} took it ({})",
                            record_line(&s.scope, r)
                        );
                    }
                    None => {
                        let _ = write!(text, ": server {server} has no record of it");
                    }
                }
                if let Some(last) = s.records.last() {
                    let _ = write!(
                        text,
                        "; server {server}'s last record is {}",
                        record_line(&s.scope, last)
                    );
                }
            }
            None => {
                let _ = write!(
                    text,
                    ": server {server} left no dump (stopped, killed, or writing elsewhere)"
                );
            }
        }
        verdict.push(text);
    }
    if verdict.is_empty() {
        "no worker has a request left unanswered".into()
    } else {
        verdict.join(". ") + "."
    }
}
