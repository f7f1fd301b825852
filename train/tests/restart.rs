//! A server killed (SIGKILL) mid-run and started again by the launcher (`PSNET_MAX_RESTARTS`)
//! rejoins the job from its checkpoint (`PSNET_CHECKPOINT_DIR`): the job ends well, with the
//! loss of every epoch and the final weights bit-identical to the single-process reference.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;

use common::{children, env_of, ok, role_of, tmp, train, wait_for_launcher};

const ARGS: [&str; 8] = [
    "--servers",
    "2",
    "--workers",
    "2",
    "--epochs",
    "4",
    "--step-delay-ms",
    "2",
];

fn epochs(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter(|l| l.starts_with("epoch "))
        .map(|l| l.split(" | ").next().unwrap_or(l).to_string())
        .collect()
}

/// The launcher's server process of rank `rank`.
fn server(launcher: u32, rank: &str) -> u32 {
    children(launcher)
        .into_iter()
        .find(|&p| {
            role_of(p).as_deref() == Some("server")
                && env_of(p, "DMLC_SERVER_ID").as_deref() == Some(rank)
        })
        .unwrap_or_else(|| panic!("no server {rank} under the launcher"))
}

/// Starts the launcher and waits for its first epoch; returns it, a signal per later epoch
/// line it prints, and all it printed once it ends.
fn started(
    cmd: &mut Command,
) -> (
    std::process::Child,
    mpsc::Receiver<()>,
    std::thread::JoinHandle<String>,
) {
    let mut launcher = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stdout = launcher.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with("epoch ") {
                let _ = tx.send(());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("training never reached its first epoch");
    (launcher, rx, reader)
}

fn kill(pid: u32) {
    assert!(Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap()
        .success());
}

#[test]
fn killed_servers_restarted_by_the_launcher_rejoin_and_the_weights_match_the_reference() {
    let dir = std::env::temp_dir().join(format!("psnet-train-restart-{}", std::process::id()));
    let (dist, refr) = (tmp("restart-dist"), tmp("restart-ref"));
    let mut job = train();
    job.args(ARGS)
        .arg("--dump")
        .arg(&dist)
        .env("PSNET_CHECKPOINT_DIR", &dir)
        .env("PSNET_CHECKPOINT_EVERY", "7")
        .env("PSNET_MAX_RESTARTS", "1");
    let (mut launcher, rx, reader) = started(&mut job);
    // Server 1 dies in the second epoch; once the job is past it, server 0.
    kill(server(launcher.id(), "1"));
    let struck = Instant::now();
    rx.recv_timeout(Duration::from_secs(60))
        .expect("no epoch completed after server 1 was killed");
    let recovered = struck.elapsed();
    kill(server(launcher.id(), "0"));
    let (status, err) = wait_for_launcher(&mut launcher, Duration::from_secs(120));
    let out = reader.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "{out}\n{err}");
    for rank in [0, 1] {
        assert!(
            err.contains(&format!("server {rank} exited")) && err.contains("starting it again"),
            "the launcher says it restarted server {rank}:\n{err}"
        );
    }
    let reference = ok(train()
        .args(ARGS)
        .args(["--reference", "--dump"])
        .arg(&refr)
        .output()
        .unwrap());
    assert_eq!(epochs(&out).len(), 4, "{out}");
    assert_eq!(epochs(&out), epochs(&reference), "loss per epoch differs");
    let (a, b) = (std::fs::read(&dist).unwrap(), std::fs::read(&refr).unwrap());
    let _ = (std::fs::remove_file(&dist), std::fs::remove_file(&refr));
    assert!(!a.is_empty());
    assert!(a == b, "final weights differ from the reference");
    eprintln!(
        "FIGURE server restart: 2 servers killed in turn and restarted, weights bit-identical; \
         the epoch after the first kill ended {} ms after it",
        recovered.as_millis()
    );
}

/// A server restarted over another job's checkpoint (its files replaced by those of an
/// earlier job, its recovery credential its own) refuses the snapshot, naming the file and
/// both jobs, and the job ends with that reason instead of serving the other job's values.
#[test]
fn a_server_restarted_over_another_jobs_checkpoint_refuses_it_and_the_job_ends_naming_it() {
    let base = std::env::temp_dir().join(format!("psnet-train-other-{}", std::process::id()));
    let (earlier, dir) = (base.join("earlier"), base.join("this"));
    ok(train()
        .args(["--servers", "2", "--workers", "2", "--epochs", "1"])
        .env("PSNET_CHECKPOINT_DIR", &earlier)
        .output()
        .unwrap());
    let mut job = train();
    job.args(ARGS)
        .env("PSNET_CHECKPOINT_DIR", &dir)
        .env("PSNET_CHECKPOINT_EVERY", "0")
        .env("PSNET_MAX_RESTARTS", "1");
    let (mut launcher, _rx, reader) = started(&mut job);
    // The earlier job's shard of server 0 replaces this job's (renamed over it, as a copy
    // would land); the credential beside it stays this job's.
    for name in ["server-0.snapshot", "server-0.journal"] {
        let aside = dir.join(format!("{name}.other"));
        std::fs::copy(earlier.join(name), &aside).unwrap();
        std::fs::rename(&aside, dir.join(name)).unwrap();
    }
    kill(server(launcher.id(), "0"));
    let (status, err) = wait_for_launcher(&mut launcher, Duration::from_secs(120));
    let out = reader.join().unwrap();
    let _ = std::fs::remove_dir_all(&base);
    assert!(
        !status.success(),
        "the job went on over another job's shard:\n{out}\n{err}"
    );
    assert!(
        err.contains("server-0.snapshot") && err.contains("not of this job"),
        "the refusal names the file and the jobs:\n{err}"
    );
}

