//! Time and transmits: the resends that fall due, peers given up, acknowledgements owed, and what
//! goes out next.

use super::*;

impl Resender {
    /// Time passes: queues resends that are due, gives up peers past the limit.
    pub fn handle_timeout(&mut self, now: Instant) {
        let config = self.config;
        let limit = config.give_up_after();
        let mut give_up = Vec::new();
        for (&id, p) in self.peers.iter_mut() {
            if p.failed.is_some() {
                continue;
            }
            if let Some((since, why)) = &p.down {
                if now >= *since + limit {
                    give_up.push((
                        id,
                        format!(
                            "connection lost ({why}) and not re-established within {:?} ({})",
                            limit,
                            config.describe()
                        ),
                    ));
                    continue;
                }
            }
            let down = p.down.is_some();
            for m in p.window.iter_mut() {
                let elapsed = now.saturating_duration_since(m.first_sent);
                // Resends that should have happened by now: one per elapsed timeout.
                let periods = elapsed.as_nanos() / config.timeout.as_nanos();
                if periods <= u128::from(m.retries) {
                    continue;
                }
                if periods > u128::from(config.max_retries) {
                    let reason = match &p.down {
                        Some((since, why)) => format!(
                            "connection lost ({why}) and not re-established for {:?}; message \
                             {} unacknowledged for {:?} ({})",
                            now.saturating_duration_since(*since),
                            m.seq,
                            elapsed,
                            config.describe()
                        ),
                        None => format!(
                            "message {} not acknowledged for {:?}, after {} resends ({})",
                            m.seq,
                            elapsed,
                            m.retries,
                            config.describe()
                        ),
                    };
                    give_up.push((id, reason));
                    break;
                }
                m.retries = periods as u32;
                if !down && !m.queued {
                    m.queued = true;
                    p.resend.push_back(m.seq);
                }
            }
        }
        for (id, reason) in give_up {
            self.fail_peer(id, reason);
        }
    }

    /// The peers with something to send now (resends or an acknowledgement).
    pub fn ready_peers(&self, now: Instant) -> Vec<NodeId> {
        self.peers
            .keys()
            .copied()
            .filter(|&id| self.has_transmit(id, now))
            .collect()
    }

    /// Whether [`Resender::poll_transmit_to`] has something for `peer` now.
    pub fn has_transmit(&self, peer: NodeId, now: Instant) -> bool {
        self.peers.get(&peer).is_some_and(|p| {
            p.failed.is_none()
                && p.down.is_none()
                && (!p.resend.is_empty() || p.ack_due(now, self.config.ack_delay()))
        })
    }

    /// The next thing to send to `peer`: a resend (oldest first), else an acknowledgement
    /// that is due.
    pub fn poll_transmit_to(&mut self, peer: NodeId, now: Instant) -> Option<Transmit> {
        let delay = self.config.ack_delay();
        let p = self.peers.get_mut(&peer)?;
        if p.failed.is_some() || p.down.is_some() {
            return None;
        }
        while let Some(seq) = p.resend.pop_front() {
            let Some(i) = p.index(seq) else { continue };
            let m = &mut p.window[i];
            m.queued = false;
            let (meta, value) = (m.meta.clone(), m.value.clone());
            let ack = p.take_ack();
            self.stats.resent += 1;
            return Some(Transmit {
                peer,
                seq: Some(seq),
                ack,
                meta,
                value,
                resend: true,
            });
        }
        if p.ack_due(now, delay) {
            let ack = p.take_ack();
            self.stats.acks_sent += 1;
            return Some(Transmit {
                peer,
                seq: None,
                ack,
                meta: Bytes::new(),
                value: None,
                resend: false,
            });
        }
        None
    }

    /// The next thing to send to any peer.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Transmit> {
        self.ready_peers(now)
            .into_iter()
            .find_map(|peer| self.poll_transmit_to(peer, now))
    }

    /// The next peer given up.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<GaveUp> {
        self.events.pop_front()
    }

    /// When [`Resender::handle_timeout`] (or an acknowledgement) is next due, if ever; the
    /// driver arms its timer with it.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        let config = &self.config;
        let mut next: Option<Instant> = None;
        let mut at = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        for p in self.peers.values() {
            if p.failed.is_some() {
                continue;
            }
            if let Some((since, _)) = &p.down {
                at(*since + config.give_up_after());
            }
            for m in &p.window {
                at(m.first_sent + config.timeout * m.retries.saturating_add(1));
            }
            if let Some(since) = p.ack_owed_since {
                at(since + config.ack_delay());
            }
        }
        self.armed = next;
        next
    }
}
