//! Node loss with real processes, every role: a worker, the server and the scheduler killed
//! (SIGKILL) or frozen (SIGSTOP) mid-run, and a worker cut off by a network partition (a veth
//! pair taken down between network namespaces). Every survivor must exit non-zero with an
//! error naming the lost node, within `PS_HEARTBEAT_TIMEOUT` of the fault (plus slack for a
//! loaded machine); a job run by a launcher is stopped by it.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

mod common;

use common::{at, children, free_port, role_of, train, wait_for_launcher, wait_within};

/// `PS_HEARTBEAT_TIMEOUT` of these jobs, in seconds (heartbeats every 0.2 s).
const TIMEOUT_S: u64 = 2;
/// A loaded 2-core machine may take this long beyond the timeout to notice and exit.
const SLACK: Duration = Duration::from_secs(4);
const SLOW: [&str; 4] = ["--epochs", "1000", "--step-delay-ms", "5"];
const SCHEDULER: &str = "the scheduler (node 1)";
const SERVER: &str = "server 0 (node 8)";
const WORKER0: &str = "worker 0 (node 9)";
const WORKER1: &str = "worker 1 (node 11)";

/// One process of a job started by hand, by its name in psnet's errors.
struct Member {
    name: &'static str,
    child: Child,
    stderr: Arc<Mutex<String>>,
}

/// A 1-server, 2-worker job (worker ranks fixed by `DMLC_WORKER_ID`), running.
struct Job {
    members: Vec<Member>,
}

/// What became of a survivor after the fault.
struct Fate {
    name: &'static str,
    success: bool,
    after: Duration,
    stderr: String,
}

