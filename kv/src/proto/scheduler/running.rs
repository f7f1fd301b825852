//! The scheduler once the job runs: signs of life and silence, barriers, lost nodes and their
//! recoveries, and the end of the job.

use super::*;

impl SchedulerState {
    /// Any message from an assigned node counts as a sign of life (and a server that took
    /// its id back and now connects under it is announced to the workers, which dial it).
    pub fn handle_alive(&mut self, from: NodeId, now: Instant) {
        if let Some(m) = self.members.get_mut(&from) {
            m.last_seen = now;
        }
        if let Some(info) = self.rejoining.remove(&from) {
            let node = info;
            for to in self.alive() {
                if matches!(ids::role_rank(to), Some((Role::Worker, _))) {
                    self.out
                        .push_back((to, Msg::Rejoined { node: node.clone() }));
                }
            }
        }
    }

    /// A heartbeat: a sign of life, answered so that the node can tell a stopped scheduler
    /// from a quiet one.
    pub fn handle_heartbeat(&mut self, from: NodeId, now: Instant) {
        if self.members.contains_key(&from) && !self.dead.contains_key(&from) {
            self.handle_alive(from, now);
            self.out.push_back((from, Msg::Heartbeat));
        }
    }

    /// A node enters a barrier of `group`.
    pub fn handle_barrier(&mut self, from: NodeId, group: Group, now: Instant) {
        self.handle_alive(from, now);
        let Some(role) = self.members.get(&from).map(|m| m.info.role) else {
            return;
        };
        if !group.contains(role) {
            let reason = format!(
                "{} entered a barrier of a group it is not in",
                describe(from)
            );
            self.out
                .push_back((from, Msg::BarrierFailed { group, reason }));
            return;
        }
        self.barriers.entry(group.0).or_default().insert(from);
        self.check_barrier(group);
    }

    /// Assigned nodes not known dead (nor lost and awaited).
    pub(super) fn alive(&self) -> Vec<NodeId> {
        self.members
            .keys()
            .copied()
            .filter(|m| !self.dead.contains_key(m) && !self.recovering.contains_key(m))
            .collect()
    }

    pub(super) fn group_members(&self, group: Group) -> Vec<NodeId> {
        self.members
            .values()
            .filter(|m| group.contains(m.info.role))
            .map(|m| m.info.id)
            .collect()
    }

    pub(super) fn check_barrier(&mut self, group: Group) {
        let Some(entered) = self.barriers.get(&group.0) else {
            return;
        };
        let members = self.group_members(group);
        if let Some((id, why)) = members
            .iter()
            .find_map(|id| self.dead.get(id).map(|why| (*id, why.clone())))
        {
            let reason = format!("barrier cannot complete: {} is gone: {why}", describe(id));
            let waiting: Vec<NodeId> = entered.iter().copied().collect();
            self.barriers.remove(&group.0);
            for to in waiting {
                self.out.push_back((
                    to,
                    Msg::BarrierFailed {
                        group,
                        reason: reason.clone(),
                    },
                ));
            }
            return;
        }
        tracing::debug!(
            group = group.0,
            entered = entered.len(),
            members = members.len(),
            "barrier"
        );
        if members.iter().all(|id| entered.contains(id)) {
            self.barriers.remove(&group.0);
            for to in members {
                self.out.push_back((to, Msg::BarrierDone { group }));
            }
        }
    }

    /// A member says why it is about to leave (a worker that lost a server): when its
    /// connection ends, that is the reason reported, so the node that failed first is named
    /// even if this one's connection is seen to close before it.
    pub fn handle_leaving(&mut self, from: NodeId, reason: String) {
        if self.members.contains_key(&from) && !self.dead.contains_key(&from) {
            self.leaving.insert(from, reason);
        }
    }

    /// A node's connection ended or it stopped answering.
    pub fn handle_lost(&mut self, id: NodeId, reason: &str) {
        if self.shutting_down || ids::is_provisional(id) || self.dead.contains_key(&id) {
            return;
        }
        if !self.members.contains_key(&id)
            || self.finalized.contains(&id)
            || self.recovering.contains_key(&id)
        {
            return;
        }
        let why = self.leaving.remove(&id).map(|w| format!("it left: {w}"));
        let reason = why.as_deref().unwrap_or(reason);
        let server = matches!(ids::role_rank(id), Some((Role::Server, _)));
        // A server that said why it stops (it cannot write its checkpoint, or cannot reload
        // it to rejoin) will not be back: the job ends now, with its reason.
        if let (Some(timeout), true, None) = (self.recovery, server, &why) {
            tracing::warn!(node = %describe(id), %reason, timeout_s = timeout.as_secs_f64(),
                "server lost: holding its rank for it to restart (PSNET_RECOVERY_TIMEOUT)");
            self.rejoining.remove(&id);
            self.recovering.insert(id, (reason.to_string(), None));
            return;
        }
        self.declare_dead(id, reason);
    }

