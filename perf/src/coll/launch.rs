//! `--np N`: the ranks as child processes of this one, on this host.
//!
//! Each child runs this executable with the same arguments minus `--np`, told its rank by
//! `PSNET_RANK` / `PSNET_WORLD_SIZE` and the meeting point by `PSNET_ROOT_ADDR` (a free port
//! on 127.0.0.1 unless the variable is set already). Rank 0's output is this process's;
//! the other ranks' stdout goes nowhere (only rank 0 prints results), their stderr comes
//! through. If a rank fails, the others are stopped and the failure names the rank. Each rank
//! starts bound to a CPU as `PSNET_BIND` says (`bind.rs`).
//!
//! No rank outlives this process: each child asks the kernel for SIGKILL when its parent
//! ends (`PR_SET_PDEATHSIG`, armed by the child itself first thing, then checked against the
//! parent's pid given by the hidden `--np-parent` flag, so a parent that died before that is
//! noticed too), and every exit path of this process kills the ranks still running.

use std::ffi::OsString;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use psnet::config::env;

use super::Failure;

/// The flag that makes a process launch ranks.
pub const NP: &str = "--np";
/// The hidden flag a launched rank is told its parent's pid by.
pub const NP_PARENT: &str = "--np-parent";

/// How long the other ranks may take to fail on their own after one failed (so that the one
/// that failed first, not one that only lost it, is blamed); then they are killed.
const GRACE: Duration = Duration::from_secs(2);

/// The arguments minus `--np N` / `--np=N`.
pub fn without_np(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == NP {
            args.next();
        } else if !arg.to_string_lossy().starts_with("--np=") {
            out.push(arg);
        }
    }
    out
}

/// The ranks started so far; those still running are killed when this goes, whatever the
/// way out (an error, a panic).
struct Ranks(Vec<Option<Child>>);

impl Ranks {
    fn kill_all(&mut self) {
        for child in self.0.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.0.iter_mut().for_each(|c| *c = None);
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// Starts `np` ranks running `args` and waits for them.
pub fn run_ranks(np: usize) -> Result<(), Failure> {
    let fail = |msg: String| Failure::new(1, msg);
    let exe = std::env::current_exe().map_err(|e| fail(format!("cannot find myself: {e}")))?;
    let args = without_np(std::env::args_os().skip(1));
    let root = if env::PSNET_ROOT_ADDR.is_set() {
        None
    } else {
        let port = psnet_launch::free_port("127.0.0.1").map_err(|e| fail(e.to_string()))?;
        Some(format!("127.0.0.1:{port}"))
    };
    let parent = std::process::id().to_string();
    let cpus = super::bind::rank_cpus(np).map_err(fail)?;
    let mut ranks = Ranks(Vec::with_capacity(np));
    for (rank, cpu) in cpus.into_iter().enumerate() {
        let mut cmd = Command::new(&exe);
        cmd.args(&args)
            .arg(NP_PARENT)
            .arg(&parent)
            .env(env::PSNET_RANK.name, rank.to_string())
            .env(env::PSNET_WORLD_SIZE.name, np.to_string())
            .stdin(Stdio::null());
        if let Some(root) = &root {
            cmd.env(env::PSNET_ROOT_ADDR.name, root);
        }
        if rank != 0 {
            cmd.stdout(Stdio::null());
        }
        let child = super::bind::start_on(cpu, || cmd.spawn())
            .map_err(fail)?
            .map_err(|e| fail(format!("cannot start rank {rank} ({}): {e}", exe.display())))?;
        ranks.0.push(Some(child));
    }
    wait(&mut ranks)
}

/// Waits for every rank; after the first failure, the others get [`GRACE`] to end, then are
/// killed. Blames the first rank that failed by itself: one that exited with
/// `EXIT_PEER_FAILED` (it only lost another) only if no other failed.
fn wait(ranks: &mut Ranks) -> Result<(), Failure> {
    let mut failed: Vec<(usize, ExitStatus)> = Vec::new();
    let mut kill_at: Option<Instant> = None;
    let mut stopped = false;
    loop {
        let mut running = 0;
        for (rank, slot) in ranks.0.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            match child.try_wait() {
                Ok(Some(status)) => {
                    *slot = None;
                    if !status.success() {
                        failed.push((rank, status));
                        kill_at.get_or_insert(Instant::now() + GRACE);
                    }
                }
                Ok(None) => running += 1,
                Err(e) => {
                    return Err(Failure::new(1, format!("waiting for rank {rank}: {e}")));
                }
            }
        }
        if running == 0 {
            break;
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            ranks.kill_all();
            stopped = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let blamed = failed
        .iter()
        .find(|(_, s)| s.code() != Some(psnet_launch::EXIT_PEER_FAILED))
        .or(failed.first());
    match blamed {
        None => Ok(()),
        Some((rank, status)) => {
            let others = if stopped {
                "; the ranks still running were stopped"
            } else {
                ""
            };
            Err(Failure::new(
                1,
                format!("rank {rank} of {} failed ({status}){others}", ranks.0.len()),
            ))
        }
    }
}

/// In a launched rank: die with the parent `parent` (the pid `--np-parent` names).
pub fn die_with_parent(parent: u32) -> Result<(), Failure> {
    use rustix::process::{getppid, set_parent_process_death_signal, Signal};
    set_parent_process_death_signal(Some(Signal::KILL))
        .map_err(|e| Failure::new(1, format!("cannot tie this rank to its parent: {e}")))?;
    let now = getppid().map(|p| p.as_raw_nonzero().get());
    if now != i32::try_from(parent).ok() {
        return Err(Failure::new(
            1,
            format!("the psnet-perf that started this rank (pid {parent}) is gone"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strip(args: &[&str]) -> Vec<String> {
        without_np(args.iter().map(OsString::from))
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect()
    }

    #[test]
    fn np_and_its_value_are_removed() {
        assert_eq!(
            strip(&["allreduce", "--np", "3", "-b", "8", "--json"]),
            ["allreduce", "-b", "8", "--json"]
        );
        assert_eq!(
            strip(&["allgather", "--np=4", "-n", "2"]),
            ["allgather", "-n", "2"]
        );
        assert_eq!(
            strip(&["reduce", "-e", "1M", "--np", "2"]),
            ["reduce", "-e", "1M"]
        );
        assert_eq!(strip(&["broadcast", "-r", "1"]), ["broadcast", "-r", "1"]);
    }
}
