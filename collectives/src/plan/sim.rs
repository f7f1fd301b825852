//! Runs the plans of every rank of one collective against each other in one thread, with the
//! order of every send, delivery, completion and reduction drawn from a seed: the plans'
//! test bench. A piece written while a send of it is in flight, a message nobody expects or a
//! plan that waits for ever fails the run.

use std::collections::VecDeque;

use bytes::Bytes;

use super::{Action, Plan};
use crate::element::{copy_bytes, reduce_bytes, Element, ReduceOp};

struct InFlight {
    from: usize,
    op: usize,
    piece: usize,
    bytes: Bytes,
}

/// Runs `plans[r]` over `bufs[r]` for every rank r until all are done.
pub(crate) fn run<T: Element>(mut plans: Vec<Plan>, bufs: &mut [Vec<T>], op: ReduceOp, seed: u64) {
    let n = plans.len();
    let mut rng = fastrand::Rng::with_seed(seed);
    // channels[from][to]: messages in order.
    let mut channels: Vec<Vec<VecDeque<(u64, Bytes)>>> = vec![vec![VecDeque::new(); n]; n];
    let mut sending: Vec<InFlight> = Vec::new();
    let piece_bytes = |buf: &Vec<T>, plan: &Plan, p: usize| {
        Bytes::copy_from_slice(bytemuck::cast_slice(&buf[plan.pieces()[p].clone()]))
    };
    loop {
        if plans.iter().all(|p| p.is_done()) && sending.is_empty() {
            break;
        }
        // Every enabled step: (kind, rank or index).
        let mut choices: Vec<(u8, usize, usize)> = Vec::new();
        for (r, plan) in plans.iter().enumerate() {
            if !plan.ready_sends.is_empty() {
                choices.push((0, r, 0));
            }
            if !plan.ready_applies.is_empty() {
                choices.push((1, r, 0));
            }
        }
        for i in 0..sending.len() {
            choices.push((2, i, 0));
        }
        for (from, row) in channels.iter().enumerate() {
            for (to, ch) in row.iter().enumerate() {
                if !ch.is_empty() {
                    choices.push((3, from, to));
                }
            }
        }
        assert!(
            !choices.is_empty(),
            "stuck: ranks {:?} wait for pieces that never come",
            plans
                .iter()
                .enumerate()
                .filter(|(_, p)| !p.is_done())
                .map(|(r, p)| (r, p.awaited_ranks()))
                .collect::<Vec<_>>()
        );
        match choices[rng.usize(..choices.len())] {
            (0, r, _) => {
                let req = plans[r].poll_send().expect("ready");
                let bytes = piece_bytes(&bufs[r], &plans[r], req.piece);
                channels[r][req.to].push_back((req.tag, bytes.clone()));
                sending.push(InFlight {
                    from: r,
                    op: req.op,
                    piece: req.piece,
                    bytes,
                });
            }
            (1, r, _) => {
                let a = plans[r].poll_apply().expect("ready");
                let range = plans[r].pieces()[a.piece].clone();
                // A send of this piece still in flight would read what we are about to write.
                assert!(
                    !sending.iter().any(|s| s.from == r && s.piece == a.piece),
                    "rank {r} writes piece {} while a send of it is in flight",
                    a.piece
                );
                let dst = &mut bufs[r][range];
                let data = a.data.host().expect("the simulation sends host bytes");
                match a.action {
                    Action::Copy => copy_bytes(dst, data),
                    Action::Reduce(order) => reduce_bytes(op, order, dst, data),
                }
                plans[r].handle_applied(a.op);
            }
            (2, i, _) => {
                let s = sending.swap_remove(i);
                let now = piece_bytes(&bufs[s.from], &plans[s.from], s.piece);
                assert_eq!(now, s.bytes, "a piece changed while its send was in flight");
                plans[s.from].handle_sent(s.op);
            }
            (3, from, to) => {
                let (tag, bytes) = channels[from][to].pop_front().expect("non-empty");
                plans[to]
                    .handle_message(from, tag, bytes)
                    .unwrap_or_else(|e| panic!("rank {to}: {e}"));
            }
            _ => unreachable!(),
        }
    }
    for (from, row) in channels.iter().enumerate() {
        for (to, ch) in row.iter().enumerate() {
            assert!(
                ch.is_empty(),
                "{} messages from {from} to {to} were never taken",
                ch.len()
            );
        }
    }
}
