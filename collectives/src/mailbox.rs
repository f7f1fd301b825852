//! Everything the transport delivers, sorted for the calls that will take it: the one task
//! that reads the transport files each message under its communicator and call number, and
//! notes lost peers, aborts and malformed messages. A rank may run ahead of another (a
//! broadcast's root never waits); its messages wait here, within a limit, until this rank
//! makes that call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use psnet_transport::{Event, NodeId, Placed, Transport};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::payload::Payload;
use crate::wire::{Header, Kind};

/// Another rank's abort of a communicator: who, why, and the call it failed in. Calls run
/// one at a time in order, so it had finished every call before that one, its messages for
/// them included: a rank still in one of those calls finishes it, and fails at the next.
#[derive(Clone, Debug)]
pub(crate) struct Abort {
    pub from: NodeId,
    pub reason: String,
    /// The aborted call's number; 0 (before any call: joining, or an older peer) fails them all.
    pub seq: u64,
}

/// A message as it arrived.
#[derive(Debug)]
pub(crate) struct Arrival {
    pub from: NodeId,
    pub header: Header,
    pub data: Bytes,
    /// Set when the transport placed the data in device memory (`data` is then empty).
    pub placed: Option<Placed>,
}

impl Arrival {
    /// Bytes it holds, in host or in device memory: both count against the limit on mail
    /// for calls not yet made.
    fn len(&self) -> usize {
        self.data.len() + self.placed.as_ref().map_or(0, |p| p.len as usize)
    }

    /// The piece's bytes as the driver hands them on.
    pub(crate) fn payload(self) -> Payload {
        match self.placed {
            None => Payload::Host(self.data),
            Some(placed) => Payload::Placed {
                from: self.from,
                tag: self.header.tag,
                len: placed.len as usize,
                result: placed.result,
            },
        }
    }
}

/// What the reading task found, behind one lock.
#[derive(Debug, Default)]
pub(crate) struct Mail {
    /// Data messages per communicator and call number.
    calls: HashMap<(u32, u64), Vec<Arrival>>,
    /// Bytes in `calls`, and the most it may hold (messages for calls this rank has not
    /// reached yet: a rank may run ahead, within reason).
    buffered: usize,
    limit: usize,
    /// Per communicator, the calls below this number are finished.
    finished: HashMap<u32, u64>,
    /// Per communicator, the first message that arrived for a call already finished here:
    /// its sender made a different call.
    pub late: HashMap<u32, (NodeId, Header)>,
    /// Set when more than `limit` bytes arrived ahead.
    pub overflow: Option<String>,
    /// Pieces of point-to-point messages by communicator, sender, tag and message number.
    pub p2p: HashMap<(u32, NodeId, u64, u64), Vec<Arrival>>,
    /// Joining messages (hello, table), in arrival order.
    pub joining: Vec<Arrival>,
    /// Peers whose connection was lost, or that fell silent (`liveness.rs`), and why.
    pub lost: HashMap<NodeId, String>,
    /// When each peer was last heard from: any message, or its connection opening.
    pub last_heard: HashMap<NodeId, Instant>,
    /// Communicators a peer aborted, the abort of the earliest call kept.
    pub aborted: HashMap<u32, Abort>,
    /// The first process this rank's admission refused for claiming a member's id without the
    /// communicator's secret, and why: another process has (or took) that rank.
    pub claimed: Option<(NodeId, String)>,
    /// Peers that sent something unreadable, and what.
    pub malformed: HashMap<NodeId, String>,
    /// The transport closed, and why.
    pub closed: Option<String>,
}

impl Mail {
    fn file(&mut self, arrival: Arrival) {
        let key = (arrival.header.comm, arrival.header.seq);
        if self.finished.get(&key.0).is_some_and(|&done| key.1 < done) {
            self.late
                .entry(key.0)
                .or_insert((arrival.from, arrival.header));
            return;
        }
        if !self.fits(&arrival) {
            return;
        }
        self.buffered += arrival.len();
        self.calls.entry(key).or_default().push(arrival);
    }

    /// Keeps a piece of a point-to-point message until its receive takes it, within the same
    /// limit as messages for calls not yet made.
    fn file_p2p(&mut self, arrival: Arrival) {
        if !self.fits(&arrival) {
            return;
        }
        self.buffered += arrival.len();
        let h = arrival.header;
        self.p2p
            .entry((h.comm, arrival.from, h.tag, h.seq))
            .or_default()
            .push(arrival);
    }

    /// The pieces of a point-to-point message that arrived so far.
    pub(crate) fn take_p2p(&mut self, key: (u32, NodeId, u64, u64)) -> Vec<Arrival> {
        let taken = self.p2p.remove(&key).unwrap_or_default();
        self.buffered -= taken.iter().map(Arrival::len).sum::<usize>();
        taken
    }

    /// Whether `arrival` fits under the limit; if not, notes the overflow.
    fn fits(&mut self, arrival: &Arrival) -> bool {
        if self.buffered + arrival.len() > self.limit {
            self.overflow.get_or_insert_with(|| {
                format!(
                    "node {} sent more than {} bytes for calls this rank has not made yet (limit: PSNET_COLL_AHEAD_BYTES)",
                    arrival.from, self.limit
                )
            });
            return false;
        }
        true
    }

