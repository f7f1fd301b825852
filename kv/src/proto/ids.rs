//! Node ids, roles, ranks and groups, numbered as in ps-lite so logs read the same.
//!
//! The scheduler is node 1, server rank r is node `8 + 2r`, worker rank r is node `9 + 2r`.
//! Before the scheduler assigns ranks, a node is known by a provisional id derived from its
//! listening address (unique per listening socket), in a range that never collides with
//! assigned ids.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;

use psnet_transport::NodeId;

/// The scheduler's node id.
pub const SCHEDULER: NodeId = NodeId(1);

/// Provisional ids have this bit set.
const PROVISIONAL: u64 = 1 << 62;

/// A node's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// Bootstraps the job, runs barriers, watches heartbeats.
    Scheduler,
    /// Holds a shard of every key and applies updates.
    Server,
    /// Pushes gradients and pulls weights.
    Worker,
}

impl Role {
    /// Parses `DMLC_ROLE`.
    pub fn parse(text: &str) -> Option<Role> {
        match text.trim().to_ascii_lowercase().as_str() {
            "scheduler" => Some(Role::Scheduler),
            "server" => Some(Role::Server),
            "worker" => Some(Role::Worker),
            _ => None,
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            Role::Scheduler => 0,
            Role::Server => 1,
            Role::Worker => 2,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Role> {
        [Role::Scheduler, Role::Server, Role::Worker]
            .into_iter()
            .find(|r| r.code() == code)
    }

    /// The group bit of this role.
    pub fn group(self) -> Group {
        match self {
            Role::Scheduler => Group::SCHEDULER,
            Role::Server => Group::SERVERS,
            Role::Worker => Group::WORKERS,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Scheduler => "scheduler",
            Role::Server => "server",
            Role::Worker => "worker",
        })
    }
}

/// A set of roles, as ps-lite's group bits (scheduler 1, servers 2, workers 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Group(pub u8);

impl Group {
    /// The scheduler.
    pub const SCHEDULER: Group = Group(1);
    /// All servers.
    pub const SERVERS: Group = Group(2);
    /// All workers.
    pub const WORKERS: Group = Group(4);
    /// Everyone.
    pub const ALL: Group = Group(7);

    /// Whether `role` belongs to the group.
    pub fn contains(self, role: Role) -> bool {
        self.0 & role.group().0 != 0
    }
}

/// The node id of `role` rank `rank`.
pub fn node_id(role: Role, rank: u32) -> NodeId {
    match role {
        Role::Scheduler => SCHEDULER,
        Role::Server => NodeId(8 + 2 * u64::from(rank)),
        Role::Worker => NodeId(9 + 2 * u64::from(rank)),
    }
}

/// The role and rank of an assigned id, or None for provisional and unknown ids.
pub fn role_rank(id: NodeId) -> Option<(Role, u32)> {
    match id.0 {
        1 => Some((Role::Scheduler, 0)),
        n if (8..PROVISIONAL).contains(&n) => {
            let rank = u32::try_from((n - 8) / 2).ok()?;
            Some((
                if n % 2 == 0 {
                    Role::Server
                } else {
                    Role::Worker
                },
                rank,
            ))
        }
        _ => None,
    }
}

/// The provisional id of a node listening at `addr`.
pub fn provisional_id(addr: SocketAddr) -> NodeId {
    let low = match addr {
        SocketAddr::V4(v4) => (u64::from(u32::from(*v4.ip())) << 16) | u64::from(v4.port()),
        SocketAddr::V6(_) => {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            addr.hash(&mut h);
            h.finish() & ((1 << 48) - 1)
        }
    };
    NodeId(PROVISIONAL | low)
}

/// Whether `id` is provisional (a node not yet assigned its rank).
pub fn is_provisional(id: NodeId) -> bool {
    id.0 & PROVISIONAL != 0
}

/// `server 0 (node 8)`-style names for errors and logs.
pub fn describe(id: NodeId) -> String {
    match role_rank(id) {
        Some((Role::Scheduler, _)) => "the scheduler (node 1)".into(),
        Some((role, rank)) => format!("{role} {rank} (node {})", id.0),
        None if is_provisional(id) => format!("an unregistered node ({id})"),
        None => format!("{id}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_follow_ps_lite() {
        assert_eq!(node_id(Role::Server, 0), NodeId(8));
        assert_eq!(node_id(Role::Worker, 0), NodeId(9));
        assert_eq!(node_id(Role::Worker, 3), NodeId(15));
        for rank in 0..100 {
            for role in [Role::Server, Role::Worker] {
                assert_eq!(role_rank(node_id(role, rank)), Some((role, rank)));
            }
        }
        assert_eq!(role_rank(SCHEDULER), Some((Role::Scheduler, 0)));
        assert_eq!(describe(NodeId(11)), "worker 1 (node 11)");
    }

    #[test]
    fn provisional_ids_are_unique_per_address_and_never_assigned() {
        let a = provisional_id("127.0.0.1:5000".parse().unwrap());
        let b = provisional_id("127.0.0.1:5001".parse().unwrap());
        let c = provisional_id("[::1]:5000".parse().unwrap());
        assert!(a != b && is_provisional(a) && is_provisional(b) && is_provisional(c));
        assert_eq!(role_rank(a), None);
        assert!(!is_provisional(node_id(Role::Worker, 1000)));
    }

    #[test]
    fn groups() {
        assert!(Group::ALL.contains(Role::Scheduler));
        assert!(Group::WORKERS.contains(Role::Worker) && !Group::WORKERS.contains(Role::Server));
        assert_eq!(Role::parse(" Worker "), Some(Role::Worker));
        assert_eq!(Role::parse("boss"), None);
    }
}
