//! Recursive doubling for small allreduces: log2(n) rounds in which partners swap their whole
//! buffers and both combine them, lower rank's operand first, so both compute the same bits.
//! When n is not a power of two, the first 2 x (n - 2^k) ranks pair up first: the even one
//! hands its buffer to the odd one, sits the rounds out, and gets the result back at the end.

use super::{Action, Plan};
use crate::element::Order;

/// Tags: the round number.
const FOLD: u64 = 0;
const UNFOLD: u64 = 1;
const ROUND: u64 = 2;

/// Allreduce of `count` elements in one piece, by recursive doubling.
pub(crate) fn doubling_allreduce(rank: usize, n: usize, count: usize, elem_size: usize) -> Plan {
    let pieces = if count == 0 {
        Vec::new()
    } else {
        std::iter::once(0..count).collect()
    };
    let mut plan = Plan::new(pieces, elem_size);
    if n == 1 || count == 0 {
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
    // The rank in the power-of-two group, if this rank takes part in the rounds.
    let new_rank = if rank < 2 * rem {
        if rank % 2 == 0 {
            let handed = plan.send(rank + 1, FOLD, 0, &[]);
            plan.recv(rank + 1, UNFOLD, 0, Action::Copy, &[handed]);
            return plan;
        }
        None
    } else {
        Some(rank - rem)
    };
    let mut last = Vec::new();
    let new_rank = match new_rank {
        Some(r) => r,
        None => {
            last.push(plan.recv(rank - 1, FOLD, 0, Action::Reduce(order(rank - 1)), &[]));
            rank / 2
        }
    };
    let real = |v: usize| if v < rem { v * 2 + 1 } else { v + rem };
    let mut mask = 1;
    let mut round = 0;
    while mask < pof2 {
        let partner = real(new_rank ^ mask);
        let sent = plan.send(partner, ROUND + round, 0, &last);
        // Combined only once our own bytes are sent: the send borrows them.
        let mut after = last.clone();
        after.push(sent);
        let id = plan.recv(
            partner,
            ROUND + round,
            0,
            Action::Reduce(order(partner)),
            &after,
        );
        last = vec![id];
        mask <<= 1;
        round += 1;
    }
    if rank < 2 * rem {
        plan.send(rank - 1, UNFOLD, 0, &last);
    }
    plan
}
