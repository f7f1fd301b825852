//! A model of the links between hosts, in simulated time and free of I/O: the network tells
//! it when a message is sent (`handle_send`) and what time it is (`handle_time`), and asks
//! when the next message finishes crossing (`poll_timeout`) and which have landed
//! (`poll_landed`).
//!
//! - Every host has an uplink, a downlink and a local path (between two endpoints of the
//!   host), each with a rate and a latency ([`HostLinks`]). Endpoints on one host share them,
//!   so a "host" with several processes behind a slow link is described as on a cluster.
//! - A message between two hosts occupies the sender's uplink and the receiver's downlink
//!   while it crosses; one between endpoints of one host occupies that host's local path.
//! - A connection's messages cross one after another, as a stream's bytes do. The
//!   connections crossing a link at once share it max-min fairly (progressive filling): each
//!   gets an equal share of every link it uses, and what a connection held back by another
//!   link cannot use goes to the others. This is the rate TCP's congestion control settles
//!   at, without its ramp-up, its windows or its losses.
//! - A message lands when its last byte has crossed plus the latency of the links it used
//!   (uplink and downlink, or the local path): latency is per message, not per round trip.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet, VecDeque};
use std::fmt;
use std::time::Duration;

/// One link: how fast it carries bytes and how long a message takes to cross beyond that.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    bytes_per_sec: f64,
    latency: Duration,
}

/// A link that cannot carry anything: a rate that is not a positive, finite number.
#[derive(Clone, Debug, PartialEq)]
pub struct InvalidLink {
    /// The rate given, in bytes per second.
    pub bytes_per_sec: f64,
}

impl fmt::Display for InvalidLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "a link's rate must be a positive, finite number of bytes per second, not {}",
            self.bytes_per_sec
        )
    }
}

impl std::error::Error for InvalidLink {}

impl Link {
    /// A link of `bytes_per_sec` adding `latency` to every message.
    pub fn new(bytes_per_sec: f64, latency: Duration) -> Result<Link, InvalidLink> {
        if bytes_per_sec.is_finite() && bytes_per_sec > 0.0 {
            Ok(Link {
                bytes_per_sec,
                latency,
            })
        } else {
            Err(InvalidLink { bytes_per_sec })
        }
    }

    /// A link of `gbit` gigabits (10^9 bits) per second.
    pub fn gbit(gbit: f64, latency: Duration) -> Result<Link, InvalidLink> {
        Link::new(gbit * 1e9 / 8.0, latency)
    }

    /// Its rate in bytes per second.
    pub fn bytes_per_sec(&self) -> f64 {
        self.bytes_per_sec
    }

    /// The latency it adds to every message.
    pub fn latency(&self) -> Duration {
        self.latency
    }
}

/// A host's links.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostLinks {
    /// What the host's endpoints send to other hosts crosses it.
    pub up: Link,
    /// What the host's endpoints receive from other hosts crosses it.
    pub down: Link,
    /// Messages between two endpoints of the host cross it.
    pub local: Link,
}

impl HostLinks {
    /// A host whose uplink and downlink are both `link`, with `local` between its endpoints.
    pub fn symmetric(link: Link, local: Link) -> HostLinks {
        HostLinks {
            up: link,
            down: link,
            local,
        }
    }
}

/// A message handed to the model, as it names it in [`LinkModel::poll_landed`].
pub type MessageId = u64;

/// A connection's messages not yet landed: the first is crossing, the others wait for it.
struct Stream {
    from: usize,
    to: usize,
    queue: VecDeque<(MessageId, u64)>,
}

/// The message at the head of a connection, crossing.
struct Crossing {
    msg: MessageId,
    /// Bytes still to cross, as of the model's `now`.
    remaining: f64,
    /// Its share of its links, in bytes per second.
    rate: f64,
    /// The links it crosses.
    links: [Option<usize>; 2],
}

