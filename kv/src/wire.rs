//! Sending and receiving kv messages over any transport.

use bytes::Bytes;
use psnet_transport::{Event, NodeId, OutMessage, Segment, Transport};

use crate::error::KvError;
use crate::proto::ids::describe;
use crate::proto::msg::Msg;

/// Sends `msg` with an optional value segment.
pub async fn send<T: Transport>(
    t: &T,
    to: NodeId,
    msg: &Msg,
    value: Option<&[u8]>,
) -> Result<(), KvError> {
    let meta = msg.encode();
    tracing::trace!(to = %describe(to), ?msg, bytes = value.map_or(0, <[u8]>::len), "send");
    let seg;
    let segs: &[Segment<'_>] = match value {
        Some(v) => {
            seg = [Segment::new(v)];
            &seg
        }
        None => &[],
    };
    t.send(to, OutMessage::new(&meta, segs)).await?;
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

/// The next event, decoded. Malformed messages are logged and skipped: they come from a
/// broken or foreign peer and must not stop this node.
pub async fn recv<T: Transport>(t: &T) -> Result<Received, KvError> {
    loop {
        match t.recv().await? {
            Event::Message(m) => match Msg::decode(&m.meta) {
                Ok(msg) => {
                    let value = m.segments.into_iter().next();
                    tracing::trace!(from = %describe(m.peer), ?msg, "recv");
                    return Ok(Received::Msg {
                        from: m.peer,
                        msg,
                        value,
                    });
                }
                Err(e) => {
                    tracing::warn!(from = %describe(m.peer), error = %e, "dropping malformed kv message");
                }
            },
            Event::PeerConnected { peer, .. } => return Ok(Received::Connected(peer)),
            Event::PeerLost { peer, reason } => return Ok(Received::Lost { peer, reason }),
        }
    }
}
