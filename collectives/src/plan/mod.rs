//! Collective algorithms as plain state, free of I/O.
//!
//! A [`Plan`] is one rank's part of one collective: the buffer split into pieces, and the
//! transfers of those pieces — to whom each goes, from whom each comes and how it is combined —
//! with what each transfer waits for. The communicator's driver only moves bytes:
//! [`Plan::poll_send`] / [`Plan::handle_sent`] for sends, [`Plan::handle_message`] /
//! [`Plan::poll_apply`] / [`Plan::handle_applied`] for receives. Pieces are sent as separate
//! messages, so a large buffer is pipelined: piece 2 of a ring step travels while piece 1 of
//! the next step is being reduced.
//!
//! The builders (`ring.rs`, `tree.rs`, `doubling.rs`, `halving.rs`, `barrier.rs`) fix every reduction's
//! order, so the same inputs give the same bits run to run.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;

use smallvec::SmallVec;

use crate::element::Order;
use crate::payload::Payload;

mod barrier;
mod doubling;
mod exchange;
mod halving;
mod ring;
mod tree;

pub(crate) use barrier::barrier;
pub(crate) use doubling::doubling_allreduce;
pub(crate) use exchange::{alltoall, gather, scatter};
pub(crate) use halving::halving_allreduce;
pub(crate) use ring::{ring_allgather, ring_allreduce, ring_reduce_scatter};
pub(crate) use tree::{tree_broadcast, tree_reduce};

/// What a received piece does to the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Combined with the piece already there.
    Reduce(Order),
    /// Written over it.
    Copy,
}

#[derive(Debug)]
enum Kind {
    Send { to: usize },
    Recv { from: usize, action: Action },
}

#[derive(Debug)]
struct Op {
    kind: Kind,
    tag: u64,
    piece: usize,
    /// Operations still to finish before this one may start (a send) or be applied (a receive).
    waiting: u32,
    /// Operations waiting for this one.
    unblocks: SmallVec<[usize; 2]>,
    /// A receive's bytes, once they arrived.
    data: Option<Payload>,
    started: bool,
    done: bool,
}

/// A send the driver should start.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct SendReq {
    /// The operation, for [`Plan::handle_sent`].
    pub op: usize,
    /// The rank to send to.
    pub to: usize,
    /// The message's tag (the receiver's plan expects this tag from this rank).
    pub tag: u64,
    /// Which piece of the buffer to send.
    pub piece: usize,
}

/// A received piece the driver should apply to the buffer.
#[derive(Debug)]
pub(crate) struct ApplyReq {
    /// The operation, for [`Plan::handle_applied`].
    pub op: usize,
    /// Which piece of the buffer it lands in.
    pub piece: usize,
    /// Reduce or copy.
    pub action: Action,
    /// The bytes received.
    pub data: Payload,
}

/// A message the plan cannot take.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PlanError {
    /// No receive of this rank's plan expects this tag from this rank.
    #[error("an unexpected piece (tag {tag}) from rank {from}{meaning}")]
    Unexpected {
        /// The sender.
        from: usize,
        /// The tag.
        tag: u64,
        /// What the tag says, where the plan's tags carry meaning (an exchange's block
        /// length); empty otherwise.
        meaning: String,
    },
    /// The expected piece has another length.
    #[error("a piece of {got} bytes from rank {from} where {want} were expected")]
    Length {
        /// The sender.
        from: usize,
        /// Bytes received.
        got: usize,
        /// Bytes expected.
        want: usize,
    },
}

/// One rank's part of one collective.
#[derive(Debug)]
pub(crate) struct Plan {
    pieces: Vec<Range<usize>>,
    elem_size: usize,
    ops: Vec<Op>,
    recv_by_tag: HashMap<(usize, u64), usize>,
    ready_sends: VecDeque<usize>,
    ready_applies: VecDeque<usize>,
    left: usize,
    /// Explains a tag no receive expects, for the error (`exchange.rs`'s tags carry lengths).
    explain: Option<fn(&Plan, usize, u64) -> String>,
}

