//! Durable server shards on disk (`PSNET_CHECKPOINT_DIR`).
//!
//! With a checkpoint directory, server rank `r` keeps two files there:
//!
//! * `server-<r>.snapshot`: a whole shard ([`ServerState::snapshot`]) behind a header
//!   (`PSNETSNP`, `u32` version 2, `u32` rank, `u64` [job id](JobId), `u64` random id of
//!   this snapshot, `u64` length, `u32` CRC-32 of the header before it and the snapshot). Written to
//!   `server-<r>.snapshot.tmp`, flushed to disk (`fsync`), then renamed over the previous one
//!   and the directory flushed: a crash leaves the old snapshot or the new one, never a mix.
//! * `server-<r>.journal`: every change the server acknowledged since that snapshot
//!   ([`Output::Journal`](crate::proto::server::Output::Journal)), appended with `write()`
//!   *before* the answers that acknowledge it are sent. A header (`PSNETJNL`, `u32` version
//!   1, `u32` rank, `u64` id of the snapshot it follows, `u32` CRC-32 of these), then per
//!   record `u64` length, `u32` CRC-32, the record. Each snapshot starts an empty journal
//!   (made aside, renamed into place after the snapshot). A journal that does not follow the
//!   snapshot beside it (a crash between the two renames, or a server started afresh over an
//!   earlier run's files) holds nothing the snapshot lacks, and is ignored.
//!
//! A server that starts with `PSNET_CHECKPOINT_DIR` writes a snapshot of its empty state at
//! once, replacing the files of an earlier run of its rank.
//!
//! [`load_shard`] restores the snapshot and replays the journal: the result is bit-identical
//! to the server that wrote them as of its last acknowledged change, so no acknowledged update
//! is lost. A record cut short at the end of the journal (the server died while appending it:
//! its acknowledgement was never sent) is recognised by its length or checksum and ignored;
//! a bad record followed by more records is an error, as is any damage to the snapshot.
//!
//! What is not recovered: the pushes of `dist_sync` rounds not yet complete and pushes
//! deferred to a later round (never acknowledged: their workers must send them again to the
//! restarted server), and the rest of what a snapshot leaves out (see
//! [`crate::proto::server`], "Checkpoints"). A change is in the files once its record is
//! written, even if the server died before its answer went out: the worker that resends it
//! then finds it applied: a push sent again says its place in the key's order
//! ([`PushFlags::retry`](crate::proto::msg::PushFlags::retry)), which the server compares
//! with the key's round count ([`ServerState::updates`], `dist_sync`) or the sender's count
//! of applied pushes (`dist_async`), both kept in the files.
//!
//! The job id binds the files to the job that wrote them: a server that rejoins refuses a
//! snapshot of another job (a checkpoint directory shared between jobs, files copied from
//! elsewhere), naming the file, rather than serving another job's values.
//!
//! A server restarted with its rank while the job waits for it (`PSNET_RECOVERY_TIMEOUT`)
//! loads its shard with [`load_shard`] and rejoins the running job (see
//! [`crate::proto::scheduler`]). It must show the scheduler the recovery credential its rank
//! keeps beside the shard, `server-<r>.credential` (32 random bytes, readable by the job's
//! user only, replaced at every start and rejoin; see [`crate::proto::recovery`]).
//!
//! Snapshots come every `PSNET_CHECKPOINT_EVERY` updates of a key and when a worker asks
//! (`Worker::save_checkpoint`); with `PSNET_CHECKPOINT_EVERY=0` the journal grows until a
//! worker asks.
//!
//! # Durability (`PSNET_CHECKPOINT_FSYNC`)
//!
//! * `0` (default): journal records are written to the kernel before their acknowledgements
//!   go out, which survives the death of the server process (crash, `kill -9`, out of
//!   memory), not a crash of the machine or its power.
//! * `1`: the journal is also flushed to disk (`fdatasync`) before the acknowledgements,
//!   once per batch of records the server handles together: survives a machine crash, at
//!   the cost of a disk flush per batch.
//!
//! Snapshots are always flushed to disk before they replace the previous one. The server's
//! loop waits while a snapshot is built and written (a copy of the shard in memory, then a
//! shard's worth of disk writes); the journal receives every round's merged gradient, so it
//! grows by about one shard per round until the next snapshot.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, Read, Write};
use std::path::{Path, PathBuf};

use crate::error::KvError;
use crate::proto::recovery::CREDENTIAL_LEN;
use crate::proto::server::ServerState;

