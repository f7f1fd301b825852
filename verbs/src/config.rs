//! [`VerbsConfig`], the settings of a [`VerbsTransport`](crate::VerbsTransport), their
//! defaults, and [`Handshake`], how queue pairs are connected.

use std::net::SocketAddr;

use psnet_fallback_tcp::TcpConfig;

use crate::device::DeviceSpec;
use crate::error::VerbsError;

/// Settings of a [`VerbsTransport`](crate::VerbsTransport).
#[derive(Clone, Debug)]
pub struct VerbsConfig {
    /// The TCP control connections: listening address (the interface's IP), limits, connect
    /// timeout, inbox bound. Its shared-memory ring is not used.
    pub tcp: TcpConfig,
    /// The device port.
    pub device: DeviceSpec,
    /// Bytes per eager buffer (`PSNET_RDMA_EAGER`).
    pub eager_bytes: usize,
    /// Receive buffers per peer (`PSNET_RDMA_RECV_DEPTH`).
    pub recv_depth: u32,
    /// Cached registrations of plain user buffers (`PSNET_RDMA_REG_CACHE`); 0: none.
    pub reg_cache: usize,
    /// Idle rendezvous receive buffers kept for reuse, in bytes.
    pub pool_bytes: usize,
    /// Largest message sent inline (`PSNET_RDMA_INLINE`); 0: none.
    pub inline_bytes: u32,
    /// Microseconds of polling after the last completion before sleeping
    /// (`PSNET_RDMA_SPIN_US`).
    pub spin_us: u64,
    /// Bytes of receive buffers offered to each peer in advance (`PSNET_RDMA_OFFER_BYTES`);
    /// 0: every large message takes the rendezvous round trip.
    pub offer_bytes: u64,
    /// How this side connects queue pairs (`PSNET_RDMA_CONNECT`); it accepts both ways.
    pub handshake: Handshake,
}

/// How queue pairs are connected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handshake {
    /// rdma_cm where this node can use it (librdmacm, the kernel's rdma_ucm, a listener on
    /// the interface's address), sockets otherwise.
    Auto,
    /// rdma_cm resolves the route from the interface's address and runs the connection
    /// exchange; disconnects and rejections arrive as its events.
    RdmaCm,
    /// Queue-pair numbers, GIDs and sequence numbers travel over the TCP control connection.
    Socket,
}

impl std::str::FromStr for Handshake {
    type Err = VerbsError;
    fn from_str(s: &str) -> Result<Self, VerbsError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Handshake::Auto),
            "rdma_cm" | "rdmacm" | "cm" => Ok(Handshake::RdmaCm),
            "socket" | "tcp" => Ok(Handshake::Socket),
            other => Err(VerbsError::BadSetting {
                name: psnet_config::env::PSNET_RDMA_CONNECT.name,
                value: other.to_string(),
                expected: "auto, rdma_cm or socket",
            }),
        }
    }
}

impl VerbsConfig {
    /// Defaults for `device`, listening on `bind`.
    pub fn new(bind: SocketAddr, device: DeviceSpec) -> Self {
        VerbsConfig {
            tcp: TcpConfig::new(bind),
            device,
            eager_bytes: 16 << 10,
            recv_depth: 64,
            reg_cache: 0,
            pool_bytes: 256 << 20,
            inline_bytes: 128,
            spin_us: 200,
            offer_bytes: 16 << 20,
            handshake: Handshake::Auto,
        }
    }
}
