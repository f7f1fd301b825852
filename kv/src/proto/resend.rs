//! `PS_RESEND`: acknowledged delivery between kv nodes, free of I/O and of the clock (time
//! comes in as `now` arguments). The driver is `crate::reliable`.
//!
//! ps-lite's Resender, with bounded memory and a clean failure instead of its abort:
//!
//! - **Sending**: every message to a peer gets that peer's next sequence number (from 1) and
//!   waits in the peer's window, as owned copies of its bytes, until acknowledged. The window
//!   is bounded in messages ([`WINDOW`]) and bytes ([`WINDOW_BYTES`], but one message always
//!   fits); when it is full, [`Resender::send`] answers [`SendError::Full`] and the driver
//!   waits for acknowledgements (back-pressure).
//! - **Acknowledgements** are cumulative ("every message below N has arrived"): piggybacked
//!   on every message to that peer, else sent alone a quarter of the timeout after the first
//!   unacknowledged delivery, at once after [`ACK_EVERY`] messages or [`ACK_BYTES`] bytes, and
//!   at once when a duplicate arrives (its sender evidently missed an acknowledgement).
//! - **Resending**: a message is resent at `sent + timeout * (1 + retries)`, as in ps-lite, and
//!   everything unacknowledged is resent at once when the connection comes back. Once a
//!   message has gone `timeout * (1 + max_retries)` without acknowledgement, or a lost
//!   connection has not come back for that long, the peer is given up: [`Resender::poll_event`]
//!   reports it, its window is dropped, and later sends to it fail.
//! - **Receiving**: per peer, the lowest sequence number not yet received plus a bitmap of the
//!   [`WINDOW`] numbers above it (128 bytes): each message is delivered exactly once, whatever
//!   the loss, duplication and reordering. A sender never has more than [`WINDOW`] messages
//!   unacknowledged, so a message beyond the bitmap can only come from a broken peer and is
//!   dropped unacknowledged.
//!
//! Delivery is exactly once but not in order across a reconnection (a resent message may
//! arrive after newer ones): the kv protocol does not need order, because a request that
//! depends on another is only sent once the other is answered.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;
use psnet_transport::NodeId;

mod transmit;

/// ps-lite's retry limit: resends of one message before its peer is given up.
pub const MAX_RETRIES: u32 = 10;
/// Most unacknowledged messages per peer, and the span of the receiver's duplicate bitmap.
pub const WINDOW: usize = 1024;
/// Most unacknowledged bytes per peer (one message always fits, whatever its size).
pub const WINDOW_BYTES: usize = 64 << 20;
/// Deliveries after which an acknowledgement goes out at once.
pub const ACK_EVERY: u32 = 32;
/// Delivered bytes after which an acknowledgement goes out at once.
pub const ACK_BYTES: usize = 1 << 20;

/// Longest resend timeout (longer ones are clamped): keeps every deadline representable.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(3600);

const WORDS: usize = WINDOW / 64;

/// Timeouts and bounds of one node's resender.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResendConfig {
    /// `PS_RESEND_TIMEOUT`: time before the first resend, and between resends.
    pub timeout: Duration,
    /// Resends of one message before its peer is given up.
    pub max_retries: u32,
    /// Most unacknowledged messages per peer (at most [`WINDOW`]).
    pub window: usize,
    /// Most unacknowledged bytes per peer.
    pub window_bytes: usize,
}

impl ResendConfig {
    /// ps-lite's behaviour with `timeout`: 10 retries, and psnet's window bounds.
    pub fn new(timeout: Duration) -> Self {
        ResendConfig {
            timeout: timeout.clamp(Duration::from_millis(1), MAX_TIMEOUT),
            max_retries: MAX_RETRIES,
            window: WINDOW,
            window_bytes: WINDOW_BYTES,
        }
    }

    /// How long a message may stay unacknowledged, or a connection stay lost, before the peer
    /// is given up.
    pub fn give_up_after(&self) -> Duration {
        self.timeout * self.max_retries.saturating_add(1)
    }

    /// How long an acknowledgement may wait for a message to ride on.
    pub fn ack_delay(&self) -> Duration {
        self.timeout / 4
    }

