//! [`VerbsError`]: why an RDMA operation of this crate failed.
//!
//! Inside the crate, failures travel as this type; where they leave it through the transport
//! contract they become a [`TransportError`] chosen by *when* they happened, as before the type
//! existed: while binding, [`TransportError::Unavailable`]; while connecting a peer (a refusal
//! included), [`TransportError::Handshake`]; while sending or receiving,
//! [`TransportError::PeerLost`]. Each keeps this error's message as its reason
//! ([`VerbsError::into_unavailable`], [`VerbsError::into_handshake`],
//! [`VerbsError::into_lost`]).

use std::error::Error as StdError;
use std::io;

use psnet_transport::{NodeId, TransportError};

use crate::control::Refusal;

#[cfg(feature = "cuda")]
pub(crate) mod gpu;
pub(crate) mod wire;

pub use wire::WireError;

/// Why an RDMA operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// A libibverbs, librdmacm or operating-system call (or a step made of such calls)
    /// failed.
    #[error("{detail}: {cause}")]
    Os {
        /// The call or step that failed (`ibv_reg_mr`, `rdma_connect`, an rdma_cm error
        /// event's name).
        op: &'static str,
        /// The error number it reported, where it reported one.
        errno: Option<i32>,
        /// What was being done (`queue pair to RTR`, `rdma_cm cannot bind 10.0.0.1:9000`).
        detail: String,
        /// The library's own message, with its causes.
        cause: String,
    },
    /// This host cannot do what was asked: no such device, an address that no RDMA port (or
    /// another port than this transport's) carries, rdma_cm missing.
    #[error("{0}")]
    Setup(String),
    /// `RLIMIT_MEMLOCK` is too low for the registered buffers.
    #[error(
        "RLIMIT_MEMLOCK is {} KiB but psnet's RDMA buffers need at least {} KiB: raise it with \
         `ulimit -l unlimited` (or `* - memlock unlimited` in /etc/security/limits.conf, \
         `LimitMEMLOCK=infinity` for systemd, `--ulimit memlock=-1` for docker), or use \
         PSNET_TRANSPORT=tcp",
        .limit / 1024,
        .need / 1024
    )]
    Memlock {
        /// The limit, in bytes.
        limit: u64,
        /// What the transport needs, in bytes.
        need: u64,
    },
    /// A setting has a value that is not understood.
    #[error("{name}: {value:?} is not {expected}")]
    BadSetting {
        /// The setting (`PSNET_RDMA_CONNECT`).
        name: &'static str,
        /// The value given.
        value: String,
        /// The values understood.
        expected: &'static str,
    },
    /// The peer refused the connection request.
    #[error("{target} refused the RDMA connection{}", refusal_text(.refusal, *.status))]
    Refused {
        /// Whom the request went to (an address or a node).
        target: String,
        /// The peer's reason, when it is a psnet peer that said why.
        refusal: Option<Refusal>,
        /// rdma_cm's reject reason (the event's status).
        status: i32,
    },
    /// The peer's receive buffers do not fit this side's: the nodes run with different
    /// settings.
    #[error(
        "peer's buffers ({recv_depth} x {slot_size} bytes) do not match this side's ({local_slot_size} \
         bytes, at least 4): set PSNET_RDMA_EAGER alike on every node"
    )]
    IncompatiblePeer {
        /// Receive buffers the peer posted.
        recv_depth: u32,
        /// Bytes per receive buffer of the peer.
        slot_size: u32,
        /// Bytes per receive buffer of this side.
        local_slot_size: usize,
    },
    /// A work request completed with an error status (the peer is gone, a retry count ran
    /// out, a key was refused).
    #[error("{kind} work request failed: {name} (status {status})")]
    WorkRequest {
        /// `Recv`, `Send` or `Write`.
        kind: &'static str,
        /// The status's name (`RetryExceeded`).
        name: String,
        /// The `ibv_wc_status` value.
        status: u32,
    },
    /// The peer sent a message whose header breaks the format or this side's limits.
    #[error(transparent)]
    BadFrame(#[from] WireError),
    /// The peer broke the protocol: a message that contradicts the link's state (an unknown
    /// rendezvous, a buffer offered twice, a body shorter than its header says).
    #[error("{0}")]
    Protocol(String),
    /// The link failed earlier, for this reason; sends in flight end with it.
    #[error("{0}")]
    LinkFailed(String),
    /// An invariant of this crate did not hold (a bug).
    #[error("{0}")]
    Internal(&'static str),
}

/// The part of a refusal's message after "refused the RDMA connection".
fn refusal_text(refusal: &Option<Refusal>, status: i32) -> String {
    match refusal {
        Some(why) => format!(": {}", why.describe()),
        None => format!(
            " (rdma_cm reject reason {status}{})",
            if status == 8 {
                ": nothing listens there through rdma_cm; if the peer runs without rdma_cm, set \
                 PSNET_RDMA_CONNECT=socket"
            } else {
                ""
            }
        ),
    }
}

impl VerbsError {
    /// `op` failed with `err` (a `sideway` error or an [`io::Error`]) while doing `detail`.
    pub(crate) fn os(
        op: &'static str,
        detail: impl Into<String>,
        err: &(dyn StdError + 'static),
    ) -> VerbsError {
        VerbsError::Os {
            op,
            errno: errno_of(err),
            detail: detail.into(),
            cause: chain(err),
        }
    }

    /// `op` failed while doing `detail` with error number `errno`.
    pub(crate) fn errno(op: &'static str, detail: impl Into<String>, errno: i32) -> VerbsError {
        VerbsError::os(op, detail, &io::Error::from_raw_os_error(errno))
    }

    /// This error as part of `step`: an [`VerbsError::Os`] failure's detail starts with it;
    /// the other kinds say enough on their own.
    pub(crate) fn during(self, step: &str) -> VerbsError {
        match self {
            VerbsError::Os {
                op,
                errno,
                detail,
                cause,
            } => VerbsError::Os {
                op,
                errno,
                detail: format!("{step}: {detail}"),
                cause,
            },
            other => other,
        }
    }

    /// The error number of an [`VerbsError::Os`] failure, where the call reported one.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            VerbsError::Os { errno, .. } => *errno,
            _ => None,
        }
    }

    /// The contract's error for a failure while binding: [`TransportError::Unavailable`].
    pub fn into_unavailable(self) -> TransportError {
        TransportError::Unavailable(self.to_string())
    }

    /// The contract's error for a failure while connecting `peer` (a refusal included):
    /// [`TransportError::Handshake`].
    pub fn into_handshake(self, peer: NodeId) -> TransportError {
        TransportError::Handshake {
            peer,
            reason: self.to_string(),
        }
    }

    /// The contract's error for a failure while sending to or receiving from `peer`:
    /// [`TransportError::PeerLost`].
    pub fn into_lost(self, peer: NodeId) -> TransportError {
        TransportError::PeerLost {
            peer,
            reason: self.to_string(),
        }
    }
}

