//! psnet's flight recorder: every node keeps its last operations in a bounded ring, and
//! writes them as JSON when something goes wrong, so that a job that stopped can say which
//! rank or node is at fault ([`doctor`], the `psnet-doctor` command).
//!
//! A [`Recorder`] belongs to one scope: a collectives communicator on one rank, or one kv
//! node. Each operation is one [`Record`], made when the operation is made and updated in
//! place as it goes (queued, started, pieces exchanged with each peer, done or failed), so
//! the ring holds one entry per operation and a fixed amount of memory
//! (`PSNET_RECORDER_ENTRIES`). A collective call is recorded when its turn comes
//! ([`Recorder::start`]) and again when it ends ([`Recorder::finish`]): a spin lock and a
//! read of the CPU's time-stamp counter each (28 ns for both here), no allocation, no I/O.
//! The ring keeps counter ticks; snapshots and dumps give µs since the Unix epoch.
//!
//! Dumps go to `PSNET_RECORDER_DIR` (default: `psnet-recorder` in the system's temporary
//! directory), one file per scope and process, written again each time (the latest is the
//! most complete): when an operation fails, when a peer is lost, on `SIGUSR1`
//! ([`install_signal_dump`]), and at a clean end with `PSNET_RECORDER_DUMP=always`.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

pub mod doctor;
mod dump;
pub mod timeline;

pub use dump::{dump_all, dump_dir, install_signal_dump, DumpPolicy, Settings, DUMP_FORMAT};

/// The most peers a record counts pieces for; the rest are summed in the last slot's place
/// (a record stays of fixed size).
pub const PEERS: usize = 8;

/// What a recorder is the recorder of.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Scope {
    /// One rank of a collectives communicator.
    Collectives {
        /// The communicator's id (the same on every rank).
        comm: u32,
        /// This rank.
        rank: u32,
        /// The number of ranks.
        size: u32,
    },
    /// One node of a kv job.
    Kv {
        /// "scheduler", "server" or "worker".
        role: String,
        /// Its rank within its role.
        rank: u32,
        /// The job's id (16 hex digits, from the scheduler's public identity: the same on
        /// every node of a job, another for every job), so that dumps of several jobs in one
        /// folder are read apart. Empty in dumps of older builds.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        job: String,
    },
}

impl Scope {
    /// A short name for file names and messages ("comm-1a2b-rank-3", "kv-worker-1").
    pub fn file_stem(&self) -> String {
        match self {
            Scope::Collectives { comm, rank, .. } => format!("comm-{comm:08x}-rank-{rank}"),
            Scope::Kv { role, rank, job } if job.is_empty() => format!("kv-{role}-{rank}"),
            Scope::Kv { role, rank, job } => format!("kv-{job}-{role}-{rank}"),
        }
    }
}

/// An operation, as recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Op {
    /// A collective call.
    Call {
        /// Its number in the communicator's order of calls (the same on every rank).
        seq: u64,
        /// "allreduce", "broadcast", ...
        coll: &'static str,
        /// Element type.
        dtype: &'static str,
        /// Elements.
        count: u64,
        /// Reduction ("sum", ...), or "" where none.
        reduce: &'static str,
        /// Root rank, where the call has one.
        root: u32,
    },
    /// A kv request of a worker to a server.
    Request {
        /// The worker's request number.
        req: u64,
        /// "push", "pull", "push_pull", "init", "command".
        what: &'static str,
        /// The key (the application's).
        key: u64,
        /// Its part (keys split across servers).
        part: u32,
        /// The server asked (its rank).
        server: u32,
        /// Bytes sent.
        bytes: u64,
    },
    /// A kv request as a server took it.
    Served {
        /// The worker's request number.
        req: u64,
        /// "push", "pull", ...
        what: &'static str,
        /// The key (the server's storage key).
        key: u64,
        /// The worker (its rank).
        worker: u32,
    },
    /// A point-to-point send or receive between two ranks of a communicator.
    P2p {
        /// "send" or "recv".
        dir: &'static str,
        /// The other rank.
        peer: u32,
        /// The message's tag.
        tag: u64,
        /// Its number among the messages between the two ranks with that tag (the n-th send
        /// meets the n-th receive).
        msg: u64,
        /// Element type.
        dtype: &'static str,
        /// Elements.
        count: u64,
    },
    /// A connection event, or anything else that happens at once.
    Event {
        /// "lost", "connected", ...
        what: &'static str,
        /// The peer (rank or node number in the scope's terms).
        peer: u64,
    },
}

