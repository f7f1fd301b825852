//! The launcher's one use of `unsafe`: code that runs in a child between `fork` and `exec`.

use std::os::unix::process::CommandExt;
use std::process::Command;

use rustix::process::{getpid, getppid, set_parent_process_death_signal, Signal};

/// Makes the kernel send SIGKILL to the process `cmd` starts when the thread that starts it
/// ends, so that a launcher killed outright (SIGKILL, OOM) leaves no process behind. Call it
/// from the thread that lives as long as the job (the launcher's main thread).
pub(crate) fn die_with_launcher(cmd: &mut Command) {
    let launcher = getpid();
    // SAFETY: the closure runs in the forked child before exec and only makes two system
    // calls (prctl, getppid) through rustix, which allocate nothing and take no lock, so it
    // is safe after fork in a multi-threaded process.
    unsafe {
        cmd.pre_exec(move || {
            set_parent_process_death_signal(Some(Signal::KILL))?;
            // The launcher died before the death signal was armed: do not start.
            if getppid() != Some(launcher) {
                return Err(std::io::Error::other("the launcher is gone"));
            }
            Ok(())
        });
    }
}
