//! Who may set what: worker 0 sets the servers' optimizer, mode and gradient compression.
//! MXNet's workers each send the optimizer (and psnet's each send the mode and compression),
//! so another worker's command is taken only as agreement with worker 0's: one that comes
//! first waits for worker 0's, and is then answered (it agrees) or refused (it does not).
//! A new optimizer that disagrees with the one in force (a changed learning rate, which may
//! arrive before worker 0's same change) waits for worker 0's next; worker 0 pushing a
//! gradient first refuses whatever still waits.
//! Before, the first such command was applied, whoever sent it: a member holding a worker's
//! place could set lr=1000 before worker 0 spoke, and keep it if worker 0 never did.

use super::{Dtype, Mode, Shadow};
use super::{Output, ServerState};
use crate::proto::msg::{CommandKind, MAX_STRING};
use crate::proto::pulled::KvCompression;
use crate::updater::OptimizerSpec;

/// Why a worker's command is refused; its text is what the worker is told.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    /// A checkpoint asked of a server without `PSNET_CHECKPOINT_DIR`.
    #[error("checkpoints are off on this server: set PSNET_CHECKPOINT_DIR on the servers")]
    CheckpointsOff,
    /// A command body beyond the protocol's string limit.
    #[error("a command of {len} bytes, at most {MAX_STRING}")]
    TooLong {
        /// Its length.
        len: usize,
    },
    /// A checkpoint found in the journal, where none is ever written.
    #[error("a checkpoint changes nothing")]
    CheckpointInJournal,
    /// An optimizer that does not parse.
    #[error("{0}")]
    Optimizer(String),
    /// Compression settings that do not parse or cannot be built.
    #[error("{0}")]
    Compression(String),
    /// Compressed pulls with `dist_async`.
    #[error(
        "compressed pulls are for dist_sync only: in dist_async each worker pulls at its own \
         pace, so the workers' copies would need a residual per worker; set \"pull\": false, \
         or use dist_sync"
    )]
    CompressedPullsNeedSync,
    /// Compression set again, differently.
    #[error(
        "gradient compression is already {current} on this server, refusing {asked}: every \
         worker must set the same compression, once"
    )]
    CompressionAlreadySet {
        /// The settings in force.
        current: String,
        /// The settings asked for.
        asked: String,
    },
    /// Compressed pulls' copies would take the server past its key budget.
    #[error(
        "compressed pulls keep a copy of every key: {copies} more bytes would bring this \
         server's keys to {total} bytes, beyond PSNET_KV_SERVER_KEY_BYTES={limit}"
    )]
    KeyBytes {
        /// The copies' bytes.
        copies: u64,
        /// The keys' bytes with them.
        total: u64,
        /// The budget.
        limit: u64,
    },
    /// A mode other than `sync` or `async`.
    #[error("unknown mode {0:?}: use sync or async")]
    UnknownMode(String),
    /// `dist_async` asked for while a synchronous round holds pushes.
    #[error(
        "cannot switch to dist_async while the dist_sync round of key {key} holds pushes \
         ({count} of {workers} workers pushed): set the mode before pushing"
    )]
    RoundInProgress {
        /// The key whose round is open.
        key: u64,
        /// Pushes it holds.
        count: u32,
        /// Workers in the job.
        workers: u32,
    },
}

/// Commands of another worker waiting for worker 0's of their kind, at most this many per
/// worker (each worker sends one of each kind at a time).
const WAITING_PER_WORKER: usize = 8;

/// Another worker's command that came before worker 0's of its kind.
#[derive(Debug)]
pub(super) struct Waiting {
    rank: u32,
    ts: u64,
    kind: CommandKind,
    body: String,
}

/// The kinds only worker 0 sets.
fn set_by_worker_0(kind: CommandKind) -> bool {
    matches!(
        kind,
        CommandKind::SetOptimizer | CommandKind::SetMode | CommandKind::SetCompression
    )
}

