//! The files: written as the driver writes them, read back by `load_shard`, damaged in every
//! way a crash or a disk can damage them.

use std::fs;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use bytes::Bytes;

use super::*;
use crate::proto::msg::{CommandKind, PushFlags};
use crate::proto::server::{Output, Push};
use crate::proto::sum;

const LIMIT: u64 = 1 << 30;
/// The job the files are written in.
const JOB: JobId = JobId(0x5eed_0000_0000_0001);

/// A fresh directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "psnet-ckpt-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn push(rank: u32, ts: u64, key: u64, values: &[f32], init: bool) -> Push {
    Push {
        rank,
        ts,
        key,
        flags: PushFlags {
            init,
            ..PushFlags::default()
        },
        n_elems: values.len() as u64,
        payload: Bytes::copy_from_slice(sum::as_bytes(values)),
    }
}

/// Writes the state's checkpoint outputs as the driver does; returns how many records.
fn write(s: &mut ServerState, files: &mut ShardFiles) -> usize {
    let mut records = 0;
    while let Some(out) = s.poll_output() {
        match out {
            Output::Journal(r) => {
                files.append(&r).unwrap();
                records += 1;
            }
            Output::Snapshot { bytes, .. } => files.write_snapshot(&bytes).unwrap(),
            Output::Done { .. } | Output::Rows { .. } => files.sync().unwrap(),
            Output::Failed { reason, .. } | Output::PeerFailed { reason, .. } => panic!("{reason}"),
        }
    }
    records
}

/// A server with momentum on two keys after `rounds` rounds, and its files in `dir`.
fn job(dir: &Path, rank: u32, every: u64, rounds: usize) -> ServerState {
    let mut s = ServerState::new(2).with_checkpoints(every);
    let mut files = ShardFiles::create(dir, rank, JOB, true, &s.snapshot()).unwrap();
    s.handle_command_request(
        0,
        1,
        CommandKind::SetOptimizer,
        r#"{"type":"sgd","learning_rate":0.1,"momentum":0.9}"#,
    );
    s.handle_push(push(0, 2, 5, &[1.0; 3], true));
    s.handle_push(push(0, 3, 6, &[2.0; 40], true));
    write(&mut s, &mut files);
    for r in 0..rounds {
        for key in [5, 6] {
            let n = s.value(key).unwrap().len();
            for rank in [1, 0] {
                let g: Vec<f32> = (0..n)
                    .map(|i| (i + r + rank as usize) as f32 * 0.01)
                    .collect();
                s.handle_push(push(rank, 10 + r as u64, key, &g, false));
            }
            write(&mut s, &mut files);
        }
    }
    s
}

#[test]
fn load_shard_rebuilds_the_state_that_wrote_the_files() {
    for every in [0, 3] {
        let dir = TempDir::new();
        let s = job(&dir.0, 2, every, 7);
        assert!(snapshot_path(&dir.0, 2).exists() && journal_path(&dir.0, 2).exists());
        assert!(!dir.0.join("server-2.snapshot.tmp").exists());
        let loaded = load_shard(&dir.0, 2, Some(JOB), 2, LIMIT)
            .unwrap()
            .expect("a shard");
        assert_eq!(loaded.snapshot(), s.snapshot(), "every {every}");
        assert_eq!(loaded.updates(5), Some(7));
        assert!(!loaded.checkpoints());
        // Another rank has no shard here.
        assert!(load_shard(&dir.0, 1, Some(JOB), 2, LIMIT)
            .unwrap()
            .is_none());
    }
    assert!(
        load_shard(Path::new("/nonexistent/psnet"), 0, Some(JOB), 2, LIMIT)
            .unwrap()
            .is_none()
    );
}

