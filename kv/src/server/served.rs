//! The server's flight recorder: a record per request taken, ended by its answer (a
//! `dist_sync` push's when its round completes), so a dump shows what a server held when a
//! job stopped.

use std::sync::Arc;

use psnet_recorder::{Op, Recorder, Scope};

use crate::config::KvConfig;
use crate::error::KvError;

/// Requests taken and not answered yet, and their records.
#[derive(Default)]
pub(super) struct Served {
    recorder: Option<Arc<Recorder>>,
    /// (worker rank, request number, record): few at a time (each worker's requests in
    /// flight), so a list scanned costs less than a hash map's hashing.
    open: Vec<(u32, u64, u64)>,
}

impl Served {
    /// Server `rank`'s recorder, as `config` says (`None` inside: off).
    pub(super) fn new(config: &KvConfig, rank: u32, job: crate::checkpoint::JobId) -> Self {
        let scope = Scope::Kv {
            role: "server".into(),
            rank,
            job: job.to_string(),
        };
        let recorder = Recorder::with(scope, &config.recorder);
        if recorder.is_some() {
            psnet_recorder::install_signal_dump();
        }
        Served {
            recorder,
            open: Vec::new(),
        }
    }

    /// Worker `worker`'s request `ts` (`what` of `key`) was taken.
    pub(super) fn took(&mut self, worker: u32, ts: u64, what: &'static str, key: u64) {
        let Some(r) = &self.recorder else {
            return;
        };
        // A request number seen again (a resend) keeps its first record open.
        if self.open.iter().any(|&(w, t, _)| w == worker && t == ts) {
            return;
        }
        let id = r.start(Op::Served {
            req: ts,
            what,
            key,
            worker,
        });
        self.open.push((worker, ts, id));
    }

    /// A connection event (`what`: "connected", "lost") of node `peer`.
    pub(super) fn event(&self, what: &'static str, peer: psnet_transport::NodeId) {
        if let Some(r) = &self.recorder {
            r.event(Op::Event { what, peer: peer.0 });
        }
    }

    /// Its answer went out (`failure`: why it failed).
    pub(super) fn answered(&mut self, worker: u32, ts: u64, failure: Option<&str>) {
        let Some(r) = &self.recorder else {
            return;
        };
        let Some(i) = self
            .open
            .iter()
            .position(|&(w, t, _)| w == worker && t == ts)
        else {
            return;
        };
        let (_, _, id) = self.open.swap_remove(i);
        r.finish(id, &[], failure);
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
