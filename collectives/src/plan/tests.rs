//! Every plan against a reference computed in one place, over rank counts 1..=9 (powers of
//! two and not), lengths from 0 (and not divisible by the rank count), piece sizes, roots and
//! orderings of every send, delivery and reduction drawn from a seed.

use bytes::Bytes;
use proptest::prelude::*;

use super::*;
use crate::element::{Element, ReduceOp};

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max];

fn inputs(n: usize, len: usize, seed: u64) -> Vec<Vec<i64>> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..n)
        .map(|_| (0..len).map(|_| rng.i64(-1000..1000)).collect())
        .collect()
}

/// The reduction of every rank's element i (integer operations are associative and
/// commutative, so any order gives these values).
fn reference(op: ReduceOp, bufs: &[Vec<i64>], range: Range<usize>) -> Vec<i64> {
    range
        .map(|i| {
            bufs.iter()
                .map(|b| b[i])
                .reduce(|a, b| match op {
                    ReduceOp::Sum | ReduceOp::Avg => i64::add(a, b),
                    ReduceOp::Prod => i64::mul(a, b),
                    ReduceOp::Min => <i64 as Element>::min(a, b),
                    ReduceOp::Max => <i64 as Element>::max(a, b),
                })
                .expect("at least one rank")
        })
        .collect()
}

/// Runs an allreduce plan builder over `n` ranks and checks every rank ends with the reference.
fn check_allreduce(
    build: fn(usize, usize, usize, usize, usize) -> Plan,
    n: usize,
    count: usize,
    piece: usize,
    op: ReduceOp,
    seed: u64,
) -> Result<(), TestCaseError> {
    let mut bufs = inputs(n, count, seed);
    let want = reference(op, &bufs, 0..count);
    let plans = (0..n).map(|r| build(r, n, count, 8, piece)).collect();
    sim::run(plans, &mut bufs, op, seed);
    for b in &bufs {
        prop_assert_eq!(b, &want);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn ring_allreduce_reduces(n in 1usize..=9, count in 0usize..200, piece in 1usize..40,
                              op in 0usize..4, seed: u64) {
        check_allreduce(ring_allreduce, n, count, piece, OPS[op], seed)?;
    }

    #[test]
    fn halving_allreduce_reduces(n in 1usize..=9, count in 0usize..200, piece in 1usize..40,
                                 op in 0usize..4, seed: u64) {
        check_allreduce(halving_allreduce, n, count, piece, OPS[op], seed)?;
    }

    #[test]
    fn doubling_allreduce_reduces(n in 1usize..=9, count in 0usize..120, piece in 1usize..40,
                                  op in 0usize..4, seed: u64) {
        check_allreduce(doubling_allreduce, n, count, piece, OPS[op], seed)?;
    }

    #[test]
    fn ring_reduce_scatter_leaves_each_rank_its_block(n in 1usize..=9, block in 0usize..40,
                                                     piece in 1usize..16, op in 0usize..4,
                                                     seed: u64) {
        let op = OPS[op];
        let mut bufs = inputs(n, n * block, seed);
        let want: Vec<Vec<i64>> =
            (0..n).map(|r| reference(op, &bufs, r * block..(r + 1) * block)).collect();
        let plans = (0..n).map(|r| ring_reduce_scatter(r, n, block, 8, piece)).collect();
        sim::run(plans, &mut bufs, op, seed);
        for (r, b) in bufs.iter().enumerate() {
            prop_assert_eq!(&b[r * block..(r + 1) * block], &want[r][..]);
        }
    }

    #[test]
    fn ring_allgather_gathers(n in 1usize..=9, block in 0usize..40, piece in 1usize..16,
                              seed: u64) {
        let own = inputs(n, block, seed);
        let want: Vec<i64> = own.iter().flatten().copied().collect();
        let mut bufs: Vec<Vec<i64>> = (0..n)
            .map(|r| {
                let mut b = vec![-1; n * block];
                b[r * block..(r + 1) * block].copy_from_slice(&own[r]);
                b
            })
            .collect();
        let plans = (0..n).map(|r| ring_allgather(r, n, block, 8, piece)).collect();
        sim::run(plans, &mut bufs, ReduceOp::Sum, seed);
        for b in &bufs {
            prop_assert_eq!(b, &want);
        }
    }

    #[test]
    fn tree_broadcast_copies_the_roots_buffer(n in 1usize..=9, root in 0usize..9,
                                              count in 0usize..100, piece in 1usize..30,
                                              seed: u64) {
        let root = root % n;
        let mut bufs = inputs(n, count, seed);
        let want = bufs[root].clone();
        let plans = (0..n).map(|r| tree_broadcast(r, n, root, count, 8, piece)).collect();
        sim::run(plans, &mut bufs, ReduceOp::Sum, seed);
        for b in &bufs {
            prop_assert_eq!(b, &want);
        }
    }

    #[test]
    fn tree_reduce_reduces_at_the_root(n in 1usize..=9, root in 0usize..9, count in 0usize..100,
                                       piece in 1usize..30, op in 0usize..4, seed: u64) {
        let (op, root) = (OPS[op], root % n);
        let mut bufs = inputs(n, count, seed);
        let want = reference(op, &bufs, 0..count);
        let plans = (0..n).map(|r| tree_reduce(r, n, root, count, 8, piece)).collect();
        sim::run(plans, &mut bufs, op, seed);
        prop_assert_eq!(&bufs[root], &want);
    }

    #[test]
    fn barrier_completes(n in 1usize..=33, seed: u64) {
        let plans = (0..n).map(|r| barrier(r, n)).collect();
        let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); n];
        sim::run(plans, &mut bufs, ReduceOp::Sum, seed);
    }

    /// Floating-point sums depend on their order: every rank must end with the same bits, and
    /// so must every run, whatever order the messages took.
    #[test]
    fn float_allreduce_gives_the_same_bits_everywhere_and_every_time(
        n in 1usize..=9, count in 0usize..120, piece in 1usize..20, algo in 0usize..3,
        seed: u64, other_seed: u64,
    ) {
        let mut rng = fastrand::Rng::with_seed(seed);
        let input: Vec<Vec<f32>> =
            (0..n).map(|_| (0..count).map(|_| rng.f32() * 1e3 - 500.0).collect()).collect();
        let plans = |n: usize| -> Vec<Plan> {
            (0..n)
                .map(|r| match algo {
                    0 => ring_allreduce(r, n, count, 4, piece),
                    1 => doubling_allreduce(r, n, count, 4, piece),
                    _ => halving_allreduce(r, n, count, 4, piece),
                })
                .collect()
        };
        let mut first = input.clone();
        sim::run(plans(n), &mut first, ReduceOp::Sum, seed);
        let mut second = input.clone();
        sim::run(plans(n), &mut second, ReduceOp::Sum, other_seed);
        let bits = |b: &Vec<f32>| b.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for r in 0..n {
            prop_assert_eq!(bits(&first[r]), bits(&first[0]));
            prop_assert_eq!(bits(&second[r]), bits(&first[0]));
        }
    }
}

