//! Point-to-point messages between two ranks of a communicator (`MPI_Send` / `MPI_Recv`,
//! torch's `send` / `recv` / `isend` / `irecv`): outside the order of collective calls, since
//! only the two ranks take part.
//!
//! A message is matched by its sender, its tag and its number among the sender's messages to
//! this rank with that tag: the n-th send from rank a to rank b with tag t meets the n-th
//! receive on b from a with t, whatever the order their futures run in. Numbers are taken
//! when the call is made ([`P2pTicket`]), so several sends and receives may be in flight
//! at once. A message travels in pieces of the communicator's piece size, each piece saying
//! the message's element type and length: a receive of another type or length fails naming
//! the sender, as does a sender lost before its message arrived.

use std::collections::HashMap;
use std::sync::Mutex;

use psnet_transport::{OutMessage, Segment, Transport};
use tokio::time::Instant;

use crate::comm::Communicator;
use crate::element::{Element, ReduceOp};
use crate::error::CollectiveError;
use crate::wire::{Call, Coll, Header, Kind};

/// The numbers of the next messages, per direction, peer rank and tag.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    next: Mutex<HashMap<(bool, usize, u64), u64>>,
}

impl Counters {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(bool, usize, u64), u64>> {
        self.next.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take(&self, send: bool, peer: usize, tag: u64) -> u64 {
        let mut next = self.lock();
        let n = next.entry((send, peer, tag)).or_insert(0);
        let seq = *n;
        *n += 1;
        seq
    }

    /// The number the next receive from `peer` with `tag` would take.
    fn peek_recv(&self, peer: usize, tag: u64) -> u64 {
        self.lock().get(&(false, peer, tag)).copied().unwrap_or(0)
    }

    /// Takes number `seq` for a receive from `peer` with `tag` if it is still the next one.
    fn take_recv_if(&self, peer: usize, tag: u64, seq: u64) -> bool {
        let mut next = self.lock();
        let n = next.entry((false, peer, tag)).or_insert(0);
        if *n != seq {
            return false;
        }
        *n += 1;
        true
    }
}

/// A send's or receive's place among the messages between two ranks with one tag, taken
/// when the call is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct P2pTicket {
    peer: usize,
    tag: u64,
    seq: u64,
}

impl P2pTicket {
    /// The send (`send`) or receive as the flight recorder keeps it.
    fn recorded<E: Element>(&self, send: bool, count: usize) -> psnet_recorder::Op {
        psnet_recorder::Op::P2p {
            dir: if send { "send" } else { "recv" },
            peer: self.peer as u32,
            tag: self.tag,
            msg: self.seq,
            dtype: E::DTYPE.name(),
            count: count as u64,
        }
    }
}

fn call_of<E: Element>(count: usize, piece: usize) -> Call {
    Call {
        coll: Coll::Send,
        dtype: E::DTYPE,
        op: ReduceOp::Sum,
        count: count as u64,
        root: piece as u32,
    }
}

impl<T: Transport> Communicator<T> {
    fn peer_rank(&self, peer: usize, what: &str) -> Result<usize, CollectiveError> {
        if peer >= self.size() || peer == self.rank {
            return Err(CollectiveError::Invalid(format!(
                "{what}: rank {peer} is not another rank of {} ranks (this is rank {})",
                self.size(),
                self.rank
            )));
        }
        Ok(peer)
    }

    /// The next send's place to rank `to` with `tag`.
    pub fn send_ticket(&self, to: usize, tag: u64) -> Result<P2pTicket, CollectiveError> {
        let peer = self.peer_rank(to, "send")?;
        Ok(P2pTicket {
            peer,
            tag,
            seq: self.p2p.take(true, peer, tag),
        })
    }

    /// The next receive's place from rank `from` with `tag`.
    pub fn recv_ticket(&self, from: usize, tag: u64) -> Result<P2pTicket, CollectiveError> {
        let peer = self.peer_rank(from, "recv")?;
        Ok(P2pTicket {
            peer,
            tag,
            seq: self.p2p.take(false, peer, tag),
        })
    }