/// The links' state: what crosses them and at what rate, as of `now`.
pub struct LinkModel {
    hosts: Vec<HostLinks>,
    /// The time `remaining` and `rate` refer to, since the simulation's start.
    now: Duration,
    streams: HashMap<u64, Stream>,
    /// Each connection's crossing message, by connection (ordered, so that shares and ties
    /// come out the same on every run).
    crossing: BTreeMap<u64, Crossing>,
    /// Messages landed or to land, with the time they do, not yet polled.
    landed: VecDeque<(MessageId, Duration)>,
    next_msg: MessageId,
    /// The connections crossing each link in use, in order.
    users: HashMap<usize, BTreeSet<u64>>,
    /// The links whose connections changed since the rates were last shared: those links,
    /// and the ones their connections reach through the links they share, are shared again
    /// before time moves on. Sharing waits for that, so that many sends at one instant (a
    /// thousand nodes connecting) share the links once, not once each; and only what a
    /// change reaches is shared again (each connection of a ring of one rank a host shares
    /// no link with another).
    dirty: Vec<usize>,
    /// When the next crossing message finishes, as of the last sharing, until time moves or
    /// what crosses changes: every endpoint waiting on the network asks at every instant,
    /// and a thousand of them looking at every crossing message each made an instant
    /// quadratic.
    next_end: Option<Option<Duration>>,
    /// While the links are not shared again yet: a time no later than the next crossing's
    /// end (each message's end if it had its links to itself), kept as messages start.
    /// Endpoints that wait sleep until then rather than share the links at every send of an
    /// instant (a thousand workers each sending to every server shared them once a send,
    /// quadratic in the sends); the links are shared once time moves.
    earliest: Option<Option<Duration>>,
}

/// Which of a host's links: `host * 3 + kind`.
const UP: usize = 0;
const DOWN: usize = 1;
const LOCAL: usize = 2;

impl LinkModel {
    /// A model of `hosts` (host `i` is `hosts[i]`), with nothing crossing, at time zero.
    pub fn new(hosts: Vec<HostLinks>) -> LinkModel {
        LinkModel {
            hosts,
            now: Duration::ZERO,
            streams: HashMap::new(),
            crossing: BTreeMap::new(),
            landed: VecDeque::new(),
            next_msg: 0,
            users: HashMap::new(),
            dirty: Vec::new(),
            next_end: None,
            earliest: None,
        }
    }

    /// How many hosts it has.
    pub fn hosts(&self) -> usize {
        self.hosts.len()
    }

    /// A message of `bytes` sent at `now` on connection `conn` from an endpoint of host
    /// `from` to one of host `to`: it starts crossing once the connection's earlier messages
    /// have. Hosts outside the model are taken modulo its host count (a model without
    /// hosts carries nothing: its messages land at once).
    pub fn handle_send(
        &mut self,
        now: Duration,
        conn: u64,
        from: usize,
        to: usize,
        bytes: u64,
    ) -> MessageId {
        self.handle_time(now);
        let msg = self.next_msg;
        self.next_msg += 1;
        if self.hosts.is_empty() {
            self.landed.push_back((msg, self.now));
            return msg;
        }
        let (from, to) = (from % self.hosts.len(), to % self.hosts.len());
        let stream = self.streams.entry(conn).or_insert_with(|| Stream {
            from,
            to,
            queue: VecDeque::new(),
        });
        // A connection joins the same two hosts for its life; one reused for others is
        // a new stream once its earlier messages have landed.
        if stream.queue.is_empty() {
            (stream.from, stream.to) = (from, to);
        }
        stream.queue.push_back((msg, bytes));
        if !self.crossing.contains_key(&conn) {
            self.start_next(conn);
            // Only a message of no bytes has crossed as it starts; looking at every other
            // crossing message at each send made an instant of many sends quadratic.
            if bytes == 0 {
                self.finish_crossed();
            }
        }
        msg
    }

