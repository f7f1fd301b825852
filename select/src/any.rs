use std::net::SocketAddr;
use std::sync::Arc;

use psnet_fallback_tcp::TcpTransport;
use psnet_transport::{
    Admission, Capabilities, Event, NodeId, OutMessage, Placer, RegisteredBuf, Transport,
    TransportError,
};
use psnet_verbs::VerbsTransport;

/// Whichever transport was chosen at start, behind the one contract.
///
/// Static dispatch: each call is one `match`, no boxing, so the hot path costs the same as
/// using the transport directly.
pub enum AnyTransport {
    /// TCP (`psnet-fallback-tcp`).
    Tcp(TcpTransport),
    /// RDMA (`psnet-verbs`).
    Rdma(VerbsTransport),
}

impl Transport for AnyTransport {
    fn local_id(&self) -> NodeId {
        match self {
            AnyTransport::Tcp(t) => t.local_id(),
            AnyTransport::Rdma(t) => t.local_id(),
        }
    }

    fn set_local_id(&self, id: NodeId) {
        match self {
            AnyTransport::Tcp(t) => t.set_local_id(id),
            AnyTransport::Rdma(t) => t.set_local_id(id),
        }
    }

    fn set_admission(&self, admission: Arc<dyn Admission>) {
        match self {
            AnyTransport::Tcp(t) => t.set_admission(admission),
            AnyTransport::Rdma(t) => t.set_admission(admission),
        }
    }

    fn set_placer(&self, placer: Arc<dyn Placer>) -> bool {
        match self {
            AnyTransport::Tcp(t) => t.set_placer(placer),
            AnyTransport::Rdma(t) => t.set_placer(placer),
        }
    }

    fn listen_addr(&self) -> SocketAddr {
        match self {
            AnyTransport::Tcp(t) => t.listen_addr(),
            AnyTransport::Rdma(t) => t.listen_addr(),
        }
    }

    fn capabilities(&self) -> Capabilities {
        match self {
            AnyTransport::Tcp(t) => t.capabilities(),
            AnyTransport::Rdma(t) => t.capabilities(),
        }
    }

    async fn connect(&self, peer: NodeId, addr: SocketAddr) -> Result<(), TransportError> {
        match self {
            AnyTransport::Tcp(t) => t.connect(peer, addr).await,
            AnyTransport::Rdma(t) => t.connect(peer, addr).await,
        }
    }

    async fn redial(&self, peer: NodeId, addr: SocketAddr) -> Result<(), TransportError> {
        match self {
            AnyTransport::Tcp(t) => t.redial(peer, addr).await,
            AnyTransport::Rdma(t) => t.redial(peer, addr).await,
        }
    }

    async fn send<'a>(&'a self, peer: NodeId, msg: OutMessage<'a>) -> Result<(), TransportError> {
        match self {
            AnyTransport::Tcp(t) => t.send(peer, msg).await,
            AnyTransport::Rdma(t) => t.send(peer, msg).await,
        }
    }

    async fn recv(&self) -> Result<Event, TransportError> {
        match self {
            AnyTransport::Tcp(t) => t.recv().await,
            AnyTransport::Rdma(t) => t.recv().await,
        }
    }

    fn disconnect(&self, peer: NodeId) {
        match self {
            AnyTransport::Tcp(t) => t.disconnect(peer),
            AnyTransport::Rdma(t) => t.disconnect(peer),
        }
    }

    fn connected_peers(&self) -> Vec<NodeId> {
        match self {
            AnyTransport::Tcp(t) => t.connected_peers(),
            AnyTransport::Rdma(t) => t.connected_peers(),
        }
    }

    fn alloc_registered(&self, len: usize) -> Result<RegisteredBuf, TransportError> {
        match self {
            AnyTransport::Tcp(t) => t.alloc_registered(len),
            AnyTransport::Rdma(t) => t.alloc_registered(len),
        }
    }

    fn shutdown(&self) {
        match self {
            AnyTransport::Tcp(t) => t.shutdown(),
            AnyTransport::Rdma(t) => t.shutdown(),
        }
    }
}