/// Where an operation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Made, waiting for its turn.
    Queued,
    /// Running: pieces or messages in flight.
    Started,
    /// Completed.
    Done,
    /// Failed (see the record's error).
    Failed,
}

/// Pieces exchanged with one peer by one operation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerCount {
    /// The peer (a rank).
    pub peer: u32,
    /// Pieces sent to it.
    pub sent: u32,
    /// Pieces received from it.
    pub received: u32,
}

/// One operation in the ring.
#[derive(Clone, Debug, Serialize)]
pub struct Record {
    /// Its number in this recorder (consecutive; the ring keeps the last ones).
    pub id: u64,
    /// What it is.
    pub op: Op,
    /// Where it is.
    pub state: State,
    /// When it was made, µs since the Unix epoch.
    pub made_us: u64,
    /// When it started (0: not yet).
    pub started_us: u64,
    /// When it ended (0: not yet).
    pub ended_us: u64,
    /// Pieces exchanged per peer, as last updated.
    #[serde(serialize_with = "peers_used")]
    pub peers: [PeerCount; PEERS],
    /// Why it failed.
    pub error: Option<String>,
}

fn peers_used<S: serde::Serializer>(peers: &[PeerCount; PEERS], s: S) -> Result<S::Ok, S::Error> {
    let used = peers.iter().take_while(|p| p.sent + p.received > 0).count();
    s.collect_seq(&peers[..used])
}

/// Microseconds since the Unix epoch, the records' clock (comparable across hosts as far as
/// their clocks agree).
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The records, in fixed slots: record `id` lives in slot `id % capacity`, so a new record
/// overwrites the oldest in place (a `VecDeque`'s pop and push moved each 232-byte record
/// twice, a third of a record's cost).
struct Ring {
    slots: Vec<Record>,
    capacity: usize,
    next_id: u64,
}

impl Ring {
    /// Records older than the ring holds.
    fn dropped(&self) -> u64 {
        self.next_id - self.slots.len() as u64
    }

    /// Record `id`, if the ring still holds it.
    fn get_mut(&mut self, id: u64) -> Option<&mut Record> {
        if id >= self.next_id || id < self.dropped() {
            return None;
        }
        let slot = (id % self.capacity as u64) as usize;
        self.slots.get_mut(slot)
    }

    /// The records, oldest first.
    fn in_order(&self) -> impl Iterator<Item = &Record> {
        let start = if self.slots.len() < self.capacity {
            0
        } else {
            (self.next_id % self.capacity as u64) as usize
        };
        self.slots[start..].iter().chain(&self.slots[..start])
    }
}

/// One scope's flight recorder. Cheap to share (`Arc`); every method takes `&self`.
pub struct Recorder {
    scope: Scope,
    /// A spin lock: held for a few nanoseconds, never across an await, and its release is a
    /// plain store where a `std` mutex's is an atomic swap (37 against 28 ns a record, start
    /// and finish). A holder descheduled mid-record makes others yield, not spin hot.
    ring: spin::mutex::SpinMutex<Ring, spin::relax::Yield>,
    policy: DumpPolicy,
    dir: PathBuf,
    /// The records' clock: the time-stamp counter (`quanta`), a third of the system clock's
    /// cost per read.
    clock: quanta::Clock,
    /// A reading of the counter and the system clock at the same moment.
    anchor: (u64, u64),
    /// `PSNET_TIMELINE`: where a Chrome trace goes at the clean end.
    timeline: Mutex<Option<PathBuf>>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

impl Recorder {
    /// A recorder of `scope` with `settings`, registered for [`dump_all`] (and `SIGUSR1`).
    /// `None` if it keeps no entries.
    pub fn with(scope: Scope, settings: &Settings) -> Option<Arc<Self>> {
        let recorder = Self::new(
            scope,
            settings.entries,
            settings.policy,
            settings.dir.clone(),
        )?;
        if let Some(t) = &settings.timeline {
            let mut slot = recorder.timeline.lock().unwrap_or_else(|p| p.into_inner());
            *slot = Some(t.clone());
        }
        Some(recorder)
    }