    /// Connection `conn` is gone: its messages still crossing or waiting to never land
    /// (those that have crossed and wait out their latency still come from
    /// [`poll_landed`](Self::poll_landed)).
    pub fn handle_close(&mut self, now: Duration, conn: u64) {
        self.handle_time(now);
        self.streams.remove(&conn);
        self.stop_crossing(conn);
    }

    /// Time has come to `now`: messages that finished crossing by then land (from
    /// [`poll_landed`](Self::poll_landed)), and what follows them on their connections
    /// starts crossing. Earlier times than the model's are taken as its own.
    pub fn handle_time(&mut self, now: Duration) {
        // What finishes by the model's time has landed (a message of no bytes lands as it
        // starts, the others below): nothing to do until time moves.
        if now <= self.now {
            return;
        }
        while let Some(next) = self.next_end().filter(|&t| t <= now) {
            self.cross_until(next);
            self.finish_crossed();
        }
        self.cross_until(now);
        // A message whose end is `now` to within a nanosecond's rounding lands now: from
        // here on every crossing message has bytes left, so none ends at the model's time.
        self.finish_crossed();
    }

    /// A time to look again at: no later than when the next crossing message finishes
    /// crossing, if any is (one held to no share of a link has no end in sight). It is that
    /// time once the links are shared; while messages start at the model's time, it may be
    /// earlier (see `earliest`), never the model's time itself.
    pub fn poll_timeout(&mut self) -> Option<Duration> {
        if self.dirty.is_empty() {
            return self.next_end();
        }
        let earliest = match self.earliest {
            Some(known) => known,
            None => self
                .crossing
                .values()
                .map(|c| self.now + crossing_time(c.remaining, self.fastest(c.links)))
                .min(),
        };
        self.earliest = Some(earliest);
        // Never the model's time itself: an endpoint told to look again now, finding that
        // time has not moved, would be told the same again.
        if earliest.is_some_and(|t| t <= self.now) {
            return self.next_end();
        }
        earliest
    }

    /// The fastest a message over `links` can cross: the slower link's whole rate.
    fn fastest(&self, links: [Option<usize>; 2]) -> f64 {
        links
            .into_iter()
            .flatten()
            .map(|l| self.rate_of(l))
            .fold(f64::INFINITY, f64::min)
    }

    /// When the next crossing message finishes crossing, the links shared as they are now.
    fn next_end(&mut self) -> Option<Duration> {
        self.share_if_stale();
        if let Some(known) = self.next_end {
            return known;
        }
        loop {
            let next = self
                .crossing
                .values()
                .filter(|c| c.rate > 0.0 || c.remaining == 0.0)
                .map(|c| self.now + crossing_time(c.remaining, c.rate))
                .min();
            // What has crossed lands at once (`handle_time` leaves none such; kept so that
            // no answer is ever the model's time itself), then the links are shared again.
            if next.is_some_and(|t| t <= self.now) {
                self.finish_crossed();
                self.share_if_stale();
                continue;
            }
            self.next_end = Some(next);
            return next;
        }
    }

    /// The next landed message with the time it lands at (its crossing's end plus the
    /// latency of its links, possibly after the model's time), in the order they finished
    /// crossing.
    pub fn poll_landed(&mut self) -> Option<(MessageId, Duration)> {
        self.landed.pop_front()
    }

    /// The links a connection between `from` and `to` uses, and the latency they add.
    fn path(&self, from: usize, to: usize) -> ([Option<usize>; 2], Duration) {
        if from == to {
            (
                [Some(from * 3 + LOCAL), None],
                self.hosts[from].local.latency,
            )
        } else {
            let latency = self.hosts[from].up.latency + self.hosts[to].down.latency;
            ([Some(from * 3 + UP), Some(to * 3 + DOWN)], latency)
        }
    }