#[test]
fn a_record_cut_short_at_the_end_is_ignored() {
    let dir = TempDir::new();
    let rounds = 4;
    job(&dir.0, 0, 0, rounds);
    let path = journal_path(&dir.0, 0);
    let full = fs::read(&path).unwrap();
    // The state before the last record: the same job one round of key 6 short.
    let whole = load_shard(&dir.0, 0, Some(JOB), 2, LIMIT).unwrap().unwrap();
    let last_len = {
        let mut at = JOURNAL_HEADER;
        let mut last = 0;
        while at < full.len() {
            let n = u64::from_le_bytes(full[at..at + 8].try_into().unwrap()) as usize;
            last = RECORD_HEADER + n;
            at += last;
        }
        assert_eq!(at, full.len());
        last
    };
    let start = full.len() - last_len;
    for cut in start..full.len() {
        fs::write(&path, &full[..cut]).unwrap();
        let s = load_shard(&dir.0, 0, Some(JOB), 2, LIMIT).unwrap().unwrap();
        assert_eq!(s.seq(), whole.seq() - 1, "cut at {cut}");
        assert_eq!(s.updates(6), Some(rounds as u64 - 1));
        assert_eq!(s.updates(5), Some(rounds as u64));
    }
    // The last record whole but garbled (its checksum fails): also cut short.
    let mut garbled = full.clone();
    *garbled.last_mut().unwrap() ^= 1;
    fs::write(&path, &garbled).unwrap();
    let s = load_shard(&dir.0, 0, Some(JOB), 2, LIMIT).unwrap().unwrap();
    assert_eq!(s.seq(), whole.seq() - 1);
    // A garbled record followed by others is damage, not a cut.
    let mut garbled = full.clone();
    garbled[start - 1] ^= 1;
    fs::write(&path, &garbled).unwrap();
    let err = load_shard(&dir.0, 0, Some(JOB), 2, LIMIT)
        .unwrap_err()
        .to_string();
    assert!(err.contains("fails its checksum and more follow"), "{err}");
    assert!(err.contains("server-0.journal"), "{err}");
    // Zeros where records were (a machine crash without fsync): damage.
    let mut zeroed = full.clone();
    zeroed[start..].fill(0);
    fs::write(&path, &zeroed).unwrap();
    let err = load_shard(&dir.0, 0, Some(JOB), 2, LIMIT)
        .unwrap_err()
        .to_string();
    assert!(err.contains("empty record"), "{err}");
}

#[test]
fn a_crash_between_the_snapshot_and_the_new_journal_loses_nothing() {
    let dir = TempDir::new();
    let s = job(&dir.0, 0, 0, 3);
    let old_journal = fs::read(journal_path(&dir.0, 0)).unwrap();
    // The snapshot of the same state made it into place, the new journal did not.
    let mut files = ShardFiles::create(&dir.0, 0, JOB, false, &s.snapshot()).unwrap();
    files.sync().unwrap();
    fs::write(journal_path(&dir.0, 0), &old_journal).unwrap();
    let loaded = load_shard(&dir.0, 0, Some(JOB), 2, LIMIT).unwrap().unwrap();
    assert_eq!(loaded.snapshot(), s.snapshot());
}

#[test]
fn a_server_started_afresh_over_old_files_never_loads_their_records() {
    let dir = TempDir::new();
    job(&dir.0, 0, 0, 3);
    let old_journal = fs::read(journal_path(&dir.0, 0)).unwrap();
    // A new job's server wrote its empty snapshot, then died before replacing the journal.
    let fresh = ServerState::new(2);
    ShardFiles::create(&dir.0, 0, JOB, false, &fresh.snapshot()).unwrap();
    fs::write(journal_path(&dir.0, 0), &old_journal).unwrap();
    let loaded = load_shard(&dir.0, 0, Some(JOB), 2, LIMIT).unwrap().unwrap();
    assert_eq!(loaded.snapshot(), fresh.snapshot());
    assert_eq!(loaded.seq(), 0);
}