    /// Sends `data` to rank `to` with `tag`; done when the transport has taken every piece.
    pub fn send<'a, E: Element>(
        &'a self,
        to: usize,
        tag: u64,
        data: &'a [E],
    ) -> impl std::future::Future<Output = Result<(), CollectiveError>> + Send + 'a {
        let ticket = self.send_ticket(to, tag);
        async move { self.send_in_turn(ticket?, data).await }
    }

    /// Receives into `buf` the message from rank `from` with `tag` that matches this call.
    pub fn recv<'a, E: Element>(
        &'a self,
        from: usize,
        tag: u64,
        buf: &'a mut [E],
    ) -> impl std::future::Future<Output = Result<(), CollectiveError>> + Send + 'a {
        let ticket = self.recv_ticket(from, tag);
        async move { self.recv_in_turn(ticket?, buf).await }
    }

    /// The send that took `ticket`, in the flight recorder.
    pub async fn send_in_turn<E: Element>(
        &self,
        ticket: P2pTicket,
        data: &[E],
    ) -> Result<(), CollectiveError> {
        let op = ticket.recorded::<E>(true, data.len());
        self.recorded(op, "send", self.send_pieces(ticket, data))
            .await
    }

    /// The receive that took `ticket`, in the flight recorder.
    pub async fn recv_in_turn<E: Element>(
        &self,
        ticket: P2pTicket,
        buf: &mut [E],
    ) -> Result<(), CollectiveError> {
        let op = ticket.recorded::<E>(false, buf.len());
        self.recorded(op, "recv", self.recv_pieces(ticket, buf))
            .await
    }

    /// Receives into `buf` the next message with `tag` from whichever other rank's comes
    /// first (MPI's `MPI_ANY_SOURCE`, torch's `recv_anysource`); returns the sender's rank.
    ///
    /// It takes a sender's next message number once a first piece of that message is here,
    /// so a receive from that rank made earlier keeps the message it was numbered for. Unlike
    /// MPI, a receive from that rank made *later*, while this one waits, takes its number
    /// first (MPI would match the earlier-posted any-source receive first). Among ranks whose
    /// messages are here, the lowest rank's is taken.
    pub async fn recv_any<E: Element>(
        &self,
        tag: u64,
        buf: &mut [E],
    ) -> Result<usize, CollectiveError> {
        let op = psnet_recorder::Op::P2p {
            dir: "recv_any",
            peer: u32::MAX,
            tag,
            msg: 0,
            dtype: E::DTYPE.name(),
            count: buf.len() as u64,
        };
        let receive = async {
            let ticket = self.match_any(tag).await?;
            self.recv_pieces(ticket, buf).await.map(|()| ticket.peer)
        };
        self.recorded(op, "recv from any rank", receive).await
    }

    /// Waits for a first piece of the next message with `tag` from any other rank, and takes
    /// that message's number.
    async fn match_any(&self, tag: u64) -> Result<P2pTicket, CollectiveError> {
        let others: Vec<usize> = (0..self.size()).filter(|&p| p != self.rank).collect();
        if others.is_empty() {
            return Err(CollectiveError::Invalid(
                "recv from any rank: this communicator has no other rank".into(),
            ));
        }
        // Any rank may send: each is dialled, so that one lost is seen as lost. One that
        // cannot be reached fails nothing here: a message it sent before it went may be
        // here, and the others may send; the loop below decides.
        let _ = crate::drive::reach_ranks(self, &others).await;
        let deadline = self.config.call_timeout.map(|t| Instant::now() + t);
        loop {
            let changed = self.mailbox.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mail = self.mailbox.lock();
                for &peer in &others {
                    let seq = self.p2p.peek_recv(peer, tag);
                    let here = mail
                        .p2p
                        .contains_key(&(self.comm, self.members[peer], tag, seq));
                    if here && self.p2p.take_recv_if(peer, tag, seq) {
                        return Ok(P2pTicket { peer, tag, seq });
                    }
                }
                // Nobody left to send: every other rank lost, or this transport closed.
                let lost: Vec<(usize, &String)> = others
                    .iter()
                    .filter_map(|&p| mail.lost.get(&self.members[p]).map(|why| (p, why)))
                    .collect();
                if lost.len() == others.len() {
                    let (rank, why) = lost[0];
                    return Err(CollectiveError::RankLost {
                        rank,
                        node: self.members[rank],
                        reason: format!("every other rank is gone ({why})"),
                    });
                }
                if let Some(why) = &mail.closed {
                    return Err(CollectiveError::Transport(format!(
                        "closed while receiving from any rank: {why}"
                    )));
                }
            }
            let timeout = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = &mut changed => {}
                () = timeout => {
                    return Err(CollectiveError::Timeout {
                        call: format!("recv from any rank (tag {tag})"),
                        waited: self.config.call_timeout.unwrap_or_default(),
                        ranks: others.clone(),
                    });
                }
            }
        }
    }

    /// Runs a send or receive as the recorded operation `op`; a failure dumps the recorder,
    /// as a failed call's does (a point-to-point failure does not fail the communicator: only
    /// two ranks knew).
    async fn recorded<R>(
        &self,
        op: psnet_recorder::Op,
        what: &str,
        run: impl std::future::Future<Output = Result<R, CollectiveError>>,
    ) -> Result<R, CollectiveError> {
        let record = self.recorder.as_ref().map(|r| r.start(op));
        let result = run.await;
        if let (Some(r), Some(id)) = (&self.recorder, record) {
            let error = result.as_ref().err().map(ToString::to_string);
            r.finish(id, &[], error.as_deref());
            if let Some(e) = error {
                self.dump_recorder(&format!("{what} failed: {e}"));
            }
        }
        result
    }

    async fn send_pieces<E: Element>(
        &self,
        ticket: P2pTicket,
        data: &[E],
    ) -> Result<(), CollectiveError> {
        crate::drive::reach_ranks(self, &[ticket.peer]).await?;
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let piece = (self.piece_elems(E::DTYPE) * E::DTYPE.size()).max(1);
        let to = self.members[ticket.peer];
        let mut chunks: Vec<&[u8]> = bytes.chunks(piece).collect();
        if chunks.is_empty() {
            chunks.push(&[]);
        }
        for (i, chunk) in chunks.into_iter().enumerate() {
            let header = Header {
                kind: Kind::P2p,
                comm: self.comm,
                seq: ticket.seq,
                tag: ticket.tag,
                call: call_of::<E>(data.len(), i),
            }
            .encode();
            let segs = [Segment::new(chunk)];
            self.transport
                .send(to, OutMessage::new(&header, &segs))
                .await
                .map_err(|e| crate::drive::lost_by_send(self, ticket.peer, e))?;
        }
        Ok(())
    }

    async fn recv_pieces<E: Element>(
        &self,
        ticket: P2pTicket,
        buf: &mut [E],
    ) -> Result<(), CollectiveError> {
        // Dialled though it would dial this rank to send: a sender that died before is then
        // seen lost rather than waited for until the call's timeout. What it sent before it
        // went is still taken: the loop below takes the pieces here before it looks at the
        // losses.
        let _ = crate::drive::reach_ranks(self, &[ticket.peer]).await;
        let from = self.members[ticket.peer];
        let key = (self.comm, from, ticket.tag, ticket.seq);
        let ours = call_of::<E>(buf.len(), 0);
        let describe = |c: &Call| format!("{} x {} (tag {})", c.count, c.dtype, ticket.tag);
        let want = std::mem::size_of_val(buf);
        let mut got = 0usize;
        let mut pieces = 0usize;
        let deadline = self.config.call_timeout.map(|t| Instant::now() + t);
        loop {
            let changed = self.mailbox.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut mail = self.mailbox.lock();
                for a in mail.take_p2p(key) {
                    let theirs = a.header.call;
                    if theirs.dtype != ours.dtype
                        || theirs.count != ours.count
                        || theirs.root as usize != pieces
                    {
                        return Err(CollectiveError::Mismatch {
                            rank: ticket.peer,
                            ours: format!("recv of {}", describe(&ours)),
                            theirs: format!("send of {}", describe(&theirs)),
                        });
                    }
                    if a.placed.is_some() || got + a.data.len() > want {
                        return Err(CollectiveError::Protocol {
                            rank: ticket.peer,
                            detail: "a point-to-point piece longer than its message".into(),
                        });
                    }
                    bytemuck::cast_slice_mut::<E, u8>(buf)[got..got + a.data.len()]
                        .copy_from_slice(&a.data);
                    got += a.data.len();
                    pieces += 1;
                }
                if pieces > 0 && got == want {
                    return Ok(());
                }
                if let Some(reason) = mail.lost.get(&from) {
                    return Err(CollectiveError::RankLost {
                        rank: ticket.peer,
                        node: from,
                        reason: reason.clone(),
                    });
                }
                if let Some(why) = &mail.closed {
                    return Err(CollectiveError::RankLost {
                        rank: ticket.peer,
                        node: from,
                        reason: format!("this rank's transport closed: {why}"),
                    });
                }
                if let Some(why) = &mail.overflow {
                    return Err(CollectiveError::Protocol {
                        rank: ticket.peer,
                        detail: why.clone(),
                    });
                }
            }
            let timeout = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = &mut changed => {}
                () = timeout => {
                    // What arrived so far is lost with the call: put nothing back.
                    return Err(CollectiveError::Timeout {
                        call: format!("recv of {}", describe(&ours)),
                        waited: self.config.call_timeout.unwrap_or_default(),
                        ranks: vec![ticket.peer],
                    });
                }
            }
        }
    }
}
