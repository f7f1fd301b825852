//! Liveness: a rank that stops (SIGSTOP, a debugger, a hung driver) keeps its connections
//! open, so its peers see no loss; without this they would wait, silently, for the call
//! timeout (600 s). Every rank sends a heartbeat on each of its open connections to members
//! every quarter of `PSNET_COLL_HEARTBEAT_TIMEOUT`, and a member heard from neither by a
//! message nor by a heartbeat for the whole timeout is lost, named with the reason, as a
//! dead one is. Only open connections are watched, so a rank's cost grows with the ranks it
//! talks to (a ring's two neighbours), not with the communicator's size.
//!
//! The decision is [`silent`]: a function of the time passed in; the task only sends and
//! looks at the clock.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use psnet_transport::{NodeId, OutMessage, Segment, Transport};
use tokio::time::Instant;

use crate::mailbox::Mailbox;
use crate::wire::{self, Kind};

/// The members, among `watched`, last heard from before `now - timeout`. A member never
/// heard from counts from when it was first watched (`first_watched`: a call connects to a
/// rank when it first needs it, long after the communicator formed), or else from `since`
/// (when watching began).
pub(crate) fn silent(
    watched: &[NodeId],
    last_heard: &HashMap<NodeId, Instant>,
    first_watched: &HashMap<NodeId, Instant>,
    since: Instant,
    now: Instant,
    timeout: Duration,
) -> Vec<NodeId> {
    watched
        .iter()
        .copied()
        .filter(|n| {
            let watched_from = first_watched.get(n).copied().unwrap_or(since).max(since);
            let heard = last_heard.get(n).copied().unwrap_or(since);
            now.saturating_duration_since(heard.max(watched_from)) > timeout
        })
        .collect()
}

/// Why a silent member is lost.
pub(crate) fn reason(timeout: Duration) -> String {
    format!(
        "no message and no heartbeat from it for {timeout:?} (PSNET_COLL_HEARTBEAT_TIMEOUT): \
         its process is stopped (SIGSTOP, a debugger), frozen, or cut off from this one"
    )
}

/// Sends heartbeats and watches `members` (every rank but this one) until the task is
/// aborted (the last communicator on this transport is dropped).
pub(crate) async fn watch<T: Transport>(
    transport: Arc<T>,
    mailbox: Arc<Mailbox>,
    members: Vec<NodeId>,
    comm: u32,
    timeout: Duration,
) {
    let beat = wire::control(Kind::Heartbeat, comm).encode();
    let every = (timeout / 4).max(Duration::from_millis(10));
    let since = Instant::now();
    // The members connected as watching begins count from then; one connected later (a call
    // dialled it) from the first look that finds it, at most one interval late.
    let connected = transport.connected_peers();
    let mut first_watched: HashMap<NodeId, Instant> = members
        .iter()
        .filter(|m| connected.contains(m))
        .map(|&m| (m, since))
        .collect();
    loop {
        tokio::time::sleep(every).await;
        let connected = transport.connected_peers();
        let watched: Vec<NodeId> = members
            .iter()
            .copied()
            .filter(|m| connected.contains(m))
            .collect();
        let seen = Instant::now();
        for &peer in &watched {
            first_watched.entry(peer).or_insert(seen);
        }
        for &peer in &watched {
            // A peer that stopped reading fills its socket at last: never wait on it here.
            let send = transport.send(peer, OutMessage::new(&beat, &[] as &[Segment<'_>]));
            let _ = tokio::time::timeout(every, send).await;
        }
        let now = Instant::now();
        let mut mail = mailbox.lock();
        let quiet = silent(
            &watched,
            &mail.last_heard,
            &first_watched,
            since,
            now,
            timeout,
        );
        let mut silent = Vec::new();
        for peer in quiet {
            if let std::collections::hash_map::Entry::Vacant(e) = mail.lost.entry(peer) {
                tracing::error!(%peer, ?timeout, "collectives: a rank fell silent");
                e.insert(reason(timeout));
                silent.push(peer);
            }
        }
        drop(mail);
        for &peer in &silent {
            mailbox.record_event("silent", peer);
        }
        if !silent.is_empty() {
            mailbox.changed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_is_silent_only_after_the_whole_timeout_without_news() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(10);
        let (a, b, c) = (NodeId(1), NodeId(2), NodeId(3));
        let heard = HashMap::from([(a, t0 + Duration::from_secs(5)), (b, t0)]);
        let none = HashMap::new();
        let at = |s| t0 + Duration::from_secs(s);
        assert!(silent(&[a, b, c], &heard, &none, t0, at(10), timeout).is_empty());
        // b heard at 0 and c never (counted from the start): both silent after 10 s.
        assert_eq!(
            silent(&[a, b, c], &heard, &none, t0, at(11), timeout),
            vec![b, c]
        );
        assert_eq!(
            silent(&[a, b, c], &heard, &none, t0, at(16), timeout),
            vec![a, b, c]
        );
        // Only watched members count.
        assert_eq!(
            silent(&[a], &heard, &none, t0, at(11), timeout),
            Vec::<NodeId>::new()
        );
        // A message heard before watching began counts from the start.
        assert!(silent(&[b], &heard, &none, at(3), at(12), timeout).is_empty());
        // Members first watched at 20 s (a call connected to them then) count from then,
        // whenever they were heard from before.
        let late = HashMap::from([(c, at(20)), (b, at(20))]);
        assert!(silent(&[b, c], &heard, &late, t0, at(29), timeout).is_empty());
        assert_eq!(
            silent(&[b, c], &heard, &late, t0, at(31), timeout),
            vec![b, c]
        );
        assert!(reason(timeout).contains("PSNET_COLL_HEARTBEAT_TIMEOUT"));
    }
}
