//! `--check 1`: inputs whose results are known exactly, and the count of elements that differ.
//!
//! Every input is a small integer that depends on the rank and the element's index, chosen so
//! that every partial result on the way is a small integer too: exact in every element type
//! (bfloat16 holds the integers up to 256 exactly, half up to 2048, uint8 up to 255), whatever
//! order the ranks combine them in. So the expected result is computed in integers, converted
//! once, and compared bit for bit (an average is that exact sum divided once, as the
//! collective's last step divides it).

use psnet::collectives::{bf16, f16, Element, ReduceOp};

/// An element type `psnet-perf` can fill and check.
pub trait Sample: Element + PartialEq {
    /// The small integer `v` (at most 255 in magnitude here) in this type, exactly.
    fn from_small(v: i64) -> Self;
}

macro_rules! sample {
    ($t:ty, $conv:expr) => {
        impl Sample for $t {
            fn from_small(v: i64) -> Self {
                $conv(v)
            }
        }
    };
}

sample!(f32, |v: i64| v as f32);
sample!(f64, |v: i64| v as f64);
sample!(f16, |v: i64| f16::from_f64(v as f64));
sample!(bf16, |v: i64| bf16::from_f64(v as f64));
sample!(i32, |v: i64| v as i32);
sample!(i64, |v: i64| v);
sample!(u8, |v: i64| v as u8);

/// Ranks whose sum inputs are not zero: 63 ranks of at most 4 sum to at most 252.
const SUMMED_RANKS: usize = 63;

/// Rank `rank`'s input at index `i` of a reduction `op` over `n` ranks.
pub fn input(op: ReduceOp, rank: usize, i: usize, n: usize) -> i64 {
    match op {
        // 1..=4, rotating with the index; ranks past the 63rd add zeros.
        ReduceOp::Sum | ReduceOp::Avg => {
            if rank < SUMMED_RANKS {
                1 + ((rank + i) % 4) as i64
            } else {
                0
            }
        }
        // 2 at min(i % 4, n) ranks (which ones rotates with the index), 1 elsewhere: every
        // partial product is a power of two up to 8.
        ReduceOp::Prod => {
            if (rank + i) % n < i % 4 {
                2
            } else {
                1
            }
        }
        ReduceOp::Min | ReduceOp::Max => 1 + ((rank * 5 + i * 3) % 17) as i64,
    }
}

/// The exact reduction of every rank's [`input`] at index `i`, in integers (an average's
/// sum: it is divided in the element type).
pub fn reduced(op: ReduceOp, i: usize, n: usize) -> i64 {
    let values = (0..n).map(|r| input(op, r, i, n));
    match op {
        ReduceOp::Sum | ReduceOp::Avg => values.sum(),
        ReduceOp::Prod => values.product(),
        ReduceOp::Min => values.min().unwrap_or(0),
        ReduceOp::Max => values.max().unwrap_or(0),
    }
}

/// The expected element at index `i` of a reduction over `n` ranks.
pub fn expected<E: Sample>(op: ReduceOp, i: usize, n: usize) -> E {
    let v = E::from_small(reduced(op, i, n));
    if op == ReduceOp::Avg {
        v.div_count(n)
    } else {
        v
    }
}

/// Rank `rank`'s own element at index `i` (allgather, broadcast): 1..=100.
pub fn own(rank: usize, i: usize) -> i64 {
    1 + ((rank * 7 + i) % 100) as i64
}

/// What no expected element is (every one is at least 1 or an average of such): written over
/// receive buffers before a checked call, so that an element the call never wrote counts as
/// wrong.
pub fn poison<E: Sample>(buf: &mut [E]) {
    buf.fill(E::from_small(0));
}

/// `buf[j] = input(op, rank, offset + j, n)`.
pub fn fill_inputs<E: Sample>(buf: &mut [E], op: ReduceOp, rank: usize, n: usize, offset: usize) {
    for (j, x) in buf.iter_mut().enumerate() {
        *x = E::from_small(input(op, rank, offset + j, n));
    }
}

/// `buf[j] = own(rank, j)`.
pub fn fill_own<E: Sample>(buf: &mut [E], rank: usize) {
    for (j, x) in buf.iter_mut().enumerate() {
        *x = E::from_small(own(rank, j));
    }
}

/// Elements of `buf` that differ from the reduction at indices `offset..`.
pub fn wrong_reduced<E: Sample>(buf: &[E], op: ReduceOp, n: usize, offset: usize) -> u64 {
    buf.iter()
        .enumerate()
        .filter(|&(j, x)| *x != expected::<E>(op, offset + j, n))
        .count() as u64
}

