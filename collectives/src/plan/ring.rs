//! Rings: every rank sends to the next and receives from the previous, one block per step.
//! Reduce-scatter takes n - 1 steps, allgather n - 1 more, and allreduce is the one followed
//! by the other. Each block is split into pieces sent as separate messages, so a step's
//! pieces flow while the previous step's are still being reduced.
//!
//! A piece is reduced along one fixed path round the ring, and the allgather copies the
//! result: every rank ends with the same bits, run after run.

use std::collections::HashMap;

use super::{chunk, pieces_of_blocks, Action, Plan};
use crate::element::Order;

/// Tags: a step's number times this, plus the piece's index.
const STEP: u64 = 1 << 32;

fn tag(step: usize, piece: usize) -> u64 {
    step as u64 * STEP + piece as u64
}

/// The ring's reduce-scatter steps over `blocks` (one per rank) from step `first` on: at step
/// s, rank r sends block `r + shift - s` and reduces block `r + shift - s - 1` into its own.
/// Afterwards rank r holds the whole reduction of block `r + shift + 1 - (n - 1)`.
/// Returns, per piece, the receive that reduced it last (the piece's final value).
fn reduce_scatter_steps(
    plan: &mut Plan,
    per_block: &[std::ops::Range<usize>],
    rank: usize,
    n: usize,
    shift: usize,
) -> HashMap<usize, usize> {
    let right = (rank + 1) % n;
    let left = (rank + n - 1) % n;
    // The receive that last wrote each piece, which the piece's next send waits for.
    let mut last_recv: HashMap<usize, usize> = HashMap::new();
    for s in 0..n - 1 {
        let send_block = (rank + shift + n * 2 - s) % n;
        let recv_block = (rank + shift + n * 2 - s - 1) % n;
        for p in per_block[send_block].clone() {
            let after: Vec<usize> = last_recv.get(&p).copied().into_iter().collect();
            plan.send(right, tag(s, p), p, &after);
        }
        for p in per_block[recv_block].clone() {
            let id = plan.recv(left, tag(s, p), p, Action::Reduce(Order::LocalFirst), &[]);
            last_recv.insert(p, id);
        }
    }
    last_recv
}

/// Allreduce of `count` elements of `elem_size` bytes over `n` ranks, pieces of at most
/// `piece` elements: reduce-scatter, then allgather.
pub(crate) fn ring_allreduce(
    rank: usize,
    n: usize,
    count: usize,
    elem_size: usize,
    piece: usize,
) -> Plan {
    let (pieces, per_block) = pieces_of_blocks((0..n).map(|c| chunk(count, n, c)), piece);
    let mut plan = Plan::new(pieces, elem_size);
    if n == 1 {
        return plan;
    }
    let right = (rank + 1) % n;
    let left = (rank + n - 1) % n;
    // With shift 0, rank r ends the reduce-scatter owning block r + 1.
    let mut last_write = reduce_scatter_steps(&mut plan, &per_block, rank, n, 0);
    // The reduce-scatter's send of each piece, which a copy over that piece must wait for
    // (the bytes are borrowed by the send until it completes).
    let mut sent: HashMap<usize, Vec<usize>> = HashMap::new();
    for op in 0..plan.ops.len() {
        if let super::Kind::Send { .. } = plan.ops[op].kind {
            sent.entry(plan.ops[op].piece).or_default().push(op);
        }
    }
    for t in 0..n - 1 {
        let step = n - 1 + t;
        let send_block = (rank + 1 + n - t) % n;
        let recv_block = (rank + n - t) % n;
        for p in per_block[send_block].clone() {
            let after: Vec<usize> = last_write.get(&p).copied().into_iter().collect();
            plan.send(right, tag(step, p), p, &after);
        }
        for p in per_block[recv_block].clone() {
            let after = sent.get(&p).cloned().unwrap_or_default();
            let id = plan.recv(left, tag(step, p), p, Action::Copy, &after);
            last_write.insert(p, id);
        }
    }
    plan
}

/// Reduce-scatter over `n` ranks of a buffer of `n * block` elements: afterwards rank r's
/// block r holds the reduction of every rank's block r (the other blocks hold partial
/// results).
pub(crate) fn ring_reduce_scatter(
    rank: usize,
    n: usize,
    block: usize,
    elem_size: usize,
    piece: usize,
) -> Plan {
    let (pieces, per_block) = pieces_of_blocks((0..n).map(|c| c * block..(c + 1) * block), piece);
    let mut plan = Plan::new(pieces, elem_size);
    if n > 1 {
        // With shift n - 1 (that is, -1), rank r ends owning block r.
        reduce_scatter_steps(&mut plan, &per_block, rank, n, n - 1);
    }
    plan
}

/// Allgather over `n` ranks of a buffer of `n * block` elements, rank r's block r filled in:
/// afterwards every block holds its rank's block.
pub(crate) fn ring_allgather(
    rank: usize,
    n: usize,
    block: usize,
    elem_size: usize,
    piece: usize,
) -> Plan {
    let (pieces, per_block) = pieces_of_blocks((0..n).map(|c| c * block..(c + 1) * block), piece);
    let mut plan = Plan::new(pieces, elem_size);
    if n == 1 {
        return plan;
    }
    let right = (rank + 1) % n;
    let left = (rank + n - 1) % n;
    let mut last_recv: HashMap<usize, usize> = HashMap::new();
    for t in 0..n - 1 {
        let send_block = (rank + n - t) % n;
        let recv_block = (rank + n * 2 - t - 1) % n;
        for p in per_block[send_block].clone() {
            let after: Vec<usize> = last_recv.get(&p).copied().into_iter().collect();
            plan.send(right, tag(t, p), p, &after);
        }
        for p in per_block[recv_block].clone() {
            let id = plan.recv(left, tag(t, p), p, Action::Copy, &[]);
            last_recv.insert(p, id);
        }
    }
    plan
}