#[test]
fn damaged_or_mismatched_files_are_clear_errors() {
    let dir = TempDir::new();
    job(&dir.0, 0, 0, 2);
    let snap = snapshot_path(&dir.0, 0);
    let journal = journal_path(&dir.0, 0);
    let good_snap = fs::read(&snap).unwrap();
    let good_journal = fs::read(&journal).unwrap();
    let err_of = || {
        load_shard(&dir.0, 0, Some(JOB), 2, LIMIT)
            .unwrap_err()
            .to_string()
    };
    for at in [0, 12, 18, 26, 34, 42, good_snap.len() - 1] {
        let mut bad = good_snap.clone();
        bad[at] ^= 0x10;
        fs::write(&snap, &bad).unwrap();
        let err = err_of();
        assert!(err.contains("bad snapshot file"), "{at}: {err}");
        assert!(err.contains("server-0.snapshot"), "{err}");
    }
    for cut in [0, 10, SNAPSHOT_HEADER, good_snap.len() - 1] {
        fs::write(&snap, &good_snap[..cut]).unwrap();
        assert!(err_of().contains("bad snapshot file"));
    }
    fs::write(&snap, &good_snap).unwrap();
    // Another server's files.
    fs::copy(&snap, snapshot_path(&dir.0, 1)).unwrap();
    fs::copy(&journal, journal_path(&dir.0, 1)).unwrap();
    let err = load_shard(&dir.0, 1, Some(JOB), 2, LIMIT)
        .unwrap_err()
        .to_string();
    assert!(err.contains("written by server 0, not 1"), "{err}");
    // Another job's size.
    let err = load_shard(&dir.0, 0, Some(JOB), 3, LIMIT)
        .unwrap_err()
        .to_string();
    assert!(err.contains("for 2 workers, this job has 3"), "{err}");
    // Another job's files: refused, naming the file and both jobs; read offline, taken.
    let other = JobId(JOB.0 + 1);
    let err = load_shard(&dir.0, 0, Some(other), 2, LIMIT)
        .unwrap_err()
        .to_string();
    assert!(err.contains("server-0.snapshot"), "{err}");
    assert!(
        err.contains(&format!(
            "a snapshot of job {JOB}, not of this job ({other})"
        )),
        "{err}"
    );
    assert!(load_shard(&dir.0, 0, None, 2, LIMIT).unwrap().is_some());
    // Journal damaged at its head, short, missing; a journal without its snapshot.
    let mut bad = good_journal.clone();
    bad[3] ^= 1;
    fs::write(&journal, &bad).unwrap();
    assert!(err_of().contains("no PSNETJNL header"));
    let mut bad = good_journal.clone();
    bad[19] ^= 1;
    fs::write(&journal, &bad).unwrap();
    assert!(err_of().contains("header fails its checksum"));
    fs::write(&journal, &good_journal[..5]).unwrap();
    assert!(err_of().contains("shorter than its header"));
    fs::remove_file(&journal).unwrap();
    assert!(err_of().contains("cannot open"));
    fs::write(&journal, &good_journal).unwrap();
    fs::remove_file(&snap).unwrap();
    assert!(err_of().contains("exists without its snapshot"));
    // Unwritable directory: creating the files fails with the path.
    let file = dir.0.join("plain-file");
    fs::write(&file, b"x").unwrap();
    let err = ShardFiles::create(&file.join("sub"), 0, JOB, false, b"").unwrap_err();
    assert!(err.to_string().contains("plain-file"), "{err}");
}

#[test]
fn the_journal_reader_takes_any_bytes() {
    let dir = TempDir::new();
    job(&dir.0, 0, 0, 2);
    let good = fs::read(journal_path(&dir.0, 0)).unwrap();
    fuzz_journal_file(&good);
    let mut rng = fastrand::Rng::with_seed(5);
    for _ in 0..300 {
        let mut bad = good.clone();
        for _ in 0..rng.usize(1..4) {
            let at = rng.usize(..bad.len());
            bad[at] = rng.u8(..);
        }
        bad.truncate(rng.usize(..=bad.len()));
        fuzz_journal_file(&bad);
    }
}

#[test]
fn recovery_credentials_are_kept_for_this_user_only_and_checked_for_length() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("psnet-cred-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    assert_eq!(read_credential(&dir, 3).unwrap(), None, "none yet");
    let c = crate::proto::recovery::fresh();
    write_credential(&dir, 3, &c).unwrap();
    assert_eq!(read_credential(&dir, 3).unwrap(), Some(c));
    let mode = std::fs::metadata(credential_path(&dir, 3))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let again = crate::proto::recovery::fresh();
    write_credential(&dir, 3, &again).unwrap();
    assert_eq!(read_credential(&dir, 3).unwrap(), Some(again), "replaced");
    std::fs::write(credential_path(&dir, 4), b"short").unwrap();
    let err = read_credential(&dir, 4).unwrap_err().to_string();
    assert!(
        err.contains("server-4.credential") && err.contains("32 bytes"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_job_id_is_the_schedulers_public_identity_in_the_table() {
    use crate::proto::ids::Role;
    use crate::proto::msg::NodeInfo;
    use psnet_transport::NodeId;
    let node = |role, byte| NodeInfo {
        id: NodeId(u64::from(byte)),
        role,
        rank: 0,
        addr: "127.0.0.1:1".parse().unwrap(),
        identity: psnet_transport::PublicIdentity([byte; 32]),
    };
    let table = [
        node(Role::Worker, 3),
        node(Role::Scheduler, 7),
        node(Role::Server, 9),
    ];
    assert_eq!(JobId::of(&table), Some(JobId(u64::from_le_bytes([7; 8]))));
    assert_eq!(JobId::of(&table[2..]), None);
    assert_eq!(JobId(0xab).to_string(), "00000000000000ab");
}