impl ServerState {
    /// Request `ts` of worker `rank`, a command: answered [`Output::Done`] (after its
    /// journal record) or [`Output::Failed`]; a checkpoint is answered by the driver once
    /// the [`Output::Snapshot`] is written. Another worker's optimizer, mode or compression
    /// is answered once worker 0's is in force, as agreement with it.
    pub fn handle_command_request(&mut self, rank: u32, ts: u64, kind: CommandKind, body: &str) {
        if kind == CommandKind::Checkpoint {
            return match self.checkpoint_refused() {
                Some(reason) => self.fail(rank, ts, reason),
                None => self.queue_snapshot(Some((rank, ts))),
            };
        }
        if rank != 0 && set_by_worker_0(kind) {
            // A new optimizer (a changed learning rate: MXNet's users set it again) may reach
            // this server before worker 0's same change; one that disagrees with the one in
            // force waits for worker 0's next, and is refused if worker 0 pushes a gradient
            // first. A mode or compression that disagrees is refused at once: neither changes.
            let changing = kind == CommandKind::SetOptimizer
                && self.set_by_rank0.contains(&kind.code())
                && self.disagreement(kind, body).is_some();
            if self.set_by_rank0.contains(&kind.code()) && !changing {
                return self.answer_agreement(rank, ts, kind, body);
            }
            // Worker 0 is gone before it set this: nothing will answer a wait.
            if let Some(why) = self.dead.get(&0).cloned() {
                return self.out.push_back(Output::PeerFailed {
                    rank,
                    ts,
                    lost: 0,
                    reason: format!("{kind:?} waits for worker 0's, and {why}"),
                });
            }
            let theirs = self
                .waiting_for_rank0
                .iter()
                .filter(|w| w.rank == rank)
                .count();
            if theirs >= WAITING_PER_WORKER {
                return self.fail(
                    rank,
                    ts,
                    format!(
                        "{theirs} commands of this worker already wait for worker 0's \
                         optimizer, mode or compression"
                    ),
                );
            }
            self.waiting_for_rank0.push(Waiting {
                rank,
                ts,
                kind,
                body: body.to_string(),
            });
            return;
        }
        let outcome = self.handle_command(kind, body);
        match &outcome {
            Ok(()) => self.out.push_back(Output::Done {
                rank,
                ts,
                value: None,
                have: None,
            }),
            Err(reason) => self.fail(rank, ts, reason.to_string()),
        }
        if rank == 0 && set_by_worker_0(kind) {
            self.answer_waiting(kind, outcome.err().map(|e| e.to_string()));
        }
    }

    /// Worker 0 pushed a gradient: the commands still waiting for its are refused, as it
    /// went on without sending one (or the same one).
    pub(super) fn worker_0_went_on(&mut self) {
        for w in std::mem::take(&mut self.waiting_for_rank0) {
            let reason = match self.disagreement(w.kind, &w.body) {
                Some(why) if self.set_by_rank0.contains(&w.kind.code()) => {
                    format!("{why} (worker 0 pushed a gradient without changing it)")
                }
                _ => format!(
                    "worker 0 pushed a gradient before it set {:?}: only worker 0 sets it, the \
                     others' must agree",
                    w.kind
                ),
            };
            tracing::warn!(worker = w.rank, kind = ?w.kind, %reason, "refused a command worker 0 never agreed with");
            self.fail(w.rank, w.ts, reason);
        }
    }

    /// Worker `lost` is gone: its own waiting commands are dropped (nobody reads their
    /// answers), and if it is worker 0, every other waiting command fails naming it (before,
    /// they waited for good, and their workers with them).
    pub(super) fn waiting_commands_lost(&mut self, lost: u32, reason: &str) {
        let waiting = std::mem::take(&mut self.waiting_for_rank0);
        for w in waiting {
            if w.rank == lost {
                continue;
            }
            if lost != 0 {
                self.waiting_for_rank0.push(w);
                continue;
            }
            self.out.push_back(Output::PeerFailed {
                rank: w.rank,
                ts: w.ts,
                lost: 0,
                reason: format!("{:?} waits for worker 0's, and {reason}", w.kind),
            });
        }
    }

    /// Worker 0's `kind` was applied (`refused`: it was not, and why): the other workers'
    /// commands of that kind that waited for it are answered.
    fn answer_waiting(&mut self, kind: CommandKind, refused: Option<String>) {
        let (now, still): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiting_for_rank0)
            .into_iter()
            .partition(|w| w.kind == kind);
        self.waiting_for_rank0 = still;
        for w in now {
            match &refused {
                None => self.answer_agreement(w.rank, w.ts, w.kind, &w.body),
                Some(why) => self.fail(
                    w.rank,
                    w.ts,
                    format!("worker 0's {kind:?}, which this one waited for, was refused: {why}"),
                ),
            }
        }
    }

    /// Another worker's `kind`, with worker 0's in force: done if it agrees (it changes
    /// nothing), refused if not.
    fn answer_agreement(&mut self, rank: u32, ts: u64, kind: CommandKind, body: &str) {
        match self.disagreement(kind, body) {
            None => self.out.push_back(Output::Done {
                rank,
                ts,
                value: None,
                have: None,
            }),
            Some(reason) => {
                tracing::warn!(worker = rank, ?kind, %reason, "refused a command that disagrees with worker 0's");
                self.fail(rank, ts, reason)
            }
        }
    }

    /// Why `body` is not the `kind` in force (None: it is).
    fn disagreement(&self, kind: CommandKind, body: &str) -> Option<String> {
        let agrees = match kind {
            CommandKind::SetOptimizer => {
                OptimizerSpec::parse(body).is_ok_and(|s| Some(s) == self.optimizer)
            }
            CommandKind::SetMode => {
                body == match self.mode {
                    Mode::Sync => "sync",
                    Mode::Async => "async",
                }
            }
            CommandKind::SetCompression => {
                // Whether a worker packs its codes is its own affair (PSNET_PACK_CODES):
                // servers take both forms, and every worker reads packed answers.
                let theirs = KvCompression::parse(body).map(|c| KvCompression {
                    pack: self.compression.map_or(c.pack, |current| current.pack),
                    ..c
                });
                if let (Ok(theirs), Some(current)) = (&theirs, self.compression) {
                    if *theirs != current {
                        return Some(format!(
                            "gradient compression is already {current} on this server, set \
                             by worker 0, refusing {theirs}: every worker must set the same \
                             compression"
                        ));
                    }
                }
                theirs.is_ok_and(|c| Some(c) == self.compression)
            }
            CommandKind::Checkpoint => true,
        };
        (!agrees).then(|| {
            format!(
                "{kind:?} {body:?} is not the one in force, which worker 0 set: only worker 0 \
                 sets it, the others' must agree"
            )
        })
    }
}

