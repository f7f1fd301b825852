//! Whole jobs as separate processes on 127.0.0.1: psnet-train launches itself in every role.
//! `dist_sync` runs must match the single-process reference bit for bit.

use std::process::{Command, Stdio};
use std::time::Duration;

mod common;

use common::{finish, ok, role, tmp, train, train_any, wait_within};

/// The epoch lines' loss and accuracy (a distributed run adds its communication figures
/// after ` | `, which the reference has not).
fn epochs(stdout: &str) -> Vec<&str> {
    stdout
        .lines()
        .filter(|l| l.starts_with("epoch "))
        .map(|l| l.split(" | ").next().unwrap_or(l))
        .collect()
}

/// The loss of every epoch line.
fn losses(stdout: &str) -> Vec<f32> {
    epochs(stdout)
        .iter()
        .map(|l| l.split_whitespace().nth(3).unwrap().parse().unwrap())
        .collect()
}

/// Runs a distributed job and the reference with the same arguments; both must agree exactly.
fn matches_reference(name: &str, args: &[&str], env: &[(&str, &str)]) {
    matches_reference_with(train, name, args, env);
}

fn matches_reference_with(train: fn() -> Command, name: &str, args: &[&str], env: &[(&str, &str)]) {
    let (dist, refr) = (tmp(&format!("{name}-dist")), tmp(&format!("{name}-ref")));
    let distributed = ok(train()
        .args(args)
        .args(["--epochs", "3", "--dump"])
        .arg(&dist)
        .envs(env.iter().copied())
        .output()
        .unwrap());
    let reference = ok(train()
        .args(args)
        .args(["--epochs", "3", "--reference", "--dump"])
        .arg(&refr)
        .output()
        .unwrap());
    assert_eq!(epochs(&distributed).len(), 3, "{distributed}");
    assert_eq!(
        epochs(&distributed),
        epochs(&reference),
        "loss per epoch differs"
    );
    let (a, b) = (std::fs::read(&dist).unwrap(), std::fs::read(&refr).unwrap());
    let _ = (std::fs::remove_file(&dist), std::fs::remove_file(&refr));
    assert!(!a.is_empty());
    assert!(a == b, "final weights differ from the reference");
}

#[test]
fn mlp_matches_reference_with_a_sharded_layer_and_compression() {
    // Two hidden layers; the first layer's 640 weights are sharded over both servers.
    let mlp = [
        "--hidden",
        "32,16",
        "--features",
        "20",
        "--classes",
        "5",
        "--samples",
        "1024",
        "--batch",
        "16",
        "--servers",
        "2",
        "--workers",
        "2",
    ];
    let bound = [("MXNET_KVSTORE_BIGARRAY_BOUND", "100")];
    matches_reference_with(train_any, "mlp", &mlp, &bound);
    let mut compressed = mlp.to_vec();
    compressed.extend(["--compression", "2bit", "--threshold", "0.01"]);
    matches_reference_with(train_any, "mlp-2bit", &compressed, &bound);
}

#[test]
fn a_run_reports_its_model_communication_and_a_summary() {
    let out = ok(train_any()
        .args([
            "--hidden",
            "32",
            "--features",
            "20",
            "--classes",
            "5",
            "--samples",
            "512",
            "--epochs",
            "2",
            "--servers",
            "1",
            "--workers",
            "2",
        ])
        .output()
        .unwrap());
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].contains("model 20-32-5") && lines[0].contains("in 4 keys"),
        "{out}"
    );
    let epoch_lines: Vec<&&str> = lines.iter().filter(|l| l.starts_with("epoch ")).collect();
    assert_eq!(epoch_lines.len(), 2, "{out}");
    for l in epoch_lines {
        assert!(
            l.contains(" | push+pull ") && l.contains("MB/s, communication "),
            "{l}"
        );
    }
    let last = lines.last().unwrap();
    assert!(
        last.starts_with("psnet-train: 2 epochs in ") && last.contains("communication"),
        "{out}"
    );
    assert!(
        !out.contains('\x1b'),
        "no terminal codes when not on a terminal: {out}"
    );
}