impl Plan {
    /// A plan over a buffer split into `pieces` (contiguous, in order, covering it), of
    /// elements of `elem_size` bytes.
    fn new(pieces: Vec<Range<usize>>, elem_size: usize) -> Plan {
        debug_assert!(pieces.windows(2).all(|w| w[0].end == w[1].start));
        Plan {
            pieces,
            elem_size,
            ops: Vec::new(),
            recv_by_tag: HashMap::new(),
            ready_sends: VecDeque::new(),
            ready_applies: VecDeque::new(),
            left: 0,
            explain: None,
        }
    }

    fn push(&mut self, kind: Kind, tag: u64, piece: usize, after: &[usize]) -> usize {
        let id = self.ops.len();
        if let Kind::Recv { from, .. } = kind {
            let old = self.recv_by_tag.insert((from, tag), id);
            assert!(old.is_none(), "one receive per sender and tag");
        }
        let mut waiting = 0;
        for &a in after {
            if !self.ops[a].done {
                self.ops[a].unblocks.push(id);
                waiting += 1;
            }
        }
        let is_send = matches!(kind, Kind::Send { .. });
        self.ops.push(Op {
            kind,
            tag,
            piece,
            waiting,
            unblocks: SmallVec::new(),
            data: None,
            started: false,
            done: false,
        });
        self.left += 1;
        if waiting == 0 && is_send {
            self.ready_sends.push_back(id);
        }
        id
    }

    /// Adds a send of `piece` to rank `to`, once every operation in `after` is done.
    pub(crate) fn send(&mut self, to: usize, tag: u64, piece: usize, after: &[usize]) -> usize {
        self.push(Kind::Send { to }, tag, piece, after)
    }

    /// Adds a receive of `piece` from rank `from`, applied once every operation in `after` is
    /// done.
    pub(crate) fn recv(
        &mut self,
        from: usize,
        tag: u64,
        piece: usize,
        action: Action,
        after: &[usize],
    ) -> usize {
        self.push(Kind::Recv { from, action }, tag, piece, after)
    }

    /// The buffer's pieces, in order (element ranges).
    pub(crate) fn pieces(&self) -> &[Range<usize>] {
        &self.pieces
    }

    /// Whether every transfer is done.
    pub(crate) fn is_done(&self) -> bool {
        self.left == 0
    }

    /// Transfers not yet done (for error messages).
    pub(crate) fn remaining(&self) -> usize {
        self.left
    }

