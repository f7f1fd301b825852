//! Starts every process of a psnet job on this host, as MXNet's `tools/launch.py --launcher
//! local` does: one scheduler, `servers` servers and `workers` workers, all running the same
//! command, told their role through `DMLC_ROLE` and the job's shape through `DMLC_PS_ROOT_URI`,
//! `DMLC_PS_ROOT_PORT`, `DMLC_NUM_SERVER` and `DMLC_NUM_WORKER`.
//!
//! If any process fails, the others are stopped after a grace period, so a broken job never
//! lingers; the outcome says which process failed first. Each process runs in a process group
//! of its own (a signal to the job reaches what it started) and is killed by the kernel if the
//! launcher's thread ends first (`PR_SET_PDEATHSIG`: a launcher killed outright leaves no
//! process of the job; what a process started itself is its own to stop).
//!
//! Server and worker `i` are told `DMLC_SERVER_ID=i` / `DMLC_WORKER_ID=i`, which the kv store
//! grants as their ranks, so the launcher's numbering is the job's: with
//! [`JobSpec::tag_output`], every line a process prints comes out prefixed `[worker 1] `,
//! and a kv error about "worker 1" means that same process.
#![deny(missing_docs)]
// `unsafe` only in `sys` (code that runs between fork and exec).
#![deny(unsafe_code)]

use std::net::TcpListener;

use psnet_config::env;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};

pub mod batch;
pub mod cluster;
mod dumps;
mod remote_dumps;
pub mod ssh;
#[allow(unsafe_code)]
mod sys;
mod tagged;
pub mod yarn;
use std::time::{Duration, Instant};
use tagged::Tagger;

/// The exit status psnet's processes use when they stop because another process of the job
/// failed (`psnet_kv::EXIT_PEER_FAILED`).
pub const EXIT_PEER_FAILED: i32 = 2;

/// The role of a launched process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The scheduler.
    Scheduler,
    /// A server.
    Server,
    /// A worker.
    Worker,
}

impl Role {
    /// `DMLC_ROLE`'s value.
    pub fn as_env(self) -> &'static str {
        match self {
            Role::Scheduler => "scheduler",
            Role::Server => "server",
            Role::Worker => "worker",
        }
    }
}

/// What to launch.
#[derive(Clone, Debug)]
pub struct JobSpec {
    /// Number of servers (at least 1).
    pub servers: u32,
    /// Number of workers (at least 1).
    pub workers: u32,
    /// The program and its arguments, run in every role.
    pub command: Vec<String>,
    /// Extra environment for every process.
    pub env: Vec<(String, String)>,
    /// The scheduler's address: by default the address `DMLC_NODE_HOST` / `DMLC_INTERFACE`
    /// choose when one is set (so the scheduler runs over the same interface and transport as
    /// the others), else 127.0.0.1.
    pub root_host: String,
    /// The scheduler's port (0: a free one).
    pub root_port: u16,
    /// How long the others may run on after one process failed.
    pub grace: Duration,
    /// Prefix every line a process prints with its role and rank (`[worker 1] `,
    /// `[scheduler] `), as `mpirun --tag-output` does; otherwise processes write straight to
    /// the launcher's stdout and stderr.
    pub tag_output: bool,
    /// Local jobs: how many times each server that dies is started again with its rank
    /// (`PSNET_MAX_RESTARTS`, `--max-restarts`), to rejoin the job from its checkpoint
    /// (`PSNET_CHECKPOINT_DIR` is required). 0: a dying server stops the job.
    pub max_restarts: u32,
    /// Local jobs: ask every process for its flight recorder dump, and print the doctor's
    /// report, once no process has written a line for this long (`--dump-after`; needs the
    /// tagged output). `None`: only on `SIGUSR1`.
    pub dump_after: Option<Duration>,
}

impl JobSpec {
    /// A local job of `servers` and `workers` running `command`.
    pub fn new(servers: u32, workers: u32, command: Vec<String>) -> Self {
        JobSpec {
            servers,
            workers,
            command,
            env: Vec::new(),
            root_host: default_root_host(),
            root_port: 0,
            grace: Duration::from_secs(10),
            tag_output: false,
            max_restarts: env::PSNET_MAX_RESTARTS.parse().ok().flatten().unwrap_or(0),
            dump_after: None,
        }
    }
}