#[test]
fn sync_two_servers_two_workers_unsharded() {
    matches_reference("2s2w", &["--servers", "2", "--workers", "2"], &[]);
}

#[test]
fn sync_sharded_keys_with_momentum() {
    // 100 weights with a bound of 50: split over both servers; the 5 biases stay on one.
    matches_reference(
        "sharded",
        &[
            "--servers",
            "2",
            "--workers",
            "2",
            "--momentum",
            "0.9",
            "--lr",
            "0.2",
        ],
        &[("MXNET_KVSTORE_BIGARRAY_BOUND", "50")],
    );
}

#[test]
fn sync_two_bit_compression_sharded() {
    matches_reference(
        "2bit",
        &[
            "--servers",
            "2",
            "--workers",
            "2",
            "--compression",
            "2bit",
            "--threshold",
            "0.25",
        ],
        &[("MXNET_KVSTORE_BIGARRAY_BOUND", "50")],
    );
}

#[test]
fn sync_one_bit_one_server_three_workers() {
    matches_reference(
        "1bit",
        &[
            "--servers",
            "1",
            "--workers",
            "3",
            "--compression",
            "1bit",
            "--threshold",
            "0",
            "--lr",
            "0.05",
        ],
        &[],
    );
}

#[test]
fn sync_one_server_one_worker() {
    matches_reference("1s1w", &["--servers", "1", "--workers", "1"], &[]);
}

#[test]
fn async_training_learns() {
    let out = ok(train()
        .args([
            "--servers",
            "2",
            "--workers",
            "2",
            "--mode",
            "async",
            "--epochs",
            "4",
        ])
        .output()
        .unwrap());
    let losses = losses(&out);
    assert_eq!(losses.len(), 4, "{out}");
    assert!(losses[3] < losses[0], "loss did not go down: {losses:?}");
}

#[test]
fn compressed_pulls_train_and_bad_combinations_are_refused_by_name() {
    for scheme in [["--compression", "2bit"], ["--compression", "1bit"]] {
        let out = ok(train()
            .args(scheme)
            .args(["--compression-pull", "--epochs", "4"])
            .env("PSNET_PARTITION_BYTES", "4096")
            .output()
            .unwrap());
        let losses = losses(&out);
        assert_eq!(losses.len(), 4, "{out}");
        assert!(losses[3] < 0.8 * losses[0], "{scheme:?}: loss {losses:?}");
    }
    for (args, why) in [
        (
            &["--compression-pull"][..],
            "needs --compression 2bit or 1bit",
        ),
        (
            &[
                "--compression",
                "2bit",
                "--compression-pull",
                "--mode",
                "async",
            ][..],
            "dist_sync only",
        ),
        (
            &["--compression", "2bit", "--compression-pull", "--reference"][..],
            "does not model --compression-pull",
        ),
    ] {
        let out = train().args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(why), "{args:?}: {err}");
    }
}

