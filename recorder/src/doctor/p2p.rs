//! The point-to-point verdict: for each send or receive a rank left unfinished (waiting, or
//! failed), what its partner's dump says of the matching message (the n-th send from a to b
//! with a tag meets the n-th receive on b from a with that tag): sent, in flight, failed,
//! never made (with the partner's last operation), or no dump at all.

use std::collections::BTreeMap;

use super::{clock, grouped, short_call, DumpFile, ReadOp, ReadRecord};
use crate::{Scope, State};

/// "recv #3 from rank 0 (tag 5) (float, 1,000 elements)".
pub(crate) fn describe(op: &ReadOp) -> String {
    match op {
        ReadOp::P2p { dtype, count, .. } => {
            format!("{} ({dtype}, {} elements)", short(op), grouped(*count))
        }
        other => format!("{other:?}"),
    }
}

/// "send #2 to rank 1 (tag 0)".
pub(crate) fn short(op: &ReadOp) -> String {
    match op {
        ReadOp::P2p {
            dir,
            peer,
            tag,
            msg,
            ..
        } => headline(dir, *peer, *tag, *msg),
        other => format!("{other:?}"),
    }
}

fn headline(dir: &str, peer: u32, tag: u64, msg: u64) -> String {
    if dir == ANY {
        return format!("recv from any rank (tag {tag})");
    }
    let way = if dir == "send" { "to" } else { "from" };
    format!("{dir} #{msg} {way} rank {peer} (tag {tag})")
}

/// A receive from any rank: it has no partner until a message matches it.
const ANY: &str = "recv_any";

/// A message's key as both ends record it: sender, receiver, tag, number.
type Key = (u32, u32, u64, u64);

/// Each rank's point-to-point records by message, and its records in order.
struct Ranks<'a> {
    p2p: BTreeMap<u32, BTreeMap<(bool, Key), &'a ReadRecord>>,
    all: BTreeMap<u32, &'a [ReadRecord]>,
}

fn key_of(rank: u32, op: &ReadOp) -> Option<(bool, Key)> {
    match op {
        ReadOp::P2p { dir, .. } if dir == ANY => None,
        ReadOp::P2p {
            dir,
            peer,
            tag,
            msg,
            ..
        } => Some(if dir == "send" {
            (true, (rank, *peer, *tag, *msg))
        } else {
            (false, (*peer, rank, *tag, *msg))
        }),
        _ => None,
    }
}

fn ranks<'a>(dumps: &[&'a DumpFile]) -> Ranks<'a> {
    let mut out = Ranks {
        p2p: BTreeMap::new(),
        all: BTreeMap::new(),
    };
    for d in dumps {
        let Scope::Collectives { rank, .. } = d.scope else {
            continue;
        };
        out.all.insert(rank, &d.records);
        let mine = out.p2p.entry(rank).or_default();
        for r in &d.records {
            if let Some(k) = key_of(rank, &r.op) {
                mine.insert(k, r);
            }
        }
    }
    out
}

/// The verdict on the sends and receives left unfinished, if any.
pub(crate) fn verdict(dumps: &[&DumpFile]) -> Option<String> {
    let ranks = ranks(dumps);
    let mut lines = Vec::new();
    for (&rank, all) in &ranks.all {
        for r in all.iter().filter(|r| r.state != State::Done) {
            if let ReadOp::P2p { dir, tag, .. } = &r.op {
                if dir == ANY {
                    lines.push(format!(
                        "rank {rank} {} {}: no message with tag {tag} reached it from any rank{}",
                        if r.state == State::Failed {
                            "failed in"
                        } else {
                            "waits in"
                        },
                        describe(&r.op),
                        r.error
                            .as_ref()
                            .map_or_else(String::new, |e| format!(" ({e})"))
                    ));
                }
            }
        }
    }
    for (&rank, records) in &ranks.p2p {
        for (&(send, key), r) in records {
            if r.state == State::Done {
                continue;
            }
            let (from, to, _, _) = key;
            let partner = if send { to } else { from };
            let mut text = format!(
                "rank {rank} {} {}",
                if r.state == State::Failed {
                    "failed in"
                } else {
                    "waits in"
                },
                describe(&r.op)
            );
            if let Some(e) = &r.error {
                text.push_str(&format!(" ({e})"));
            }
            text.push_str(": ");
            text.push_str(&partner_side(&ranks, partner, !send, key));
            lines.push(text);
        }
    }
    (!lines.is_empty()).then(|| lines.join(". ") + ".")
}

/// What rank `partner`'s dump says of its side (`send`: its send) of message `key`.
fn partner_side(ranks: &Ranks<'_>, partner: u32, send: bool, key: Key) -> String {
    // Every rank with a dump has an entry, empty when it made no send or receive.
    let Some(records) = ranks.p2p.get(&partner) else {
        return format!("rank {partner} left no dump");
    };
    let (_, _, tag, msg) = key;
    let what = if send { "sent" } else { "received" };
    match records.get(&(send, key)) {
        Some(r) => match r.state {
            State::Done => format!("rank {partner} {what} it (done at {})", clock(r.ended_us)),
            State::Failed => format!(
                "rank {partner}'s side failed: {}",
                r.error.clone().unwrap_or_default()
            ),
            State::Queued | State::Started => {
                format!(
                    "rank {partner}'s side is in flight since {}",
                    clock(r.started_us)
                )
            }
        },
        None => {
            let same: Vec<u64> = records
                .keys()
                .filter(|(s, (f, t, g, _))| *s == send && (*f, *t) == (key.0, key.1) && *g == tag)
                .map(|(_, (_, _, _, m))| *m)
                .collect();
            let made = match (same.first(), same.last()) {
                (Some(a), Some(b)) if a == b => format!("only #{a}"),
                (Some(a), Some(b)) => format!("#{a} to #{b}"),
                _ => "none".into(),
            };
            let last = ranks
                .all
                .get(&partner)
                .and_then(|all| all.last())
                .map_or_else(
                    || "it recorded nothing".to_string(),
                    |l| {
                        format!(
                            "its last operation is {}, {}",
                            short_call(&l.op),
                            match l.state {
                                State::Done => format!("done at {}", clock(l.ended_us)),
                                State::Failed => format!("failed at {}", clock(l.ended_us)),
                                _ => "not finished".into(),
                            }
                        )
                    },
                );
            format!(
                "rank {partner} never {} message #{msg} (of those with tag {tag}, its dump holds {made}); {last}",
                if send { "sent" } else { "received" }
            )
        }
    }
}
