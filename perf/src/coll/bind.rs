//! `--np N`: which CPU each rank runs on (`PSNET_BIND`).
//!
//! mpirun binds 2 ranks to cores by default (and leaves oversubscribed ranks unbound), and
//! `scripts/bench-allreduce.sh` measures Open MPI with its defaults; `--np` binds the same
//! way, so that both sides run under the same placement: one CPU per rank when there are no
//! more ranks than CPUs this process may use, none otherwise, unless `PSNET_BIND=core` asks
//! for round robin or `none` for no binding. Both sides spin while they wait, and an
//! unbound pair can be placed on one core for a while.
//!
//! A child inherits the affinity of the thread that starts it, so the launching thread binds
//! itself to the rank's CPU, starts the rank, and takes back its own mask: no code runs in
//! the child between fork and exec.

use std::fmt::Write as _;
use std::str::FromStr;

use psnet::config::env;
use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};

/// How `--np` binds its ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bind {
    /// One CPU per rank when the ranks fit, none otherwise.
    Auto,
    /// One CPU per rank, round robin over the CPUs.
    Core,
    /// No binding: the kernel places the ranks.
    None,
}

impl FromStr for Bind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Bind::Auto),
            "core" | "cores" => Ok(Bind::Core),
            "none" => Ok(Bind::None),
            _ => Err("one of auto, core, none".into()),
        }
    }
}

/// The CPU each of `np` ranks is bound to (`None`: not bound), given the CPUs this process
/// may use, in order.
pub fn plan(bind: Bind, np: usize, allowed: &[usize]) -> Vec<Option<usize>> {
    let bound = match bind {
        Bind::None => false,
        Bind::Core => !allowed.is_empty(),
        // One CPU alone binds nothing worth binding: every rank would share it anyway.
        Bind::Auto => allowed.len() > 1 && np <= allowed.len(),
    };
    (0..np)
        .map(|rank| bound.then(|| allowed[rank % allowed.len()]))
        .collect()
}

/// The CPUs this thread may run on, in order.
pub fn allowed_cpus() -> std::io::Result<Vec<usize>> {
    let set = sched_getaffinity(None)?;
    Ok((0..CpuSet::MAX_CPU).filter(|&c| set.is_set(c)).collect())
}

/// The CPUs `--np`'s ranks are bound to, one per rank, from `PSNET_BIND`.
pub(crate) fn rank_cpus(np: usize) -> Result<Vec<Option<usize>>, String> {
    let bind: Bind = env::PSNET_BIND
        .parse_or_default()
        .map_err(|e| e.to_string())?;
    let allowed = allowed_cpus().map_err(|e| format!("cannot read this process's CPUs: {e}"))?;
    Ok(plan(bind, np, &allowed))
}

/// Runs `start` (which starts a child process) with this thread bound to `cpu`, so that the
/// child starts bound to it; this thread's own CPUs are restored before returning.
pub(crate) fn start_on<R>(cpu: Option<usize>, start: impl FnOnce() -> R) -> Result<R, String> {
    let Some(cpu) = cpu else {
        return Ok(start());
    };
    let own =
        sched_getaffinity(None).map_err(|e| format!("cannot read this thread's CPUs: {e}"))?;
    let mut one = CpuSet::new();
    one.set(cpu);
    sched_setaffinity(None, &one).map_err(|e| format!("cannot bind to CPU {cpu}: {e}"))?;
    let started = start();
    sched_setaffinity(None, &own)
        .map_err(|e| format!("cannot restore this thread's CPUs after binding: {e}"))?;
    Ok(started)
}

/// This process's CPUs as a list of ranges ("0", "0-3,8"), for the banner.
pub fn describe_own() -> String {
    match allowed_cpus() {
        Ok(cpus) => ranges(&cpus),
        Err(_) => "?".into(),
    }
}

/// `cpus` (ascending) as ranges: "0-3,8".
pub fn ranges(cpus: &[usize]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        if !out.is_empty() {
            out.push(',');
        }
        if i == j {
            let _ = write!(out, "{}", cpus[i]);
        } else {
            let _ = write!(out, "{}-{}", cpus[i], cpus[j]);
        }
        i = j + 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_binds_one_cpu_per_rank_only_when_they_fit() {
        assert_eq!(plan(Bind::Auto, 2, &[0, 1]), vec![Some(0), Some(1)]);
        assert_eq!(plan(Bind::Auto, 2, &[2, 5, 7]), vec![Some(2), Some(5)]);
        assert_eq!(plan(Bind::Auto, 4, &[0, 1]), vec![None; 4]);
        assert_eq!(plan(Bind::Auto, 1, &[3]), vec![None]);
    }

    #[test]
    fn core_goes_round_robin_and_none_binds_nothing() {
        assert_eq!(
            plan(Bind::Core, 5, &[0, 1]),
            vec![Some(0), Some(1), Some(0), Some(1), Some(0)]
        );
        assert_eq!(plan(Bind::Core, 2, &[]), vec![None, None]);
        assert_eq!(plan(Bind::None, 2, &[0, 1, 2]), vec![None, None]);
    }

    #[test]
    fn bind_parses_its_words_and_refuses_others() {
        assert_eq!("auto".parse::<Bind>(), Ok(Bind::Auto));
        assert_eq!(" Core ".parse::<Bind>(), Ok(Bind::Core));
        assert_eq!("none".parse::<Bind>(), Ok(Bind::None));
        assert!("socket".parse::<Bind>().is_err());
    }

    #[test]
    fn cpu_lists_print_as_ranges() {
        assert_eq!(ranges(&[]), "");
        assert_eq!(ranges(&[0]), "0");
        assert_eq!(ranges(&[0, 1, 2, 3, 8]), "0-3,8");
        assert_eq!(ranges(&[1, 3, 4]), "1,3-4");
    }

    #[test]
    fn a_child_started_on_a_cpu_runs_there_and_this_thread_keeps_its_cpus() {
        let own = allowed_cpus().unwrap();
        let cpu = *own.last().unwrap();
        let out = start_on(Some(cpu), || {
            std::process::Command::new("grep")
                .args(["Cpus_allowed_list", "/proc/self/status"])
                .output()
        })
        .unwrap()
        .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            text.split_whitespace().last(),
            Some(cpu.to_string().as_str())
        );
        assert_eq!(allowed_cpus().unwrap(), own);
    }
}
