//! Sending and receiving kv messages over any transport.

use bytes::Bytes;
use psnet_transport::{Event, NodeId, OutMessage, Segment, Transport};

use crate::error::KvError;
use crate::proto::ids::describe;
use crate::proto::msg::{peek_exchange, Exchange, Msg};

/// Sends `msg` with an optional value segment.
pub async fn send<T: Transport>(
    t: &T,
    to: NodeId,
    msg: &Msg,
    value: Option<&[u8]>,
) -> Result<(), KvError> {
    send_segment(t, to, msg, value.map(Segment::new)).await
}

/// [`send`] with the value as a segment: host bytes, or device memory the transport copies
/// out (or lets its NIC read).
pub async fn send_segment<T: Transport>(
    t: &T,
    to: NodeId,
    msg: &Msg,
    value: Option<Segment<'_>>,
) -> Result<(), KvError> {
    let meta = msg.encode();
    tracing::trace!(to = %describe(to), ?msg, bytes = value.map_or(0, |v| v.len()), "send");
    let seg;
    let segs: &[Segment<'_>] = match value {
        Some(v) => {
            seg = [v];
            &seg
        }
        None => &[],
    };
    let mut out = OutMessage::new(&meta, segs);
    if msg.is_confidential() {
        out = out.confidential();
    }
    t.send(to, out).await?;
    Ok(())
}

/// What a node receives, decoded.
pub enum Received {
    /// A kv message, with its value segment if any.
    Msg {
        /// Sender.
        from: NodeId,
        /// The message.
        msg: Msg,
        /// Segment 0, if present.
        value: Option<Bytes>,
    },
    /// A kv message that could not be read: its metadata does not decode, or it carries more
    /// data segments than such a message does.
    Malformed {
        /// Sender.
        from: NodeId,
        /// The request it asks or answers, when its first bytes tell.
        exchange: Option<Exchange>,
        /// What was wrong.
        reason: String,
    },
    /// A connection came up.
    Connected(NodeId),
    /// A connection ended.
    Lost {
        /// The peer.
        peer: NodeId,
        /// Why.
        reason: String,
    },
}

/// The next event, decoded. Malformed messages are handed on as [`Received::Malformed`]:
/// they come from a broken or foreign peer, which must hear why rather than wait, and must
/// not stop this node.
pub async fn recv<T: Transport>(t: &T) -> Result<Received, KvError> {
    Ok(match t.recv().await? {
        Event::Message(m) => decode(m.peer, &m.meta, m.segments.into_iter()),
        Event::PeerConnected { peer, .. } => Received::Connected(peer),
        Event::PeerLost { peer, reason } => Received::Lost { peer, reason },
    })
}

/// One message from `from`: its metadata `meta` (without a `PS_RESEND` envelope) and its
/// data segments, decoded and checked.
pub fn decode(
    from: NodeId,
    meta: &[u8],
    segments: impl ExactSizeIterator<Item = Bytes>,
) -> Received {
    let count = segments.len();
    match Msg::decode(meta).and_then(|msg| msg.check_segments(count).map(|()| msg)) {
        Ok(msg) => {
            tracing::trace!(from = %describe(from), ?msg, "recv");
            Received::Msg {
                from,
                msg,
                value: segments.into_iter().next(),
            }
        }
        Err(e) => Received::Malformed {
            from,
            exchange: peek_exchange(meta),
            reason: e.to_string(),
        },
    }
}
