//! The rdma_cm handshake's driver: the connection manager's ids and events (route resolved
//! from the interface's address, REQ / REP / RTU, disconnects and rejections), decided by
//! [`crate::proto::handshake::rdma_cm`].

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use psnet_transport::session::Role;
use psnet_transport::{Event, NodeId, Transport};
use sideway::ibverbs::queue_pair::QueuePairState;

use super::link_channel;
use crate::control::{CmMessage, Refusal};
use crate::device::Device;
use crate::error::VerbsError;
use crate::link::Link;
use crate::proto::handshake::rdma_cm::{
    self as machine, CmAnswered, Hello, OnEvent, OnHello, OnWelcome,
};
use crate::rdmacm::{self, CmChannel, CmEvent, CmId, ConnParam};
use crate::transport::{lock, random_u64, Inner};

/// How long rdma_cm may take to resolve an address or a route.
const CM_RESOLVE_MS: i32 = 2000;

/// rdma_cm's side of the transport: the channel, the listening id, and the ids of the links.
pub(in crate::transport) struct CmState {
    pub(in crate::transport) channel: Arc<CmChannel>,
    _listener: CmId,
    conns: Mutex<HashMap<usize, CmConn>>,
}

/// An rdma_cm id serving a link.
struct CmConn {
    id: CmId,
    peer: NodeId,
    link: u32,
    /// This side sent the connect request.
    active: bool,
    /// Where the request goes (active side).
    addr: Option<SocketAddr>,
}

impl Inner {
    /// A queue pair received its first message: on a link accepted through rdma_cm that
    /// still waits for the RTU (lost, and repeated only after rdma_cm's timeout), the peer's
    /// queue pair is connected, so sending may start now.
    pub(in crate::transport) fn on_established(&self, qp_num: u32) {
        let Some(cm) = &self.cm else { return };
        let link = lock(&self.by_id)
            .values()
            .find(|l| l.qp_number() == qp_num)
            .cloned();
        let Some(link) = link else { return };
        let accepted = lock(&cm.conns)
            .values()
            .any(|c| c.link == link.id && machine::established_readies(c.active));
        if accepted {
            link.set_remote_ready();
            self.links_changed.notify_waiters();
        }
    }

    /// Disconnects and destroys the rdma_cm ids serving link `link`.
    pub(in crate::transport) fn drop_cm_of_link(&self, link: u32) {
        let Some(cm) = &self.cm else { return };
        let gone: Vec<CmConn> = {
            let mut conns = lock(&cm.conns);
            let keys: Vec<usize> = conns
                .iter()
                .filter(|(_, c)| c.link == link)
                .map(|(k, _)| *k)
                .collect();
            keys.iter().filter_map(|k| conns.remove(k)).collect()
        };
        // Outside the lock: destroying an id may wait for the kernel.
        for conn in gone {
            // Tells the peer at once (it sees DISCONNECTED); fails harmlessly if never connected.
            let _ = conn.id.disconnect();
        }
    }

    /// Whether an rdma_cm connect request of link `link` is under way.
    pub(super) fn cm_pending(&self, link: u32) -> bool {
        self.cm
            .as_ref()
            .is_some_and(|cm| lock(&cm.conns).values().any(|c| c.link == link && c.active))
    }

