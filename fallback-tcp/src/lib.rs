//! psnet's TCP transport: the [`Transport`](psnet_transport::Transport) contract over TCP.
//!
//! Chosen when the interface psnet runs on has no RDMA device (e.g. `eth0`), or forced with
//! `PSNET_TRANSPORT=tcp`. Built for speed:
//! - one connection per peer pair, `TCP_NODELAY`;
//! - a frame header and the caller's segments leave in one vectored write, no copy and no
//!   allocation per message;
//! - each connection reads into one growing buffer that is cut into the received segments
//!   without copying, and reused once the application drops them;
//! - received messages wait in a queue bounded in bytes; when it is full the connection stops
//!   reading, and TCP's flow control makes the sender wait (back-pressure, not unbounded memory);
//! - between processes on one host, large messages (64 KiB and up) travel through a ring of
//!   shared memory the sender offers after its first large message (`PSNET_SHM_RING` bytes, 0 to
//!   disable): one copy instead of two through the kernel, only a descriptor on the socket, in
//!   order with everything else; a full ring falls back to the socket. The ring is an anonymous
//!   memory file sealed against resizing, handed over by descriptor (`SCM_RIGHTS`) to the peer
//!   that presents the offer's token: no file in `/dev/shm`, nothing a name could redirect.
//!
//! For reliability tests, `PSNET_FAULTS` ([`FaultSpec`]) drops connections with a message in
//! flight, resets them periodically and delays sends, on real sockets.
#![deny(missing_docs)]

mod buffers;
mod config;
mod conn;
mod faults;
mod handshake;
mod inbox;
mod peers;
mod queued;
mod reader;
mod send;
mod shm;
mod socket;
mod transport;

pub use config::{Congestion, TcpConfig};
pub use faults::{FaultCounts, FaultSpec};
pub use transport::{SendPaths, TcpTransport};