    /// A recorder keeping the last `capacity` operations of `scope`, dumping by `policy` to
    /// `dir`, registered for [`dump_all`] (and `SIGUSR1`). `None` if `capacity` is 0.
    pub fn new(
        scope: Scope,
        capacity: usize,
        policy: DumpPolicy,
        dir: PathBuf,
    ) -> Option<Arc<Self>> {
        if capacity == 0 {
            return None;
        }
        let clock = quanta::Clock::new();
        let recorder = Arc::new(Recorder {
            scope,
            ring: spin::mutex::SpinMutex::new(Ring {
                slots: Vec::with_capacity(capacity),
                capacity,
                next_id: 0,
            }),
            policy,
            dir,
            anchor: (clock.raw(), now_us()),
            clock,
            timeline: Mutex::new(None),
        });
        dump::register(Arc::downgrade(&recorder));
        Some(recorder)
    }

    /// A recorder for `scope` as the environment says (`PSNET_RECORDER_ENTRIES`,
    /// `PSNET_RECORDER_DIR`, `PSNET_RECORDER_DUMP`); `None` if it is off. A value that does
    /// not parse is logged and the default taken: a recorder's settings never stop a job.
    pub fn from_env(scope: Scope) -> Option<Arc<Self>> {
        Self::with(scope, &Settings::from_env())
    }

    /// What this is the recorder of.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    fn lock(&self) -> spin::mutex::SpinMutexGuard<'_, Ring> {
        self.ring.lock()
    }

    fn ticks(&self) -> u64 {
        self.clock.raw()
    }

    /// µs since the Unix epoch of a reading of the ring's clock (0 stays 0: never).
    fn micros(&self, ticks: u64) -> u64 {
        if ticks == 0 {
            return 0;
        }
        let (raw, unix) = self.anchor;
        if ticks >= raw {
            unix + self.clock.delta_as_nanos(raw, ticks) / 1000
        } else {
            unix.saturating_sub(self.clock.delta_as_nanos(ticks, raw) / 1000)
        }
    }

    /// Records a new operation, queued; returns its id.
    pub fn begin(&self, op: Op) -> u64 {
        self.push(op, State::Queued, self.ticks(), 0, 0)
    }

    /// Records a new operation that starts now (one whose turn came); returns its id.
    pub fn start(&self, op: Op) -> u64 {
        let now = self.ticks();
        self.push(op, State::Started, now, now, 0)
    }

    /// Records something that happened at once.
    pub fn event(&self, op: Op) {
        let now = self.ticks();
        self.push(op, State::Done, now, now, now);
    }

    fn push(&self, op: Op, state: State, made: u64, started: u64, ended: u64) -> u64 {
        let mut ring = self.lock();
        let id = ring.next_id;
        ring.next_id += 1;
        let record = Record {
            id,
            op,
            state,
            made_us: made,
            started_us: started,
            ended_us: ended,
            peers: [PeerCount::default(); PEERS],
            error: None,
        };
        if ring.slots.len() < ring.capacity {
            ring.slots.push(record);
        } else {
            let slot = (id % ring.capacity as u64) as usize;
            ring.slots[slot] = record;
        }
        id
    }

    /// Changes record `id`, if the ring still holds it (`false`: it does not).
    fn update(&self, id: u64, change: impl FnOnce(&mut Record)) -> bool {
        match self.lock().get_mut(id) {
            Some(r) => {
                change(r);
                true
            }
            None => false,
        }
    }

    /// Operation `id` started; `false` if the ring no longer holds it.
    pub fn started(&self, id: u64) -> bool {
        let now = self.ticks();
        self.update(id, |r| {
            r.state = State::Started;
            r.started_us = now;
        })
    }

    /// Operation `id`'s pieces so far, per peer (the first [`PEERS`] peers).
    pub fn progress(&self, id: u64, peers: &[PeerCount]) {
        self.update(id, |r| {
            for (slot, p) in r.peers.iter_mut().zip(peers) {
                *slot = *p;
            }
        });
    }

