//! The queue-pair handshake carried over the TCP control connection, as plain bytes.
//!
//! The side that calls `connect` sends a request with its queue pair; the other side builds
//! its queue pair, connects it and answers; the requester connects its own and confirms. When
//! both sides request at once, the request with the larger nonce wins and the other is dropped
//! by both sides alike.

use crate::link::QpInfo;

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
        fn garbage_is_refused_not_panicked(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            if let Some(m) = Control::decode(&bytes) {
                prop_assert_eq!(m.encode(), bytes);
            }
        }
    }
}