    /// Tells every live member that `id` failed, and fails what cannot complete without it.
    pub(super) fn declare_dead(&mut self, id: NodeId, reason: &str) {
        tracing::warn!(node = %describe(id), %reason, "node lost");
        self.dead.insert(id, reason.to_string());
        for to in self.alive() {
            self.out.push_back((
                to,
                Msg::NodeFailed {
                    id,
                    reason: reason.to_string(),
                },
            ));
        }
        let groups: Vec<u8> = self.barriers.keys().copied().collect();
        for g in groups {
            self.check_barrier(Group(g));
        }
        self.check_finished();
    }

    /// Time passes: nodes silent for longer than the heartbeat timeout are declared dead.
    ///
    /// If the scheduler itself did not run for half the timeout (it was stopped, or its
    /// machine stalled), the nodes' silence is its own: their clocks restart instead, so that
    /// a scheduler resumed after a SIGSTOP does not declare a whole healthy job dead.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.expire_recoveries(now);
        let Some(limit) = self.heartbeat_timeout else {
            return;
        };
        let stalled = self
            .last_tick
            .map(|t| now.saturating_duration_since(t))
            .filter(|gap| *gap > limit / 2);
        self.last_tick = Some(now);
        if let Some(gap) = stalled {
            tracing::warn!(
                gap_s = gap.as_secs_f64(),
                "the scheduler did not run for a while: restarting the nodes' heartbeat clocks"
            );
            for m in self.members.values_mut() {
                m.last_seen = now;
            }
            return;
        }
        let silent: Vec<(NodeId, Duration)> = self
            .members
            .values()
            .filter(|m| {
                let id = &m.info.id;
                !self.dead.contains_key(id)
                    && !self.finalized.contains(id)
                    && !self.recovering.contains_key(id)
            })
            .filter_map(|m| {
                let quiet = now.saturating_duration_since(m.last_seen);
                (quiet > limit).then_some((m.info.id, quiet))
            })
            .collect();
        for (id, quiet) in silent {
            self.handle_lost(
                id,
                &format!(
                    "no heartbeat for {:.1} s (PS_HEARTBEAT_TIMEOUT={} s)",
                    quiet.as_secs_f64(),
                    limit.as_secs()
                ),
            );
        }
    }

    /// Lost servers not back within the recovery timeout are declared failed.
    pub(super) fn expire_recoveries(&mut self, now: Instant) {
        let Some(timeout) = self.recovery else {
            return;
        };
        let mut expired = Vec::new();
        for (id, (reason, deadline)) in self.recovering.iter_mut() {
            match deadline {
                None => *deadline = Some(now + timeout),
                Some(d) if now >= *d => expired.push((*id, reason.clone())),
                Some(_) => {}
            }
        }
        for (id, reason) in expired {
            self.recovering.remove(&id);
            let reason = format!(
                "{reason}; not restarted within PSNET_RECOVERY_TIMEOUT={} s",
                timeout.as_secs_f64()
            );
            tracing::warn!(node = %describe(id), %reason, "lost server did not rejoin");
            self.declare_dead(id, &reason);
        }
    }

    /// A worker is done.
    pub fn handle_finalize(&mut self, from: NodeId, now: Instant) {
        self.handle_alive(from, now);
        let member = self.members.get(&from).map(|m| m.info.role);
        if member == Some(Role::Worker) {
            self.finalized.insert(from);
            self.check_finished();
        }
    }

    pub(super) fn check_finished(&mut self) {
        if self.shutting_down || !self.is_assigned() {
            return;
        }
        let workers_done = self
            .group_members(Group::WORKERS)
            .iter()
            .all(|w| self.finalized.contains(w) || self.dead.contains_key(w));
        if workers_done {
            self.shutting_down = true;
            for to in self.alive() {
                self.out.push_back((to, Msg::Shutdown));
            }
        }
    }
}