impl ServerState {
    /// A worker's command: optimizer, compression, mode, checkpoint. `Err` is the reason to
    /// report. With checkpoints on, a change comes out as an [`Output::Journal`] record
    /// first; a checkpoint as an [`Output::Snapshot`].
    pub fn handle_command(&mut self, kind: CommandKind, body: &str) -> Result<(), CommandError> {
        if kind == CommandKind::Checkpoint {
            if !self.checkpoints() {
                return Err(CommandError::CheckpointsOff);
            }
            self.queue_snapshot(None);
            return Ok(());
        }
        if body.len() > MAX_STRING {
            return Err(CommandError::TooLong { len: body.len() });
        }
        self.apply_command(kind, body)?;
        self.commit(None, |_, seq| super::journal::command(seq, kind, body));
        Ok(())
    }

    /// Applies a command (live and in replay); `Err` changes nothing.
    pub(super) fn apply_command(
        &mut self,
        kind: CommandKind,
        body: &str,
    ) -> Result<(), CommandError> {
        match kind {
            CommandKind::Checkpoint => return Err(CommandError::CheckpointInJournal),
            CommandKind::SetOptimizer => {
                let spec = OptimizerSpec::parse(body)
                    .map_err(|e| CommandError::Optimizer(e.to_string()))?;
                self.updater = Some(spec.build());
                self.optimizer = Some(spec);
            }
            CommandKind::SetCompression => {
                let params = KvCompression::parse(body)
                    .map_err(|e| CommandError::Compression(e.to_string()))?;
                if params.pull && self.mode == Mode::Async {
                    return Err(CommandError::CompressedPullsNeedSync);
                }
                match self.compression {
                    Some(current) if current == params => {}
                    // Pushes compressed with the settings in force may be on their way or
                    // waiting in a round, and the other workers go on compressing with them.
                    Some(current) => {
                        return Err(CommandError::CompressionAlreadySet {
                            current: current.to_string(),
                            asked: params.to_string(),
                        })
                    }
                    None => {
                        // Keys initialized before get their copies: held twice from now on.
                        let copies: u64 = match params.pull {
                            true => self
                                .keys
                                .values()
                                .filter(|k| k.dtype == Dtype::F32)
                                .map(|k| k.value.len() as u64 * 4)
                                .sum(),
                            false => 0,
                        };
                        if self.key_bytes + copies > self.key_limit {
                            return Err(CommandError::KeyBytes {
                                copies,
                                total: self.key_bytes + copies,
                                limit: self.key_limit,
                            });
                        }
                        self.key_bytes += copies;
                        self.compressor = params
                            .params
                            .compressor()
                            .map_err(|e| CommandError::Compression(e.to_string()))?;
                        self.compression = Some(params);
                        // Keys initialized before: their copies start from their values.
                        if self.pull_scheme().is_some() {
                            for k in self.keys.values_mut() {
                                if k.dtype == Dtype::F32 {
                                    k.shadow = Some(Shadow::new(&k.value, 0));
                                }
                            }
                        }
                    }
                }
            }
            CommandKind::SetMode => {
                let mode = match body {
                    "sync" => Mode::Sync,
                    "async" => Mode::Async,
                    other => return Err(CommandError::UnknownMode(other.to_string())),
                };
                if mode == Mode::Async {
                    if self.pull_scheme().is_some() {
                        return Err(CommandError::CompressedPullsNeedSync);
                    }
                    if let Some((key, count)) = self.round_in_progress() {
                        return Err(CommandError::RoundInProgress {
                            key,
                            count,
                            workers: self.num_workers,
                        });
                    }
                }
                self.mode = mode;
            }
        }
        // Only worker 0's commands of these kinds are applied (live, or replayed from the
        // journal): what is in force is worker 0's.
        self.set_by_rank0.insert(kind.code());
        Ok(())
    }
}