/// `err` and its causes, as one line.
fn chain(err: &(dyn StdError + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let next = cause.to_string();
        // Transparent wrappers repeat their cause's message.
        if !text.ends_with(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = cause.source();
    }
    text
}

/// The error number in `err` or its causes.
///
/// `sideway` wraps the `io::Error` of a failed call in an error kind that forwards to it
/// transparently, which hides it from `source()`; its message still ends with
/// `(os error N)`, which is read then.
fn errno_of(err: &(dyn StdError + 'static)) -> Option<i32> {
    let mut level = Some(err);
    let mut last = err;
    while let Some(e) = level {
        if let Some(code) = e
            .downcast_ref::<io::Error>()
            .and_then(io::Error::raw_os_error)
        {
            return Some(code);
        }
        last = e;
        level = e.source();
    }
    let text = last.to_string();
    let at = text.rfind("(os error ")?;
    text[at + "(os error ".len()..]
        .strip_suffix(')')?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("failed to do it")]
    struct Outer(#[source] Kind);

    #[derive(Debug, thiserror::Error)]
    #[error(transparent)]
    enum Kind {
        Io(#[from] io::Error),
    }

    #[test]
    fn os_errors_keep_the_call_the_number_and_every_cause() {
        let e = VerbsError::os(
            "ibv_create_qp",
            "create queue pair",
            &Outer(Kind::Io(io::Error::from_raw_os_error(libc::ENOMEM))),
        );
        assert_eq!(e.raw_os_error(), Some(libc::ENOMEM));
        let text = e.to_string();
        assert!(
            text.starts_with("create queue pair: failed to do it: "),
            "{text}"
        );
        assert!(
            text.ends_with(&format!("(os error {})", libc::ENOMEM)),
            "{text}"
        );
        assert!(matches!(
            e,
            VerbsError::Os {
                op: "ibv_create_qp",
                ..
            }
        ));

        let e = VerbsError::errno(
            "rdma_resolve_addr",
            "rdma_cm cannot resolve x",
            libc::ENODEV,
        );
        assert_eq!(e.raw_os_error(), Some(libc::ENODEV));
        let e = VerbsError::os("rdma_cm", "d", &io::Error::other("rdma_cm id already gone"));
        assert_eq!(e.raw_os_error(), None);
        assert_eq!(e.to_string(), "d: rdma_cm id already gone");
    }

    #[test]
    fn refusals_say_why() {
        let e = VerbsError::Refused {
            target: "10.0.0.2:9000".into(),
            refusal: Some(Refusal::CannotConnect),
            status: 28,
        };
        let text = e.to_string();
        assert!(
            text.contains("10.0.0.2:9000 refused the RDMA connection: "),
            "{text}"
        );
        assert!(text.contains("PSNET_RDMA_EAGER"), "{text}");
        let e = VerbsError::Refused {
            target: "node 3".into(),
            refusal: None,
            status: 8,
        };
        let text = e.to_string();
        assert!(
            text.contains("(rdma_cm reject reason 8: nothing listens"),
            "{text}"
        );
        assert!(text.contains("PSNET_RDMA_CONNECT=socket"), "{text}");
    }

    #[test]
    fn contract_errors_keep_the_message() {
        let e = VerbsError::Memlock {
            limit: 64 << 10,
            need: 1 << 30,
        };
        let text = e.to_string();
        assert!(text.starts_with("RLIMIT_MEMLOCK is 64 KiB"), "{text}");
        assert!(
            text.contains("1048576 KiB") && text.contains("ulimit -l"),
            "{text}"
        );
        match e.clone().into_unavailable() {
            TransportError::Unavailable(reason) => assert_eq!(reason, text),
            other => panic!("{other:?}"),
        }
        match e.clone().into_handshake(NodeId(4)) {
            TransportError::Handshake { peer, reason } => {
                assert_eq!((peer, reason), (NodeId(4), text.clone()))
            }
            other => panic!("{other:?}"),
        }
        match e.into_lost(NodeId(5)) {
            TransportError::PeerLost { peer, reason } => {
                assert_eq!((peer, reason), (NodeId(5), text))
            }
            other => panic!("{other:?}"),
        }
        let frame = VerbsError::from(WireError::UnknownKind(77));
        assert_eq!(frame.to_string(), WireError::UnknownKind(77).to_string());
    }
}