    fn rate_of(&self, link: usize) -> f64 {
        let host = &self.hosts[link / 3];
        match link % 3 {
            UP => host.up.bytes_per_sec,
            DOWN => host.down.bytes_per_sec,
            _ => host.local.bytes_per_sec,
        }
    }

    /// Moves every crossing message on by its rate from the model's time to `t`.
    fn cross_until(&mut self, t: Duration) {
        if t <= self.now {
            return;
        }
        self.share_if_stale();
        self.next_end = None;
        self.earliest = None;
        let dt = (t - self.now).as_secs_f64();
        for c in self.crossing.values_mut() {
            c.remaining = (c.remaining - c.rate * dt).max(0.0);
        }
        self.now = t;
    }

    /// Starts the next message of `conn` crossing, if it has one.
    fn start_next(&mut self, conn: u64) {
        let Some(stream) = self.streams.get(&conn) else {
            return;
        };
        let Some(&(msg, bytes)) = stream.queue.front() else {
            return;
        };
        let (links, _) = self.path(stream.from, stream.to);
        self.next_end = None;
        // Another message that may finish first; those stopped leave the time a bound.
        // (One of no bytes lands as it starts.)
        if let (Some(earliest), true) = (self.earliest, bytes > 0) {
            let end = self.now + crossing_time(bytes as f64, self.fastest(links));
            self.earliest = Some(Some(earliest.map_or(end, |t| t.min(end))));
        }
        for link in links.into_iter().flatten() {
            self.users.entry(link).or_default().insert(conn);
            self.dirty.push(link);
        }
        self.crossing.insert(
            conn,
            Crossing {
                msg,
                remaining: bytes as f64,
                rate: 0.0,
                links,
            },
        );
    }

    /// `conn` no longer crosses its links.
    fn stop_crossing(&mut self, conn: u64) -> Option<Crossing> {
        let c = self.crossing.remove(&conn)?;
        self.next_end = None;
        for link in c.links.into_iter().flatten() {
            if let Some(users) = self.users.get_mut(&link) {
                users.remove(&conn);
                if users.is_empty() {
                    self.users.remove(&link);
                }
            }
            self.dirty.push(link);
        }
        Some(c)
    }

    /// Lands the messages that have crossed (within a nanosecond's worth of bytes, as
    /// times are whole nanoseconds), and starts what follows each on its connection.
    fn finish_crossed(&mut self) {
        loop {
            let done: Vec<u64> = self
                .crossing
                .iter()
                .filter(|(_, c)| c.remaining <= c.rate * 1e-9)
                .map(|(&conn, _)| conn)
                .collect();
            if done.is_empty() {
                return;
            }
            for conn in done {
                let Some(c) = self.stop_crossing(conn) else {
                    continue;
                };
                let Some(stream) = self.streams.get_mut(&conn) else {
                    continue;
                };
                stream.queue.pop_front();
                let (from, to, idle) = (stream.from, stream.to, stream.queue.is_empty());
                let (_, latency) = self.path(from, to);
                self.landed.push_back((c.msg, self.now + latency));
                if idle {
                    // Kept no longer than it carries something: a simulation of many nodes
                    // opens and uses many connections.
                    self.streams.remove(&conn);
                } else {
                    self.start_next(conn);
                }
            }
            // A message that starts with no bytes has crossed already: another round.
            self.share_zero_length();
        }
    }

    /// Gives messages of no bytes a rate, so that `finish_crossed` lands them.
    fn share_zero_length(&mut self) {
        self.next_end = None;
        for c in self.crossing.values_mut() {
            if c.remaining == 0.0 && c.rate == 0.0 {
                c.rate = 1.0;
            }
        }
    }

    /// Shares the links again if what crosses them changed since they last were.
    fn share_if_stale(&mut self) {
        if !self.dirty.is_empty() {
            self.share();
        }
    }