/// How one process ended.
#[derive(Debug)]
pub struct Ended {
    /// Its role.
    pub role: Role,
    /// Launch index within the role (not its rank: ranks follow listening addresses).
    pub index: u32,
    /// Exit status (None if it was killed by the launcher).
    pub status: Option<ExitStatus>,
}

/// The job's outcome.
#[derive(Debug)]
pub struct Outcome {
    /// Every process, in the order they ended.
    pub ended: Vec<Ended>,
    /// The process to blame, if any failed: the first that failed by its own exit. A process
    /// that exited with [`EXIT_PEER_FAILED`] (it stopped because another failed) is blamed
    /// only if no other process failed.
    pub first_failure: Option<(Role, u32, String)>,
    /// The signal (SIGINT, SIGTERM, SIGHUP) that stopped the job, if one did: every process
    /// was then stopped, and the launcher should exit with `128 + signal`.
    pub signal: Option<i32>,
}

impl Outcome {
    /// Whether every process exited with status 0 and no signal stopped the job.
    pub fn success(&self) -> bool {
        self.first_failure.is_none() && self.signal.is_none()
    }

    /// The exit status the launcher takes from the blamed process: its own exit code, or
    /// `128 + signal` when a signal ended it (as a shell reports it); `None` without a failure.
    pub fn failure_code(&self) -> Option<u8> {
        use std::os::unix::process::ExitStatusExt;
        let (role, index, _) = self.first_failure.as_ref()?;
        let status = self
            .ended
            .iter()
            .find(|e| e.role == *role && e.index == *index)
            .and_then(|e| e.status)?;
        let code = status
            .code()
            .or_else(|| status.signal().map(|sig| 128 + sig))
            .unwrap_or(1);
        Some(u8::try_from(code).unwrap_or(1).max(1))
    }
}

/// The signals that stop a job: each is passed on to every process of the job.
const STOP_SIGNALS: [i32; 3] = [
    signal_hook::consts::SIGINT,
    signal_hook::consts::SIGTERM,
    signal_hook::consts::SIGHUP,
];

/// Sends `sig` to the process group `child` leads (each child runs in a group of its own, so
/// that what it started itself goes too). A group already gone is not an error.
fn signal_group(child: &Child, sig: rustix::process::Signal) {
    let _ = rustix::process::kill_process_group(rustix::process::Pid::from_child(child), sig);
}

/// Catches the stop signals while a job runs; the handlers go when this is dropped.
struct StopSignals {
    caught: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ids: Vec<signal_hook::SigId>,
}

impl StopSignals {
    fn install() -> Result<Self, LaunchError> {
        let caught = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut ids = Vec::new();
        for sig in STOP_SIGNALS {
            let id = signal_hook::flag::register_usize(sig, caught.clone(), sig as usize)
                .map_err(LaunchError::Wait)?;
            ids.push(id);
        }
        Ok(StopSignals { caught, ids })
    }

    /// The signal caught, if any.
    fn caught(&self) -> Option<i32> {
        match self.caught.load(std::sync::atomic::Ordering::Acquire) {
            0 => None,
            sig => i32::try_from(sig).ok(),
        }
    }
}

