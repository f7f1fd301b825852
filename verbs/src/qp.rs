//! [`QpInfo`]: where a queue pair is, as both handshakes exchange it. Plain data at the
//! bottom of the crate's layers: the handshake codec (`control`), the protocol (`proto`) and
//! the links that fill and use it (`link`, which re-exports it) all sit above it.

/// Where a queue pair is, exchanged over the TCP control connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpInfo {
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number it sends with.
    pub psn: u32,
    /// LID (InfiniBand).
    pub lid: u16,
    /// GID (RoCE, or routed InfiniBand).
    pub gid: [u8; 16],
    /// Path MTU as the `ibv_mtu` value.
    pub mtu: u32,
    /// Receive buffers it posted.
    pub recv_depth: u32,
    /// Bytes per receive buffer.
    pub slot_size: u32,
}