    fn describe(&self) -> String {
        format!(
            "PS_RESEND_TIMEOUT={} ms, {} retries",
            self.timeout.as_millis(),
            self.max_retries
        )
    }
}

/// Why [`Resender::send`] did not take a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SendError {
    /// The peer's window is full: wait until acknowledgements free it (or the peer is given up).
    Full,
    /// The peer was given up, for this reason.
    Failed(String),
}

/// What arriving message `seq` is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// New: hand it to the node.
    Deliver,
    /// Already delivered: drop it.
    Duplicate,
    /// Beyond the duplicate window (a broken peer): drop it, unacknowledged.
    OutOfWindow,
}

/// A message (or an acknowledgement alone) for the driver to send to `peer`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transmit {
    /// The peer.
    pub peer: NodeId,
    /// Sequence number of the message; None: an acknowledgement alone.
    pub seq: Option<u64>,
    /// Cumulative acknowledgement to carry: every message below it from `peer` has arrived.
    pub ack: u64,
    /// The encoded kv message (empty for an acknowledgement alone).
    pub meta: Bytes,
    /// Its value segment, if any.
    pub value: Option<Bytes>,
    /// Whether this is a resend.
    pub resend: bool,
}

/// A peer given up: operations that depend on it must fail with this reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GaveUp {
    /// The peer.
    pub peer: NodeId,
    /// What happened, with the settings that applied.
    pub reason: String,
}

/// Counters, for logs and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Messages sent (first transmissions).
    pub sent: u64,
    /// Resends.
    pub resent: u64,
    /// Acknowledgements sent alone.
    pub acks_sent: u64,
    /// Messages delivered.
    pub delivered: u64,
    /// Duplicates dropped.
    pub duplicates: u64,
    /// Messages dropped beyond the duplicate window.
    pub out_of_window: u64,
    /// Peers given up.
    pub gave_up: u64,
}

#[derive(Debug)]
struct Pending {
    seq: u64,
    meta: Bytes,
    value: Option<Bytes>,
    first_sent: Instant,
    retries: u32,
    queued: bool,
}

impl Pending {
    fn len(&self) -> usize {
        self.meta.len() + self.value.as_ref().map_or(0, Bytes::len)
    }
}

/// Which sequence numbers have arrived from one peer, in constant memory.
#[derive(Debug)]
struct Received {
    /// Every number below has arrived.
    base: u64,
    /// Arrived numbers in `base..base + WINDOW`, at bit `seq % WINDOW`.
    bits: [u64; WORDS],
}

impl Received {
    fn new() -> Self {
        Received {
            base: 1,
            bits: [0; WORDS],
        }
    }

    fn bit(seq: u64) -> (usize, u64) {
        let i = (seq % WINDOW as u64) as usize;
        (i / 64, 1 << (i % 64))
    }

    fn receive(&mut self, seq: u64) -> Delivery {
        if seq < self.base {
            return Delivery::Duplicate;
        }
        if seq - self.base >= WINDOW as u64 {
            return Delivery::OutOfWindow;
        }
        let (w, m) = Self::bit(seq);
        if self.bits[w] & m != 0 {
            return Delivery::Duplicate;
        }
        self.bits[w] |= m;
        loop {
            let (w, m) = Self::bit(self.base);
            if self.bits[w] & m == 0 {
                break;
            }
            self.bits[w] &= !m;
            self.base += 1;
        }
        Delivery::Deliver
    }
}

#[derive(Debug)]
struct Peer {
    next_seq: u64,
    /// Unacknowledged messages, by increasing (consecutive) sequence number.
    window: VecDeque<Pending>,
    window_bytes: usize,
    /// Sequence numbers to resend, oldest first.
    resend: VecDeque<u64>,
    received: Received,
    /// First delivery not yet acknowledged.
    ack_owed_since: Option<Instant>,
    ack_urgent: bool,
    owed_count: u32,
    owed_bytes: usize,
    /// The connection is lost since then, for this reason.
    down: Option<(Instant, String)>,
    failed: Option<String>,
}

impl Peer {
    fn new() -> Self {
        Peer {
            next_seq: 1,
            window: VecDeque::new(),
            window_bytes: 0,
            resend: VecDeque::new(),
            received: Received::new(),
            ack_owed_since: None,
            ack_urgent: false,
            owed_count: 0,
            owed_bytes: 0,
            down: None,
            failed: None,
        }
    }

