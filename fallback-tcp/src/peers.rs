//! The table of peers: at most one connection per peer, and the rule that settles two nodes
//! dialling each other at the same time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use psnet_transport::NodeId;
use tokio::sync::Notify;

use crate::conn::Conn;

/// What the table holds for one peer.
pub(crate) enum Slot {
    /// A connection is being set up (by our dial or an accepted hello); the token tells whose.
    Pending(u64),
    /// The live connection.
    Connected(Arc<Conn>),
}

/// What to do with a hello from `remote`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum HelloDecision {
    /// Take the connection.
    Accept,
    /// Refuse it, telling the dialler why.
    Reject(&'static str),
}

/// The tie-break for an incoming hello, given what we hold for that peer.
///
/// When both nodes dial each other, the connection dialled by the smaller id survives: the
/// smaller node refuses the larger one's hello while its own dial is pending, and the larger
/// node accepts the smaller one's. A hello while we hold a live connection means the peer lost
/// it and came back, so the new connection replaces the old.
pub(crate) fn decide_hello(local: NodeId, remote: NodeId, dialing: bool) -> HelloDecision {
    if local == remote {
        HelloDecision::Reject("duplicate node id")
    } else if dialing && local < remote {
        HelloDecision::Reject("simultaneous connect: the smaller node id's connection wins")
    } else {
        HelloDecision::Accept
    }
}

#[derive(Default)]
pub(crate) struct Peers {
    slots: Mutex<HashMap<NodeId, Slot>>,
    /// Notified whenever a slot changes, for `connect` calls waiting on another's setup.
    pub(crate) changed: Notify,
    next_token: AtomicU64,
}

impl Peers {
    pub(crate) fn lock(&self) -> MutexGuard<'_, HashMap<NodeId, Slot>> {
        // A panic while holding this lock cannot leave the map inconsistent (single inserts and
        // removals), so a poisoned lock is still usable.
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn token(&self) -> u64 {
        self.next_token.fetch_add(1, Ordering::Relaxed)
    }

    /// The live connection to `peer`.
    pub(crate) fn get(&self, peer: NodeId) -> Option<Arc<Conn>> {
        match self.lock().get(&peer) {
            Some(Slot::Connected(c)) => Some(c.clone()),
            _ => None,
        }
    }

    /// Removes the pending marker `token` if it is still there.
    pub(crate) fn clear_pending(&self, peer: NodeId, token: u64) {
        let mut slots = self.lock();
        if matches!(slots.get(&peer), Some(Slot::Pending(t)) if *t == token) {
            slots.remove(&peer);
            drop(slots);
            self.changed.notify_waiters();
        }
    }

    /// Installs `conn` if the pending marker `token` is still in place.
    pub(crate) fn install(&self, peer: NodeId, token: u64, conn: Arc<Conn>) -> bool {
        let mut slots = self.lock();
        let ours = matches!(slots.get(&peer), Some(Slot::Pending(t)) if *t == token);
        if ours {
            slots.insert(peer, Slot::Connected(conn));
        }
        drop(slots);
        self.changed.notify_waiters();
        ours
    }

    /// Removes `conn` if it is still the installed connection; true if it was.
    pub(crate) fn remove_conn(&self, conn: &Arc<Conn>) -> bool {
        let mut slots = self.lock();
        let current =
            matches!(slots.get(&conn.peer), Some(Slot::Connected(c)) if Arc::ptr_eq(c, conn));
        if current {
            slots.remove(&conn.peer);
        }
        drop(slots);
        self.changed.notify_waiters();
        current
    }

    /// The connected peers, sorted.
    pub(crate) fn connected(&self) -> Vec<NodeId> {
        let mut ids: Vec<NodeId> = self
            .lock()
            .iter()
            .filter_map(|(id, s)| matches!(s, Slot::Connected(_)).then_some(*id))
            .collect();
        ids.sort();
        ids
    }

    /// Empties the table, returning every connection.
    pub(crate) fn drain(&self) -> Vec<Arc<Conn>> {
        let conns = self
            .lock()
            .drain()
            .filter_map(|(_, s)| match s {
                Slot::Connected(c) => Some(c),
                Slot::Pending(_) => None,
            })
            .collect();
        self.changed.notify_waiters();
        conns
    }
}

/// Removes a pending marker when a `connect` or handshake is abandoned half-way.
pub(crate) struct PendingGuard<'a> {
    pub(crate) peers: &'a Peers,
    pub(crate) peer: NodeId,
    pub(crate) token: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.peers.clear_pending(self.peer, self.token);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smaller_id_wins_simultaneous_connect() {
        let (small, big) = (NodeId(3), NodeId(9));
        // The smaller node refuses the bigger one's hello while dialling...
        assert!(matches!(
            decide_hello(small, big, true),
            HelloDecision::Reject(_)
        ));
        // ...and the bigger node accepts the smaller one's, so exactly one survives.
        assert_eq!(decide_hello(big, small, true), HelloDecision::Accept);
    }

    #[test]
    fn accepts_when_idle_or_reconnecting_and_rejects_duplicates() {
        assert_eq!(
            decide_hello(NodeId(1), NodeId(2), false),
            HelloDecision::Accept
        );
        assert_eq!(
            decide_hello(NodeId(2), NodeId(1), false),
            HelloDecision::Accept
        );
        assert!(matches!(
            decide_hello(NodeId(5), NodeId(5), false),
            HelloDecision::Reject("duplicate node id")
        ));
    }
}
