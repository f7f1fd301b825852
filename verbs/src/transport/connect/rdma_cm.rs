//! The rdma_cm handshake: the route resolved from the interface's address, REQ / REP / RTU,
//! psnet's handshake ([`CmMessage`]) in the private data, as ps-lite does; disconnects and
//! rejections arrive as rdma_cm events.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use psnet_transport::{Event, NodeId, Transport};
use sideway::ibverbs::queue_pair::QueuePairState;

use crate::control::{CmMessage, Refusal};
use crate::device::Device;
use crate::error::VerbsError;
use crate::link::Link;
use crate::proto::handshake::Phase;
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
            .any(|c| c.link == link.id && !c.active);
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
        let target = addr
            .map(|a| a.to_string())
            .unwrap_or_else(|| peer.to_string());
        let step = match ev.kind {
            rdmacm::kind::ADDR_RESOLVED => self
                .with_cm_id(ev.id, |id| id.resolve_route(CM_RESOLVE_MS))
                .and_then(|resolving| resolving)
                .map_err(|e| {
                    VerbsError::os(
                        "rdma_resolve_route",
                        format!("rdma_cm cannot resolve a route to {target}"),
                        &e,
                    )
                }),
            rdmacm::kind::ROUTE_RESOLVED => self.send_cm_request(ev.id, &link, &target),
            rdmacm::kind::CONNECT_RESPONSE => self.on_cm_response(ev.id, peer, &link, &ev),
            rdmacm::kind::ESTABLISHED => {
                if !active {
                    link.set_remote_ready();
                    self.links_changed.notify_waiters();
                }
                Ok(())
            }
            rdmacm::kind::REJECTED => match CmMessage::decode(&ev.private_data) {
                // Retried by `connect` while the link waits (see `cm_pending`).
                Some(CmMessage::Refused(Refusal::Crossed | Refusal::NoControlConnection)) => {
                    tracing::debug!(%peer, "connect request refused for now; retrying");
                    if let Some(conn) = lock(&cm.conns).remove(&ev.id) {
                        drop(conn);
                    }
                    Ok(())
                }
                Some(CmMessage::Refused(why)) => Err(VerbsError::Refused {
                    target: target.clone(),
                    refusal: Some(why),
                    status: ev.status,
                }),
                _ => Err(VerbsError::Refused {
                    target: target.clone(),
                    refusal: None,
                    status: ev.status,
                }),
            },
            rdmacm::kind::DISCONNECTED => {
                // The peer ended this queue pair on purpose or died; its control connection
                // goes (or went) with it, and a new one may already be up: leave that alone.
                let reason = format!("{target} disconnected ({name})");
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
            rdmacm::kind::ADDR_ERROR
            | rdmacm::kind::ROUTE_ERROR
            | rdmacm::kind::CONNECT_ERROR
            | rdmacm::kind::UNREACHABLE
            | rdmacm::kind::DEVICE_REMOVAL => Err(VerbsError::errno(
                name,
                format!("rdma_cm: {name} for {target}"),
                ev.status.abs(),
            )),
            _ => Ok(()),
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
    fn send_cm_request(&self, key: usize, link: &Link, target: &str) -> Result<(), VerbsError> {
        let hello = CmMessage::Hello {
            from: self.tcp.local_id().0,
            nonce: link.nonce,
            recv_depth: self.params.recv_depth,
            slot_size: self.params.slot_size as u32,
        };
        let param = cm_param(link, hello);
        let detail = || format!("rdma_cm cannot connect to {target}");
        self.with_cm_id(key, |id| {
            if let Some((device, port)) = id.device_port() {
                if device != self.dev.name || port != self.dev.port {
                    return Err(VerbsError::Setup(format!(
                        "{}: rdma_cm routes to it through {device} port {port}, but this \
                         transport runs on {} port {} (check DMLC_INTERFACE and PSNET_IB_DEVICE)",
                        detail(),
                        self.dev.name,
                        self.dev.port
                    )));
                }
            }
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
        let Some(CmMessage::Welcome {
            nonce: _,
            recv_depth,
            slot_size,
        }) = CmMessage::decode(&ev.private_data)
        else {
            return Err(VerbsError::Protocol(
                "the peer accepted the RDMA connection without psnet's reply".into(),
            ));
        };
        let current = lock(&self.links)
            .get(peer)
            .is_some_and(|c| c.link().id == link.id && c.phase() == Phase::Requested);
        if !current {
            // Superseded by the peer's own request meanwhile: let this connection go.
            self.drop_cm_of_link(link.id);
            return Ok(());
        }
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
    /// or refuses saying why; simultaneous requests are settled by nonce, as over sockets.
    fn on_cm_request(&self, id: CmId, data: &[u8]) {
        let refuse = |id: CmId, why: Refusal| {
            if let Err(e) = id.reject(&CmMessage::Refused(why).encode()) {
                tracing::debug!(error = %e, "rdma_cm reject");
            }
        };
        let Some(CmMessage::Hello {
            from,
            nonce,
            recv_depth,
            slot_size,
        }) = CmMessage::decode(data)
        else {
            tracing::warn!("refused an rdma_cm connect request that is not psnet's");
            return refuse(id, Refusal::Malformed);
        };
        let peer = NodeId(from);
        // The peer's control connection must be up and its arrival handled here: handling it
        // after this request would take the new link for a stale one. Refused for now
        // otherwise; the peer asks again.
        if !self.tcp.connected_peers().contains(&peer) || !lock(&self.addrs).contains_key(&peer) {
            return refuse(id, Refusal::NoControlConnection);
        }
        if !lock(&self.links).answers(peer, nonce) {
            return refuse(id, Refusal::Crossed);
        }
        let reply_nonce = random_u64();
        let built = self.new_link(peer, reply_nonce).and_then(|link| {
            let connected = id
                .qp_attr(QueuePairState::ReadyToReceive)
                .and_then(|rtr| Ok((rtr, id.qp_attr(QueuePairState::ReadyToSend)?)))
                .map_err(|e| {
                    VerbsError::os("rdma_init_qp_attr", "rdma_cm queue-pair attributes", &e)
                })
                .and_then(|(rtr, rts)| link.connect_with(recv_depth, slot_size, rtr, rts));
            if let Err(e) = connected {
                link.fail(&e.to_string());
                lock(&self.by_id).remove(&link.id);
                return Err(e);
            }
            Ok(link)
        });
        let link = match built {
            Ok(link) => link,
            Err(reason) => {
                tracing::warn!(%peer, %reason, "cannot build the queue pair a peer asked for");
                return refuse(id, Refusal::CannotConnect);
            }
        };
        let installed = lock(&self.links).install_answer(peer, nonce, link.clone(), None, true);
        if !self.settle_answer(installed) {
            return refuse(id, Refusal::Crossed);
        }
        let welcome = CmMessage::Welcome {
            nonce: reply_nonce,
            recv_depth: self.params.recv_depth,
            slot_size: self.params.slot_size as u32,
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
