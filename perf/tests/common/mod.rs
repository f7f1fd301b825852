//! What psnet-perf's process tests share.
// Each test crate uses a part of it.
#![allow(dead_code)]

use std::process::{Child, Command, Output};

/// A server process, killed if the test fails before it exits on its own.
pub struct Server(Option<Child>);

impl Server {
    /// Starts `cmd`.
    pub fn start(cmd: &mut Command) -> Self {
        Server(Some(cmd.spawn().expect("start server")))
    }

    /// Waits for the server to exit by itself (after its client's goodbye).
    pub fn finish(mut self) -> Output {
        self.0
            .take()
            .expect("not finished yet")
            .wait_with_output()
            .expect("server exits")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Runs `cmd` (psnet-perf), fails the test unless it exits 0, and returns its output.
pub fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run psnet-perf");
    assert!(
        out.status.success(),
        "psnet-perf failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// JSON Lines: every line of `text` is one flat JSON object (no nested arrays or objects).
pub fn json_lines(text: &str) -> Vec<serde_json::Value> {
    assert!(!text.trim().is_empty(), "no output");
    text.lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("line is not JSON ({e}): {line}\n{text}"));
            let obj = v
                .as_object()
                .unwrap_or_else(|| panic!("not an object: {line}"));
            assert!(
                obj.values().all(|f| !f.is_object() && !f.is_array()),
                "not flat: {line}"
            );
            v
        })
        .collect()
}
