//! Recursive doubling: log2(n) rounds in which partners swap their whole buffers and both
//! combine them, lower rank's operand first, so both compute the same bits. When n is not a
//! power of two, the first 2 x (n - 2^k) ranks pair up first: the even one hands its buffer
//! to the odd one, sits the rounds out, and gets the result back at the end.
//!
//! The buffer moves in pieces, each a message of its own, and each piece goes on to the next
//! round as soon as it is combined: a large buffer pipelines, with at most [`WINDOW`] pieces
//! started ahead of the oldest one not yet combined. On two ranks this is one
//! exchange, against the ring's two steps for the same bytes.

use super::{pieces_of_blocks, Action, Plan};
use crate::element::Order;

/// Tags: a step's number times this, plus the piece's index.
const STEP: u64 = 1 << 32;
const FOLD: u64 = 0;
const UNFOLD: u64 = 1;
const ROUND: u64 = 2;

/// Pieces a rank may have started ahead of the oldest one not yet combined: piece p is sent
/// only once piece p - WINDOW has its result. Sending every piece at once left the receiver
/// with the whole buffer waiting in transport buffers, out of cache by the time it was
/// combined. 2-rank in-place busbw, GB/s, with and without the window, alternating runs:
/// same-host ring 8-32 MiB 5.2-5.7 against 3.4-5.4, 64 MiB 4.0 against 2.1-2.3; sockets
/// 32-64 MiB 2.6-2.8 against 1.9-2.2; no change up to 4 MiB. Windows of 4 and 8 pieces
/// were between the two.
const WINDOW: usize = 2;

fn tag(step: u64, piece: usize) -> u64 {
    step * STEP + piece as u64
}

/// Allreduce of `count` elements in pieces of at most `piece` elements, by recursive
/// doubling.
pub(crate) fn doubling_allreduce(
    rank: usize,
    n: usize,
    count: usize,
    elem_size: usize,
    piece: usize,
) -> Plan {
    let (pieces, _) = pieces_of_blocks(std::iter::once(0..count), piece);
    let mut plan = Plan::new(pieces, elem_size);
    if n == 1 {
        return plan;
    }
    let pof2 = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let rem = n - pof2;
    let order = |peer: usize| {
        if peer < rank {
            Order::RemoteFirst
        } else {
            Order::LocalFirst
        }
    };
    let all = 0..plan.pieces.len();
    // Each piece's last operation, for the window.
    let mut finals: Vec<usize> = Vec::with_capacity(plan.pieces.len());
    let window = |finals: &Vec<usize>, p: usize| -> Vec<usize> {
        p.checked_sub(WINDOW)
            .map(|q| finals[q])
            .into_iter()
            .collect()
    };
    if rank < 2 * rem && rank % 2 == 0 {
        for p in all {
            let after = window(&finals, p);
            let handed = plan.send(rank + 1, tag(FOLD, p), p, &after);
            finals.push(plan.recv(rank + 1, tag(UNFOLD, p), p, Action::Copy, &[handed]));
        }
        return plan;
    }
    // The rank in the power-of-two group.
    let new_rank = if rank < 2 * rem { rank / 2 } else { rank - rem };
    let real = |v: usize| if v < rem { v * 2 + 1 } else { v + rem };
    for p in all {
        let mut last = window(&finals, p);
        if rank < 2 * rem {
            let folded = plan.recv(
                rank - 1,
                tag(FOLD, p),
                p,
                Action::Reduce(order(rank - 1)),
                &last,
            );
            last = vec![folded];
        }
        let mut mask = 1;
        let mut round = 0;
        while mask < pof2 {
            let partner = real(new_rank ^ mask);
            let sent = plan.send(partner, tag(ROUND + round, p), p, &last);
            // Combined only once our own bytes are sent: the send borrows them.
            let mut after = last.clone();
            after.push(sent);
            let id = plan.recv(
                partner,
                tag(ROUND + round, p),
                p,
                Action::Reduce(order(partner)),
                &after,
            );
            last = vec![id];
            mask <<= 1;
            round += 1;
        }
        if rank < 2 * rem {
            plan.send(rank - 1, tag(UNFOLD, p), p, &last);
        }
        finals.push(last[0]);
    }
    plan
}
