//! The scheduler's state: registration and rank assignment, barriers, liveness, shutdown.
//! No I/O and no clock: events come in through `handle_*` (with `now`), messages to send come
//! out of [`SchedulerState::poll_transmit`].
//!
//! Ranks follow ps-lite's rule, so a job with fixed ports gets the same ranks every time:
//! within each role, nodes are ordered by listening address (IP, then port) and numbered from
//! 0 in that order. Launch order does not matter. One exception: when every node of a role
//! wishes a rank (`DMLC_WORKER_ID` / `DMLC_SERVER_ID`, which psnet-launch sets) and the wishes
//! are a permutation of the role's ranks, they are granted, so that the launcher's
//! `[worker 1]` is the kv store's worker 1.
//!
//! With a recovery timeout ([`SchedulerState::with_recovery`], `PSNET_RECOVERY_TIMEOUT`), a
//! lost server is not declared failed at once: its rank is held for the timeout, and a
//! server that registers meanwhile showing the lost server's recovery credential (from its
//! checkpoint directory, see [`super::recovery`]) takes the lost one's id back with the new
//! identity it drew (`Reassign`); every other member learns its new address and the public
//! half of that identity (`Rejoined`).
//! Any other server's registration is refused and logged. Past the timeout the loss is
//! declared as any other. Workers are not recovered: a lost worker ends the job.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use psnet_transport::{NodeId, PublicIdentity};

use super::ids::{self, describe, Group, Role, SCHEDULER};
use super::msg::{Msg, NodeInfo, NO_REQUEST};
use super::recovery::{Credentials, CREDENTIAL_LEN};

mod running;

/// What a node says of itself when it registers ([`Msg::Register`]'s fields).
#[derive(Clone, Debug)]
pub struct Registration {
    /// Its role.
    pub role: Role,
    /// Where it listens.
    pub addr: SocketAddr,
    /// The rank it wishes.
    pub rank_hint: Option<u32>,
    /// A restarted server's recovery credential.
    pub recovery: Option<[u8; CREDENTIAL_LEN]>,
    /// The public half of the identity it drew.
    pub identity: PublicIdentity,
}

/// What the scheduler knows about one assigned node.
#[derive(Debug)]
struct Member {
    info: NodeInfo,
    last_seen: Instant,
}

/// The scheduler of one job.
pub struct SchedulerState {
    num_servers: u32,
    num_workers: u32,
    heartbeat_timeout: Option<Duration>,
    /// Registrations before assignment: provisional id, role, address, wished rank, public
    /// identity.
    pending: Vec<(NodeId, Role, SocketAddr, Option<u32>, PublicIdentity)>,
    members: BTreeMap<NodeId, Member>,
    barriers: BTreeMap<u8, BTreeSet<NodeId>>,
    dead: BTreeMap<NodeId, String>,
    /// Why members said they are leaving (a worker failing on a lost server): their
    /// connection's end is then not the cause, and the scheduler's report says what was.
    leaving: BTreeMap<NodeId, String>,
    finalized: BTreeSet<NodeId>,
    shutting_down: bool,
    out: VecDeque<(NodeId, Msg)>,
    scheduler_addr: SocketAddr,
    /// The public half of the scheduler's own identity (the nodes draw theirs).
    identity: PublicIdentity,
    /// When time last passed here ([`Self::handle_timeout`]).
    last_tick: Option<Instant>,
    /// How long a lost server's rank is held for it to rejoin (None: not at all).
    recovery: Option<Duration>,
    /// Lost servers whose rank is held: why each was lost, and until when (set at the
    /// first tick after the loss).
    recovering: BTreeMap<NodeId, (String, Option<Instant>)>,
    /// Servers that took their id back, announced to the workers once they connect under it
    /// (before that, a worker dialling the new address would find a node without the id).
    rejoining: BTreeMap<NodeId, NodeInfo>,
    /// The servers' commitments to their recovery credentials.
    credentials: Credentials,
}

impl SchedulerState {
    /// A scheduler expecting `num_servers` and `num_workers`, listening at `addr`.
    /// `heartbeat_timeout`: a node silent for longer is declared dead (None: never).
    /// `identity` is the public half of the one the scheduler proves its id with.
    pub fn new(
        num_servers: u32,
        num_workers: u32,
        addr: SocketAddr,
        heartbeat_timeout: Option<Duration>,
        identity: PublicIdentity,
    ) -> Self {
        SchedulerState {
            identity,
            last_tick: None,
            num_servers,
            num_workers,
            heartbeat_timeout,
            pending: Vec::new(),
            members: BTreeMap::new(),
            barriers: BTreeMap::new(),
            dead: BTreeMap::new(),
            leaving: BTreeMap::new(),
            finalized: BTreeSet::new(),
            shutting_down: false,
            out: VecDeque::new(),
            scheduler_addr: addr,
            recovery: None,
            recovering: BTreeMap::new(),
            rejoining: BTreeMap::new(),
            credentials: Credentials::default(),
        }
    }

