//! The server's flight recorder: a record per request taken, ended by its answer (a
//! `dist_sync` push's when its round completes), so a dump shows what a server held when a
//! job stopped.

use std::collections::HashMap;
use std::sync::Arc;

use psnet_recorder::{Op, Recorder, Scope};

use crate::config::KvConfig;
use crate::error::KvError;

/// Requests taken and not answered yet, and their records.
#[derive(Default)]
pub(super) struct Served {
    recorder: Option<Arc<Recorder>>,
    /// (worker rank, request number) -> record.
    open: HashMap<(u32, u64), u64>,
}

impl Served {
    /// Server `rank`'s recorder, as `config` says (`None` inside: off).
    pub(super) fn new(config: &KvConfig, rank: u32) -> Self {
        let scope = Scope::Kv {
            role: "server".into(),
            rank,
        };
        let recorder = Recorder::with(scope, &config.recorder);
        if recorder.is_some() {
            psnet_recorder::install_signal_dump();
        }
        Served {
            recorder,
            open: HashMap::new(),
        }
    }

    /// Worker `worker`'s request `ts` (`what` of `key`) was taken.
    pub(super) fn took(&mut self, worker: u32, ts: u64, what: &'static str, key: u64) {
        let Some(r) = &self.recorder else {
            return;
        };
        let id = r.begin(Op::Served {
            req: ts,
            what,
            key,
            worker,
        });
        r.started(id);
        // A request number seen again (a resend) keeps its first record open.
        self.open.entry((worker, ts)).or_insert(id);
    }

    /// Its answer went out (`failure`: why it failed).
    pub(super) fn answered(&mut self, worker: u32, ts: u64, failure: Option<&str>) {
        let (Some(r), Some(id)) = (&self.recorder, self.open.remove(&(worker, ts))) else {
            return;
        };
        match failure {
            None => r.done(id),
            Some(why) => r.failed(id, why),
        }
    }

    /// The server stops: a failure dumps the recorder, a clean end too if asked.
    pub(super) fn ended(&self, result: &Result<(), KvError>) {
        let Some(r) = &self.recorder else {
            return;
        };
        match result {
            Ok(()) => {
                r.dump_at_end();
            }
            Err(e) => {
                r.dump_on_failure(&format!("the server stopped: {e}"));
            }
        }
    }
}
