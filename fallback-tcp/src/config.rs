use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use psnet_transport::auth::Secret;
use psnet_transport::codec::DataPath;
use psnet_transport::Limits;

use crate::faults::FaultSpec;

/// Settings of a [`crate::TcpTransport`].
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Address to listen on; port 0 picks a free port.
    pub bind: SocketAddr,
    /// Frame limits, checked before anything is allocated.
    pub limits: Limits,
    /// How long `connect` keeps retrying a peer that refuses or does not answer.
    pub connect_timeout: Duration,
    /// How long a new connection may take to say who it is.
    pub handshake_timeout: Duration,
    /// Bytes of received messages that may wait for `recv` before connections stop reading.
    pub inbox_bytes: usize,
    /// Bytes of large incoming frames not yet complete that all connections together may
    /// hold (`PSNET_RECV_INFLIGHT_BYTES`): a connection whose next frame does not fit waits
    /// for room, and is closed, naming this limit, if none comes within `inflight_wait`; a
    /// frame larger than the whole budget is refused at once.
    pub inflight_bytes: usize,
    /// How long a connection waits for room in `inflight_bytes`.
    pub inflight_wait: Duration,
    /// `SO_SNDBUF` / `SO_RCVBUF`; `None` leaves the kernel's autotuning on.
    pub socket_buffer: Option<usize>,
    /// Bytes of the shared-memory ring offered to a peer on this host, per direction, once
    /// the first large message goes to it (0: never; the socket carries everything).
    pub shm_ring: usize,
    /// What this node's data travels over, announced in every hello: peers that differ are
    /// refused at the handshake (TCP, unless this transport is RDMA's control channel).
    pub data_path: DataPath,
    /// The job's shared secret (`PSNET_SECRET` / `PSNET_SECRET_FILE`): every connection, made
    /// or accepted, first proves it ([`psnet_transport::auth`]); a peer that cannot is refused
    /// and logged with its address. `None`: the job is open to any process that reaches it.
    pub secret: Option<Secret>,
    /// Faults to inject into sends (`PSNET_FAULTS`), for reliability tests; `None`: none.
    pub faults: Option<FaultSpec>,
}

impl TcpConfig {
    /// Defaults, listening on `bind`.
    pub fn new(bind: SocketAddr) -> Self {
        TcpConfig {
            bind,
            limits: Limits::default(),
            connect_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(10),
            inbox_bytes: 256 << 20,
            inflight_bytes: 2 << 30,
            inflight_wait: Duration::from_secs(60),
            socket_buffer: None,
            shm_ring: crate::shm::DEFAULT_RING,
            data_path: DataPath::Tcp,
            secret: None,
            faults: None,
        }
    }
}

impl Default for TcpConfig {
    /// Listens on 127.0.0.1 with a free port.
    fn default() -> Self {
        TcpConfig::new(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
    }
}
