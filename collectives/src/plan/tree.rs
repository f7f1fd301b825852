//! Binomial trees rooted at any rank: broadcast sends each piece down the tree as soon as it
//! arrived, reduce combines the children's pieces in a fixed order and sends the result up.
//! Both take ceil(log2 n) hops per piece, and the pieces pipeline down (or up) the tree.

use super::{pieces_of_blocks, Action, Plan};
use crate::element::Order;

/// The tree as rank `rank` sees it (ranks renumbered so that the root is 0): its parent, if
/// not the root, and its children, nearest subtree first.
fn tree(rank: usize, n: usize, root: usize) -> (Option<usize>, Vec<usize>) {
    let vr = (rank + n - root) % n;
    let real = |v: usize| (v + root) % n;
    let mut parent = None;
    let mut children = Vec::new();
    let mut mask = 1;
    while mask < n {
        if vr & mask != 0 {
            parent = Some(real(vr - mask));
            break;
        }
        if vr + mask < n {
            children.push(real(vr + mask));
        }
        mask <<= 1;
    }
    (parent, children)
}

/// Broadcast of `count` elements from `root`.
pub(crate) fn tree_broadcast(
    rank: usize,
    n: usize,
    root: usize,
    count: usize,
    elem_size: usize,
    piece: usize,
) -> Plan {
    let (pieces, _) = pieces_of_blocks(std::iter::once(0..count), piece);
    let mut plan = Plan::new(pieces, elem_size);
    let (parent, children) = tree(rank, n, root);
    for p in 0..plan.pieces.len() {
        let arrived: Vec<usize> = parent
            .map(|from| plan.recv(from, p as u64, p, Action::Copy, &[]))
            .into_iter()
            .collect();
        // The biggest subtree (the last child found) first: it has the longest way to go.
        for &child in children.iter().rev() {
            plan.send(child, p as u64, p, &arrived);
        }
    }
    plan
}

/// Reduce of `count` elements to `root`: afterwards the root's buffer holds the reduction of
/// every rank's (the others hold partial results).
pub(crate) fn tree_reduce(
    rank: usize,
    n: usize,
    root: usize,
    count: usize,
    elem_size: usize,
    piece: usize,
) -> Plan {
    let (pieces, _) = pieces_of_blocks(std::iter::once(0..count), piece);
    let mut plan = Plan::new(pieces, elem_size);
    let (parent, children) = tree(rank, n, root);
    for p in 0..plan.pieces.len() {
        // Children are combined nearest first, each after the previous: a fixed order.
        let mut last: Vec<usize> = Vec::new();
        for &child in &children {
            let id = plan.recv(child, p as u64, p, Action::Reduce(Order::LocalFirst), &last);
            last = vec![id];
        }
        if let Some(to) = parent {
            plan.send(to, p as u64, p, &last);
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::tree;

    #[test]
    fn every_rank_but_the_root_has_one_parent_and_the_edges_agree() {
        for n in 1..40 {
            for root in 0..n {
                let mut parents = 0;
                for r in 0..n {
                    let (parent, children) = tree(r, n, root);
                    if let Some(p) = parent {
                        parents += 1;
                        assert!(
                            tree(p, n, root).1.contains(&r),
                            "n {n} root {root} rank {r}"
                        );
                    } else {
                        assert_eq!(r, root);
                    }
                    for c in children {
                        assert_eq!(tree(c, n, root).0, Some(r));
                    }
                }
                assert_eq!(parents, n - 1);
            }
        }
    }
}
