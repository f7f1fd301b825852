//! The link model's place in the network ([`MemNetConfig::hosts`](crate::MemNetConfig)):
//! which host each endpoint is on, and which queued messages are still crossing. The
//! network's lock holds it; [`LinkModel`] does the arithmetic.

use std::collections::HashMap;

use tokio::time::Instant;

use crate::links::{HostLinks, LinkModel, MessageId};

/// The model, its clock's start, and where things are.
pub(crate) struct Wires {
    model: LinkModel,
    /// The model's time zero.
    epoch: Instant,
    /// Each endpoint's host.
    host_of: HashMap<u64, usize>,
    /// The host the next endpoint bound without one goes on.
    next_host: usize,
    /// Messages crossing, by the model's id: the endpoint whose inbox holds each.
    crossing: HashMap<MessageId, u64>,
}

impl Wires {
    /// Wires for `hosts`; None without hosts (messages then land after their delay alone).
    pub(crate) fn new(hosts: &[HostLinks]) -> Option<Wires> {
        (!hosts.is_empty()).then(|| Wires {
            model: LinkModel::new(hosts.to_vec()),
            epoch: Instant::now(),
            host_of: HashMap::new(),
            next_host: 0,
            crossing: HashMap::new(),
        })
    }

    /// Puts endpoint `ep` on `host`, or on the hosts in turn (in the order endpoints bind)
    /// when None; returns the host. A host outside the model is taken modulo its host
    /// count.
    pub(crate) fn place(&mut self, ep: u64, host: Option<usize>) -> usize {
        let hosts = self.model.hosts();
        let host = host.unwrap_or_else(|| {
            let h = self.next_host;
            self.next_host = (self.next_host + 1) % hosts;
            h
        });
        self.host_of.insert(ep, host % hosts);
        host % hosts
    }

    /// The host endpoint `ep` is on.
    pub(crate) fn host_of(&self, ep: u64) -> usize {
        self.host_of.get(&ep).copied().unwrap_or(0)
    }

    fn since_epoch(&self) -> std::time::Duration {
        Instant::now().saturating_duration_since(self.epoch)
    }

    /// A message of `bytes` sent now from `from` to `to` over connection `conn`: crossing
    /// until [`land`](Self::land) says otherwise.
    pub(crate) fn send(&mut self, conn: u64, from: u64, to: u64, bytes: usize) -> MessageId {
        let now = self.since_epoch();
        let (from_host, to_host) = (self.host_of(from), self.host_of(to));
        let msg = self.model.handle_send(
            now,
            stream(conn, from < to),
            from_host,
            to_host,
            bytes as u64,
        );
        self.crossing.insert(msg, to);
        msg
    }

    /// Connection `conn` is gone: what it had crossing never lands.
    pub(crate) fn close(&mut self, conn: u64) {
        let now = self.since_epoch();
        self.model.handle_close(now, stream(conn, true));
        self.model.handle_close(now, stream(conn, false));
    }

    /// What has crossed by now: each message's endpoint, id and landing time.
    pub(crate) fn land(&mut self) -> Vec<(u64, MessageId, Instant)> {
        let now = self.since_epoch();
        self.model.handle_time(now);
        let mut landed = Vec::new();
        while let Some((msg, at)) = self.model.poll_landed() {
            if let Some(ep) = self.crossing.remove(&msg) {
                landed.push((ep, msg, self.epoch + at));
            }
        }
        landed
    }

    /// When the next crossing message finishes crossing (it lands after the links'
    /// latency), if any is.
    pub(crate) fn next_landing(&mut self) -> Option<Instant> {
        self.model.poll_timeout().map(|t| self.epoch + t)
    }
}

/// The model's stream of one direction of connection `conn`: a connection carries both
/// ways at once, each way's messages one after another.
fn stream(conn: u64, up: bool) -> u64 {
    conn.wrapping_mul(2) + u64::from(up)
}