/// The CRC-32 (IEEE, as zlib's) the files' headers and records carry.
fn crc32(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// The CRC-32 of the concatenation of `parts`.
fn crc32_parts(parts: &[&[u8]]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for p in parts {
        h.update(p);
    }
    h.finalize()
}

const SNAPSHOT_MAGIC: &[u8; 8] = b"PSNETSNP";
const JOURNAL_MAGIC: &[u8; 8] = b"PSNETJNL";
/// The snapshot file's version (2: the job id).
const SNAPSHOT_VERSION: u32 = 2;
/// The journal file's version.
const JOURNAL_VERSION: u32 = 1;
/// Snapshot file header: magic, version, rank, job, id, length, CRC.
const SNAPSHOT_HEADER: usize = 44;
/// Journal file header: magic, version, rank, snapshot id, CRC.
const JOURNAL_HEADER: usize = 28;
/// Record header: length, CRC.
const RECORD_HEADER: usize = 12;

/// `dir/server-<rank>.snapshot`.
pub fn snapshot_path(dir: &Path, rank: u32) -> PathBuf {
    dir.join(format!("server-{rank}.snapshot"))
}

/// `dir/server-<rank>.journal`.
pub fn journal_path(dir: &Path, rank: u32) -> PathBuf {
    dir.join(format!("server-{rank}.journal"))
}

/// Where server rank `rank` keeps its recovery credential.
pub fn credential_path(dir: &Path, rank: u32) -> PathBuf {
    dir.join(format!("server-{rank}.credential"))
}

/// Server rank `rank`'s recovery credential, if its file exists; a file of another length is
/// an error naming it.
pub fn read_credential(dir: &Path, rank: u32) -> Result<Option<[u8; CREDENTIAL_LEN]>, KvError> {
    let path = credential_path(dir, rank);
    match fs::read(&path) {
        Ok(bytes) => bytes.as_slice().try_into().map(Some).map_err(|_| {
            KvError::Checkpoint(format!(
                "{}: a recovery credential is {CREDENTIAL_LEN} bytes, this file has {}",
                path.display(),
                bytes.len()
            ))
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_error("read", &path, e)),
    }
}

/// Makes `credential` server rank `rank`'s, readable and writable by this user only: written
/// aside, flushed, renamed into place.
pub fn write_credential(
    dir: &Path,
    rank: u32,
    credential: &[u8; CREDENTIAL_LEN],
) -> Result<(), KvError> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = credential_path(dir, rank);
    let tmp = dir.join(format!("server-{rank}.credential.tmp"));
    let _ = fs::remove_file(&tmp);
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(credential)?;
            f.sync_all()
        })
        .map_err(|e| io_error("write", &tmp, e))?;
    fs::rename(&tmp, &path).map_err(|e| io_error("rename into place", &path, e))?;
    sync_dir(dir)
}

fn io_error(what: &str, path: &Path, e: io::Error) -> KvError {
    KvError::Checkpoint(format!("cannot {what} {}: {e}", path.display()))
}

/// A checkpoint error about the contents of `path`, naming it.
fn within(path: &Path, e: KvError) -> KvError {
    match e {
        KvError::Checkpoint(what) => KvError::Checkpoint(format!("{}: {what}", path.display())),
        other => other,
    }
}

/// Flushes a directory's entries (renames) to disk.
fn sync_dir(dir: &Path) -> Result<(), KvError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_error("flush the directory", dir, e))
}

fn journal_header(rank: u32, id: u64) -> [u8; JOURNAL_HEADER] {
    let mut h = [0u8; JOURNAL_HEADER];
    h[..8].copy_from_slice(JOURNAL_MAGIC);
    h[8..12].copy_from_slice(&JOURNAL_VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&rank.to_le_bytes());
    h[16..24].copy_from_slice(&id.to_le_bytes());
    let crc = crc32(&h[..24]);
    h[24..].copy_from_slice(&crc.to_le_bytes());
    h
}

/// The job a checkpoint belongs to: the first 8 bytes of the public half of the scheduler's
/// identity, which the scheduler draws afresh at every start and every node receives in its
/// table (so a server that rejoins the same job computes the same id, and another job's
/// files differ). It is no secret: it tells jobs apart, it does not prove anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct JobId(pub u64);

impl JobId {
    /// The id of the job whose table is `nodes`; `None` if the table has no scheduler.
    pub fn of(nodes: &[crate::proto::msg::NodeInfo]) -> Option<JobId> {
        let scheduler = nodes
            .iter()
            .find(|n| n.role == crate::proto::ids::Role::Scheduler)?;
        Some(JobId::of_scheduler(&scheduler.identity))
    }

