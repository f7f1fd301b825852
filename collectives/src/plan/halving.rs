//! Recursive halving and doubling (Rabenseifner's allreduce): a reduce-scatter in which
//! partners at distance 2^(k-1), ..., 2, 1 swap half of what they still hold and each reduces
//! the half it keeps, then an allgather in which partners at distance 1, 2, ..., 2^(k-1) swap
//! everything they hold. Each rank sends 2(n-1)/n of the buffer, as in the ring, but in
//! 2 log2(n) steps instead of 2(n - 1); recursive doubling takes log2(n) steps but sends the
//! whole buffer in each.
//!
//! When n is not a power of two, the first 2 x (n - 2^k) ranks pair up first as in
//! `doubling.rs`: the even one hands its buffer to the odd one, sits the steps out, and gets
//! the result back at the end.
//!
//! Every block is reduced on one path (its partial sums meet at one rank per step, lower
//! rank's operand first) and then copied: every rank ends with the same bits, run after run.

use super::{chunk, pieces_of_blocks, Action, Plan};
use crate::element::Order;

/// Tags: a step's number times this, plus the piece's index.
const STEP: u64 = 1 << 32;
const FOLD: u64 = 0;
const UNFOLD: u64 = 1;
/// The reduce-scatter's steps, then the allgather's.
const STEPS: u64 = 2;

fn tag(step: u64, piece: usize) -> u64 {
    step * STEP + piece as u64
}

/// What each piece's next transfer must wait for: the operation that last wrote it (before
/// a send reads it or a receive combines into it) and the sends reading it since (before a
/// receive overwrites it: a send borrows the bytes until it completes).
struct Deps {
    written: Vec<Option<usize>>,
    reading: Vec<Vec<usize>>,
}

impl Deps {
    fn new(pieces: usize) -> Deps {
        Deps {
            written: vec![None; pieces],
            reading: vec![Vec::new(); pieces],
        }
    }

    fn send(&mut self, plan: &mut Plan, to: usize, tag: u64, p: usize) {
        let after: Vec<usize> = self.written[p].into_iter().collect();
        let id = plan.send(to, tag, p, &after);
        self.reading[p].push(id);
    }

    fn recv(&mut self, plan: &mut Plan, from: usize, tag: u64, p: usize, action: Action) {
        let mut after = std::mem::take(&mut self.reading[p]);
        after.extend(self.written[p]);
        self.written[p] = Some(plan.recv(from, tag, p, action, &after));
    }
}

/// Allreduce of `count` elements of `elem_size` bytes over `n` ranks, pieces of at most
/// `piece` elements, by recursive halving (reduce-scatter) and doubling (allgather).
pub(crate) fn halving_allreduce(
    rank: usize,
    n: usize,
    count: usize,
    elem_size: usize,
    piece: usize,
) -> Plan {
    let pof2 = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let rem = n - pof2;
    let (pieces, per_block) = pieces_of_blocks((0..pof2).map(|b| chunk(count, pof2, b)), piece);
    let mut plan = Plan::new(pieces, elem_size);
    if n == 1 {
        return plan;
    }
    let all = 0..plan.pieces.len();
    let mut deps = Deps::new(plan.pieces.len());
    let order = |peer: usize| {
        if peer < rank {
            Order::RemoteFirst
        } else {
            Order::LocalFirst
        }
    };
    if rank < 2 * rem && rank % 2 == 0 {
        for p in all.clone() {
            deps.send(&mut plan, rank + 1, tag(FOLD, p), p);
        }
        for p in all {
            deps.recv(&mut plan, rank + 1, tag(UNFOLD, p), p, Action::Copy);
        }
        return plan;
    }
    if rank < 2 * rem {
        for p in all.clone() {
            deps.recv(
                &mut plan,
                rank - 1,
                tag(FOLD, p),
                p,
                Action::Reduce(order(rank - 1)),
            );
        }
    }
    // This rank's place in the power-of-two group, and the real rank of a place.
    let me = if rank < 2 * rem { rank / 2 } else { rank - rem };
    let real = |v: usize| if v < rem { v * 2 + 1 } else { v + rem };
    let pieces_of = |blocks: std::ops::Range<usize>| {
        per_block[blocks.start].start..per_block[blocks.end - 1].end
    };
    let mut step = STEPS;
    // Reduce-scatter: the blocks this rank still holds halve each step, down to block `me`.
    let (mut lo, mut hi) = (0, pof2);
    let mut mask = pof2 / 2;
    while mask > 0 {
        let partner = real(me ^ mask);
        let mid = lo + (hi - lo) / 2;
        let (keep, give) = if me & mask == 0 {
            (lo..mid, mid..hi)
        } else {
            (mid..hi, lo..mid)
        };
        for p in pieces_of(give) {
            deps.send(&mut plan, partner, tag(step, p), p);
        }
        for p in pieces_of(keep.clone()) {
            deps.recv(
                &mut plan,
                partner,
                tag(step, p),
                p,
                Action::Reduce(order(partner)),
            );
        }
        (lo, hi) = (keep.start, keep.end);
        step += 1;
        mask /= 2;
    }
    // Allgather: the blocks this rank holds double each step, back to all of them.
    let mut mask = 1;
    while mask < pof2 {
        let partner = real(me ^ mask);
        let theirs = lo ^ mask;
        for p in pieces_of(lo..hi) {
            deps.send(&mut plan, partner, tag(step, p), p);
        }
        for p in pieces_of(theirs..theirs + mask) {
            deps.recv(&mut plan, partner, tag(step, p), p, Action::Copy);
        }
        lo = lo.min(theirs);
        hi = lo + 2 * mask;
        step += 1;
        mask *= 2;
    }
    if rank < 2 * rem {
        for p in all {
            deps.send(&mut plan, rank - 1, tag(UNFOLD, p), p);
        }
    }
    plan
}
