//! Whether this host runs more ranks than the CPUs they may use between them.
//!
//! A rank that waits spins; with more spinning ranks than CPUs it must give its CPU away
//! between polls (see `drive.rs`). Counting this process's own CPUs is not enough: a launcher
//! that binds each rank to one CPU (mpirun with 2 ranks, `psnet-perf --np`) leaves every rank
//! seeing one CPU, though no two share one. So the ranks gather their CPU masks when the
//! communicator forms, and a host is oversubscribed when its ranks outnumber the CPUs in the
//! union of theirs.

use rustix::thread::{sched_getaffinity, CpuSet};

/// Bytes of a CPU mask on the wire: one bit per CPU, as many CPUs as the kernel's `cpu_set_t`.
pub(crate) const MASK_BYTES: usize = CpuSet::MAX_CPU / 8;

/// This process's CPUs (the calling thread's affinity) as a bitmap, CPU `c` at bit `c % 8`
/// of byte `c / 8`. If the kernel will not say, the CPUs `available_parallelism` counts.
pub(crate) fn own_mask() -> [u8; MASK_BYTES] {
    let mut mask = [0u8; MASK_BYTES];
    match sched_getaffinity(None) {
        Ok(set) => {
            for cpu in (0..CpuSet::MAX_CPU).filter(|&c| set.is_set(c)) {
                mask[cpu / 8] |= 1 << (cpu % 8);
            }
        }
        Err(_) => {
            let n = std::thread::available_parallelism().map_or(1, |n| n.get());
            for cpu in 0..n.min(CpuSet::MAX_CPU) {
                mask[cpu / 8] |= 1 << (cpu % 8);
            }
        }
    }
    mask
}

/// The number of CPUs in the union of the masks of `ranks`, in `masks` (every rank's mask,
/// in rank order, `MASK_BYTES` each).
pub(crate) fn union_size(masks: &[u8], ranks: &[usize]) -> usize {
    let mut union = [0u8; MASK_BYTES];
    for &rank in ranks {
        let Some(mask) = masks.get(rank * MASK_BYTES..(rank + 1) * MASK_BYTES) else {
            continue;
        };
        for (u, m) in union.iter_mut().zip(mask) {
            *u |= m;
        }
    }
    union.iter().map(|b| b.count_ones() as usize).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mask(cpus: &[usize]) -> [u8; MASK_BYTES] {
        let mut m = [0u8; MASK_BYTES];
        for &c in cpus {
            m[c / 8] |= 1 << (c % 8);
        }
        m
    }

    #[test]
    fn ranks_bound_to_different_cpus_count_every_cpu_once() {
        let masks = [mask(&[0]), mask(&[1]), mask(&[0, 1]), mask(&[9, 700])].concat();
        assert_eq!(union_size(&masks, &[0, 1]), 2);
        assert_eq!(union_size(&masks, &[0, 2]), 2);
        assert_eq!(union_size(&masks, &[0]), 1);
        assert_eq!(union_size(&masks, &[0, 3]), 3);
        assert_eq!(union_size(&masks, &[]), 0);
        // A rank beyond the masks (cannot happen: every rank sends one) counts nothing.
        assert_eq!(union_size(&masks, &[4]), 0);
    }

    #[test]
    fn this_process_has_at_least_one_cpu() {
        let own = own_mask();
        assert!(union_size(&own, &[0]) >= 1);
    }
}
