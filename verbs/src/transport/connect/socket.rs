//! The socket handshake's driver: [`Control`] messages over the TCP control connection,
//! decided by [`crate::proto::handshake::socket`].

use psnet_transport::session::Role;
use psnet_transport::{NodeId, OutMessage, Transport, TransportError};

use super::link_channel;
use crate::control::Control;
use crate::proto::handshake::socket::{Answered, OnReply, OnRequest};
use crate::transport::{lock, random_u64, Inner};

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
                let step = lock(&self.links).handle_request(peer, nonce);
                match step {
                    OnRequest::Ignore => return,
                    OnRequest::Resend(reply) => {
                        let _ = self.send_control(peer, reply).await;
                        return;
                    }
                    OnRequest::Answer => {}
                }
                let link = match self.new_link(peer, random_u64()).and_then(|l| {
                    let name = link_channel(nonce, l.nonce);
                    let tags = self.link_tags(peer, Role::Acceptor, &name);
                    let connected = tags.and_then(|tags| {
                        l.protect(tags);
                        l.connect_to(&info)
                    });
                    connected.map(|()| l.clone()).inspect_err(|e| {
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
                let answered = lock(&self.links).handle_answer_built(peer, nonce, link);
                let reply = match answered {
                    Answered::Installed { retired, reply } => {
                        self.settle_answer(Ok(retired));
                        reply
                    }
                    Answered::Superseded(link) => {
                        self.settle_answer(Err(link));
                        return;
                    }
                };
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
                let step = lock(&self.links).handle_reply(peer, request, nonce);
                let (link, ready) = match step {
                    OnReply::Ignore => return,
                    OnReply::Resend(ready) => {
                        // A repeated reply: our confirmation was lost, send it again.
                        let _ = self.send_control(peer, ready).await;
                        return;
                    }
                    OnReply::Connect { link, ready } => (link, ready),
                };
                let tags = self.link_tags(peer, Role::Dialler, &link_channel(link.nonce, nonce));
                let connected = tags.and_then(|tags| {
                    link.protect(tags);
                    link.connect_to(&info)
                });
                if let Err(e) = connected {
                    let reason = e.to_string();
                    tracing::warn!(%peer, %reason, "cannot connect the queue pair");
                    self.remove_link(peer, Some(link.id), &reason);
                    self.drop_control(peer);
                    return;
                }
                lock(&self.links).handle_connected(peer, link.id);
                self.announce(peer);
                if self.send_control(peer, ready).await.is_err() {
                    self.remove_link(peer, Some(link.id), "control connection lost");
                    return;
                }
                link.set_remote_ready();
                self.links_changed.notify_waiters();
            }
            Control::Ready { nonce } => {
                let link = lock(&self.links).handle_ready(peer, nonce);
                if let Some(link) = link {
                    link.set_remote_ready();
                }
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