    /// Holds a lost server's rank for `timeout` (`PSNET_RECOVERY_TIMEOUT`) so that a
    /// restarted server can take it back (None: a lost server fails the job at once).
    pub fn with_recovery(mut self, timeout: Option<Duration>) -> Self {
        self.recovery = timeout;
        self
    }

    /// Whether a node without an id may register now: before every node is assigned, and
    /// afterwards while a lost server's rank is held for it.
    pub fn takes_registrations(&self) -> bool {
        !self.is_assigned() || !self.recovering.is_empty()
    }

    /// Lost servers whose rank is held for them to rejoin.
    pub fn recovering(&self) -> Vec<NodeId> {
        self.recovering.keys().copied().collect()
    }

    /// The public half of the scheduler's own identity.
    pub fn identity(&self) -> PublicIdentity {
        self.identity
    }

    /// The next message to send.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<(NodeId, Msg)> {
        self.out.pop_front()
    }

    /// Whether every node has been assigned.
    pub fn is_assigned(&self) -> bool {
        !self.members.is_empty()
    }

    /// Whether the job is over (shutdown sent).
    pub fn is_finished(&self) -> bool {
        self.shutting_down
    }

    /// The nodes that died, with what was seen.
    pub fn dead(&self) -> &BTreeMap<NodeId, String> {
        &self.dead
    }

    /// How many of each role have registered so far (for a bootstrap timeout message).
    pub fn registered(&self) -> (u32, u32) {
        let count = |role| self.pending.iter().filter(|p| p.1 == role).count() as u32;
        if self.is_assigned() {
            (self.num_servers, self.num_workers)
        } else {
            (count(Role::Server), count(Role::Worker))
        }
    }

    /// A server assigned its id committed to its recovery credential. Taken only from a
    /// server member under its own id; anything else is refused and logged.
    pub fn handle_recovery_key(&mut self, from: NodeId, commit: [u8; CREDENTIAL_LEN]) {
        let is_server = matches!(ids::role_rank(from), Some((Role::Server, _)));
        if !is_server || !self.members.contains_key(&from) {
            tracing::warn!(node = %describe(from), "refused: only a server of the job commits to a recovery credential, for its own rank");
            return;
        }
        self.credentials.commit(from, commit);
    }

    /// A node (under its provisional id) registers ([`Msg::Register`]).
    pub fn handle_register(&mut self, from: NodeId, reg: Registration, now: Instant) {
        let Registration {
            role,
            addr,
            rank_hint,
            recovery,
            identity,
        } = reg;
        if self.members.contains_key(&from) {
            // A member has its id (and its identity): nothing to register, nothing changes.
            let reason = format!(
                "{} is already registered: a node registers once",
                describe(from)
            );
            tracing::warn!(node = %describe(from), %role, %addr, "refusing a second registration");
            self.out
                .push_back((from, Msg::NodeFailed { id: from, reason }));
            return;
        }
        if self.is_assigned() && role == Role::Server && ids::is_provisional(from) {
            return self.handle_rejoin(from, addr, rank_hint, recovery.as_ref(), identity, now);
        }
        let limit = match role {
            Role::Server => self.num_servers,
            Role::Worker => self.num_workers,
            Role::Scheduler => 0,
        };
        let have = self.pending.iter().filter(|p| p.1 == role).count() as u32;
        if self.is_assigned() || have >= limit || self.pending.iter().any(|p| p.0 == from) {
            let reason = if role == Role::Scheduler {
                "a second scheduler registered with this scheduler".to_string()
            } else if self.pending.iter().any(|p| p.0 == from) {
                format!("{role} at {addr} registered twice")
            } else {
                format!(
                    "the job already has its {limit} {role}(s) (DMLC_NUM_SERVER={}, DMLC_NUM_WORKER={})",
                    self.num_servers, self.num_workers
                )
            };
            self.out
                .push_back((from, Msg::NodeFailed { id: from, reason }));
            return;
        }
        self.pending.push((from, role, addr, rank_hint, identity));
        if self.pending.len() as u32 == self.num_servers + self.num_workers {
            self.assign(now);
        }
    }

    /// A message from `from` that could not be read (`reason`): the sender is told, so that
    /// it does not wait on it. A node still registering is refused (its registration is all
    /// it may send); a member gets a `Failed` for [`NO_REQUEST`], the scheduler's messages
    /// having no request ids. Strangers cannot connect at all.
    pub fn handle_malformed(&mut self, from: NodeId, reason: &str) {
        tracing::warn!(from = %describe(from), %reason, "could not read a kv message");
        if ids::is_provisional(from) && !self.is_assigned() {
            let reason = format!("the scheduler could not read the registration: {reason}");
            self.out
                .push_back((from, Msg::NodeFailed { id: from, reason }));
        } else if self.members.contains_key(&from) {
            let reason = format!("the scheduler could not read a message of this node: {reason}");
            self.out.push_back((
                from,
                Msg::Failed {
                    ts: NO_REQUEST,
                    reason,
                },
            ));
        }
    }

    fn assign(&mut self, now: Instant) {
        let mut pending = std::mem::take(&mut self.pending);
        // ps-lite's order: by address (IP, then port), per role; then a role's wished ranks
        // where they are a permutation of its ranks.
        pending.sort_by_key(|p| (p.1, p.2.ip(), p.2.port()));
        for role in [Role::Server, Role::Worker] {
            let wishes: Vec<Option<u32>> = pending
                .iter()
                .filter(|p| p.1 == role)
                .map(|p| p.3)
                .collect();
            let mut granted: Vec<u32> = wishes.iter().flatten().copied().collect();
            granted.sort_unstable();
            let permutation = granted.len() == wishes.len()
                && granted.iter().enumerate().all(|(i, &r)| r as usize == i);
            if permutation {
                pending.sort_by_key(|p| (p.1, if p.1 == role { p.3 } else { None }));
            } else if wishes.iter().any(Option::is_some) {
                tracing::info!(
                    "{role} ranks follow listening addresses: the wished ranks \
                     (DMLC_WORKER_ID / DMLC_SERVER_ID) are not each of 0..{} once",
                    wishes.len()
                );
            }
        }
        let mut nodes = vec![self.own_info()];
        let mut provisional = Vec::new();
        for role in [Role::Server, Role::Worker] {
            for (rank, (prov, _, addr, _, identity)) in
                pending.iter().filter(|p| p.1 == role).enumerate()
            {
                let info = NodeInfo {
                    id: ids::node_id(role, rank as u32),
                    role,
                    rank: rank as u32,
                    addr: *addr,
                    identity: *identity,
                };
                provisional.push((*prov, info.id));
                nodes.push(info);
            }
        }
        for info in &nodes[1..] {
            self.members.insert(
                info.id,
                Member {
                    info: info.clone(),
                    last_seen: now,
                },
            );
        }
        for (prov, id) in provisional {
            self.out.push_back((
                prov,
                Msg::Assign {
                    your_id: id,
                    nodes: nodes.clone(),
                },
            ));
        }
    }

    /// A server registers while the job runs: it takes back the id of a lost server whose
    /// rank is held (the one it wishes, or any), with the new identity it drew, if its
    /// recovery credential is the one that server committed to.
    fn handle_rejoin(
        &mut self,
        from: NodeId,
        addr: SocketAddr,
        hint: Option<u32>,
        credential: Option<&[u8; CREDENTIAL_LEN]>,
        identity: PublicIdentity,
        now: Instant,
    ) {
        let wished = hint.map(|rank| ids::node_id(Role::Server, rank));
        let held = match wished {
            Some(id) => Some(id).filter(|id| self.recovering.contains_key(id)),
            None => self.recovering.keys().next().copied(),
        };
        let refuse = |s: &mut Self, reason: String| {
            tracing::warn!(%addr, %reason, "refusing a server's registration");
            s.out
                .push_back((from, Msg::NodeFailed { id: from, reason }));
        };
        let Some(_) = held.filter(|_| !self.shutting_down) else {
            let waiting: Vec<String> = self.recovering.keys().map(|id| describe(*id)).collect();
            let reason = match (self.recovery, waiting.is_empty(), hint) {
                (None, _, _) => format!(
                    "the job already has its {} server(s), and lost servers are not replaced \
                     (PSNET_RECOVERY_TIMEOUT is 0)",
                    self.num_servers
                ),
                (Some(_), true, _) => format!(
                    "the job already has its {} server(s) and none is lost: a server may \
                     rejoin only in place of a lost one",
                    self.num_servers
                ),
                (Some(_), false, Some(rank)) => format!(
                    "server {rank} (DMLC_SERVER_ID) is not lost; the job waits for {}",
                    waiting.join(", ")
                ),
                (Some(_), false, None) => "the job is ending".into(),
            };
            return refuse(self, reason);
        };
        let held: Vec<NodeId> = self.recovering.keys().copied().collect();
        let id = match self.credentials.take(held, wished, credential) {
            Ok(id) => id,
            Err(why) => {
                let reason = format!(
                    "a server at {addr} asked for the rank of a lost server and was refused: {why}"
                );
                return refuse(self, reason);
            }
        };
        let (lost, _) = self.recovering.remove(&id).expect("held");
        let Some(member) = self.members.get_mut(&id) else {
            return;
        };
        member.info.addr = addr;
        member.info.identity = identity;
        member.last_seen = now;
        let info = member.info.clone();
        tracing::warn!(node = %describe(id), %addr, %lost, "a restarted server took its rank back");
        let nodes = self.member_infos();
        self.out
            .push_back((from, Msg::Reassign { your_id: id, nodes }));
        self.rejoining.insert(id, info);
    }

    /// Every node, the scheduler first, with their public identities.
    pub fn member_infos(&self) -> Vec<NodeInfo> {
        let mut nodes = vec![self.own_info()];
        nodes.extend(self.members.values().map(|m| m.info.clone()));
        nodes
    }

    /// The scheduler as the nodes' lists name it.
    fn own_info(&self) -> NodeInfo {
        NodeInfo {
            id: SCHEDULER,
            role: Role::Scheduler,
            rank: 0,
            addr: self.scheduler_addr,
            identity: self.identity,
        }
    }
}

#[cfg(test)]
mod tests;
