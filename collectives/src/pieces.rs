//! A call's buffer as the driver sees it: pieces it sends and pieces it applies received
//! bytes to. Host buffers are one kind ([`HostPieces`]); GPU buffers another (`gpu.rs`), whose
//! pieces are sent straight from device memory and reduced where they lie.
//!
//! Each piece sits behind its own lock, so a send can borrow one piece (the transport reads
//! it until the send completes) while another is being reduced into; the plan's order makes
//! the two never meet on one piece, and the locks turn a breach of that order into an error.

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use psnet_transport::{NodeId, OutMessage, Segment, Transport, TransportError};
use tokio::sync::RwLock;

use crate::element::{copy_bytes, reduce_bytes, Element, ReduceOp};
use crate::error::CollectiveError;
use crate::payload::Payload;
use crate::plan::{Action, Plan};
use crate::wire::HEADER_LEN;

/// A finished send: the plan's operation, the rank it went to, and how it went.
pub(crate) type Sent = (usize, usize, Result<(), TransportError>);

/// A send the driver starts: the plan's operation and the rank it goes to (returned with
/// the result), the node, and the message's header.
pub(crate) struct Outgoing {
    pub op: usize,
    pub rank: usize,
    pub to: NodeId,
    pub header: [u8; HEADER_LEN],
}

/// A buffer split into a plan's pieces.
pub(crate) trait Pieces: Sync {
    /// Sends `piece` after `out.header` to `out.to`; the piece stays borrowed until the
    /// returned future completes. An error if the piece is being written.
    fn send<'a, T: Transport>(
        &'a self,
        transport: &'a T,
        out: Outgoing,
        piece: usize,
    ) -> Result<BoxFuture<'a, Sent>, CollectiveError>;

    /// Applies received `data` to `piece`: copies it over the piece, or reduces it in with
    /// `op`. An error if the piece is being sent, if the bytes are somewhere this buffer
    /// cannot read them, or if the reduction fails (on a GPU).
    fn apply(
        &self,
        piece: usize,
        action: Action,
        op: ReduceOp,
        data: &Payload,
    ) -> Result<(), CollectiveError>;
}

/// Sends `segment` after `out.header` to `out.to`, naming the plan's operation and rank in
/// the result.
pub(crate) async fn send_segment<T: Transport>(
    transport: &T,
    out: Outgoing,
    segment: Segment<'_>,
) -> Sent {
    let segments = [segment];
    let result = transport
        .send(out.to, OutMessage::new(&out.header, &segments))
        .await;
    (out.op, out.rank, result)
}

/// The error for a piece taken while the plan's order says it is busy.
pub(crate) fn busy(what: &str) -> CollectiveError {
    CollectiveError::Invalid(format!("internal: a piece {what}"))
}

/// A host buffer's pieces.
pub(crate) struct HostPieces<'b, E>(Vec<RwLock<&'b mut [E]>>);

impl<'b, E: Element> HostPieces<'b, E> {
    /// `buf` split into `plan`'s pieces.
    pub(crate) fn new(buf: &'b mut [E], plan: &Plan) -> Self {
        let mut rest = buf;
        let mut pieces = Vec::with_capacity(plan.pieces().len());
        for range in plan.pieces() {
            let (piece, tail) = rest.split_at_mut(range.len());
            pieces.push(RwLock::new(piece));
            rest = tail;
        }
        HostPieces(pieces)
    }
}

impl<E: Element> Pieces for HostPieces<'_, E> {
    fn send<'a, T: Transport>(
        &'a self,
        transport: &'a T,
        out: Outgoing,
        piece: usize,
    ) -> Result<BoxFuture<'a, Sent>, CollectiveError> {
        let piece = self.0[piece]
            .try_read()
            .map_err(|_| busy("sent while being written"))?;
        Ok(async move {
            let bytes: &[u8] = bytemuck::cast_slice(&piece[..]);
            send_segment(transport, out, Segment::from(bytes)).await
        }
        .boxed())
    }

    fn apply(
        &self,
        piece: usize,
        action: Action,
        op: ReduceOp,
        data: &Payload,
    ) -> Result<(), CollectiveError> {
        // Only a call on the device arms device memory for its pieces.
        let data = data
            .host()
            .ok_or_else(|| busy("of a host buffer placed in device memory"))?;
        let mut piece = self.0[piece]
            .try_write()
            .map_err(|_| busy("written while being sent"))?;
        match action {
            Action::Copy => copy_bytes(&mut piece, data),
            Action::Reduce(order) => reduce_bytes(op, order, &mut piece, data),
        }
        Ok(())
    }
}
