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
//! - between processes on one host, each side offers the other a message queue in shared
//!   memory when they connect (`PSNET_SHM_QUEUE` bytes): once mapped, every message goes
//!   through it in send order, small ones copied in whole, and the reader polls it for
//!   `PSNET_SHM_SPIN_US` after each message before it sleeps on an eventfd, so no message
//!   waits for the kernel's TCP stack;
//! - large messages (256 KiB and up with the queue, 64 KiB without) travel through a ring of
//!   shared memory the sender offers after its first large message (`PSNET_SHM_RING` bytes, 0 to
//!   disable both): one copy instead of two, only a descriptor in the queue or on the socket;
//!   a full ring falls back to the socket. Ring and queue are anonymous memory files sealed
//!   against resizing, handed over by descriptor (`SCM_RIGHTS`) to the peer that presents the
//!   offer's token: no file in `/dev/shm`, nothing a name could redirect.
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
mod sys;
mod transport;

pub use config::{Congestion, TcpConfig};
pub use faults::{FaultCounts, FaultSpec};
pub use transport::{PeerSession, SendPaths, TcpTransport};