/// A server restarted over a damaged snapshot refuses it naming the file and the checksum,
/// tells the scheduler, and the scheduler ends the job at once with that reason. Before, the
/// workers redialled the server that had left until the job's end (237 s), and their errors
/// did not name the checksum.
#[test]
fn a_server_restarted_over_a_damaged_snapshot_ends_the_job_naming_the_checksum() {
    let dir = std::env::temp_dir().join(format!("psnet-train-damaged-{}", std::process::id()));
    let mut job = train();
    job.args(ARGS)
        .env("PSNET_CHECKPOINT_DIR", &dir)
        .env("PSNET_CHECKPOINT_EVERY", "0")
        .env("PSNET_RECOVERY_TIMEOUT", "100")
        .env("PSNET_MAX_RESTARTS", "1");
    let (mut launcher, _rx, reader) = started(&mut job);
    let snapshot = dir.join("server-0.snapshot");
    let mut bytes = std::fs::read(&snapshot).expect("server 0's first snapshot");
    // A bit of the shard's values (the last byte: past the header, whose sizes are checked
    // first) turned, as a disk or a copy might.
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    // Written aside and renamed over, as a damaged copy would land: the file is whole.
    let aside = dir.join("server-0.snapshot.damaged");
    std::fs::write(&aside, &bytes).unwrap();
    std::fs::rename(&aside, &snapshot).unwrap();
    kill(server(launcher.id(), "0"));
    let killed = Instant::now();
    let (status, err) = wait_for_launcher(&mut launcher, Duration::from_secs(120));
    let took = killed.elapsed();
    let out = reader.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        !status.success(),
        "the job went on over a damaged shard:\n{out}\n{err}"
    );
    assert!(
        err.contains("server-0.snapshot") && err.contains("checksum"),
        "the refusal names the file and the checksum:\n{err}"
    );
    // The scheduler ends the job with the server's reason at once, rather than holding the
    // rank for the recovery window (set to 100 s here).
    assert!(
        err.lines().any(|l| l.contains("scheduler")
            && l.contains("cannot rejoin")
            && l.contains("checksum")),
        "the scheduler does not end the job with the reason:\n{err}"
    );
    assert!(
        took < Duration::from_secs(50),
        "the job waited {took:?} for a server that could not rejoin:\n{err}"
    );
}

/// A process that registers as a server while a lost server's rank is held for it (the
/// issue's first attack: before, the first process to register got the rank, every node's
/// traffic, and the job exited 0 with its weights) is refused: it lacks the recovery
/// credential the lost server committed to. The real server, restarted over its own
/// checkpoint directory, then takes its rank back and the job ends well.
#[test]
fn a_process_registering_in_a_lost_servers_place_without_its_credential_is_refused() {
    use common::{finish, free_port, role};
    let base = std::env::temp_dir().join(format!("psnet-train-impostor-{}", std::process::id()));
    let (own, other) = (base.join("own"), base.join("other"));
    let port = free_port();
    let job = |dir: &std::path::Path| {
        let mut cmd = train();
        cmd.args(["--epochs", "6", "--step-delay-ms", "2"])
            .env("PSNET_CHECKPOINT_DIR", dir)
            .env("PSNET_RECOVERY_TIMEOUT", "60")
            .env("DMLC_SERVER_ID", "0");
        cmd
    };
    let scheduler = role(&mut job(&own), "scheduler", port, 1);
    let mut server = role(&mut job(&own), "server", port, 1);
    let worker = role(&mut job(&own), "worker", port, 1);
    // Once the server wrote its first snapshot, it is killed outright.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !own.join("server-0.snapshot").exists() {
        assert!(Instant::now() < deadline, "server 0 wrote no snapshot");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(100));
    server.kill().unwrap();
    server.wait().unwrap();
    // An impostor registers as server 0, with a checkpoint directory of its own holding a
    // credential of the right length that is not the lost server's, and is refused.
    let credential = std::fs::read(own.join("server-0.credential")).unwrap();
    std::fs::create_dir_all(&other).unwrap();
    let guess: Vec<u8> = credential.iter().map(|b| b ^ 0x5a).collect();
    std::fs::write(other.join("server-0.credential"), guess).unwrap();
    // It may come before the scheduler has noticed the loss ("none is lost"): again then.
    let deadline = Instant::now() + Duration::from_secs(30);
    let err = loop {
        let (status, err) = finish(
            role(&mut job(&other), "server", port, 1),
            Duration::from_secs(60),
        );
        assert!(!status.success(), "the impostor took the lost rank:\n{err}");
        if err.contains("none is lost") && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
            continue;
        }
        break err;
    };
    assert!(
        err.contains("was refused") && err.contains("credential"),
        "the impostor's error names the credential:\n{err}"
    );
    // The real server comes back over its own directory and takes its rank back.
    let server = role(&mut job(&own), "server", port, 1);
    let (status, werr) = finish(worker, Duration::from_secs(120));
    let (_, serr) = finish(server, Duration::from_secs(30));
    let (sstatus, scherr) = finish(scheduler, Duration::from_secs(30));
    let _ = std::fs::remove_dir_all(&base);
    assert!(
        status.success() && sstatus.success(),
        "the job failed after the real server came back:\n{werr}\n{serr}\n{scherr}"
    );
    assert!(
        scherr.contains("refusing a server's registration") && scherr.contains("credential"),
        "the scheduler logs the refusal:\n{scherr}"
    );
    assert!(
        scherr.contains("a restarted server took its rank back"),
        "{scherr}"
    );
}