    /// The messages that arrived for call `seq` of communicator `comm`.
    pub(crate) fn take_call(&mut self, comm: u32, seq: u64) -> Vec<Arrival> {
        let taken = self.calls.remove(&(comm, seq)).unwrap_or_default();
        self.buffered -= taken.iter().map(Arrival::len).sum::<usize>();
        taken
    }

    /// Keeps the abort of the earliest call: the first call that must fail.
    fn note_abort(&mut self, comm: u32, abort: Abort) {
        let kept = self.aborted.entry(comm).or_insert_with(|| abort.clone());
        if abort.seq < kept.seq {
            *kept = abort;
        }
    }

    /// The abort that call `seq` of communicator `comm` fails by, if any: one sent in that
    /// call or an earlier one.
    pub(crate) fn abort_of(&self, comm: u32, seq: u64) -> Option<&Abort> {
        self.aborted.get(&comm).filter(|a| a.seq <= seq)
    }

    /// Call `seq` of communicator `comm` is over: messages for it, now or later, are late.
    pub(crate) fn finish_call(&mut self, comm: u32, seq: u64) {
        self.finished.insert(comm, seq + 1);
        if let Some(first) = self.take_call(comm, seq).into_iter().next() {
            self.late.entry(comm).or_insert((first.from, first.header));
        }
    }
}

/// The mail, and a signal for every change to it.
#[derive(Debug)]
pub(crate) struct Mailbox {
    mail: Mutex<Mail>,
    /// Signalled whenever the mail changes.
    pub changed: Notify,
    /// The communicator's flight recorder, once it is formed: connection events go there.
    recorder: std::sync::OnceLock<Arc<psnet_recorder::Recorder>>,
}

impl Mailbox {
    /// A mailbox holding at most `limit` bytes for calls not yet made.
    pub(crate) fn new(limit: usize) -> Self {
        Mailbox {
            mail: Mutex::new(Mail {
                limit,
                ..Mail::default()
            }),
            changed: Notify::new(),
            recorder: std::sync::OnceLock::new(),
        }
    }

    /// Where connection events are recorded from now on.
    pub(crate) fn set_recorder(&self, recorder: Arc<psnet_recorder::Recorder>) {
        let _ = self.recorder.set(recorder);
    }

    /// Records a connection event (`what`: "connected", "lost", "silent") of the rank at
    /// `peer`, if there is a recorder.
    pub(crate) fn record_event(&self, what: &'static str, peer: NodeId) {
        if let Some(r) = self.recorder.get() {
            // Ranks are nodes 1..=size (`node_of`).
            let rank = peer.0.saturating_sub(1);
            r.event(psnet_recorder::Op::Event { what, peer: rank });
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Mail> {
        self.mail.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Notes a refused claim to member `node`'s id (the first one is kept) and wakes the calls.
    pub(crate) fn note_claim(&self, node: NodeId, why: String) {
        self.lock().claimed.get_or_insert((node, why));
        self.changed.notify_waiters();
    }
}

/// Reads `transport` until it closes, filing what arrives in `mailbox`.
pub(crate) async fn read_all<T: Transport>(transport: Arc<T>, mailbox: Arc<Mailbox>) {
    loop {
        let event = transport.recv().await;
        let mut mail = mailbox.lock();
        match event {
            Ok(Event::Message(m)) => match Header::decode(&m.meta) {
                Ok(header) if header.kind == Kind::Heartbeat => {
                    mail.last_heard.insert(m.peer, Instant::now());
                    continue;
                }
                Ok(header) if m.segments.len() <= 1 => {
                    let data = m.segments.into_iter().next().unwrap_or_default();
                    mail.last_heard.insert(m.peer, Instant::now());
                    let arrival = Arrival {
                        from: m.peer,
                        header,
                        data,
                        placed: m.placed,
                    };
                    match header.kind {
                        Kind::Data => mail.file(arrival),
                        Kind::Abort => {
                            let reason = String::from_utf8_lossy(&arrival.data).into_owned();
                            mail.note_abort(
                                header.comm,
                                Abort {
                                    from: m.peer,
                                    reason,
                                    seq: header.seq,
                                },
                            );
                        }
                        Kind::Hello | Kind::Table => mail.joining.push(arrival),
                        Kind::P2p => mail.file_p2p(arrival),
                        Kind::Heartbeat => unreachable!("taken above"),
                    }
                }
                Ok(_) => {
                    mail.malformed.entry(m.peer).or_insert_with(|| {
                        format!("a message of {} segments (one at most)", m.segments.len())
                    });
                }
                Err(e) => {
                    mail.malformed.entry(m.peer).or_insert(e);
                }
            },
            Ok(Event::PeerLost { peer, reason }) => {
                let first = !mail.lost.contains_key(&peer);
                mail.lost.entry(peer).or_insert(reason);
                if first {
                    drop(mail);
                    mailbox.record_event("lost", peer);
                    mailbox.changed.notify_waiters();
                    continue;
                }
            }
            // A collective's messages lost with a connection are not sent again: a peer lost
            // once stays lost for every call, even if it connects again.
            Ok(Event::PeerConnected { peer, .. }) => {
                mail.last_heard.insert(peer, Instant::now());
                drop(mail);
                mailbox.record_event("connected", peer);
                continue;
            }
            Err(e) => {
                mail.closed = Some(e.to_string());
                drop(mail);
                mailbox.changed.notify_waiters();
                return;
            }
        }
        drop(mail);
        mailbox.changed.notify_waiters();
    }
}
