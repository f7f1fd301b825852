//! `--launcher yarn` against a stand-in ResourceManager on 127.0.0.1 (the REST endpoints the
//! launcher uses) that runs each application's container command as a local process.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;

#[derive(Default)]
struct Rm {
    next: u32,
    apps: HashMap<String, (Child, bool)>,
    killed: Vec<String>,
}

/// A stand-in ResourceManager; returns its URL.
fn stand_in(logs: PathBuf) -> (String, Arc<Mutex<Rm>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let rm = Arc::new(Mutex::new(Rm::default()));
    let state = rm.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let (state, logs) = (state.clone(), logs.clone());
            std::thread::spawn(move || serve(conn, &state, &logs));
        }
    });
    (url, rm)
}

fn serve(conn: TcpStream, rm: &Mutex<Rm>, logs: &Path) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let mut len = 0;
    loop {
        let mut h = String::new();
        reader.read_line(&mut h).unwrap();
        if h.trim().is_empty() {
            break;
        }
        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap();
        }
    }
    let mut body = vec![0; len];
    reader.read_exact(&mut body).unwrap();
    let mut rm = rm.lock().unwrap();
    let (code, answer) = match (method, path) {
        ("POST", "/ws/v1/cluster/apps/new-application") => {
            rm.next += 1;
            (
                200,
                json!({ "application-id": format!("application_1_{:04}", rm.next) }),
            )
        }
        ("POST", "/ws/v1/cluster/apps") => {
            let ctx: Value = serde_json::from_slice(&body).unwrap();
            let id = ctx["application-id"].as_str().unwrap().to_string();
            let spec = &ctx["am-container-spec"];
            let dir = logs.join(&id);
            std::fs::create_dir_all(&dir).unwrap();
            let cmd = spec["commands"]["command"]
                .as_str()
                .unwrap()
                .replace("<LOG_DIR>", dir.to_str().unwrap());
            let mut child = Command::new("sh");
            child.args(["-c", &cmd]).current_dir(&dir);
            for e in spec["environment"]["entry"].as_array().unwrap() {
                child.env(e["key"].as_str().unwrap(), e["value"].as_str().unwrap());
            }
            rm.apps.insert(id, (child.spawn().unwrap(), false));
            (202, json!({}))
        }
        ("GET", p) if p.starts_with("/ws/v1/cluster/apps/") => {
            let id = p.rsplit('/').next().unwrap();
            let (child, killed) = rm.apps.get_mut(id).unwrap();
            let (state, status) = match child.try_wait().unwrap() {
                _ if *killed => ("KILLED", "KILLED"),
                None => ("RUNNING", "UNDEFINED"),
                Some(s) if s.success() => ("FINISHED", "SUCCEEDED"),
                Some(_) => ("FINISHED", "FAILED"),
            };
            (
                200,
                json!({ "app": { "id": id, "state": state, "finalStatus": status } }),
            )
        }
        ("PUT", p) if p.ends_with("/state") => {
            let id = p
                .trim_end_matches("/state")
                .rsplit('/')
                .next()
                .unwrap()
                .to_string();
            if let Some((child, killed)) = rm.apps.get_mut(&id) {
                let _ = child.kill();
                let _ = child.wait();
                *killed = true;
            }
            rm.killed.push(id);
            (200, json!({ "state": "KILLED" }))
        }
        _ => (404, json!({ "error": "unknown" })),
    };
    let text = answer.to_string();
    let mut conn = conn;
    let _ = write!(
        conn,
        "HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
        text.len()
    );
}

fn temp(tag: &str) -> PathBuf {
    common::scratch(&format!("yarn-{tag}"))
}

fn launch(url: &str, job: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_psnet-launch"));
    cmd.args([
        "--launcher",
        "yarn",
        "--yarn-rm",
        url,
        "--root",
        "127.0.0.1",
        "-n",
        "2",
        "-s",
        "2",
        "--grace",
        "1",
        "--",
    ])
    .args(job)
    .env_remove("DMLC_INTERFACE")
    .env_remove("DMLC_NODE_HOST");
    cmd
}

#[test]
fn a_training_job_through_yarn_matches_the_reference() {
    let dir = temp("train");
    let (url, rm) = stand_in(dir.clone());
    let train = common::trainer();
    let want = common::reference_weights(&dir);
    let weights = dir.join("w.bin");
    let mut job = vec![train.to_str().unwrap()];
    job.extend(common::SMALL_MODEL);
    job.extend(["--dump", weights.to_str().unwrap()]);
    let out = launch(&url, &job)
        .env("PS_HEARTBEAT_INTERVAL", "0.2")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        std::fs::read(&weights).unwrap() == want,
        "weights differ from the reference"
    );
    let rm = rm.lock().unwrap();
    assert_eq!(rm.apps.len(), 4, "one application per server and worker");
    assert!(rm.killed.is_empty(), "nothing to kill: {:?}", rm.killed);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_application_that_fails_stops_the_job_and_the_others_are_killed() {
    let dir = temp("fail");
    let (url, rm) = stand_in(dir.clone());
    let script = "[ \"${DMLC_WORKER_ID:-}\" = 1 ] && exit 3; exec sleep 60";
    let out = launch(&url, &["sh", "-c", script]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("worker 1 (YARN application"), "{stderr}");
    assert!(stderr.contains("ended FINISHED / FAILED"), "{stderr}");
    assert_eq!(
        rm.lock().unwrap().killed.len(),
        4,
        "every application killed"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_signal_to_the_launcher_kills_every_application() {
    let dir = temp("signal");
    let (url, rm) = stand_in(dir.clone());
    let mut child = launch(&url, &["sh", "-c", "exec sleep 60"])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while rm.lock().unwrap().apps.len() < 4 {
        assert!(started.elapsed() < Duration::from_secs(20), "not submitted");
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = rustix::process::Pid::from_child(&child);
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(128 + 15));
    let mut killed = rm.lock().unwrap().killed.clone();
    killed.sort();
    assert_eq!(
        killed,
        (1..=4)
            .map(|i| format!("application_1_{i:04}"))
            .collect::<Vec<_>>()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unreachable_resource_manager_is_one_clear_line() {
    let out = launch("http://127.0.0.1:9", &["true"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.contains("cannot reach the YARN ResourceManager at http://127.0.0.1:9")
            && stderr.contains("--yarn-rm"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}