    /// Shares every link among the connections crossing it, max-min fairly: the link whose
    /// equal share of what is left is least fixes its connections' rates at that share,
    /// which the other links they use then lose; until every connection has a rate. Only
    /// the links in use are looked at (a simulation of a thousand hosts has few at once),
    /// and the least share is kept in a heap: a ring of a thousand hosts has two thousand
    /// links in use, and finding the least by looking at each made this quadratic.
    fn share(&mut self) {
        // The connections a change reaches: those crossing a changed link, those crossing a
        // link those cross, and so on. The others keep their rates.
        self.next_end = None;
        let mut reached: BTreeSet<u64> = BTreeSet::new();
        let mut seen: HashSet<usize> = HashSet::new();
        let mut todo = std::mem::take(&mut self.dirty);
        while let Some(link) = todo.pop() {
            if !seen.insert(link) {
                continue;
            }
            for &conn in self.users.get(&link).into_iter().flatten() {
                if reached.insert(conn) {
                    todo.extend(self.crossing[&conn].links.into_iter().flatten());
                }
            }
        }
        // Each link in use: what is left of its rate, its connections, and how many of them
        // have no rate yet.
        let mut links: HashMap<usize, InUse> = HashMap::new();
        let mut uses: HashMap<u64, [Option<usize>; 2]> = HashMap::new();
        for &conn in &reached {
            let path = self.crossing[&conn].links;
            for link in path.into_iter().flatten() {
                let rate = self.rate_of(link);
                let l = links.entry(link).or_insert(InUse {
                    left: rate,
                    users: Vec::new(),
                    unfixed: 0,
                    version: 0,
                });
                l.users.push(conn);
                l.unfixed += 1;
            }
            uses.insert(conn, path);
        }
        let mut least: BinaryHeap<Reverse<(Share, usize, u32)>> = links
            .iter()
            .map(|(&link, l)| Reverse((l.share(), link, l.version)))
            .collect();
        let mut fixed: HashSet<u64> = HashSet::new();
        while let Some(Reverse((Share(share), link, version))) = least.pop() {
            if links.get(&link).is_none_or(|l| l.version != version) {
                continue;
            }
            let users = links.remove(&link).expect("a link in use").users;
            for conn in users {
                if !fixed.insert(conn) {
                    continue;
                }
                if let Some(c) = self.crossing.get_mut(&conn) {
                    c.rate = share;
                }
                for other in uses[&conn].into_iter().flatten().filter(|&o| o != link) {
                    let Some(l) = links.get_mut(&other) else {
                        continue;
                    };
                    l.left -= share;
                    l.unfixed -= 1;
                    if l.unfixed == 0 {
                        links.remove(&other);
                    } else {
                        l.version += 1;
                        least.push(Reverse((l.share(), other, l.version)));
                    }
                }
            }
        }
        self.share_zero_length();
    }
}

/// A link in use while the links are shared.
struct InUse {
    left: f64,
    users: Vec<u64>,
    unfixed: usize,
    /// Bumped when `left` or `unfixed` change: the heap's older entries for it are stale.
    version: u32,
}

impl InUse {
    fn share(&self) -> Share {
        Share(self.left.max(0.0) / self.unfixed as f64)
    }
}

/// A share of a link, ordered as `f64::total_cmp` orders it.
#[derive(Clone, Copy, PartialEq)]
struct Share(f64);

impl Eq for Share {}

impl PartialOrd for Share {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Share {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// How long `remaining` bytes take at `rate`, rounded up to whole nanoseconds (a message
/// never lands before its bytes have crossed); capped for a rate of nothing.
fn crossing_time(remaining: f64, rate: f64) -> Duration {
    if remaining <= 0.0 {
        return Duration::ZERO;
    }
    let secs = remaining / rate;
    if !secs.is_finite() || secs > 1e9 {
        return Duration::from_secs(1_000_000_000);
    }
    Duration::from_nanos((secs * 1e9).ceil() as u64)
}

#[cfg(test)]
mod tests;