    /// Starts connecting `link` to `addr` through rdma_cm: resolve the address from this
    /// interface's, then the route, then send the request (see [`Inner::on_cm_event`]).
    pub(super) fn start_cm_connect(
        &self,
        peer: NodeId,
        addr: SocketAddr,
        link: &Link,
    ) -> Result<(), VerbsError> {
        let cm = self.cm.as_ref().ok_or_else(|| {
            VerbsError::Setup(
                "rdma_cm is unavailable on this node (set PSNET_RDMA_CONNECT=socket)".into(),
            )
        })?;
        let id = cm
            .channel
            .create_id()
            .map_err(|e| VerbsError::os("rdma_create_id", "rdma_cm id", &e))?;
        let key = id.key();
        let local = self.tcp.listen_addr();
        let src = (!local.ip().is_unspecified()).then(|| SocketAddr::new(local.ip(), 0));
        let mut conns = lock(&cm.conns);
        // Registered before the call: its events may be read at once by the control loop.
        conns.insert(
            key,
            CmConn {
                id,
                peer,
                link: link.id,
                active: true,
                addr: Some(addr),
            },
        );
        let started = conns[&key].id.resolve_addr(src, addr, CM_RESOLVE_MS);
        if let Err(e) = started {
            let conn = conns.remove(&key);
            drop(conns);
            drop(conn);
            return Err(VerbsError::os(
                "rdma_resolve_addr",
                format!("rdma_cm cannot resolve {addr}"),
                &e,
            ));
        }
        Ok(())
    }

    /// Acts on one rdma_cm event: the steps of a connection, and its failures as per-peer
    /// errors.
    pub(super) fn on_cm_event(&self, ev: CmEvent) {
        let Some(cm) = &self.cm else { return };
        let name = rdmacm::event_name(ev.kind);
        tracing::debug!(local = %self.tcp.local_id(), event = name, status = ev.status, "rdma_cm event");
        if ev.kind == rdmacm::kind::CONNECT_REQUEST {
            if let Some(id) = ev.new_id {
                self.on_cm_request(id, &ev.private_data);
            }
            return;
        }
        let Some((peer, link_id, active, addr)) = lock(&cm.conns)
            .get(&ev.id)
            .map(|c| (c.peer, c.link, c.active, c.addr))
        else {
            return;
        };
        let Some(link) = lock(&self.by_id).get(&link_id).cloned() else {
            self.drop_cm_of_link(link_id);
            return;
        };
        let target = machine::target(addr, peer);
        let step = match machine::on_event(ev.kind, ev.status, active, &target) {
            OnEvent::ResolveRoute => self
                .with_cm_id(ev.id, |id| id.resolve_route(CM_RESOLVE_MS))
                .and_then(|resolving| resolving)
                .map_err(|e| {
                    VerbsError::os(
                        "rdma_resolve_route",
                        format!("rdma_cm cannot resolve a route to {target}"),
                        &e,
                    )
                }),
            OnEvent::SendHello => self.send_cm_request(ev.id, &link, &target),
            OnEvent::Welcome => self.on_cm_response(ev.id, peer, &link, &ev),
            OnEvent::PeerReady => {
                link.set_remote_ready();
                self.links_changed.notify_waiters();
                Ok(())
            }
            OnEvent::Rejected => {
                let verdict = machine::handle_rejected(peer, &target, &ev.private_data, ev.status);
                // Refused for now: retried by `connect` while the link waits (see
                // `cm_pending`) once this id is gone.
                if verdict.is_ok() {
                    if let Some(conn) = lock(&cm.conns).remove(&ev.id) {
                        drop(conn);
                    }
                }
                verdict
            }
            OnEvent::Disconnected(reason) => {
                match self.remove_link(peer, Some(link.id), &reason) {
                    Some(true) => self.inbox.push_event(Event::PeerLost { peer, reason }),
                    Some(false) => {}
                    None => {
                        link.fail(&reason);
                        lock(&self.by_id).remove(&link.id);
                        self.drop_cm_of_link(link.id);
                    }
                }
                Ok(())
            }
            OnEvent::Fail(e) => Err(e),
            OnEvent::Ignore => Ok(()),
        };
        if let Err(e) = step {
            self.fail_link(&link, e.to_string());
        }
    }

    /// Runs `f` on the rdma_cm id `key`; an error if rdma_cm is off or the id is gone.
    fn with_cm_id<R>(&self, key: usize, f: impl FnOnce(&CmId) -> R) -> std::io::Result<R> {
        let cm = self
            .cm
            .as_ref()
            .ok_or_else(|| std::io::Error::other("no rdma_cm"))?;
        let conns = lock(&cm.conns);
        let conn = conns
            .get(&key)
            .ok_or_else(|| std::io::Error::other("rdma_cm id already gone"))?;
        Ok(f(&conn.id))
    }