    /// The acknowledgement to send now; nothing is owed afterwards.
    fn take_ack(&mut self) -> u64 {
        self.ack_owed_since = None;
        self.ack_urgent = false;
        self.owed_count = 0;
        self.owed_bytes = 0;
        self.received.base
    }

    fn ack_due(&self, now: Instant, delay: Duration) -> bool {
        match self.ack_owed_since {
            Some(since) => self.ack_urgent || now >= since + delay,
            None => self.ack_urgent,
        }
    }

    fn index(&self, seq: u64) -> Option<usize> {
        let first = self.window.front()?.seq;
        let i = usize::try_from(seq.checked_sub(first)?).ok()?;
        (i < self.window.len()).then_some(i)
    }

    fn clear_resends(&mut self) {
        self.resend.clear();
        for p in &mut self.window {
            p.queued = false;
        }
    }
}

/// One node's `PS_RESEND` state for all its peers.
#[derive(Debug)]
pub struct Resender {
    config: ResendConfig,
    peers: HashMap<NodeId, Peer>,
    events: VecDeque<GaveUp>,
    /// The deadline last handed out by `poll_timeout` (None: no timer armed).
    armed: Option<Instant>,
    wake: bool,
    stats: Stats,
}

impl Resender {
    /// A resender with `config` (window bounds clamped to [`WINDOW`]).
    pub fn new(mut config: ResendConfig) -> Self {
        config.window = config.window.clamp(1, WINDOW);
        config.timeout = config.timeout.clamp(Duration::from_millis(1), MAX_TIMEOUT);
        config.max_retries = config.max_retries.min(1 << 20);
        Resender {
            config,
            peers: HashMap::new(),
            events: VecDeque::new(),
            armed: None,
            wake: false,
            stats: Stats::default(),
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &ResendConfig {
        &self.config
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    fn peer(&mut self, peer: NodeId) -> &mut Peer {
        self.peers.entry(peer).or_insert_with(Peer::new)
    }

    /// Whether the timer driver must run again: a deadline earlier than the one
    /// [`Resender::poll_timeout`] last gave, or a peer given up. Resets the flag. (Sends that
    /// are due at once are found with [`Resender::has_transmit`] instead.)
    pub fn take_wake(&mut self) -> bool {
        std::mem::take(&mut self.wake)
    }

    /// A deadline appeared at `at`.
    fn timer(&mut self, at: Instant) {
        if self.armed.is_none_or(|a| at < a) {
            self.armed = Some(at);
            self.wake = true;
        }
    }

    /// Takes `meta` (an encoded message) and `value` into `peer`'s window under the next
    /// sequence number and returns what to send.
    pub fn send(
        &mut self,
        peer: NodeId,
        meta: Bytes,
        value: Option<Bytes>,
        now: Instant,
    ) -> Result<Transmit, SendError> {
        let config = self.config;
        let p = self.peer(peer);
        if let Some(reason) = &p.failed {
            return Err(SendError::Failed(reason.clone()));
        }
        let len = meta.len() + value.as_ref().map_or(0, Bytes::len);
        if p.window.len() >= config.window
            || (!p.window.is_empty() && p.window_bytes + len > config.window_bytes)
        {
            return Err(SendError::Full);
        }
        let seq = p.next_seq;
        p.next_seq += 1;
        p.window.push_back(Pending {
            seq,
            meta: meta.clone(),
            value: value.clone(),
            first_sent: now,
            retries: 0,
            queued: false,
        });
        p.window_bytes += len;
        let ack = p.take_ack();
        self.timer(now + config.timeout);
        self.stats.sent += 1;
        Ok(Transmit {
            peer,
            seq: Some(seq),
            ack,
            meta,
            value,
            resend: false,
        })
    }

    /// `peer` has every message we sent below `ack`; returns how many left the window.
    pub fn handle_ack(&mut self, peer: NodeId, ack: u64) -> usize {
        let Some(p) = self.peers.get_mut(&peer) else {
            return 0;
        };
        if ack > p.next_seq {
            // Acknowledges what was never sent: a broken peer; ignore it.
            return 0;
        }
        let mut freed = 0;
        while p.window.front().is_some_and(|m| m.seq < ack) {
            let m = p.window.pop_front().expect("checked");
            p.window_bytes -= m.len();
            freed += 1;
        }
        if freed > 0 {
            let first = p.window.front().map_or(p.next_seq, |m| m.seq);
            p.resend.retain(|&s| s >= first);
        }
        freed
    }

    /// Message `seq` of `len` bytes arrived from `peer`: deliver it or drop it.
    pub fn handle_incoming(
        &mut self,
        peer: NodeId,
        seq: u64,
        len: usize,
        now: Instant,
    ) -> Delivery {
        let delay = self.config.ack_delay();
        let p = self.peers.entry(peer).or_insert_with(Peer::new);
        let d = p.received.receive(seq);
        match d {
            Delivery::Deliver => {
                let first = p.ack_owed_since.is_none();
                if first {
                    p.ack_owed_since = Some(now);
                }
                p.owed_count += 1;
                p.owed_bytes = p.owed_bytes.saturating_add(len);
                if p.owed_count >= ACK_EVERY || p.owed_bytes >= ACK_BYTES {
                    p.ack_urgent = true;
                }
                self.stats.delivered += 1;
                if first {
                    self.timer(now + delay);
                }
            }
            Delivery::Duplicate => {
                p.ack_urgent = true;
                self.stats.duplicates += 1;
            }
            Delivery::OutOfWindow => self.stats.out_of_window += 1,
        }
        d
    }

    /// The connection to `peer` broke (or a send found none). True if it was up: the driver
    /// then tries to reconnect. Nothing is resent until it is back.
    pub fn handle_peer_lost(&mut self, peer: NodeId, reason: &str, now: Instant) -> bool {
        let p = self.peers.entry(peer).or_insert_with(Peer::new);
        if p.failed.is_some() || p.down.is_some() {
            return false;
        }
        p.down = Some((now, reason.to_string()));
        p.clear_resends();
        let limit = self.config.give_up_after();
        self.timer(now + limit);
        true
    }

    /// A connection to `peer` is (again) up: everything unacknowledged goes out again.
    pub fn handle_peer_connected(&mut self, peer: NodeId) {
        let p = self.peer(peer);
        p.down = None;
        if p.failed.is_some() {
            return;
        }
        p.resend.clear();
        for m in &mut p.window {
            m.queued = true;
            p.resend.push_back(m.seq);
        }
    }

    /// `peer` is a new process under the same id (a restarted server): everything known of
    /// the old one (its window, sequence numbers, loss) is dropped; both sides start again.
    pub fn forget_peer(&mut self, peer: NodeId) {
        self.peers.remove(&peer);
        self.wake = true;
    }

    /// Whether the connection to `peer` is lost and not yet back.
    pub fn is_down(&self, peer: NodeId) -> bool {
        self.peers.get(&peer).is_some_and(|p| p.down.is_some())
    }

    /// Why `peer` was given up, if it was.
    pub fn failure(&self, peer: NodeId) -> Option<&str> {
        self.peers.get(&peer).and_then(|p| p.failed.as_deref())
    }

    /// Messages to `peer` not yet acknowledged.
    pub fn unacked(&self, peer: NodeId) -> usize {
        self.peers.get(&peer).map_or(0, |p| p.window.len())
    }

    /// Messages not yet acknowledged by peers that are not given up.
    pub fn unacked_total(&self) -> usize {
        self.peers
            .values()
            .filter(|p| p.failed.is_none())
            .map(|p| p.window.len())
            .sum()
    }

    /// Gives `peer` up (the driver found it unreachable for good): its window is dropped and
    /// a [`GaveUp`] event reported. No-op if it was already given up.
    pub fn fail_peer(&mut self, peer: NodeId, reason: String) {
        let p = self.peer(peer);
        if p.failed.is_some() {
            return;
        }
        p.failed = Some(reason.clone());
        p.window.clear();
        p.window_bytes = 0;
        p.resend.clear();
        p.down = None;
        self.stats.gave_up += 1;
        self.events.push_back(GaveUp { peer, reason });
        self.wake = true;
    }
}

#[cfg(test)]
mod tests;
