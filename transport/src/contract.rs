use std::future::Future;
use std::net::SocketAddr;

use std::sync::Arc;

use crate::admission::Admission;
use crate::caps::Capabilities;
use crate::error::TransportError;
use crate::memory::RegisteredBuf;
use crate::message::{Event, OutMessage};
use crate::node::NodeId;
use crate::placement::Placer;

/// The one interface between psnet's protocols (kv store, collectives) and the wire.
///
/// A transport listens from the moment it is built, connects to peers named by node id and
/// address, and moves [`OutMessage`]s to them with per-peer ordered, reliable delivery.
///
/// # Contract
/// - **Ordering**: messages sent to one peer arrive in the order their sends completed; a
///   caller that awaits each send before starting the next gets program order.
/// - **Borrowing**: the message's metadata and segments are borrowed until the returned future
///   completes; implementations write them without an intermediate copy where they can. If a
///   send future is dropped before it completes, the connection to that peer is closed (a
///   half-written frame would corrupt the stream), and the peer sees it lost.
/// - **Back-pressure**: when a peer does not receive, sends to it stop completing rather than
///   buffering without bound; when this side does not call [`Transport::recv`], it stops
///   reading and its peers' sends wait.
/// - **Errors** are per peer: a dead peer fails only sends to it (with its id in the error),
///   and [`Transport::recv`] reports [`Event::PeerLost`] for it once.
/// - **Connections**: one per peer pair. If both sides connect at once, the connection dialled
///   by the smaller node id is kept and both `connect` calls succeed with it.
pub trait Transport: Send + Sync + 'static {
    /// This node's id, sent to peers when connecting.
    fn local_id(&self) -> NodeId;

    /// Changes the id sent on connections made from now on (bootstrap: a node learns its final
    /// id from the scheduler after its first connection). Existing connections keep theirs.
    fn set_local_id(&self, id: NodeId);

    /// Installs who may connect from now on (see [`Admission`]): hellos carry this node's
    /// proof, incoming hellos the policy refuses are answered with its reason and logged with
    /// the dialler's address, and a live connection is replaced only by one that passed the
    /// policy. Connections already made stay. Without one, every claimed id is believed.
    fn set_admission(&self, admission: Arc<dyn Admission>);

    /// Installs `placer`, asked for every data message from now on, when its metadata has
    /// arrived, whether one of its segments goes into device memory (see
    /// [`crate::placement`]); it replaces an earlier one. Returns whether this transport
    /// places segments at all: one that does not (the default) delivers every segment as host
    /// bytes, as it does for messages the placer leaves alone, and the receiver copies them.
    fn set_placer(&self, placer: Arc<dyn Placer>) -> bool {
        let _ = placer;
        false
    }

    /// The address peers reach this node at.
    fn listen_addr(&self) -> SocketAddr;

    /// What this transport can do.
    fn capabilities(&self) -> Capabilities;

    /// Connects to `peer` at `addr`, retrying until the connect timeout; returns at once if a
    /// connection to `peer` exists.
    fn connect(
        &self,
        peer: NodeId,
        addr: SocketAddr,
    ) -> impl Future<Output = Result<(), TransportError>> + Send + '_;

    /// Connects to a peer known to listen at `addr` (one connected before, or one that
    /// listened before it said where): like [`Transport::connect`], but an address that
    /// refuses the connection is an error at once ([`TransportError::Connect`]
    /// with [`std::io::ErrorKind::ConnectionRefused`]) instead of being retried until the
    /// timeout: nobody listens there any more, so the peer's process is gone. Transports that
    /// cannot tell a refusal fall back to `connect`.
    fn redial(
        &self,
        peer: NodeId,
        addr: SocketAddr,
    ) -> impl Future<Output = Result<(), TransportError>> + Send + '_ {
        self.connect(peer, addr)
    }

    /// Sends `msg` to `peer`; completes when the transport no longer needs the borrowed bytes.
    fn send<'a>(
        &'a self,
        peer: NodeId,
        msg: OutMessage<'a>,
    ) -> impl Future<Output = Result<(), TransportError>> + Send + 'a;

    /// The next event from any peer. Fails only with [`TransportError::Closed`] once the
    /// transport is shut down.
    fn recv(&self) -> impl Future<Output = Result<Event, TransportError>> + Send + '_;

    /// Closes the connection to `peer` (a no-op if there is none). No [`Event::PeerLost`]
    /// is reported for a connection closed this way.
    fn disconnect(&self, peer: NodeId);

    /// The peers currently connected.
    fn connected_peers(&self) -> Vec<NodeId>;

    /// A buffer of `len` bytes the transport can send from without copying or registering it
    /// again (registered with the NIC on RDMA, plain memory on TCP).
    fn alloc_registered(&self, len: usize) -> Result<RegisteredBuf, TransportError>;

    /// Stops listening and closes every connection; later calls fail with
    /// [`TransportError::Closed`]. Messages whose `send` completed before the call still
    /// reach their peers, in order, before those peers see this node lost: a job's last
    /// word (the scheduler's shutdown order) is never overtaken by its own disconnection.
    /// To keep that promise for a process that exits right after, the call may block for a
    /// bounded time while the peers' side acknowledges what was sent (at most a second over
    /// TCP; two over RDMA, whose control connections are TCP's), the full time only when a
    /// peer stopped reading.
    fn shutdown(&self);
}