    /// Active side, route resolved: checks rdma_cm chose this transport's port, then asks.
    fn send_cm_request(
        &self,
        key: usize,
        link: &Arc<Link>,
        target: &str,
    ) -> Result<(), VerbsError> {
        let hello = machine::hello(
            self.tcp.local_id(),
            link,
            self.params.recv_depth,
            self.params.slot_size as u32,
        );
        let param = cm_param(link, hello);
        let detail = || format!("rdma_cm cannot connect to {target}");
        self.with_cm_id(key, |id| {
            let routed = id.device_port();
            machine::check_route(
                target,
                routed
                    .as_ref()
                    .map(|(device, port)| (device.as_str(), *port)),
                (&self.dev.name, self.dev.port),
            )?;
            id.connect(&param)
                .map_err(|e| VerbsError::os("rdma_connect", detail(), &e))
        })
        .unwrap_or_else(|gone| Err(VerbsError::os("rdma_connect", detail(), &gone)))
    }

    /// Active side: the peer accepted; connect the queue pair, complete the exchange, send.
    fn on_cm_response(
        &self,
        key: usize,
        peer: NodeId,
        link: &Arc<Link>,
        ev: &CmEvent,
    ) -> Result<(), VerbsError> {
        let step = lock(&self.links).handle_welcome(peer, link.id, &ev.private_data)?;
        let OnWelcome::Connect {
            recv_depth,
            slot_size,
            nonce,
        } = step
        else {
            // Superseded by the peer's own request meanwhile: let this connection go.
            self.drop_cm_of_link(link.id);
            return Ok(());
        };
        const FAILED: &str = "cannot complete the RDMA connection";
        self.with_cm_id(key, |id| {
            let attr = |state| {
                id.qp_attr(state)
                    .map_err(|e| VerbsError::os("rdma_init_qp_attr", FAILED, &e))
            };
            let (rtr, rts) = (
                attr(QueuePairState::ReadyToReceive)?,
                attr(QueuePairState::ReadyToSend)?,
            );
            let name = link_channel(link.nonce, nonce);
            link.protect(self.link_tags(peer, Role::Dialler, &name)?);
            link.connect_with(recv_depth, slot_size, rtr, rts)
                .map_err(|e| e.during(FAILED))?;
            id.establish()
                .map_err(|e| VerbsError::os("rdma_establish", FAILED, &e))
        })
        .unwrap_or_else(|gone| Err(VerbsError::os("rdma_establish", FAILED, &gone)))?;
        lock(&self.links).handle_connected(peer, link.id);
        self.announce(peer);
        link.set_remote_ready();
        self.links_changed.notify_waiters();
        Ok(())
    }

