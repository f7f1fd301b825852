//! The socket handshake: queue-pair numbers, GIDs and sequence numbers exchanged over the
//! TCP control connection ([`Control`] messages: request, reply, ready), as NCCL and
//! perftest do.

use psnet_transport::{NodeId, OutMessage, Transport, TransportError};

use super::beats_request;
use crate::control::Control;
use crate::transport::{lock, random_u64, Current, Inner, Phase};

impl Inner {
    pub(super) async fn send_control(
        &self,
        peer: NodeId,
        msg: Control,
    ) -> Result<(), TransportError> {
        let bytes = msg.encode();
        self.tcp.send(peer, OutMessage::new(&bytes, &[])).await
    }

    pub(super) async fn on_control(&self, peer: NodeId, msg: Control) {
        tracing::debug!(local = %self.tcp.local_id(), %peer, ?msg, "RDMA handshake message");
        match msg {
            Control::Request { nonce, info } => {
                let repeat = {
                    let links = lock(&self.links);
                    match links.get(&peer) {
                        // Both sides requested at once and ours wins.
                        Some(c) if c.phase == Phase::Requested && beats_request(c, nonce) => return,
                        Some(c) if c.phase == Phase::Connected => match c.answered {
                            // Our reply may have been lost: send it again.
                            Some((answered, reply)) if answered == nonce => Some(reply),
                            // A request the peer gave up when both sides requested at once
                            // (a new connection removes this link before its requests come).
                            _ => return,
                        },
                        _ => None,
                    }
                };
                if let Some(reply) = repeat {
                    let _ = self.send_control(peer, reply).await;
                    return;
                }
                let reply_nonce = random_u64();
                let link = match self.new_link(peer, reply_nonce).and_then(|l| {
                    l.connect_to(&info).map(|()| l.clone()).inspect_err(|e| {
                        l.fail(&e.to_string());
                        lock(&self.by_id).remove(&l.id);
                    })
                }) {
                    Ok(l) => l,
                    Err(reason) => {
                        tracing::warn!(%peer, %reason, "cannot build the queue pair a peer asked for");
                        self.drop_control(peer);
                        return;
                    }
                };
                let reply = Control::Reply {
                    request: nonce,
                    nonce: reply_nonce,
                    info: link.local_info(),
                };
                let answer = Current {
                    link: link.clone(),
                    phase: Phase::Connected,
                    announced: true,
                    answered: Some((nonce, reply)),
                    via_cm: false,
                };
                if !self.install_answer(peer, nonce, answer) {
                    return;
                }
                self.links_changed.notify_waiters();
                self.announce(peer);
                if self.send_control(peer, reply).await.is_err() {
                    self.remove_link(peer, None, "control connection lost");
                }
            }
            Control::Reply {
                request,
                nonce,
                info,
            } => {
                let (link, repeated) = {
                    let links = lock(&self.links);
                    match links.get(&peer) {
                        Some(c) if c.link.nonce == request => {
                            (c.link.clone(), c.phase != Phase::Requested)
                        }
                        _ => return,
                    }
                };
                if repeated {
                    // A repeated reply: our confirmation was lost, send it again.
                    let _ = self.send_control(peer, Control::Ready { nonce }).await;
                    return;
                }
                if let Err(e) = link.connect_to(&info) {
                    let reason = e.to_string();
                    tracing::warn!(%peer, %reason, "cannot connect the queue pair");
                    self.remove_link(peer, Some(link.id), &reason);
                    self.drop_control(peer);
                    return;
                }
                if let Some(c) = lock(&self.links).get_mut(&peer) {
                    if c.link.id == link.id {
                        c.phase = Phase::Connected;
                        c.announced = true;
                    }
                }
                self.announce(peer);
                if self
                    .send_control(peer, Control::Ready { nonce })
                    .await
                    .is_err()
                {
                    self.remove_link(peer, Some(link.id), "control connection lost");
                    return;
                }
                link.set_remote_ready();
                self.links_changed.notify_waiters();
            }
            Control::Ready { nonce } => {
                let links = lock(&self.links);
                if let Some(c) = links.get(&peer) {
                    if c.link.nonce == nonce {
                        c.link.set_remote_ready();
                    }
                }
                drop(links);
                self.links_changed.notify_waiters();
            }
        }
    }

    /// Closes the control connection to `peer`, which then counts as not seen (see
    /// `on_cm_request`).
    pub(in crate::transport) fn drop_control(&self, peer: NodeId) {
        lock(&self.addrs).remove(&peer);
        self.tcp.disconnect(peer);
    }
}
