//! [`QpInfo`]: where a queue pair is, as both handshakes exchange it. A plain type shared by
//! the handshake codec ([`crate::control`]) and the links that fill and use it
//! ([`crate::link`]), so neither depends on the other.

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
