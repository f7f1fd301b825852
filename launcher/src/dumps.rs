//! The job's flight recorder dumps (`psnet_recorder`): every process of a local job writes
//! them to one folder of the job's, `SIGUSR1` to the launcher asks every process for one and
//! prints what `psnet-doctor` makes of them, and a job that fails gets the same verdict
//! with the folder named.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use psnet_config::env;

use crate::Role;

/// How long the processes get to write their dumps once asked.
const DUMP_WAIT: Duration = Duration::from_secs(2);

/// The folder a job's dumps go to: `PSNET_RECORDER_DIR` if the user set it, else one of the
/// job's own (by its scheduler's port) under the system's temporary directory.
pub(crate) fn job_dir(told: Option<&str>, port: u16) -> PathBuf {
    match told {
        Some(dir) => PathBuf::from(dir),
        None => std::env::temp_dir()
            .join("psnet-recorder")
            .join(format!("job-{port}")),
    }
}

/// `SIGUSR1` to the launcher, caught while the job runs.
pub(crate) struct DumpRequests {
    asked: Arc<AtomicBool>,
    id: Option<signal_hook::SigId>,
}

impl DumpRequests {
    pub(crate) fn install() -> Self {
        let asked = Arc::new(AtomicBool::new(false));
        let id = signal_hook::flag::register(signal_hook::consts::SIGUSR1, asked.clone()).ok();
        DumpRequests { asked, id }
    }

    /// Whether `SIGUSR1` came since the last call.
    pub(crate) fn take(&self) -> bool {
        self.asked.swap(false, Ordering::AcqRel)
    }
}

impl Drop for DumpRequests {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            signal_hook::low_level::unregister(id);
        }
    }
}

/// A job's processes on other hosts (`--launcher ssh`): which they are, asking them for
/// dumps, and bringing their dumps into this host's folder.
pub(crate) trait OtherHosts {
    /// Whether the process of `role` `index` runs on another host (its child here is the
    /// `ssh` client, which must not be sent `SIGUSR1`: it would die, and its remote
    /// command with it).
    fn is_remote(&self, role: Role, index: u32) -> bool;
    /// How many hosts other than this one the job runs on.
    fn count(&self) -> usize;
    /// Asks every process of the job on other hosts for its dump.
    fn ask(&self, port: u16);
    /// Copies the dumps of the processes on other hosts into `dir`.
    fn fetch(&self, dir: &Path, port: u16);
}

/// A job that runs on this host only.
pub(crate) struct ThisHostOnly;

impl OtherHosts for ThisHostOnly {
    fn is_remote(&self, _: Role, _: u32) -> bool {
        false
    }
    fn count(&self) -> usize {
        0
    }
    fn ask(&self, _: u16) {}
    fn fetch(&self, _: &Path, _: u16) {}
}

/// Asks every running process for its dump (`SIGUSR1` to the group of each process here;
/// psnet's processes catch it from their start; those on other hosts through `others`),
/// waits for them, brings the other hosts' dumps here, and prints the doctor's report.
pub(crate) fn ask_and_report<'a>(
    here: impl Iterator<Item = &'a Child>,
    others: &dyn OtherHosts,
    port: u16,
    dir: &Path,
    why: &str,
) {
    let mut asked = 0;
    for child in here {
        crate::signal_group(child, rustix::process::Signal::USR1);
        asked += 1;
    }
    others.ask(port);
    let elsewhere = match others.count() {
        0 => String::new(),
        n => format!(" here and every process on {n} other hosts"),
    };
    eprintln!(
        "psnet-launch: {why}: asked {asked} processes{elsewhere} for their flight recorder dumps ({})",
        dir.display()
    );
    std::thread::sleep(DUMP_WAIT);
    others.fetch(dir, port);
    print_report(dir, false);
}

/// After a failed job: the doctor's verdict on what its processes dumped, if they dumped.
pub(crate) fn report_failure(dir: &Path) {
    print_report(dir, true);
}

fn print_report(dir: &Path, verdict_only: bool) {
    let dumps = match psnet_recorder::doctor::read_dir(dir) {
        Ok((dumps, _)) if !dumps.is_empty() => dumps,
        _ => {
            if !verdict_only {
                eprintln!("psnet-launch: no flight recorder dump in {}", dir.display());
            }
            return;
        }
    };
    let report = psnet_recorder::doctor::report(&dumps);
    let shown = if verdict_only {
        report
            .split("Evidence per node:")
            .next()
            .unwrap_or(&report)
            .trim_end()
            .to_string()
    } else {
        report
    };
    eprintln!(
        "psnet-launch: flight recorder dumps in {} (psnet-doctor {} for the evidence per node):\n{shown}",
        dir.display(),
        dir.display()
    );
}

/// When to ask the job for dumps unprompted: `--dump-after S` seconds without a line from
/// any process, once per quiet spell.
pub(crate) struct Watch {
    pub(crate) dir: PathBuf,
    after: Option<Duration>,
    activity: Option<Arc<crate::tagged::Activity>>,
    /// The last line's time when the job was last asked.
    asked_at: Option<u64>,
}

impl Watch {
    pub(crate) fn new(
        dir: PathBuf,
        after: Option<Duration>,
        activity: Option<Arc<crate::tagged::Activity>>,
    ) -> Self {
        Watch {
            dir,
            after,
            activity,
            asked_at: None,
        }
    }

    /// Whether the job has been quiet for `--dump-after` and not asked since its last line.
    pub(crate) fn due(&mut self) -> Option<Duration> {
        let (after, activity) = (self.after?, self.activity.as_ref()?);
        let quiet = activity.quiet_for();
        let last = activity.last_ms();
        if quiet < after || self.asked_at == Some(last) {
            return None;
        }
        self.asked_at = Some(last);
        Some(quiet)
    }
}

/// The `PSNET_RECORDER_DIR` the user gave the job, if any.
pub(crate) fn told_dir(spec_env: &[(String, String)]) -> Option<String> {
    spec_env
        .iter()
        .rev()
        .find(|(k, v)| k == env::PSNET_RECORDER_DIR.name && !v.is_empty())
        .map(|(_, v)| v.clone())
        .or_else(|| env::PSNET_RECORDER_DIR.get())
}
