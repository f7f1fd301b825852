//! What the whole-job tests share: the small model, `psnet-train` with a clean environment,
//! one role of a job started by hand, and waiting for a child with a bound.
#![allow(dead_code)] // each test file uses a part

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The small model the job tests train (softmax regression, 20 features, 5 classes): quick
/// on 2 cores. The default multi-layer perceptron is tested by `mlp_matches_reference`.
pub const SMALL: [&str; 10] = [
    "--hidden",
    "none",
    "--features",
    "20",
    "--classes",
    "5",
    "--samples",
    "4096",
    "--batch",
    "32",
];

pub fn train() -> Command {
    let mut cmd = train_any();
    cmd.args(SMALL);
    cmd
}

pub fn train_any() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_psnet-train"));
    for var in [
        "DMLC_ROLE",
        "DMLC_INTERFACE",
        "DMLC_NODE_HOST",
        "PSNET_TRANSPORT",
        "RUST_LOG",
        "PS_VERBOSE",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("PS_HEARTBEAT_INTERVAL", "0.2");
    cmd
}

pub fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("psnet-train-{}-{name}.bin", std::process::id()))
}

pub fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "job failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// One role of a 1-server job whose scheduler listens at 127.0.0.1:`port`.
pub fn role(cmd: &mut Command, role: &str, port: u16, workers: u32) -> Child {
    at(cmd, role, "127.0.0.1", "127.0.0.1", port, workers)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// `cmd` set up as `role` of a 1-server job of `workers` workers, listening on `host`, its
/// scheduler at `root`:`port`.
pub fn at<'a>(
    cmd: &'a mut Command,
    role: &str,
    root: &str,
    host: &str,
    port: u16,
    workers: u32,
) -> &'a mut Command {
    cmd.env("DMLC_ROLE", role)
        .env("DMLC_PS_ROOT_URI", root)
        .env("DMLC_PS_ROOT_PORT", port.to_string())
        .env("DMLC_NUM_SERVER", "1")
        .env("DMLC_NUM_WORKER", workers.to_string())
        .env("DMLC_NODE_HOST", host)
}

/// A port free on 127.0.0.1 now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn wait_within(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    None
}

/// Output and status of a finished child.
pub fn finish(mut child: Child, limit: Duration) -> (std::process::ExitStatus, String) {
    let status = wait_within(&mut child, limit).expect("no hang");
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    (status, err)
}

/// Waits up to `limit` for a launcher started with piped stderr; its status and stderr.
pub fn wait_for_launcher(
    launcher: &mut Child,
    limit: Duration,
) -> (std::process::ExitStatus, String) {
    use std::io::Read;
    let status = wait_within(launcher, limit).expect("the launcher hangs");
    let mut err = String::new();
    if let Some(mut stderr) = launcher.stderr.take() {
        let _ = stderr.read_to_string(&mut err);
    }
    (status, err)
}

/// The ids of `pid`'s child processes.
pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// A variable of `pid`'s environment.
pub fn env_of(pid: u32, name: &str) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{name}=");
    env.split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(prefix.as_bytes()))
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// `pid`'s `DMLC_ROLE`.
pub fn role_of(pid: u32) -> Option<String> {
    env_of(pid, "DMLC_ROLE")
}