#[test]
fn chunks_cover_the_count_evenly() {
    for count in 0..50 {
        for n in 1..10 {
            let ranges: Vec<_> = (0..n).map(|c| chunk(count, n, c)).collect();
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[n - 1].end, count);
            assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
            let lens: Vec<_> = ranges.iter().map(|r| r.len()).collect();
            assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
        }
    }
}

#[test]
fn a_piece_of_the_wrong_length_or_tag_is_refused() {
    // Two ranks, two blocks of 5 elements in one piece each: rank 0 first reduces block 1
    // (piece 1, step 0) from rank 1.
    let mut plan = ring_allreduce(0, 2, 10, 4, 100);
    assert_eq!(
        plan.handle_message(1, 99, Bytes::from_static(&[0; 20])),
        Err(PlanError::Unexpected {
            from: 1,
            tag: 99,
            meaning: String::new()
        })
    );
    assert_eq!(
        plan.handle_message(1, 1, Bytes::from_static(&[0; 3])),
        Err(PlanError::Length {
            from: 1,
            got: 3,
            want: 20
        })
    );
    assert_eq!(
        plan.handle_message(1, 1, Bytes::from_static(&[0; 20])),
        Ok(())
    );
    // The same piece twice.
    assert_eq!(
        plan.handle_message(1, 1, Bytes::from_static(&[0; 20])),
        Err(PlanError::Unexpected {
            from: 1,
            tag: 1,
            meaning: String::new()
        })
    );
}

#[test]
fn a_piece_placed_in_device_memory_is_checked_and_handed_on_as_placed() {
    use crate::payload::Payload;
    use psnet_transport::NodeId;
    let placed = |len| Payload::Placed {
        from: NodeId(2),
        tag: 1,
        len,
        result: Ok(()),
    };
    let mut plan = ring_allreduce(0, 2, 10, 4, 100);
    assert_eq!(
        plan.handle_message(1, 1, placed(24)),
        Err(PlanError::Length {
            from: 1,
            got: 24,
            want: 20
        })
    );
    assert_eq!(plan.handle_message(1, 1, placed(20)), Ok(()));
    let apply = plan.poll_apply().expect("the piece may be combined");
    assert_eq!(
        apply.data,
        placed(20),
        "the driver learns where the bytes are"
    );
}

#[test]
fn doubling_keeps_only_a_window_of_pieces_in_flight() {
    // Two ranks, 10 pieces: at first only the first two may go; piece 2 goes once piece 0 is
    // combined, and not before.
    let mut plan = doubling_allreduce(0, 2, 100, 4, 10);
    let first: Vec<SendReq> = std::iter::from_fn(|| plan.poll_send()).collect();
    assert_eq!(
        first.iter().map(|s| s.piece).collect::<Vec<_>>(),
        [0, 1],
        "only the window's pieces are released"
    );
    plan.handle_sent(first[0].op);
    assert!(plan.poll_send().is_none(), "sent is not combined");
    let round0 = 2u64 << 32;
    plan.handle_message(1, round0, Bytes::from(vec![0u8; 40]))
        .unwrap();
    let apply = plan.poll_apply().expect("piece 0 may be combined");
    assert_eq!(apply.piece, 0);
    assert!(plan.poll_send().is_none(), "received is not combined");
    plan.handle_applied(apply.op);
    let next = plan.poll_send().expect("piece 2 released");
    assert_eq!(next.piece, 2);
    assert!(plan.poll_send().is_none());
}