/// Elements of `buf` that differ from rank `rank`'s own elements.
pub fn wrong_own<E: Sample>(buf: &[E], rank: usize) -> u64 {
    buf.iter()
        .enumerate()
        .filter(|&(j, x)| *x != E::from_small(own(rank, j)))
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Folds every rank's input in `E`'s own arithmetic, in the order given.
    fn fold_in<E: Sample>(op: ReduceOp, i: usize, order: &[usize]) -> E {
        let n = order.len();
        let mut acc = E::from_small(input(op, order[0], i, n));
        for &r in &order[1..] {
            let x = E::from_small(input(op, r, i, n));
            acc = match op {
                ReduceOp::Sum | ReduceOp::Avg => E::add(acc, x),
                ReduceOp::Prod => E::mul(acc, x),
                ReduceOp::Min => E::min(acc, x),
                ReduceOp::Max => E::max(acc, x),
            };
        }
        if op == ReduceOp::Avg {
            acc.div_count(n)
        } else {
            acc
        }
    }

    fn exact_in<E: Sample>() {
        for n in [1, 2, 3, 4, 7, 8, 9, 63, 64, 100, 300] {
            let forward: Vec<usize> = (0..n).collect();
            let backward: Vec<usize> = (0..n).rev().collect();
            for op in ReduceOp::ALL {
                if op == ReduceOp::Avg && !E::DTYPE.is_float() {
                    continue;
                }
                for i in 0..40 {
                    let want = expected::<E>(op, i, n);
                    for order in [&forward, &backward] {
                        assert_eq!(
                            fold_in::<E>(op, i, order),
                            want,
                            "{} {op} over {n} ranks at {i}",
                            E::DTYPE
                        );
                    }
                    assert!(reduced(op, i, n) >= 1 && reduced(op, i, n) <= 255);
                }
            }
        }
        // Own elements are exact, and never the poison.
        for r in 0..300 {
            for i in 0..300 {
                let v = own(r, i);
                assert!((1..=100).contains(&v));
                assert!(E::from_small(v) != E::from_small(0));
                assert!(E::from_small(v) != E::from_small(v + 1), "{} {v}", E::DTYPE);
            }
        }
    }

    #[test]
    fn expected_results_are_exact_in_every_type_and_order() {
        exact_in::<f32>();
        exact_in::<f64>();
        exact_in::<f16>();
        exact_in::<bf16>();
        exact_in::<i32>();
        exact_in::<i64>();
        exact_in::<u8>();
    }

    #[test]
    fn results_depend_on_the_index() {
        for op in ReduceOp::ALL {
            let values: Vec<i64> = (0..8).map(|i| reduced(op, i, 3)).collect();
            assert!(values.iter().any(|&v| v != values[0]), "{op}: {values:?}");
        }
        let inputs: Vec<i64> = (0..4).map(|r| input(ReduceOp::Sum, r, 0, 4)).collect();
        assert_eq!(inputs, [1, 2, 3, 4]);
        assert_eq!(reduced(ReduceOp::Sum, 0, 4), 10);
        assert_eq!(reduced(ReduceOp::Prod, 3, 4), 8);
        assert_eq!(reduced(ReduceOp::Prod, 3, 2), 4);
    }

    #[test]
    fn wrong_elements_are_counted() {
        let n = 3;
        let mut buf = vec![0.0f32; 50];
        assert_eq!(
            wrong_reduced(&buf, ReduceOp::Sum, n, 10),
            50,
            "poison is wrong"
        );
        for (j, x) in buf.iter_mut().enumerate() {
            *x = expected(ReduceOp::Sum, 10 + j, n);
        }
        assert_eq!(wrong_reduced(&buf, ReduceOp::Sum, n, 10), 0);
        assert_eq!(wrong_reduced(&buf, ReduceOp::Sum, n, 11), 50, "shifted");
        buf[7] += 1.0;
        buf[49] = f32::NAN;
        assert_eq!(wrong_reduced(&buf, ReduceOp::Sum, n, 10), 2);

        let mut mine = vec![bf16::from_f32(0.0); 300];
        fill_own(&mut mine, 2);
        assert_eq!(wrong_own(&mine, 2), 0);
        assert_eq!(wrong_own(&mine, 1), 300);
        poison(&mut mine[..5]);
        assert_eq!(wrong_own(&mine, 2), 5);

        let mut ins = vec![0u8; 8];
        fill_inputs(&mut ins, ReduceOp::Max, 1, n, 4);
        let want: Vec<u8> = (4..12)
            .map(|i| input(ReduceOp::Max, 1, i, n) as u8)
            .collect();
        assert_eq!(ins, want);
    }
}