    /// The id of the job whose scheduler's public identity is `identity`.
    pub fn of_scheduler(identity: &psnet_transport::PublicIdentity) -> JobId {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&identity.0[..8]);
        JobId(u64::from_le_bytes(bytes))
    }
}

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A fresh id for a snapshot, that its journal names.
fn snapshot_id() -> u64 {
    let mut bytes = [0u8; 8];
    if getrandom::fill(&mut bytes).is_err() {
        // Ids need only differ from the previous snapshot's.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        bytes = (now ^ u64::from(std::process::id()).rotate_left(32)).to_le_bytes();
    }
    u64::from_le_bytes(bytes)
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// A server's open checkpoint files.
#[derive(Debug)]
pub(crate) struct ShardFiles {
    dir: PathBuf,
    rank: u32,
    job: JobId,
    fsync: bool,
    journal: File,
    /// Records appended since the journal was last flushed to disk.
    unsynced: bool,
}

impl ShardFiles {
    /// Creates `dir` if needed and makes `snapshot` (a new server's) rank `rank`'s snapshot
    /// in job `job`, with an empty journal, replacing the files of an earlier run.
    pub(crate) fn create(
        dir: &Path,
        rank: u32,
        job: JobId,
        fsync: bool,
        snapshot: &[u8],
    ) -> Result<Self, KvError> {
        fs::create_dir_all(dir).map_err(|e| io_error("create", dir, e))?;
        if snapshot_path(dir, rank).exists() {
            tracing::info!(
                dir = %dir.display(),
                rank,
                "replacing the checkpoint of an earlier run of this server"
            );
        }
        let journal = Self::write_snapshot_files(dir, rank, job, snapshot)?;
        Ok(ShardFiles {
            dir: dir.to_path_buf(),
            rank,
            job,
            fsync,
            journal,
            unsynced: false,
        })
    }

    /// Appends one record to the journal (written to the kernel on return).
    pub(crate) fn append(&mut self, record: &[u8]) -> Result<(), KvError> {
        let mut header = [0u8; RECORD_HEADER];
        header[..8].copy_from_slice(&(record.len() as u64).to_le_bytes());
        header[8..].copy_from_slice(&crc32(record).to_le_bytes());
        self.journal
            .write_all(&header)
            .and_then(|()| self.journal.write_all(record))
            .map_err(|e| io_error("append to", &journal_path(&self.dir, self.rank), e))?;
        self.unsynced = true;
        Ok(())
    }

    /// With `PSNET_CHECKPOINT_FSYNC=1`, flushes the records appended so far to disk; call
    /// before sending what acknowledges them.
    pub(crate) fn sync(&mut self) -> Result<(), KvError> {
        if self.fsync && self.unsynced {
            self.journal
                .sync_data()
                .map_err(|e| io_error("flush", &journal_path(&self.dir, self.rank), e))?;
        }
        self.unsynced = false;
        Ok(())
    }

    /// Makes `snapshot` the snapshot and starts an empty journal. On error the previous
    /// snapshot and the journal in use still hold every change.
    pub(crate) fn write_snapshot(&mut self, snapshot: &[u8]) -> Result<(), KvError> {
        // Records before the snapshot are in it: they need no flush of their own.
        self.journal = Self::write_snapshot_files(&self.dir, self.rank, self.job, snapshot)?;
        self.unsynced = false;
        Ok(())
    }

    /// Writes the snapshot aside, flushes it, renames it into place, then does the same with
    /// an empty journal; returns the new journal, open for appending.
    fn write_snapshot_files(
        dir: &Path,
        rank: u32,
        job: JobId,
        snapshot: &[u8],
    ) -> Result<File, KvError> {
        let path = snapshot_path(dir, rank);
        let tmp = dir.join(format!("server-{rank}.snapshot.tmp"));
        let id = snapshot_id();
        let mut header = [0u8; SNAPSHOT_HEADER];
        header[..8].copy_from_slice(SNAPSHOT_MAGIC);
        header[8..12].copy_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
        header[12..16].copy_from_slice(&rank.to_le_bytes());
        header[16..24].copy_from_slice(&job.0.to_le_bytes());
        header[24..32].copy_from_slice(&id.to_le_bytes());
        header[32..40].copy_from_slice(&(snapshot.len() as u64).to_le_bytes());
        let crc = crc32_parts(&[&header[..40], snapshot]);
        header[40..].copy_from_slice(&crc.to_le_bytes());
        File::create(&tmp)
            .and_then(|mut f| {
                f.write_all(&header)?;
                f.write_all(snapshot)?;
                f.sync_all()
            })
            .map_err(|e| io_error("write", &tmp, e))?;
        fs::rename(&tmp, &path).map_err(|e| io_error("rename into place", &path, e))?;
        sync_dir(dir)?;
        // A crash before the journal is replaced leaves the old journal beside the new
        // snapshot: its records are in the snapshot, and its id tells it apart.
        let path = journal_path(dir, rank);
        let tmp = dir.join(format!("server-{rank}.journal.tmp"));
        File::create(&tmp)
            .and_then(|mut f| {
                f.write_all(&journal_header(rank, id))?;
                f.sync_all()
            })
            .map_err(|e| io_error("write", &tmp, e))?;
        let journal = OpenOptions::new()
            .append(true)
            .open(&tmp)
            .map_err(|e| io_error("open", &tmp, e))?;
        fs::rename(&tmp, &path).map_err(|e| io_error("rename into place", &path, e))?;
        sync_dir(dir)?;
        Ok(journal)
    }
}

/// What [`replay_journal`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Replayed {
    /// Records applied.
    pub applied: u64,
    /// Records the snapshot already held.
    pub skipped: u64,
    /// Bytes of a record cut short at the end, ignored (0: none).
    pub torn: u64,
    /// The journal follows another snapshot than the one given: ignored whole.
    pub stale: bool,
}

