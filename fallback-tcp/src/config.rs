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
    /// How long a frame being received may go without a byte (`PSNET_FRAME_STALL_TIMEOUT`):
    /// then its connection is closed, naming the stall, and its room in `inflight_bytes` is
    /// given back. Between frames a connection may be idle for ever.
    pub frame_stall: Duration,
    /// `SO_SNDBUF` / `SO_RCVBUF`; `None` leaves the kernel's autotuning on.
    pub socket_buffer: Option<usize>,
    /// The congestion control each connection asks the kernel for (`PSNET_TCP_CONGESTION`).
    pub congestion: Congestion,
    /// Bytes of the shared-memory ring offered to a peer on this host, per direction, once
    /// the first large message goes to it (0: never; the socket carries everything).
    pub shm_ring: usize,
    /// Bytes of the shared-memory message queue offered to a peer on this host when the
    /// connection opens, per direction (a power of two from 4096 to 64 MiB; 0, or `shm_ring`
    /// 0: none). Once the peer maps it, every message goes through it.
    pub shm_queue: usize,
    /// How long a reader polls the queue after its last message before it sleeps.
    pub shm_spin: Duration,
    /// Bytes per chunk when device memory in a message is staged through host buffers, sent
    /// or placed on arrival (`PSNET_GPU_STAGE_CHUNK`).
    pub gpu_stage_chunk: usize,
    /// What this node's data travels over, announced in every hello: peers that differ are
    /// refused at the handshake (TCP, unless this transport is RDMA's control channel).
    pub data_path: DataPath,
    /// The job's shared secret (`PSNET_SECRET` / `PSNET_SECRET_FILE`): every connection, made
    /// or accepted, first proves it ([`psnet_transport::auth`]); a peer that cannot is refused
    /// and logged with its address. `None`: the job is open to any process that reaches it.
    pub secret: Option<Secret>,
    /// Encrypt the data frames this node sends (`PSNET_ENCRYPT`); only with a secret, whose
    /// session keys it uses ([`psnet_transport::session`]).
    pub encrypt: bool,
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
            frame_stall: Duration::from_secs(60),
            socket_buffer: None,
            congestion: Congestion::Auto,
            shm_ring: crate::shm::DEFAULT_RING,
            shm_queue: crate::shm::queue::DEFAULT_QUEUE,
            shm_spin: Duration::from_micros(50),
            gpu_stage_chunk: psnet_transport::device::DEFAULT_STAGE_CHUNK,
            data_path: DataPath::Tcp,
            secret: None,
            encrypt: false,
            faults: None,
        }
    }
}

/// Which TCP congestion control a connection uses.
///
/// Between two processes on one host, congestion control has no network to protect, but the
/// algorithm still shapes how segments are sent. Under BBR (a common system default, and this
/// machine's), psnet's loopback connections carrying large messages both ways saw their
/// segments arrive out of order (the kernel's TCPOFOQueue and SACK-reordering counters), and
/// the duplicate acknowledgements that followed retransmitted data that was never lost: 910
/// retransmitted segments over 2,000 2-rank 1 MiB allreduces, against 1 with cubic, which
/// also ran them 1.6x as fast. So same-host connections ask for a loss-based algorithm, and
/// connections to other hosts keep the system's choice, which knows the network.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Congestion {
    /// Same-host connections use cubic, or reno where cubic is not allowed (reno always is);
    /// the others keep the system's default. Where neither can be set, the default stays.
    #[default]
    Auto,
    /// Every connection keeps the system's default (`net.ipv4.tcp_congestion_control`).
    System,
    /// Every connection uses this algorithm; a connection the kernel refuses it to fails,
    /// naming it.
    Named(String),
}

/// Algorithms tried, in order, for a same-host connection under [`Congestion::Auto`].
const SAME_HOST_CHOICES: [&str; 2] = ["cubic", "reno"];

impl Congestion {
    /// The algorithms to try, in order, for a connection (empty: keep the default), and
    /// whether failing to set any of them is an error.
    pub(crate) fn choices(&self, same_host: bool) -> (Vec<&str>, bool) {
        match self {
            Congestion::Auto if same_host => (SAME_HOST_CHOICES.to_vec(), false),
            Congestion::Auto | Congestion::System => (Vec::new(), false),
            Congestion::Named(name) => (vec![name.as_str()], true),
        }
    }
}

impl std::str::FromStr for Congestion {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        match s {
            "" | "auto" => Ok(Congestion::Auto),
            "system" => Ok(Congestion::System),
            // TCP_CA_NAME_MAX is 16 bytes with its terminating zero.
            name if name.len() < 16
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') =>
            {
                Ok(Congestion::Named(name.to_string()))
            }
            other => Err(format!(
                "{other:?} is not auto, system or an algorithm's name (such as cubic, reno or bbr, at most 15 characters)"
            )),
        }
    }
}

impl Default for TcpConfig {
    /// Listens on 127.0.0.1 with a free port.
    fn default() -> Self {
        TcpConfig::new(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn congestion_parses_and_chooses() {
        assert_eq!("".parse::<Congestion>(), Ok(Congestion::Auto));
        assert_eq!("auto".parse::<Congestion>(), Ok(Congestion::Auto));
        assert_eq!("system".parse::<Congestion>(), Ok(Congestion::System));
        assert_eq!(
            "bbr".parse::<Congestion>(),
            Ok(Congestion::Named("bbr".into()))
        );
        assert!("no such algorithm".parse::<Congestion>().is_err());
        assert!("a_very_long_name_x".parse::<Congestion>().is_err());

        assert_eq!(
            Congestion::Auto.choices(true),
            (vec!["cubic", "reno"], false)
        );
        assert_eq!(Congestion::Auto.choices(false), (vec![], false));
        assert_eq!(Congestion::System.choices(true), (vec![], false));
        assert_eq!(
            Congestion::Named("bbr".into()).choices(false),
            (vec!["bbr"], true)
        );
    }
}