impl Drop for StopSignals {
    fn drop(&mut self) {
        for id in self.ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

/// Why a job could not be launched.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// Bad specification.
    #[error("{0}")]
    Invalid(String),
    /// A process could not be started.
    #[error("cannot start {role:?} {index} ({program}): {source}")]
    Spawn {
        /// Role.
        role: Role,
        /// Index within the role.
        index: u32,
        /// The program.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Waiting on a process failed.
    #[error("waiting for a process: {0}")]
    Wait(std::io::Error),
}

/// The scheduler's address for a job on this host (see [`JobSpec::root_host`]).
pub fn default_root_host() -> String {
    let chosen = [env::DMLC_NODE_HOST, env::DMLC_INTERFACE]
        .iter()
        .any(|v| v.get().is_some());
    if chosen {
        if let Ok(address) = psnet_config::interface::node_address_from_env() {
            return address.ip.to_string();
        }
    }
    "127.0.0.1".into()
}

/// A free TCP port on `host` for the scheduler.
pub fn free_port(host: &str) -> Result<u16, LaunchError> {
    let l = TcpListener::bind((host, 0))
        .map_err(|e| LaunchError::Invalid(format!("no free port on {host}: {e}")))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| LaunchError::Invalid(e.to_string()))
}

/// The environment of process `index` of `role`.
pub fn process_env(spec: &JobSpec, role: Role, index: u32, port: u16) -> Vec<(String, String)> {
    let mut env = vec![
        ("DMLC_ROLE".to_string(), role.as_env().to_string()),
        ("DMLC_PS_ROOT_URI".to_string(), spec.root_host.clone()),
        ("DMLC_PS_ROOT_PORT".to_string(), port.to_string()),
        ("DMLC_NUM_SERVER".to_string(), spec.servers.to_string()),
        ("DMLC_NUM_WORKER".to_string(), spec.workers.to_string()),
    ];
    // A job on loopback keeps its nodes on loopback too, unless told otherwise.
    let told = |name: &str| {
        env::ALL.iter().any(|v| v.name == name && v.is_set())
            || spec.env.iter().any(|(k, _)| k == name)
    };
    let loopback = spec
        .root_host
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback());
    if loopback && !told("DMLC_INTERFACE") && !told("DMLC_NODE_HOST") {
        env.push(("DMLC_NODE_HOST".to_string(), spec.root_host.clone()));
    }
    match role {
        Role::Worker => env.push(("DMLC_WORKER_ID".to_string(), index.to_string())),
        Role::Server => env.push(("DMLC_SERVER_ID".to_string(), index.to_string())),
        Role::Scheduler => {}
    }
    // The job's flight recorder dumps, together in a folder of the job's.
    if dumps::told_dir(&spec.env).is_none() {
        let dir = dumps::job_dir(None, port);
        env.push((
            env::PSNET_RECORDER_DIR.name.to_string(),
            dir.display().to_string(),
        ));
    }
    env.extend(spec.env.iter().cloned());
    env
}

/// Launches the job on this host and waits for every process.
pub fn launch_local(spec: &JobSpec) -> Result<Outcome, LaunchError> {
    launch_with(spec, &dumps::ThisHostOnly, |role, index, port| {
        let mut cmd = Command::new(&spec.command[0]);
        cmd.args(&spec.command[1..]);
        cmd.envs(process_env(spec, role, index, port));
        cmd
    })
}