    /// Every piece this plan receives: the sender's rank, the tag and the length in bytes
    /// (the device calls place exactly these).
    #[cfg(feature = "cuda")]
    pub(crate) fn receives(&self) -> impl Iterator<Item = (usize, u64, usize)> + '_ {
        self.ops.iter().filter_map(|op| match op.kind {
            Kind::Recv { from, .. } => {
                Some((from, op.tag, self.pieces[op.piece].len() * self.elem_size))
            }
            Kind::Send { .. } => None,
        })
    }

    /// The ranks this plan still expects a piece from.
    pub(crate) fn awaited_ranks(&self) -> Vec<usize> {
        let mut ranks: Vec<usize> = self
            .ops
            .iter()
            .filter(|op| !op.done && op.data.is_none())
            .filter_map(|op| match op.kind {
                Kind::Recv { from, .. } => Some(from),
                Kind::Send { .. } => None,
            })
            .collect();
        ranks.sort_unstable();
        ranks.dedup();
        ranks
    }

    /// Every rank this plan sends to or receives from, in order.
    pub(crate) fn partners(&self) -> Vec<usize> {
        let mut ranks: Vec<usize> = self
            .ops
            .iter()
            .map(|op| match op.kind {
                Kind::Recv { from, .. } => from,
                Kind::Send { to } => to,
            })
            .collect();
        ranks.sort_unstable();
        ranks.dedup();
        ranks
    }

    /// The next send that may start.
    pub(crate) fn poll_send(&mut self) -> Option<SendReq> {
        let id = self.ready_sends.pop_front()?;
        let op = &mut self.ops[id];
        op.started = true;
        let Kind::Send { to } = op.kind else {
            unreachable!("only sends are queued to send")
        };
        Some(SendReq {
            op: id,
            to,
            tag: op.tag,
            piece: op.piece,
        })
    }

    /// A send has completed: its piece may be written again.
    pub(crate) fn handle_sent(&mut self, op: usize) {
        debug_assert!(self.ops[op].started && matches!(self.ops[op].kind, Kind::Send { .. }));
        self.finish(op);
    }

    /// A piece arrived from rank `from`.
    pub(crate) fn handle_message(
        &mut self,
        from: usize,
        tag: u64,
        data: impl Into<Payload>,
    ) -> Result<(), PlanError> {
        let data = data.into();
        let id = match self.recv_by_tag.get(&(from, tag)) {
            Some(&id) if self.ops[id].data.is_none() && !self.ops[id].done => id,
            _ => {
                let meaning = self.explain.map(|f| f(self, from, tag)).unwrap_or_default();
                return Err(PlanError::Unexpected { from, tag, meaning });
            }
        };
        let want = self.pieces[self.ops[id].piece].len() * self.elem_size;
        if data.len() != want {
            return Err(PlanError::Length {
                from,
                got: data.len(),
                want,
            });
        }
        let op = &mut self.ops[id];
        op.data = Some(data);
        if op.waiting == 0 {
            self.ready_applies.push_back(id);
        }
        Ok(())
    }

    /// The next received piece that may be applied.
    pub(crate) fn poll_apply(&mut self) -> Option<ApplyReq> {
        let id = self.ready_applies.pop_front()?;
        let op = &mut self.ops[id];
        op.started = true;
        let Kind::Recv { action, .. } = op.kind else {
            unreachable!("only receives are queued to apply")
        };
        Some(ApplyReq {
            op: id,
            piece: op.piece,
            action,
            data: op.data.take().expect("queued once its bytes arrived"),
        })
    }

    /// A received piece has been applied.
    pub(crate) fn handle_applied(&mut self, op: usize) {
        debug_assert!(self.ops[op].started && matches!(self.ops[op].kind, Kind::Recv { .. }));
        self.finish(op);
    }

    fn finish(&mut self, id: usize) {
        let op = &mut self.ops[id];
        assert!(!op.done, "an operation finishes once");
        op.done = true;
        self.left -= 1;
        for next in std::mem::take(&mut op.unblocks) {
            let n = &mut self.ops[next];
            n.waiting -= 1;
            if n.waiting == 0 {
                match n.kind {
                    Kind::Send { .. } => self.ready_sends.push_back(next),
                    Kind::Recv { .. } if n.data.is_some() => self.ready_applies.push_back(next),
                    Kind::Recv { .. } => {}
                }
            }
        }
    }
}

/// Element range of chunk `c` when `count` elements are split into `n` chunks as evenly as
/// possible (the first `count % n` chunks one longer).
pub(crate) fn chunk(count: usize, n: usize, c: usize) -> Range<usize> {
    let base = count / n;
    let extra = count % n;
    let start = c * base + c.min(extra);
    let len = base + usize::from(c < extra);
    start..start + len
}

/// Splits `range` into pieces of at most `piece` elements (none if it is empty).
fn split(range: Range<usize>, piece: usize) -> impl Iterator<Item = Range<usize>> {
    let piece = piece.max(1);
    range
        .clone()
        .step_by(piece)
        .map(move |s| s..(s + piece).min(range.end))
}

/// Pieces of a buffer split into `blocks` (in order), each split into pieces of at most
/// `piece` elements: the piece list and, per block, the indices of its pieces.
fn pieces_of_blocks(
    blocks: impl Iterator<Item = Range<usize>>,
    piece: usize,
) -> (Vec<Range<usize>>, Vec<Range<usize>>) {
    let mut pieces = Vec::new();
    let mut per_block = Vec::new();
    for b in blocks {
        let first = pieces.len();
        pieces.extend(split(b, piece));
        per_block.push(first..pieces.len());
    }
    (pieces, per_block)
}

#[cfg(test)]
pub(crate) mod sim;

#[cfg(test)]
mod tests;