#[test]
fn reference_refuses_async() {
    let out = train()
        .args(["--reference", "--mode", "async"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("dist_sync only"));
}

#[test]
fn a_job_described_without_its_role_is_refused_not_launched_alone() {
    // ps-lite refuses to start without DMLC_ROLE; starting a separate job would hide the
    // mistake behind a run that exits 0.
    let out = train()
        .env("DMLC_PS_ROOT_URI", "127.0.0.1")
        .env("DMLC_PS_ROOT_PORT", "9")
        .env("DMLC_NUM_SERVER", "1")
        .env("DMLC_NUM_WORKER", "1")
        .env_remove("DMLC_ROLE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("DMLC_ROLE is not set"), "{err}");
    assert!(
        String::from_utf8_lossy(&out.stdout).is_empty(),
        "no job ran"
    );
}

#[test]
fn logs_to_a_pipe_carry_no_colour_codes() {
    let out = train()
        .args(["--epochs", "1"])
        .env("PS_VERBOSE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.is_empty(), "PS_VERBOSE=1 logs something");
    assert!(!err.contains('\x1b'), "ANSI escape in piped logs: {err}");
}

#[test]
fn clean_runs_print_no_warnings() {
    // Servers may close before a worker has read its own shutdown: the job ending, not a
    // lost node (this used to warn in about one run in four).
    for _ in 0..4 {
        let out = train().args(["--epochs", "1"]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(!err.contains("WARN"), "{err}");
    }
}

#[test]
fn settings_are_checked_before_any_process_starts_and_mxnet_mode_names_work() {
    let out = train().args(["--compression", "3bit"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("3bit") && !err.contains("transport selected"),
        "{err}"
    );
    for name in ["dist_sync", "dist_sync_device", "dist_device_sync"] {
        let out = train()
            .args(["--mode", name, "--reference", "--epochs", "1"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // dist_async is accepted by name (and then refused by --reference for its own reason).
    let out = train()
        .args(["--mode", "dist_async", "--reference", "--epochs", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("reproduces dist_sync only"), "{err}");
}

#[test]
fn with_a_job_secret_a_process_without_it_is_refused_and_the_job_runs() {
    use std::os::unix::fs::PermissionsExt;
    let secret = tmp("secret");
    std::fs::write(&secret, "correct horse battery staple\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let file = secret.to_str().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let with_secret = |r| role(train().env("PSNET_SECRET_FILE", file), r, port, 1);
    let (scheduler, server) = (with_secret("scheduler"), with_secret("server"));
    // Squatters race for the one worker slot: one without the secret, one with a wrong one.
    let (open, wrong) = (
        role(&mut train(), "worker", port, 1),
        role(train().env("PSNET_SECRET", "a guess"), "worker", port, 1),
    );
    for (squatter, why) in [(open, "presented none"), (wrong, "does not know")] {
        let (status, err) = finish(squatter, Duration::from_secs(60));
        assert!(!status.success(), "a squatter joined: {err}");
        assert!(err.contains(why), "{err}");
    }
    let (status, err) = finish(with_secret("worker"), Duration::from_secs(120));
    assert!(status.success(), "the member's job failed: {err}");
    let (_, err) = finish(server, Duration::from_secs(30));
    let (status, sched_err) = finish(scheduler, Duration::from_secs(30));
    assert!(status.success(), "{sched_err}\n{err}");
    // The scheduler logged each refusal with the dialler's address.
    assert!(
        sched_err.contains("refusing a connection from=127.0.0.1:")
            && sched_err.contains("presented none"),
        "{sched_err}"
    );
    assert!(
        sched_err.contains("from=127.0.0.1:")
            && sched_err.contains("the dialler refused this node"),
        "{sched_err}"
    );
    let _ = std::fs::remove_file(&secret);
}

/// `PSNET_ENCRYPT=1`: every data frame on the sockets sealed (shared memory off, so that the
/// job's messages cross them), and the job ends bit-identical to the reference; without a
/// secret the setting is refused at start, naming it.
#[test]
fn an_encrypted_job_matches_the_reference_and_encryption_needs_the_secret() {
    matches_reference(
        "encrypted",
        &["--servers", "2", "--workers", "2"],
        &[
            ("PSNET_SECRET", "correct horse battery staple"),
            ("PSNET_ENCRYPT", "1"),
            ("PSNET_SHM_RING", "0"),
        ],
    );
    let out = train()
        .args(["--epochs", "1"])
        .env("PSNET_ENCRYPT", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("PSNET_ENCRYPT") && err.contains("PSNET_SECRET"),
        "{err}"
    );
}

/// `PSNET_TIMELINE`: each node of a job writes, at its clean end, a Chrome trace of its
/// flight recorder and its dump; the dumps merge into one trace with a process per node and
/// an event per request.
#[test]
fn with_psnet_timeline_every_node_writes_a_trace_and_the_job_merges() {
    let dir = std::env::temp_dir().join(format!("psnet-train-timeline-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    ok(train()
        .args(["--servers", "1", "--workers", "2", "--epochs", "1"])
        .env("PSNET_TIMELINE", &dir)
        .output()
        .unwrap());
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let traces: Vec<&String> = names
        .iter()
        .filter(|n| n.ends_with(".trace.json"))
        .collect();
    // Two workers, the server and the scheduler (its membership: connections, assignments).
    assert_eq!(traces.len(), 4, "{names:?}");
    for t in &traces {
        let trace: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join(t)).unwrap()).unwrap();
        let events = trace["traceEvents"].as_array().expect("a Chrome trace");
        assert!(
            events.iter().any(|e| e["ph"] == "X" && e["dur"].is_u64()),
            "{t}: no complete event"
        );
    }
    let (dumps, skipped) = psnet_recorder::doctor::read_dir(&dir).unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    let merged = psnet_recorder::timeline::chrome_trace(&dumps);
    let events = merged["traceEvents"].as_array().unwrap();
    let drawn = events.iter().filter(|e| e["ph"] == "X").count();
    let records: usize = dumps.iter().map(|d| d.records.len()).sum();
    assert_eq!(drawn, records, "one event per recorded operation");
    // Requests and rounds, and the connection events on a track of their own.
    assert!(events
        .iter()
        .any(|e| e["ph"] == "X" && e["name"].as_str().is_some_and(|n| n.contains("key"))));
    assert!(events
        .iter()
        .any(|e| e["cat"] == "events" && e["name"] == "connected"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The soak: a dist_sync job whose every process drops 1% of its connections with a message
/// in flight, delays each send up to 100 µs and closes a connection after every 200th send
/// (10 epochs) ends, with `PS_RESEND=1`, bit-identical to the single-process reference, in
/// bounded time.
#[test]
fn with_ps_resend_a_job_under_dropped_connections_and_resets_ends_bit_identical() {
    let (dist, refr) = (tmp("faults-dist"), tmp("faults-ref"));
    let job = ["--servers", "2", "--workers", "2", "--epochs", "10"];
    let mut child = train()
        .args(job)
        .arg("--dump")
        .arg(&dist)
        .env("PS_RESEND", "1")
        .env("PS_RESEND_TIMEOUT", "200")
        .env(
            "PSNET_FAULTS",
            "drop=0.01,delay=100us,reset_every=200,seed=7",
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_within(&mut child, Duration::from_secs(300)).expect("the job must not hang");
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(status.success(), "the job failed under faults:\n{err}");
    // Every process reports what it injected; the job must really have been struck.
    let figure = |line: &str, key: &str| -> u64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let reports: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("faults injected"))
        .collect();
    let total = |key| reports.iter().map(|l| figure(l, key)).sum::<u64>();
    let (sends, drops, resets) = (total("sends="), total("drops="), total("resets="));
    eprintln!(
        "FIGURE faults: {} processes, {sends} sends, {drops} connections dropped with a \
         message, {resets} closed after one",
        reports.len()
    );
    assert_eq!(reports.len(), 5, "{err}");
    assert!(drops > 0 && resets > 0, "no fault struck: {err}");
    ok(train()
        .args(job)
        .args(["--reference", "--dump"])
        .arg(&refr)
        .output()
        .unwrap());
    let (a, b) = (std::fs::read(&dist).unwrap(), std::fs::read(&refr).unwrap());
    let _ = (std::fs::remove_file(&dist), std::fs::remove_file(&refr));
    assert!(
        !a.is_empty() && a == b,
        "final weights differ from the fault-free reference"
    );
}
