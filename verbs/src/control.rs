//! The queue-pair handshake carried over the TCP control connection, as plain bytes.
//!
//! The side that calls `connect` sends a request with its queue pair; the other side builds
//! its queue pair, connects it and answers; the requester connects its own and confirms. When
//! both sides request at once, the request with the larger nonce wins and the other is dropped
//! by both sides alike.
//!
//! With rdma_cm ([`CmMessage`]), the same handshake rides in the private data of the
//! connection manager's REQ, REP and REJ: the connect request names the requesting node
//! (which the TCP control connection has authenticated) and its nonce; the same nonce rule
//! settles simultaneous connects.

use crate::qp::QpInfo;

const TAG: u8 = b'V';
const INFO_LEN: usize = 4 + 4 + 2 + 16 + 4 + 4 + 4;

/// A handshake message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    /// "Connect your queue pair to this one" (requester's nonce and queue pair).
    Request {
        /// The requester's link nonce.
        nonce: u64,
        /// Its queue pair.
        info: QpInfo,
    },
    /// "Done; here is mine" (the request's nonce, the responder's nonce and queue pair).
    Reply {
        /// Nonce of the request answered.
        request: u64,
        /// The responder's link nonce.
        nonce: u64,
        /// Its queue pair.
        info: QpInfo,
    },
    /// "Mine is connected to yours": the responder may send.
    Ready {
        /// The responder's link nonce.
        nonce: u64,
    },
}

fn put_info(out: &mut Vec<u8>, i: &QpInfo) {
    out.extend_from_slice(&i.qpn.to_le_bytes());
    out.extend_from_slice(&i.psn.to_le_bytes());
    out.extend_from_slice(&i.lid.to_le_bytes());
    out.extend_from_slice(&i.gid);
    out.extend_from_slice(&i.mtu.to_le_bytes());
    out.extend_from_slice(&i.recv_depth.to_le_bytes());
    out.extend_from_slice(&i.slot_size.to_le_bytes());
}

fn get_info(b: &[u8]) -> QpInfo {
    let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    QpInfo {
        qpn: u32_at(0),
        psn: u32_at(4),
        lid: u16::from_le_bytes([b[8], b[9]]),
        gid: b[10..26].try_into().expect("16 bytes"),
        mtu: u32_at(26),
        recv_depth: u32_at(30),
        slot_size: u32_at(34),
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl Control {
    /// Encodes the message.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![TAG];
        match self {
            Control::Request { nonce, info } => {
                out.push(1);
                out.extend_from_slice(&nonce.to_le_bytes());
                put_info(&mut out, info);
            }
            Control::Reply {
                request,
                nonce,
                info,
            } => {
                out.push(2);
                out.extend_from_slice(&request.to_le_bytes());
                out.extend_from_slice(&nonce.to_le_bytes());
                put_info(&mut out, info);
            }
            Control::Ready { nonce } => {
                out.push(3);
                out.extend_from_slice(&nonce.to_le_bytes());
            }
        }
        out
    }

    /// Decodes a message; `None` for anything malformed.
    pub fn decode(b: &[u8]) -> Option<Control> {
        if b.len() < 2 || b[0] != TAG {
            return None;
        }
        let body = &b[2..];
        match (b[1], body.len()) {
            (1, n) if n == 8 + INFO_LEN => Some(Control::Request {
                nonce: u64_at(body, 0),
                info: get_info(&body[8..]),
            }),
            (2, n) if n == 16 + INFO_LEN => Some(Control::Reply {
                request: u64_at(body, 0),
                nonce: u64_at(body, 8),
                info: get_info(&body[16..]),
            }),
            (3, 8) => Some(Control::Ready {
                nonce: u64_at(body, 0),
            }),
            _ => None,
        }
    }
}

/// Where this side's link to a peer stands when a connect request from that peer arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnLink {
    /// No link.
    None,
    /// This side requested one too, with this nonce.
    Requested(u64),
    /// A connected link.
    Connected,
}

/// Whether a request from the peer (with `nonce`) is answered, given this side's link; both
/// handshakes (socket and rdma_cm) settle crossing requests with it.
pub fn answers_request(own: OwnLink, nonce: u64) -> bool {
    match own {
        OwnLink::None => true,
        // Both sides requested at once: the larger nonce wins on both sides.
        OwnLink::Requested(ours) => ours <= nonce,
        // A request from before the link came up; a peer that lost its link reconnects its
        // control connection, which removes this one first.
        OwnLink::Connected => false,
    }
}

/// Marks psnet's rdma_cm private data (a peer of another program is refused).
const CM_MAGIC: [u8; 2] = *b"PS";
/// Version of the private-data layout.
const CM_VERSION: u8 = 1;

/// Why a connect request was refused, carried in the REJ's private data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Both sides connected at once and this side's request wins (larger nonce); the
    /// requester waits for it, or asks again later.
    Crossed = 1,
    /// No TCP control connection from the requesting node (it must dial that first).
    NoControlConnection = 2,
    /// The request's private data was not psnet's.
    Malformed = 3,
    /// The queue pair could not be built or connected (buffer sizes differ, no resources).
    CannotConnect = 4,
}

impl Refusal {
    /// What the refusal means, for error messages.
    pub fn describe(self) -> &'static str {
        match self {
            Refusal::Crossed => "the peer's own connect request crossed ours and wins",
            Refusal::NoControlConnection => "the peer has no control connection from this node",
            Refusal::Malformed => "the peer did not understand the connect request",
            Refusal::CannotConnect => {
                "the peer could not connect a queue pair to ours (set PSNET_RDMA_EAGER alike on every node)"
            }
        }
    }
}