/// Reads the shard of server `rank` from `dir` (see the [module](self) docs): `Ok(None)`
/// when it has no snapshot there, else the state as of its last acknowledged change, for
/// `num_workers` workers and `key_limit` bytes of values (`PSNET_KV_SERVER_KEY_BYTES`), with
/// checkpoints off (the caller turns them on and makes a fresh snapshot). A damaged snapshot,
/// a missing or damaged journal, files of another rank, or (with `job` given: a server
/// rejoining its job; tools reading files offline pass `None`) a snapshot of another job
/// are errors naming the file.
pub fn load_shard(
    dir: &Path,
    rank: u32,
    job: Option<JobId>,
    num_workers: u32,
    key_limit: u64,
) -> Result<Option<ServerState>, KvError> {
    let snap = snapshot_path(dir, rank);
    let journal = journal_path(dir, rank);
    let bytes = match fs::read(&snap) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if journal.exists() {
                return Err(KvError::Checkpoint(format!(
                    "{} exists without its snapshot {}",
                    journal.display(),
                    snap.display()
                )));
            }
            return Ok(None);
        }
        Err(e) => return Err(io_error("read", &snap, e)),
    };
    let (id, body) = read_snapshot_file(&bytes, rank, job).map_err(|e| within(&snap, e))?;
    let mut state =
        ServerState::restore(body, num_workers, key_limit).map_err(|e| within(&snap, e))?;
    drop(bytes);
    let file = File::open(&journal).map_err(|e| io_error("open", &journal, e))?;
    let len = file
        .metadata()
        .map_err(|e| io_error("read", &journal, e))?
        .len();
    let replayed = replay_journal(BufReader::new(file), len, rank, id, &mut state)
        .map_err(|e| within(&journal, e))?;
    if replayed.stale {
        tracing::info!(
            file = %journal.display(),
            "ignoring a journal that does not follow the snapshot (written before it, or by an \
             earlier run)"
        );
    }
    if replayed.torn > 0 {
        tracing::warn!(
            file = %journal.display(),
            bytes = replayed.torn,
            "ignoring a journal record cut short at the end (never acknowledged)"
        );
    }
    tracing::info!(
        dir = %dir.display(),
        rank,
        seq = state.seq(),
        keys = state.keys().len(),
        applied = replayed.applied,
        skipped = replayed.skipped,
        "server shard loaded"
    );
    Ok(Some(state))
}

/// The id and the snapshot of a snapshot file, its header checked.
fn read_snapshot_file(
    bytes: &[u8],
    rank: u32,
    job: Option<JobId>,
) -> Result<(u64, &[u8]), KvError> {
    let bad = |what: String| KvError::Checkpoint(format!("bad snapshot file: {what}"));
    if bytes.len() < SNAPSHOT_HEADER || &bytes[..8] != SNAPSHOT_MAGIC {
        return Err(bad("no PSNETSNP header".into()));
    }
    let version = u32_at(bytes, 8);
    if version != SNAPSHOT_VERSION {
        return Err(bad(format!(
            "version {version}, this build reads {SNAPSHOT_VERSION}"
        )));
    }
    let of = u32_at(bytes, 12);
    if of != rank {
        return Err(bad(format!("written by server {of}, not {rank}")));
    }
    let len = u64_at(bytes, 32);
    let body = &bytes[SNAPSHOT_HEADER..];
    if len != body.len() as u64 {
        return Err(bad(format!(
            "{len} bytes announced, {} present",
            body.len()
        )));
    }
    if crc32_parts(&[&bytes[..40], body]) != u32_at(bytes, 40) {
        return Err(bad("checksum mismatch".into()));
    }
    let theirs = JobId(u64_at(bytes, 16));
    if let Some(ours) = job.filter(|&ours| ours != theirs) {
        return Err(KvError::Checkpoint(format!(
            "a snapshot of job {theirs}, not of this job ({ours}): another job's checkpoint \
             (is PSNET_CHECKPOINT_DIR shared between jobs?)"
        )));
    }
    Ok((u64_at(bytes, 24), body))
}

