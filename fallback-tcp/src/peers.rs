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
    /// Our dial to the peer is under way; the token tells whose.
    Dialing(u64),
    /// A hello from the peer is being answered; the token tells whose.
    Accepting(u64),
    /// The live connection.
    Connected(Arc<Conn>),
}

impl Slot {
    /// What a hello from this peer finds.
    pub(crate) fn existing(slot: Option<&Slot>) -> Existing {
        match slot {
            None => Existing::Nothing,
            Some(Slot::Dialing(_)) => Existing::Dialing,
            Some(Slot::Accepting(_)) => Existing::Accepting,
            Some(Slot::Connected(c)) if c.is_broken() => Existing::Nothing,
            Some(Slot::Connected(c)) if c.dialed_by_us => Existing::Ours,
            Some(Slot::Connected(_)) => Existing::Theirs,
        }
    }

    fn token(&self) -> Option<u64> {
        match self {
            Slot::Dialing(t) | Slot::Accepting(t) => Some(*t),
            Slot::Connected(_) => None,
        }
    }
}

/// What we hold for a peer when its hello arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Existing {
    /// Nothing (or a connection already known to be broken).
    Nothing,
    /// Our own dial is under way.
    Dialing,
    /// Another hello from it is being answered.
    Accepting,
    /// A live connection we dialled.
    Ours,
    /// A live connection it dialled.
    Theirs,
}

/// The reason given when the other side's connection wins; the dialler then waits for it.
pub(crate) const SIMULTANEOUS: &str = "simultaneous connect: the smaller node id's connection wins";

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
/// The acceptor decides, and a dialler that gets an acknowledgement installs that connection.
/// When both nodes dial each other, the connection dialled by the smaller id survives,
/// whether the smaller node's dial is still under way or already done: the smaller node
/// refuses the larger one's hello, the larger node accepts the smaller one's. A hello from a
/// peer whose own earlier connection we hold means it gave that one up (it only dials when it
/// has none), so the new connection replaces the old.
pub(crate) fn decide_hello(local: NodeId, remote: NodeId, existing: Existing) -> HelloDecision {
    if local == remote {
        return HelloDecision::Reject("duplicate node id");
    }
    match existing {
        Existing::Nothing | Existing::Theirs => HelloDecision::Accept,
        Existing::Accepting => {
            HelloDecision::Reject("another connection from this node is being set up")
        }
        Existing::Dialing | Existing::Ours if local < remote => HelloDecision::Reject(SIMULTANEOUS),
        Existing::Dialing | Existing::Ours => HelloDecision::Accept,
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

    /// The live connection to `peer`, waiting (at most `limit`) while one is being set up. An
    /// acceptor installs its connection just after it acknowledged the hello, so the dialler
    /// may send over it while this side is a moment behind (on a loaded host, long enough for
    /// a send from here to find no connection yet).
    pub(crate) async fn settled(
        &self,
        peer: NodeId,
        limit: std::time::Duration,
    ) -> Option<Arc<Conn>> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            match self.lock().get(&peer) {
                Some(Slot::Connected(c)) => return Some(c.clone()),
                Some(Slot::Dialing(_) | Slot::Accepting(_)) => {}
                None => return None,
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return None;
            }
        }
    }

    /// Removes the pending marker `token` if it is still there.
    pub(crate) fn clear_pending(&self, peer: NodeId, token: u64) {
        let mut slots = self.lock();
        if slots.get(&peer).and_then(Slot::token) == Some(token) {
            slots.remove(&peer);
            drop(slots);
            self.changed.notify_waiters();
        }
    }

    /// Installs an accepted `conn` if the marker `token` is still in place.
    pub(crate) fn install_accepted(&self, peer: NodeId, token: u64, conn: Arc<Conn>) -> bool {
        let mut slots = self.lock();
        let ours = slots.get(&peer).and_then(Slot::token) == Some(token);
        if ours {
            slots.insert(peer, Slot::Connected(conn));
        }
        drop(slots);
        self.changed.notify_waiters();
        ours
    }

    /// Installs a dialled `conn` the peer acknowledged: the acceptor has made it the
    /// connection, so it replaces whatever is here (closing a replaced connection).
    pub(crate) fn install_dialled(&self, peer: NodeId, conn: Arc<Conn>) {
        let old = self.lock().insert(peer, Slot::Connected(conn));
        if let Some(Slot::Connected(old)) = old {
            old.close();
        }
        self.changed.notify_waiters();
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
                Slot::Dialing(_) | Slot::Accepting(_) => None,
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

    #[tokio::test(start_paused = true)]
    async fn a_send_waits_for_a_connection_being_set_up_and_no_longer() {
        use std::time::Duration;
        let peers = Arc::new(Peers::default());
        let peer = NodeId(4);
        let limit = Duration::from_secs(5);
        assert!(
            peers.settled(peer, limit).await.is_none(),
            "nothing to wait for"
        );
        let token = peers.token();
        peers.lock().insert(peer, Slot::Accepting(token));
        let waiter = tokio::spawn({
            let peers = peers.clone();
            async move { peers.settled(peer, limit).await.is_none() }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            !waiter.is_finished(),
            "it waits while the accept is under way"
        );
        peers.clear_pending(peer, token);
        assert!(
            waiter.await.unwrap(),
            "woken when the setup ended, and nothing there"
        );
        // A setup that never ends is given up at the limit.
        let token = peers.token();
        peers.lock().insert(peer, Slot::Dialing(token));
        let started = tokio::time::Instant::now();
        assert!(peers.settled(peer, limit).await.is_none());
        assert_eq!(started.elapsed(), limit);
    }

    #[test]
    fn smaller_id_wins_simultaneous_connect() {
        let (small, big) = (NodeId(3), NodeId(9));
        for ours in [Existing::Dialing, Existing::Ours] {
            // The smaller node refuses the bigger one's hello, whether its own dial is under
            // way or already done...
            assert_eq!(
                decide_hello(small, big, ours),
                HelloDecision::Reject(SIMULTANEOUS)
            );
            // ...and the bigger node accepts the smaller one's, so exactly one survives.
            assert_eq!(decide_hello(big, small, ours), HelloDecision::Accept);
        }
    }

    #[test]
    fn accepts_when_idle_or_reconnecting_and_rejects_duplicates() {
        for existing in [Existing::Nothing, Existing::Theirs] {
            assert_eq!(
                decide_hello(NodeId(1), NodeId(2), existing),
                HelloDecision::Accept
            );
            assert_eq!(
                decide_hello(NodeId(2), NodeId(1), existing),
                HelloDecision::Accept
            );
        }
        assert!(matches!(
            decide_hello(NodeId(1), NodeId(2), Existing::Accepting),
            HelloDecision::Reject(_)
        ));
        assert!(matches!(
            decide_hello(NodeId(5), NodeId(5), Existing::Nothing),
            HelloDecision::Reject("duplicate node id")
        ));
    }
}