    /// Operation `id` ended: its pieces per peer, and why it failed if it did (one lock for
    /// what [`Self::progress`] and [`Self::done`] or [`Self::failed`] do).
    pub fn finish(&self, id: u64, peers: &[PeerCount], error: Option<&str>) {
        let now = self.ticks();
        self.update(id, |r| {
            for (slot, p) in r.peers.iter_mut().zip(peers) {
                *slot = *p;
            }
            r.state = if error.is_some() {
                State::Failed
            } else {
                State::Done
            };
            if r.started_us == 0 {
                r.started_us = now;
            }
            r.ended_us = now;
            r.error = error.map(str::to_string);
        });
    }

    /// Operation `id` completed.
    pub fn done(&self, id: u64) {
        let now = self.ticks();
        self.update(id, |r| {
            r.state = State::Done;
            if r.started_us == 0 {
                r.started_us = now;
            }
            r.ended_us = now;
        });
    }

    /// Operation `id` failed with `error`.
    pub fn failed(&self, id: u64, error: &str) {
        let now = self.ticks();
        self.update(id, |r| {
            r.state = State::Failed;
            r.ended_us = now;
            r.error = Some(error.to_string());
        });
    }

    /// The records the ring holds, oldest first, and how many older ones it let go.
    pub fn snapshot(&self) -> (Vec<Record>, u64) {
        let (mut records, dropped) = {
            let ring = self.lock();
            (ring.in_order().cloned().collect::<Vec<_>>(), ring.dropped())
        };
        for r in &mut records {
            r.made_us = self.micros(r.made_us);
            r.started_us = self.micros(r.started_us);
            r.ended_us = self.micros(r.ended_us);
        }
        (records, dropped)
    }

    /// Writes this recorder's dump now (`reason`: why), unless the policy is never to
    /// dump but on `SIGUSR1`; returns the file written.
    pub fn dump_on_failure(&self, reason: &str) -> Option<PathBuf> {
        if self.policy == DumpPolicy::Never {
            return None;
        }
        self.dump(reason)
    }

    /// Writes this recorder's dump at a clean end, if the policy says so.
    /// With `PSNET_TIMELINE`, also writes its Chrome trace there.
    pub fn dump_at_end(&self) -> Option<PathBuf> {
        let timeline = self
            .timeline
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(dir) = timeline {
            match dump::write_timeline(self, &dir) {
                Ok(path) => tracing::info!(path = %path.display(), "timeline written"),
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "could not write the timeline")
                }
            }
        }
        if self.policy != DumpPolicy::Always {
            return None;
        }
        self.dump("clean end (PSNET_RECORDER_DUMP=always)")
    }

    /// Writes this recorder's dump now; logs (and returns `None`) if it cannot.
    pub fn dump(&self, reason: &str) -> Option<PathBuf> {
        match dump::write(self, reason) {
            Ok(path) => {
                tracing::info!(path = %path.display(), %reason, "flight recorder dump written");
                Some(path)
            }
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "could not write the flight recorder's dump");
                None
            }
        }
    }

    pub(crate) fn dir(&self) -> &std::path::Path {
        &self.dir
    }
}

/// The pieces one operation exchanged, counted per peer as it runs (no allocation); hand
/// it to [`Recorder::progress`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Tally {
    peers: [PeerCount; PEERS],
}

impl Tally {
    fn slot(&mut self, peer: u32) -> &mut PeerCount {
        let used = self
            .peers
            .iter()
            .position(|p| p.sent + p.received == 0 || p.peer == peer);
        let i = match used {
            Some(i) => i,
            // Full: the last slot stands for every further peer.
            None => PEERS - 1,
        };
        if self.peers[i].sent + self.peers[i].received == 0 {
            self.peers[i].peer = peer;
        }
        &mut self.peers[i]
    }

    /// A piece went to `peer`.
    pub fn sent(&mut self, peer: u32) {
        self.slot(peer).sent += 1;
    }

    /// A piece came from `peer`.
    pub fn received(&mut self, peer: u32) {
        self.slot(peer).received += 1;
    }

    /// The counts.
    pub fn peers(&self) -> &[PeerCount] {
        &self.peers
    }
}

/// The registry of live recorders, for [`dump_all`].
pub(crate) type Registered = Vec<Weak<Recorder>>;

#[cfg(test)]
mod tests;