/// Applies the records of a journal file (`len` bytes read from `input`) of server `rank`
/// to `state`, in order (see [`ServerState::apply_journal`]), if the journal follows the
/// snapshot of id `snapshot` (else it is [`Replayed::stale`] and nothing is applied). A
/// record cut short at the end is ignored and counted in [`Replayed::torn`].
pub fn replay_journal(
    mut input: impl Read,
    len: u64,
    rank: u32,
    snapshot: u64,
    state: &mut ServerState,
) -> Result<Replayed, KvError> {
    let bad = |what: String| KvError::Checkpoint(format!("bad journal: {what}"));
    let read_error = |e: io::Error| KvError::Checkpoint(format!("cannot read the journal: {e}"));
    let mut header = [0u8; JOURNAL_HEADER];
    if len < JOURNAL_HEADER as u64 {
        return Err(bad(format!("{len} bytes, shorter than its header")));
    }
    input.read_exact(&mut header).map_err(read_error)?;
    if &header[..8] != JOURNAL_MAGIC {
        return Err(bad("no PSNETJNL header".into()));
    }
    let version = u32_at(&header, 8);
    if version != JOURNAL_VERSION {
        return Err(bad(format!(
            "version {version}, this build reads {JOURNAL_VERSION}"
        )));
    }
    let of = u32_at(&header, 12);
    if of != rank {
        return Err(bad(format!("written by server {of}, not {rank}")));
    }
    if crc32(&header[..24]) != u32_at(&header, 24) {
        return Err(bad("its header fails its checksum".into()));
    }
    let mut done = Replayed::default();
    if u64_at(&header, 16) != snapshot {
        done.stale = true;
        return Ok(done);
    }
    let mut at = JOURNAL_HEADER as u64;
    let mut record = Vec::new();
    loop {
        let left = len - at;
        if left == 0 {
            return Ok(done);
        }
        if left < RECORD_HEADER as u64 {
            done.torn = left;
            return Ok(done);
        }
        let mut rh = [0u8; RECORD_HEADER];
        input.read_exact(&mut rh).map_err(read_error)?;
        let n = u64::from_le_bytes(rh[..8].try_into().expect("8 bytes"));
        let crc = u32::from_le_bytes(rh[8..].try_into().expect("4 bytes"));
        let room = left - RECORD_HEADER as u64;
        if n > room {
            // Cut short while being appended: never acknowledged.
            done.torn = left;
            return Ok(done);
        }
        if n == 0 {
            return Err(bad(format!(
                "an empty record at byte {at} (the file is damaged; after a machine crash \
                 with PSNET_CHECKPOINT_FSYNC=0 its end may be lost)"
            )));
        }
        record.resize(n as usize, 0);
        input.read_exact(&mut record).map_err(read_error)?;
        if crc32(&record) != crc {
            if n == room {
                done.torn = left;
                return Ok(done);
            }
            return Err(bad(format!(
                "the record at byte {at} fails its checksum and more follow (the file is \
                 damaged; after a machine crash with PSNET_CHECKPOINT_FSYNC=0 its end may be \
                 lost)"
            )));
        }
        if state.apply_journal(&record)? {
            done.applied += 1;
        } else {
            done.skipped += 1;
        }
        at += RECORD_HEADER as u64 + n;
    }
}

/// For fuzzing: `data` as a journal file of server 0 (following the snapshot its header
/// names), replayed onto an empty state.
#[doc(hidden)]
pub fn fuzz_journal_file(data: &[u8]) {
    let mut state = ServerState::new(2);
    let id = data.get(16..24).map_or(0, |b| u64_at(b, 0));
    let _ = replay_journal(data, data.len() as u64, 0, id, &mut state);
}

#[cfg(test)]
mod tests;