/// Launches the job, each process started by the command `command(role, index, port)`
/// returns (the program itself here, `ssh HOST ...` for another host), and waits for every
/// process: one group each, signals passed on, output tagged, the first failure blamed.
/// `others`: the job's processes on other hosts, asked for dumps and whose dumps are
/// brought into the job's dump folder before a report.
pub(crate) fn launch_with(
    spec: &JobSpec,
    others: &dyn dumps::OtherHosts,
    command: impl Fn(Role, u32, u16) -> Command,
) -> Result<Outcome, LaunchError> {
    if spec.servers == 0 || spec.workers == 0 {
        return Err(LaunchError::Invalid(
            "a job needs at least one server and one worker".into(),
        ));
    }
    let Some(program) = spec.command.first() else {
        return Err(LaunchError::Invalid("no command to launch".into()));
    };
    let checkpoints = env::PSNET_CHECKPOINT_DIR.is_set()
        || spec
            .env
            .iter()
            .any(|(k, v)| k == env::PSNET_CHECKPOINT_DIR.name && !v.is_empty());
    if spec.max_restarts > 0 && !checkpoints {
        return Err(LaunchError::Invalid(
            "restarting servers (--max-restarts / PSNET_MAX_RESTARTS) needs PSNET_CHECKPOINT_DIR: \
             a restarted server reloads its shard from there"
                .into(),
        ));
    }
    let port = if spec.root_port == 0 {
        free_port(&spec.root_host)?
    } else {
        spec.root_port
    };
    let mut roles = vec![(Role::Scheduler, 0)];
    roles.extend((0..spec.servers).map(|i| (Role::Server, i)));
    roles.extend((0..spec.workers).map(|i| (Role::Worker, i)));
    let signals = StopSignals::install()?;
    let mut children: Vec<(Role, u32, Child)> = Vec::new();
    let mut tagger = spec.tag_output.then(Tagger::new);
    let activity = tagger.as_ref().map(Tagger::activity);
    let mut spawn = |role: Role, index: u32| {
        let mut cmd = command(role, index, port);
        // A group of its own: a signal to the job reaches what the process started, and a
        // terminal's Ctrl-C reaches the launcher, which stops everything in order.
        cmd.process_group(0);
        sys::die_with_launcher(&mut cmd);
        if tagger.is_some() {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
            role,
            index,
            program: program.clone(),
            source,
        })?;
        if let Some(t) = &mut tagger {
            t.follow(&mut child, &tag(role, index));
        }
        Ok(child)
    };
    for (role, index) in roles {
        match spawn(role, index) {
            Ok(child) => children.push((role, index, child)),
            Err(e) => {
                for (_, _, mut c) in children {
                    signal_group(&c, rustix::process::Signal::KILL);
                    let _ = c.wait();
                }
                return Err(e);
            }
        }
    }
    let restarts = Restarts {
        most: spec.max_restarts,
        spawn: &mut spawn,
    };
    let dir = dumps::job_dir(dumps::told_dir(&spec.env).as_deref(), port);
    let watch = dumps::Watch::new(dir.clone(), spec.dump_after, activity);
    let outcome = wait_all(
        children,
        spec.grace,
        &signals,
        restarts,
        (watch, others, port),
    );
    if let Some(t) = tagger {
        t.finish(OUTPUT_DRAIN);
    }
    // A job that failed (not one stopped by a signal): what its processes dumped.
    if outcome
        .as_ref()
        .is_ok_and(|o| o.first_failure.is_some() && o.signal.is_none())
    {
        others.fetch(&dir, port);
        dumps::report_failure(&dir);
    }
    outcome
}

/// How long the launcher waits, once every process ended, for the rest of their output
/// (a process's own child may still hold its pipe open).
const OUTPUT_DRAIN: Duration = Duration::from_secs(2);

/// The prefix of a process's lines.
fn tag(role: Role, index: u32) -> String {
    match role {
        Role::Scheduler => "[scheduler] ".into(),
        _ => format!("[{} {index}] ", role.as_env()),
    }
}

/// The job's scheduler on this host (the batch and YARN launchers keep it here), in a group
/// of its own and killed with the launcher.
pub(crate) fn spawn_local_scheduler(spec: &JobSpec, port: u16) -> Result<Child, LaunchError> {
    let mut cmd = Command::new(&spec.command[0]);
    cmd.args(&spec.command[1..])
        .envs(process_env(spec, Role::Scheduler, 0, port))
        .process_group(0);
    sys::die_with_launcher(&mut cmd);
    cmd.spawn().map_err(|source| LaunchError::Spawn {
        role: Role::Scheduler,
        index: 0,
        program: spec.command[0].clone(),
        source,
    })
}

/// `spec` for a job whose processes may wait in a queue before they start (batch systems,
/// YARN): unless the user chose a `PSNET_BOOTSTRAP_TIMEOUT`, registration waits without limit
/// (0), since the launcher itself notices tasks that end before the job does.
pub(crate) fn queued(spec: &JobSpec) -> JobSpec {
    let mut spec = spec.clone();
    let chosen = env::PSNET_BOOTSTRAP_TIMEOUT.is_set()
        || spec
            .env
            .iter()
            .any(|(k, _)| k == env::PSNET_BOOTSTRAP_TIMEOUT.name);
    if !chosen {
        spec.env.push((
            env::PSNET_BOOTSTRAP_TIMEOUT.name.to_string(),
            "0".to_string(),
        ));
    }
    spec
}

/// Kills the local scheduler's group and reaps it.
pub(crate) fn stop_local_scheduler(scheduler: &mut Child) {
    signal_group(scheduler, rustix::process::Signal::KILL);
    let _ = scheduler.wait();
}

/// How long processes may take to exit after the launcher passed a signal on to them.
pub(crate) const SIGNAL_GRACE: Duration = Duration::from_secs(5);

