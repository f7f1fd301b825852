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

/// A piece of a host buffer: one the call writes, or one it only sends (an input of its own).
enum Piece<'b, E> {
    Write(&'b mut [E]),
    Read(&'b [E]),
}

impl<E> std::ops::Deref for Piece<'_, E> {
    type Target = [E];
    fn deref(&self) -> &[E] {
        match self {
            Piece::Write(p) => p,
            Piece::Read(p) => p,
        }
    }
}

/// A host buffer's pieces.
pub(crate) struct HostPieces<'b, E>(Vec<RwLock<Piece<'b, E>>>);

impl<'b, E: Element> HostPieces<'b, E> {
    /// `buf` split into `plan`'s pieces.
    pub(crate) fn new(buf: &'b mut [E], plan: &Plan) -> Self {
        Self::over_two(&[], buf, plan)
    }

    /// `plan`'s pieces over `send` followed by `recv`, as if one buffer: the pieces in `send`
    /// are only sent (an exchange's input need not be copied into the buffer it writes).
    pub(crate) fn over_two(send: &'b [E], recv: &'b mut [E], plan: &Plan) -> Self {
        let (mut read, mut write) = (send, recv);
        let mut pieces = Vec::with_capacity(plan.pieces().len());
        for range in plan.pieces() {
            if range.start < send.len() {
                debug_assert!(range.end <= send.len(), "a piece straddles the two buffers");
                let (piece, tail) = read.split_at(range.len());
                pieces.push(RwLock::new(Piece::Read(piece)));
                read = tail;
            } else {
                let (piece, tail) = std::mem::take(&mut write).split_at_mut(range.len());
                pieces.push(RwLock::new(Piece::Write(piece)));
                write = tail;
            }
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
        let Piece::Write(piece) = &mut *piece else {
            return Err(busy("of the call's input written"));
        };
        match action {
            Action::Copy => copy_bytes(piece, data),
            Action::Reduce(order) => reduce_bytes(op, order, piece, data),
        }
        Ok(())
    }
}