impl Job {
    /// Starts the members from their commands (already set up with their role) and returns
    /// once worker 0 reports its first epoch.
    fn start(commands: Vec<(&'static str, Command)>) -> Job {
        let (tx, rx) = mpsc::channel();
        let members = commands
            .into_iter()
            .map(|(name, mut cmd)| {
                let mut child = cmd
                    .env("PS_HEARTBEAT_TIMEOUT", TIMEOUT_S.to_string())
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("start a member");
                let stdout = child.stdout.take().unwrap();
                let tx = (name == WORKER0).then(|| tx.clone());
                std::thread::spawn(move || {
                    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                        if line.starts_with("epoch") {
                            if let Some(tx) = &tx {
                                let _ = tx.send(());
                            }
                        }
                    }
                });
                let stderr = Arc::new(Mutex::new(String::new()));
                let (mut pipe, sink) = (child.stderr.take().unwrap(), stderr.clone());
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = pipe.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        sink.lock()
                            .unwrap()
                            .push_str(&String::from_utf8_lossy(&buf[..n]));
                    }
                });
                Member {
                    name,
                    child,
                    stderr,
                }
            })
            .collect();
        let mut job = Job { members };
        if rx.recv_timeout(Duration::from_secs(60)).is_err() {
            let logs = job.logs();
            job.kill_all();
            panic!("training never started:\n{logs}");
        }
        job
    }

    /// The usual job on 127.0.0.1.
    fn local() -> Job {
        let port = free_port();
        let member = |role: &str, id: Option<&str>| {
            let mut cmd = train();
            at(&mut cmd, role, "127.0.0.1", "127.0.0.1", port, 2).args(SLOW);
            if let Some(id) = id {
                cmd.env("DMLC_WORKER_ID", id);
            }
            cmd
        };
        Job::start(vec![
            (SCHEDULER, member("scheduler", None)),
            (SERVER, member("server", None)),
            (WORKER0, member("worker", Some("0"))),
            (WORKER1, member("worker", Some("1"))),
        ])
    }

    fn pid(&self, name: &str) -> u32 {
        self.members
            .iter()
            .find(|m| m.name == name)
            .map(|m| m.child.id())
            .expect("a member of that name")
    }

    fn signal(&self, name: &str, signal: &str) {
        let ok = Command::new("kill")
            .args([signal, &self.pid(name).to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {signal} {name}");
    }

    /// Waits for every member but `victims` to exit; their fates, timed from `struck`.
    fn survivors(&mut self, victims: &[&str], struck: Instant) -> Vec<Fate> {
        let limit = Duration::from_secs(TIMEOUT_S) + SLACK + Duration::from_secs(30);
        let mut fates = Vec::new();
        for m in self
            .members
            .iter_mut()
            .filter(|m| !victims.contains(&m.name))
        {
            let left = limit.saturating_sub(struck.elapsed());
            let status = wait_within(&mut m.child, left);
            let after = struck.elapsed();
            // Let the reader thread take the last bytes.
            std::thread::sleep(Duration::from_millis(50));
            let stderr = m.stderr.lock().unwrap().clone();
            let status =
                status.unwrap_or_else(|| panic!("{} hangs after the fault:\n{stderr}", m.name));
            fates.push(Fate {
                name: m.name,
                success: status.success(),
                after,
                stderr,
            });
        }
        fates
    }

    fn logs(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("--- {}\n{}", m.name, m.stderr.lock().unwrap()))
            .collect()
    }

    fn kill_all(&mut self) {
        for m in &mut self.members {
            let _ = m.child.kill();
            let _ = m.child.wait();
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // SIGKILL also ends a stopped process.
        self.kill_all();
    }
}

/// Every survivor failed, naming `lost` (and `also`, if given), within the timeout plus slack.
fn check(fates: &[Fate], lost: &str, also: Option<&str>, what: &str) {
    for f in fates {
        assert!(
            !f.success,
            "{} exited 0 after {what}:\n{}",
            f.name, f.stderr
        );
        assert!(
            f.stderr.contains(lost) && also.is_none_or(|a| f.stderr.contains(a)),
            "{} does not name {lost} after {what}:\n{}",
            f.name,
            f.stderr
        );
        assert!(
            f.after <= Duration::from_secs(TIMEOUT_S) + SLACK,
            "{} took {:?} to notice {what}",
            f.name,
            f.after
        );
        eprintln!(
            "FIGURE node loss: {what}: {} exited naming it after {} ms",
            f.name,
            f.after.as_millis()
        );
    }
}

#[test]
fn a_killed_worker_is_named_by_every_survivor() {
    let mut job = Job::local();
    job.signal(WORKER1, "-KILL");
    let fates = job.survivors(&[WORKER1], Instant::now());
    check(&fates, WORKER1, None, "worker 1 killed");
}

#[test]
fn a_killed_server_is_named_by_every_survivor() {
    let mut job = Job::local();
    job.signal(SERVER, "-KILL");
    let fates = job.survivors(&[SERVER], Instant::now());
    check(&fates, SERVER, None, "the server killed");
}

#[test]
fn a_killed_scheduler_is_named_by_every_survivor() {
    let mut job = Job::local();
    job.signal(SCHEDULER, "-KILL");
    let fates = job.survivors(&[SCHEDULER], Instant::now());
    check(&fates, SCHEDULER, None, "the scheduler killed");
}

#[test]
fn a_frozen_worker_is_declared_dead_after_the_heartbeat_timeout() {
    let mut job = Job::local();
    job.signal(WORKER1, "-STOP");
    let struck = Instant::now();
    let fates = job.survivors(&[WORKER1], struck);
    check(&fates, WORKER1, Some("no heartbeat"), "worker 1 frozen");
    for f in &fates {
        assert!(
            f.after >= Duration::from_secs(TIMEOUT_S) / 2,
            "{} declared the frozen worker dead before the timeout: {:?}",
            f.name,
            f.after
        );
    }
}

#[test]
fn a_frozen_server_is_declared_dead_after_the_heartbeat_timeout() {
    let mut job = Job::local();
    job.signal(SERVER, "-STOP");
    let fates = job.survivors(&[SERVER], Instant::now());
    check(&fates, SERVER, Some("no heartbeat"), "the server frozen");
}

#[test]
fn a_frozen_scheduler_is_declared_lost_after_the_heartbeat_timeout() {
    let mut job = Job::local();
    job.signal(SCHEDULER, "-STOP");
    let fates = job.survivors(&[SCHEDULER], Instant::now());
    check(&fates, SCHEDULER, None, "the scheduler frozen");
}

/// Two network namespaces joined by one veth pair, removed on drop.
struct Partition {
    a: String,
    b: String,
}

const A_ADDR: &str = "10.232.1.1";
const B_ADDR: &str = "10.232.1.2";

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run `ip`: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}`: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Partition {
    fn new() -> Result<Partition, String> {
        let pid = std::process::id();
        let p = Partition {
            a: format!("psnet-part-{pid}-a"),
            b: format!("psnet-part-{pid}-b"),
        };
        ip(&["netns", "add", &p.a])?;
        ip(&["netns", "add", &p.b])?;
        ip(&[
            "link", "add", "eth0", "netns", &p.a, "type", "veth", "peer", "name", "eth0", "netns",
            &p.b,
        ])?;
        for (ns, addr) in [(&p.a, A_ADDR), (&p.b, B_ADDR)] {
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(p)
    }

    /// `psnet-train` in namespace `ns` as `role`, listening on `host`.
    fn member(&self, ns: &str, role: &str, host: &str, port: u16, id: Option<&str>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_psnet-train")])
            .args(common::SMALL)
            .args(SLOW);
        for var in [
            "DMLC_INTERFACE",
            "PSNET_TRANSPORT",
            "RUST_LOG",
            "PS_VERBOSE",
        ] {
            cmd.env_remove(var);
        }
        cmd.env("PS_HEARTBEAT_INTERVAL", "0.2");
        at(&mut cmd, role, A_ADDR, host, port, 2);
        if let Some(id) = id {
            cmd.env("DMLC_WORKER_ID", id);
        }
        cmd
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}

#[test]
fn a_network_partition_is_reported_on_both_sides() {
    let net = match Partition::new() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("SKIPPED: network namespaces unavailable (needs root and iproute2): {e}");
            return;
        }
    };
    let port = 9400;
    let mut job = Job::start(vec![
        (
            SCHEDULER,
            net.member(&net.a, "scheduler", A_ADDR, port, None),
        ),
        (SERVER, net.member(&net.a, "server", A_ADDR, port, None)),
        (
            WORKER0,
            net.member(&net.a, "worker", A_ADDR, port, Some("0")),
        ),
        (
            WORKER1,
            net.member(&net.b, "worker", B_ADDR, port, Some("1")),
        ),
    ]);
    // Cut worker 1 off: its link goes down; no reset reaches either side.
    ip(&["-n", &net.b, "link", "set", "eth0", "down"]).expect("take the link down");
    let fates = job.survivors(&[], Instant::now());
    let (cut_off, rest): (Vec<Fate>, Vec<Fate>) =
        fates.into_iter().partition(|f| f.name == WORKER1);
    check(&rest, WORKER1, None, "worker 1 partitioned away");
    check(
        &cut_off,
        SCHEDULER,
        None,
        "the partition, seen from worker 1",
    );
}

#[test]
fn a_launched_job_is_stopped_by_its_launcher_when_the_server_is_killed() {
    // psnet-train without DMLC_ROLE launches the job itself (psnet-launch's local launcher).
    let mut launcher = train()
        .args(SLOW)
        .args(["--servers", "1", "--workers", "2"])
        .env("PS_HEARTBEAT_TIMEOUT", TIMEOUT_S.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(launcher.stdout.take().unwrap()).lines();
    assert!(
        lines.any(|l| l.is_ok_and(|l| l.contains("epoch"))),
        "training never started"
    );
    std::thread::spawn(move || lines.for_each(drop));
    let members = children(launcher.id());
    assert_eq!(
        members.len(),
        4,
        "scheduler, server, two workers: {members:?}"
    );
    let server = *members
        .iter()
        .find(|&&p| role_of(p).as_deref() == Some("server"))
        .expect("the server process");
    assert!(Command::new("kill")
        .args(["-KILL", &server.to_string()])
        .status()
        .unwrap()
        .success());
    let struck = Instant::now();
    let (status, err) = wait_for_launcher(&mut launcher, Duration::from_secs(60));
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("server 0"),
        "the launcher names the killed server:\n{err}"
    );
    for p in members {
        assert!(
            !std::path::Path::new(&format!("/proc/{p}")).exists()
                || std::fs::read_to_string(format!("/proc/{p}/stat"))
                    .is_ok_and(|s| s.contains(") Z ")),
            "process {p} outlived the launcher"
        );
    }
    eprintln!(
        "FIGURE node loss: the server killed under the launcher: the job stopped after {} ms",
        struck.elapsed().as_millis()
    );
}
