//! What a worker does when time passes, and when a server, another node, the scheduler or the
//! connections go: which requests fail, with which reason, and what it tells the others.

use super::*;

impl WorkerState {
    /// What to tell before `event` is handled (and the worker's calls fail): a worker that
    /// lost a server says so (`Leaving`) to the scheduler and the other servers. They may see
    /// this worker's connection close before the server's; with this, they name the server,
    /// not the worker.
    pub fn leaving_before(&self, event: &Received) -> Vec<(NodeId, Msg)> {
        match event {
            Received::Lost { peer, reason } if is_server(*peer) && !self.recovery => {
                self.leaving(*peer, reason)
            }
            _ => Vec::new(),
        }
    }

    /// The `Leaving` messages a worker about to fail because `cause` is gone sends to every
    /// live peer its failure reaches (the scheduler and the servers, `cause` aside); none
    /// while the job ends normally or once `cause` was already known lost.
    pub fn leaving(&self, cause: NodeId, reason: &str) -> Vec<(NodeId, Msg)> {
        if self.shutdown || self.finalizing || self.dead.contains_key(&cause) {
            return Vec::new();
        }
        let msg = Msg::Leaving {
            reason: format!("{} is gone: {reason}", describe(cause)),
        };
        std::iter::once(SCHEDULER)
            .chain(self.servers.iter().copied())
            .filter(|to| *to != cause && !self.dead.contains_key(to))
            .map(|to| (to, msg.clone()))
            .collect()
    }

    /// A message from `from` that could not be read: if it answers a request of this worker
    /// to `from`, that request fails naming it; anything else is logged and dropped.
    pub(super) fn handle_malformed(
        &mut self,
        from: NodeId,
        exchange: Option<Exchange>,
        reason: String,
    ) {
        if let Some(Exchange::Answer(ts)) = exchange {
            if matches!(self.pending.get(&ts), Some(w) if w.to == from) {
                if let Some(w) = self.pending.remove(&ts) {
                    let _ = w.tx.send(Err(KvError::Protocol {
                        node: describe(from),
                        reason: format!("unreadable answer: {reason}"),
                    }));
                }
                return;
            }
        }
        tracing::warn!(from = %describe(from), %reason, "dropping a malformed kv message");
    }

    /// The worker waits for its next message from `now` (`Some`), or got one (`None`): a
    /// wait of [`CAUGHT_UP_WAIT`] or more means it had read everything that reached it.
    pub fn handle_waiting(&mut self, now: Instant, waiting: bool) {
        if let Some(since) = self.waiting_since.take() {
            if now.saturating_duration_since(since) >= CAUGHT_UP_WAIT {
                self.caught_up = self.caught_up.max(now);
            }
        }
        if waiting {
            self.waiting_since = Some(now);
        }
    }

    /// Time passes: a scheduler silent past the heartbeat timeout, as of the last time this
    /// worker had caught up with what reached it, counts as lost. Returns true when that
    /// happened now.
    pub fn handle_timeout(&mut self, now: Instant) -> bool {
        match self.scheduler_silence(now) {
            Some(reason) => {
                self.handle_lost(SCHEDULER, reason);
                true
            }
            None => false,
        }
    }

    /// Why the scheduler counts as lost at `now`, if it does (see [`Self::handle_timeout`]);
    /// the driver tells the servers ([`Self::leaving`]) before it hands the loss over.
    pub fn scheduler_silence(&mut self, now: Instant) -> Option<String> {
        let limit = self.heartbeat_timeout?;
        if self.shutdown || self.dead.contains_key(&SCHEDULER) {
            return None;
        }
        if self
            .waiting_since
            .is_some_and(|since| now.saturating_duration_since(since) >= CAUGHT_UP_WAIT)
        {
            self.caught_up = self.caught_up.max(now);
        }
        let quiet = self
            .caught_up
            .min(now)
            .saturating_duration_since(self.scheduler_heard);
        (quiet > limit).then(|| {
            format!(
                "silent for {:.1} s (PS_HEARTBEAT_TIMEOUT={} s): stopped or cut off",
                quiet.as_secs_f64(),
                limit.as_secs_f64()
            )
        })
    }

    /// This worker's transport closed: nothing more will be answered, barriers included.
    pub fn handle_closed(&mut self) {
        for (_, w) in self.pending.drain() {
            let _ = w.tx.send(Err(KvError::Shutdown));
        }
        self.fail_barrier("this worker's transport is closed".into());
    }