/// Servers that die are started again, at most `most` times each, while the job is not
/// already stopping.
struct Restarts<'a> {
    most: u32,
    spawn: &'a mut dyn FnMut(Role, u32) -> Result<Child, LaunchError>,
}

fn wait_all(
    mut running: Vec<(Role, u32, Child)>,
    grace: Duration,
    signals: &StopSignals,
    restarts: Restarts<'_>,
    (mut watch, others, port): (dumps::Watch, &dyn dumps::OtherHosts, u16),
) -> Result<Outcome, LaunchError> {
    let dump_requests = dumps::DumpRequests::install();
    let mut restarted: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    let mut signal: Option<i32> = None;
    let mut ended = Vec::new();
    let mut first_failure: Option<(Role, u32, String, bool)> = None;
    let mut kill_at: Option<Instant> = None;
    while !running.is_empty() {
        let mut i = 0;
        while i < running.len() {
            match running[i].2.try_wait().map_err(LaunchError::Wait)? {
                Some(status) => {
                    let (role, index, _) = running.swap_remove(i);
                    let used = restarted.get(&index).copied().unwrap_or(0);
                    let restart = role == Role::Server
                        && !status.success()
                        && used < restarts.most
                        && signal.is_none()
                        && kill_at.is_none();
                    if restart {
                        eprintln!(
                            "psnet-launch: server {index} exited ({status}); starting it again \
                             ({} of {}) to rejoin the job from its checkpoint",
                            used + 1,
                            restarts.most
                        );
                        restarted.insert(index, used + 1);
                        ended.push(Ended {
                            role,
                            index,
                            status: Some(status),
                        });
                        match (restarts.spawn)(role, index) {
                            Ok(child) => {
                                running.push((role, index, child));
                                continue;
                            }
                            Err(e) => {
                                eprintln!("psnet-launch: {e}");
                                first_failure.get_or_insert((
                                    role,
                                    index,
                                    status.to_string(),
                                    false,
                                ));
                                kill_at.get_or_insert(Instant::now() + grace);
                                continue;
                            }
                        }
                    }
                    // Blame the process that failed by its own exit: one that stopped
                    // because another failed (EXIT_PEER_FAILED) yields to any other failure,
                    // even one seen in the same poll or during the grace period.
                    let blamed_is_peer = first_failure.as_ref().map(|f| f.3);
                    if !status.success() && blamed_is_peer != Some(false) {
                        let is_peer = status.code() == Some(EXIT_PEER_FAILED);
                        if blamed_is_peer.is_none() || !is_peer {
                            first_failure = Some((role, index, status.to_string(), is_peer));
                        }
                        kill_at.get_or_insert(Instant::now() + grace);
                    }
                    ended.push(Ended {
                        role,
                        index,
                        status: Some(status),
                    });
                }
                None => i += 1,
            }
        }
        if signal.is_none() {
            if let Some(sig) = signals.caught() {
                // Passed on to every process (each is a group of its own), then killed if
                // still there after SIGNAL_GRACE.
                signal = Some(sig);
                let term = rustix::process::Signal::TERM;
                for (_, _, child) in &running {
                    signal_group(child, term);
                }
                let by = Instant::now() + SIGNAL_GRACE.min(grace.max(Duration::from_millis(100)));
                kill_at = Some(kill_at.map_or(by, |t| t.min(by)));
            }
        }
        let here = || {
            running
                .iter()
                .filter(|(role, index, _)| !others.is_remote(*role, *index))
                .map(|(_, _, c)| c)
        };
        if dump_requests.take() {
            dumps::ask_and_report(here(), others, port, &watch.dir, "SIGUSR1");
        } else if let Some(quiet) = watch.due().filter(|_| kill_at.is_none()) {
            let why = format!("no output for {} s (--dump-after)", quiet.as_secs());
            dumps::ask_and_report(here(), others, port, &watch.dir, &why);
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            for (role, index, mut child) in running.drain(..) {
                signal_group(&child, rustix::process::Signal::KILL);
                let _ = child.kill();
                let _ = child.wait();
                ended.push(Ended {
                    role,
                    index,
                    status: None,
                });
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(Outcome {
        ended,
        first_failure: first_failure.map(|(role, index, status, _)| (role, index, status)),
        signal,
    })
}

#[cfg(test)]
mod tests;
