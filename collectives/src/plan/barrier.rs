//! The dissemination barrier: in round k every rank signals rank + 2^k and waits for
//! rank - 2^k; after ceil(log2 n) rounds every rank has heard, directly or not, from all.

use super::{Action, Plan};

/// A barrier over `n` ranks: empty messages, one per round.
pub(crate) fn barrier(rank: usize, n: usize) -> Plan {
    // One empty piece, which every message carries.
    let mut plan = Plan::new(std::iter::once(0..0).collect(), 1);
    let mut dist = 1;
    let mut round = 0u64;
    let mut last = Vec::new();
    while dist < n {
        let sent = plan.send((rank + dist) % n, round, 0, &last);
        // Every message shares the one (empty) piece: its receive waits for the send of it.
        last = vec![plan.recv((rank + n - dist) % n, round, 0, Action::Copy, &[sent])];
        dist *= 2;
        round += 1;
    }
    plan
}