    /// The scheduler declared `node` failed: for a server that was awaited, it did not
    /// rejoin in time, and what waited on it fails now.
    pub(super) fn handle_failed(&mut self, node: NodeId, reason: String) {
        self.recovering.remove(&node);
        if !self.shutdown && !self.dead.contains_key(&node) {
            self.declare_lost(node, reason);
        }
    }

    /// A lost server was restarted and took its id back (the driver has learned its new
    /// address and token and dialled it): every request still waiting on it is answered
    /// [`KvError::Rejoined`], so that its call sends it again. A push says how many of this
    /// worker's pushes of its key the server acknowledged before it (its place in the
    /// key's order), so that one the server applied before it died is not applied twice.
    pub fn handle_rejoined(&mut self, server: NodeId) {
        let lost = self.recovering.remove(&server);
        if self.dead.contains_key(&server) {
            return;
        }
        tracing::warn!(node = %describe(server), lost = lost.as_deref().unwrap_or("-"),
            "server rejoined: sending again what it had not answered");
        let mut waiting: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, w)| w.to == server)
            .map(|(ts, _)| *ts)
            .collect();
        // Sent in request order, so a key's pushes take their places in the order sent.
        waiting.sort_unstable();
        let mut ahead: HashMap<u64, u64> = HashMap::new();
        for ts in waiting {
            let Some(w) = self.pending.remove(&ts) else {
                continue;
            };
            let retry = match w.asked {
                Asked::Push { key, init: false } => {
                    let before = ahead.entry(key).or_default();
                    let place =
                        self.acknowledged.get(&(server, key)).copied().unwrap_or(0) + *before;
                    *before += 1;
                    Some(place)
                }
                Asked::Push { init: true, .. } => Some(0),
                Asked::Pull { .. } | Asked::Other => None,
            };
            let _ = w.tx.send(Err(KvError::Rejoined {
                node: describe(server),
                retry,
            }));
        }
    }

    /// A node is gone (the transport lost it, the scheduler declared it failed, or it left).
    pub fn handle_lost(&mut self, node: NodeId, reason: String) {
        if self.shutdown || self.dead.contains_key(&node) {
            return;
        }
        if self.recovery && is_server(node) && !self.finalizing {
            if let std::collections::btree_map::Entry::Vacant(e) = self.recovering.entry(node) {
                tracing::warn!(node = %describe(node), %reason,
                    "server lost: waiting for it to restart and rejoin (PSNET_RECOVERY_TIMEOUT)");
                e.insert(reason);
            }
            return;
        }
        self.declare_lost(node, reason);
    }

    /// `node` is gone for good: what waits on it fails (everything, for a server or the
    /// scheduler).
    pub(super) fn declare_lost(&mut self, node: NodeId, reason: String) {
        if self.finalizing && node != SCHEDULER {
            tracing::debug!(node = %describe(node), %reason, "peer closed while the job ends");
        } else {
            tracing::warn!(node = %describe(node), %reason, "node lost");
        }
        self.dead.insert(node, reason.clone());
        // A lost server takes its shard with it: the keys with a part there, and the
        // dist_sync rounds that other workers (failing on it too) will never finish, cannot
        // complete on any server; without the scheduler the job cannot end. So every request
        // fails now rather than wait forever.
        self.fail_pending_to(node, &reason, is_fatal(node));
        if is_fatal(node) {
            // Nor can a barrier the other workers may never reach.
            self.fail_barrier(format!("{} is gone: {reason}", describe(node)));
        }
    }

    /// Fails every request waiting on `node` (every request at all when `all`).
    pub(super) fn fail_pending_to(&mut self, node: NodeId, reason: &str, all: bool) {
        let ts: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, w)| all || w.to == node)
            .map(|(ts, _)| *ts)
            .collect();
        for ts in ts {
            if let Some(w) = self.pending.remove(&ts) {
                let _ = w.tx.send(Err(KvError::NodeLost {
                    node: describe(node),
                    reason: reason.to_string(),
                }));
            }
        }
    }

    pub(super) fn fail_barrier(&mut self, reason: String) {
        if let Some((_, tx)) = self.barrier.take() {
            let _ = tx.send(Err(KvError::Barrier(reason)));
        }
    }
}