    /// Passive side: a peer asks to connect. Builds and connects a queue pair and accepts,
    /// or refuses saying why, as [`machine::admit_hello`] and [`Links::handle_hello`] decide.
    ///
    /// [`Links::handle_hello`]: crate::proto::handshake::Links::handle_hello
    fn on_cm_request(&self, id: CmId, data: &[u8]) {
        let refuse = |id: CmId, why: Refusal| {
            if let Err(e) = id.reject(&CmMessage::Refused(why).encode()) {
                tracing::debug!(error = %e, "rdma_cm reject");
            }
        };
        // The peer's control connection must be up and its arrival handled here.
        let control_seen = |peer| {
            self.tcp.connected_peers().contains(&peer) && lock(&self.addrs).contains_key(&peer)
        };
        let hello = match machine::admit_hello(data, control_seen) {
            Ok(hello) => hello,
            Err(why) => return refuse(id, why),
        };
        let step = lock(&self.links).handle_hello(hello);
        let Hello {
            peer,
            nonce,
            recv_depth,
            slot_size,
        } = match step {
            OnHello::Refuse(why) => return refuse(id, why),
            OnHello::Answer(hello) => hello,
        };
        let built = self.new_link(peer, random_u64()).and_then(|link| {
            let name = link_channel(nonce, link.nonce);
            let connected = self
                .link_tags(peer, Role::Acceptor, &name)
                .map(|tags| link.protect(tags))
                .and_then(|()| {
                    id.qp_attr(QueuePairState::ReadyToReceive)
                        .and_then(|rtr| Ok((rtr, id.qp_attr(QueuePairState::ReadyToSend)?)))
                        .map_err(|e| {
                            VerbsError::os("rdma_init_qp_attr", "rdma_cm queue-pair attributes", &e)
                        })
                        .and_then(|(rtr, rts)| link.connect_with(recv_depth, slot_size, rtr, rts))
                });
            if let Err(e) = connected {
                link.fail(&e.to_string());
                lock(&self.by_id).remove(&link.id);
                return Err(e);
            }
            Ok(link)
        });
        let link = match built {
            Ok(link) => link,
            Err(reason) => return refuse(id, machine::cannot_answer(peer, &reason)),
        };
        let answered = lock(&self.links).handle_cm_answer_built(
            peer,
            nonce,
            link.clone(),
            self.params.recv_depth,
            self.params.slot_size as u32,
        );
        let welcome = match answered {
            CmAnswered::Accept { retired, welcome } => {
                self.settle_answer(Ok(retired));
                welcome
            }
            CmAnswered::Refuse { link, why } => {
                self.settle_answer(Err(link));
                return refuse(id, why);
            }
        };
        let param = cm_param(&link, welcome);
        if let Err(e) = id.accept(&param) {
            let reason = format!("rdma_cm cannot accept: {e}");
            tracing::warn!(%peer, %reason, "RDMA connection failed");
            self.remove_link(peer, Some(link.id), &reason);
            return;
        }
        if let Some(cm) = &self.cm {
            lock(&cm.conns).insert(
                id.key(),
                CmConn {
                    id,
                    peer,
                    link: link.id,
                    active: false,
                    addr: None,
                },
            );
        }
        self.links_changed.notify_waiters();
        self.announce(peer);
    }
}

/// What rdma_cm sends for `link`: its queue pair and psnet's handshake message, with the
/// same retry limits as the socket handshake's queue pairs.
fn cm_param(link: &Link, message: CmMessage) -> ConnParam {
    ConnParam {
        qp_num: link.qp_number(),
        private_data: message.encode(),
        retry_count: 7,
        rnr_retry_count: 6,
    }
}

/// Opens rdma_cm's channel and listens on the control connection's address (the same IP and
/// port, in rdma_cm's own port space), so that peers find both at one address.
pub(in crate::transport) fn listen_cm(
    dev: &Device,
    addr: SocketAddr,
) -> Result<CmState, VerbsError> {
    let channel = CmChannel::new()
        .map_err(|e| VerbsError::os("rdma_create_event_channel", "rdma_cm event channel", &e))?;
    let listener = channel
        .create_id()
        .map_err(|e| VerbsError::os("rdma_create_id", "rdma_cm id", &e))?;
    listener
        .bind(addr)
        .map_err(|e| VerbsError::os("rdma_bind_addr", format!("rdma_cm cannot bind {addr}"), &e))?;
    listener.listen(128).map_err(|e| {
        VerbsError::os(
            "rdma_listen",
            format!("rdma_cm cannot listen on {addr}"),
            &e,
        )
    })?;
    if let Some((device, port)) = listener.device_port() {
        if device != dev.name || port != dev.port {
            return Err(VerbsError::Setup(format!(
                "rdma_cm binds {addr} to {device} port {port}, but this transport runs on {} \
                 port {}",
                dev.name, dev.port
            )));
        }
    }
    tracing::debug!(%addr, "rdma_cm listening");
    Ok(CmState {
        channel,
        _listener: listener,
        conns: Mutex::new(HashMap::new()),
    })
}