/// The handshake in rdma_cm private data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmMessage {
    /// In the connect request (at most 56 bytes): who asks, and its receive buffers.
    Hello {
        /// The requesting node.
        from: u64,
        /// Its link nonce.
        nonce: u64,
        /// Receive buffers it posted.
        recv_depth: u32,
        /// Bytes per receive buffer.
        slot_size: u32,
    },
    /// In the accept: the responder's nonce and receive buffers.
    Welcome {
        /// The responder's link nonce.
        nonce: u64,
        /// Receive buffers it posted.
        recv_depth: u32,
        /// Bytes per receive buffer.
        slot_size: u32,
    },
    /// In the reject.
    Refused(Refusal),
}

impl CmMessage {
    /// Encodes the message (28 bytes at most).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(28);
        out.extend_from_slice(&CM_MAGIC);
        out.push(CM_VERSION);
        match self {
            CmMessage::Hello {
                from,
                nonce,
                recv_depth,
                slot_size,
            } => {
                out.push(1);
                out.extend_from_slice(&from.to_le_bytes());
                out.extend_from_slice(&nonce.to_le_bytes());
                out.extend_from_slice(&recv_depth.to_le_bytes());
                out.extend_from_slice(&slot_size.to_le_bytes());
            }
            CmMessage::Welcome {
                nonce,
                recv_depth,
                slot_size,
            } => {
                out.push(2);
                out.extend_from_slice(&nonce.to_le_bytes());
                out.extend_from_slice(&recv_depth.to_le_bytes());
                out.extend_from_slice(&slot_size.to_le_bytes());
            }
            CmMessage::Refused(why) => {
                out.push(3);
                out.push(*why as u8);
            }
        }
        out
    }

    /// Decodes a message; `None` for anything not psnet's. The connection manager pads
    /// private data with zeros to its field size, so bytes after the message are ignored.
    pub fn decode(b: &[u8]) -> Option<CmMessage> {
        if b.len() < 4 || b[..2] != CM_MAGIC || b[2] != CM_VERSION {
            return None;
        }
        let body = &b[4..];
        let u32_at = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().expect("4 bytes"));
        match b[3] {
            1 if body.len() >= 24 => Some(CmMessage::Hello {
                from: u64_at(body, 0),
                nonce: u64_at(body, 8),
                recv_depth: u32_at(16),
                slot_size: u32_at(20),
            }),
            2 if body.len() >= 16 => Some(CmMessage::Welcome {
                nonce: u64_at(body, 0),
                recv_depth: u32_at(8),
                slot_size: u32_at(12),
            }),
            3 if !body.is_empty() => Some(CmMessage::Refused(match body[0] {
                1 => Refusal::Crossed,
                2 => Refusal::NoControlConnection,
                3 => Refusal::Malformed,
                4 => Refusal::CannotConnect,
                _ => return None,
            })),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn info() -> impl Strategy<Value = QpInfo> {
        (
            any::<u32>(),
            any::<u32>(),
            any::<u16>(),
            any::<[u8; 16]>(),
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
        )
            .prop_map(|(qpn, psn, lid, gid, mtu, recv_depth, slot_size)| QpInfo {
                qpn,
                psn,
                lid,
                gid,
                mtu,
                recv_depth,
                slot_size,
            })
    }

    proptest! {
        #[test]
        fn roundtrips(nonce: u64, request: u64, i in info()) {
            for m in [
                Control::Request { nonce, info: i },
                Control::Reply { request, nonce, info: i },
                Control::Ready { nonce },
            ] {
                prop_assert_eq!(Control::decode(&m.encode()), Some(m));
            }
        }

        #[test]
        fn crossing_requests_leave_exactly_one_answered(a: u64, b: u64) {
            prop_assume!(a != b);
            // Each side holds its own request and receives the other's.
            let a_answers = answers_request(OwnLink::Requested(a), b);
            let b_answers = answers_request(OwnLink::Requested(b), a);
            prop_assert!(a_answers != b_answers);
            prop_assert!(answers_request(OwnLink::None, a));
            prop_assert!(!answers_request(OwnLink::Connected, a));
        }

        #[test]
        fn cm_messages_roundtrip_through_padding(from: u64, nonce: u64, depth: u32, slot: u32, pad in 0usize..40) {
            for m in [
                CmMessage::Hello { from, nonce, recv_depth: depth, slot_size: slot },
                CmMessage::Welcome { nonce, recv_depth: depth, slot_size: slot },
                CmMessage::Refused(Refusal::Crossed),
                CmMessage::Refused(Refusal::CannotConnect),
            ] {
                let mut bytes = m.encode();
                // A connect request's private data is at most 56 bytes.
                prop_assert!(bytes.len() <= 56);
                bytes.resize(bytes.len() + pad, 0);
                prop_assert_eq!(CmMessage::decode(&bytes), Some(m));
            }
        }

        #[test]
        fn cm_garbage_is_refused_not_panicked(bytes in proptest::collection::vec(any::<u8>(), 0..60)) {
            if let Some(m) = CmMessage::decode(&bytes) {
                let encoded = m.encode();
                prop_assert_eq!(&bytes[..encoded.len()], &encoded[..]);
            }
        }

        #[test]
        fn garbage_is_refused_not_panicked(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            if let Some(m) = Control::decode(&bytes) {
                prop_assert_eq!(m.encode(), bytes);
            }
        }
    }
}
