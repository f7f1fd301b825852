//! The task that delivers a connection's messages once the peer sends through the same-host
//! queue: records in the queue, and the socket's data frames in the places their markers hold.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use psnet_transport::{Incoming, Limits};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;

use crate::conn::Conn;
use crate::inbox::Inbox;
use crate::shm::queue::{Record, RecvQueue};
use crate::shm::RecvRing;

/// Why the queue's task stopped.
#[derive(Clone, Debug)]
pub(crate) enum QueueEnd {
    /// The socket ended and everything the queue held was delivered.
    Drained,
    /// The peer broke the queue's rules.
    Refused(String),
    /// Waiting on the queue's eventfd failed.
    Failed(String),
    /// The inbox is closed: the transport is shutting down.
    Shutdown,
}

/// What the socket reader keeps of a connection's queue.
pub(crate) struct QueueLink {
    /// Where the socket's data frames go once the queue is in use.
    frames: Option<mpsc::UnboundedSender<Incoming>>,
    /// Data frames the queue's task is ready to take: the socket reader reads a data frame's
    /// body only with a permit, so that it holds no more than before the queue (one frame
    /// waiting for room in the inbox), and a stalled receiver stalls the sender's socket.
    wanted: Arc<Semaphore>,
    task: Option<AbortOnDrop>,
    /// Data frames the socket reader delivered itself, before the queue was mapped.
    pub(crate) direct: u64,
    /// The peer's ring, for the queue's ring records; set before the ring is accepted.
    pub(crate) ring: Arc<OnceLock<Arc<RecvRing>>>,
    /// Why the queue's task closed the connection, set before it closes it.
    closed_because: Arc<OnceLock<QueueEnd>>,
}

impl Default for QueueLink {
    fn default() -> Self {
        QueueLink {
            frames: None,
            wanted: Arc::new(Semaphore::new(0)),
            task: None,
            direct: 0,
            ring: Arc::default(),
            closed_because: Arc::default(),
        }
    }
}

/// Closes the semaphore the socket reader waits on.
struct CloseOnDrop(Arc<Semaphore>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// Stops the queue's task if the socket reader is stopped (transport shutdown).
struct AbortOnDrop(JoinHandle<QueueEnd>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl QueueLink {
    /// Starts delivering from `queue`: from now on the socket's data frames go through it.
    pub(crate) fn start(
        &mut self,
        queue: RecvQueue,
        conn: Arc<Conn>,
        inbox: Arc<Inbox>,
        limits: Limits,
        spin: Duration,
    ) {
        let (tx, rx) = mpsc::unbounded_channel();
        let wanted = Arc::new(Semaphore::new(0));
        self.wanted = wanted.clone();
        let task = Delivery {
            wanted,
            outstanding: 0,
            queue,
            frames: rx,
            early: VecDeque::new(),
            frames_open: true,
            delivered_unmarked: self.direct,
            started: false,
            ring: self.ring.clone(),
            conn,
            inbox,
            limits,
            spin,
            polls: 0,
            wakes: WakeLimit::default(),
        };
        self.frames = Some(tx);
        let closed_because = self.closed_because.clone();
        self.task = Some(AbortOnDrop(tokio::spawn(async move {
            // However the task ends (a panic included), a socket reader waiting to hand over
            // a frame must not wait for nobody.
            let _wanted = CloseOnDrop(task.wanted.clone());
            let conn = task.conn.clone();
            let end = task.run().await;
            // The connection cannot go on without its queue: the peer is told why, as for a
            // bad frame on the socket, and both sides see the loss. The reason is kept first:
            // the socket reader, seeing the connection closed, stops this task.
            match &end {
                QueueEnd::Refused(why) => {
                    let _ = closed_because.set(end.clone());
                    conn.close_with_notice(why).await;
                }
                QueueEnd::Failed(_) => {
                    let _ = closed_because.set(end.clone());
                    conn.close();
                }
                QueueEnd::Drained | QueueEnd::Shutdown => {}
            }
            end
        })));
    }

    /// Whether the queue is in use.
    pub(crate) fn is_started(&self) -> bool {
        self.frames.is_some()
    }

    /// Waits until the queue's task takes another data frame from the socket; false if it
    /// has ended.
    pub(crate) async fn wait_wanted(&self) -> bool {
        match self.wanted.acquire().await {
            Ok(permit) => {
                permit.forget();
                true
            }
            Err(_) => false,
        }
    }

    /// Hands a data frame from the socket to the queue's task; false if the task has ended.
    pub(crate) fn forward(&self, msg: Incoming) -> bool {
        match &self.frames {
            Some(tx) => tx.send(msg).is_ok(),
            None => false,
        }
    }

    /// This side closed the connection: stops the queue's task, and says why if the task
    /// itself closed it (None otherwise).
    pub(crate) fn stop(mut self) -> Option<QueueEnd> {
        self.frames = None;
        drop(self.task.take());
        self.closed_because.get().cloned()
    }

    /// The socket has ended: lets the queue's task deliver what the queue still holds, and
    /// says why it stopped (None if the queue was never used).
    pub(crate) async fn finish(mut self) -> Option<QueueEnd> {
        self.frames = None;
        let mut task = self.task.take()?;
        let end = (&mut task.0).await;
        Some(end.unwrap_or_else(|e| QueueEnd::Failed(format!("the queue's task ended: {e}"))))
    }
}

struct Delivery {
    queue: RecvQueue,
    frames: mpsc::UnboundedReceiver<Incoming>,
    wanted: Arc<Semaphore>,
    /// Frames asked for (permits given) and not yet received.
    outstanding: usize,
    /// Frames taken from the socket before the queue said where they go.
    early: VecDeque<Incoming>,
    frames_open: bool,
    /// Data frames delivered that had no marker (sent before the queue's first record).
    delivered_unmarked: u64,
    started: bool,
    ring: Arc<OnceLock<Arc<RecvRing>>>,
    conn: Arc<Conn>,
    inbox: Arc<Inbox>,
    limits: Limits,
    spin: Duration,
    /// Polls of an idle queue, for reading the clock less often than polling.
    polls: u32,
    /// Wake-ups that found nothing to read.
    wakes: WakeLimit,
}

/// Wake-ups of the queue's eventfd that found the queue empty. A sender signals only a
/// sleeping reader that has a record to read, so these are rare; a peer that writes the
/// eventfd in a loop would otherwise have this reader spin after each of them, a core's
/// worth. The reader then sleeps without spinning, and past `SPURIOUS_PER_SECOND` in a
/// second it pauses before each wait, so the flood costs it a thousand wake-ups a second.
#[derive(Default)]
struct WakeLimit {
    /// Woken by the eventfd, and not yet found a record since.
    woken: bool,
    window: Option<Instant>,
    spurious: u32,
    warned: bool,
}

const SPURIOUS_PER_SECOND: u32 = 1000;
const SPURIOUS_PAUSE: Duration = Duration::from_millis(1);

impl WakeLimit {
    /// A record was read: the last wake-up was for it.
    fn read(&mut self) {
        self.woken = false;
    }

    /// The queue is empty: whether the last wake-up was spurious, and how long to pause
    /// before waiting again.
    fn empty(&mut self) -> (bool, Option<Duration>) {
        if !std::mem::take(&mut self.woken) {
            return (false, None);
        }
        let now = Instant::now();
        let start = *self.window.get_or_insert(now);
        if now.duration_since(start) >= Duration::from_secs(1) {
            self.window = Some(now);
            self.spurious = 0;
        }
        self.spurious += 1;
        (
            true,
            (self.spurious > SPURIOUS_PER_SECOND).then_some(SPURIOUS_PAUSE),
        )
    }
}

/// A step that cannot go on.
enum Stop {
    End(QueueEnd),
}

impl From<String> for Stop {
    fn from(why: String) -> Self {
        Stop::End(QueueEnd::Refused(why))
    }
}

impl Delivery {
    async fn run(mut self) -> QueueEnd {
        let mut idle_since: Option<Instant> = None;
        loop {
            let step = match self.queue.consumer.next(&self.limits) {
                Err(why) => return QueueEnd::Refused(why.to_string()),
                Ok(Some(record)) => {
                    idle_since = None;
                    self.wakes.read();
                    self.record(record).await
                }
                Ok(None) => self.idle(&mut idle_since).await,
            };
            if let Err(Stop::End(end)) = step {
                return end;
            }
        }
    }

    async fn record(&mut self, record: Record) -> Result<(), Stop> {
        match record {
            Record::Start(before) => {
                if self.started {
                    return Err("a second start record in the queue".to_string().into());
                }
                self.started = true;
                // From here on frames are asked for at their markers only.
                self.revoke();
                let owed = before.checked_sub(self.delivered_unmarked).ok_or_else(|| {
                    format!(
                        "the queue's start counts {before} earlier messages, {} arrived",
                        self.delivered_unmarked
                    )
                })?;
                for _ in 0..owed {
                    let msg = self.socket_frame().await?;
                    self.deliver(msg).await?;
                }
                Ok(())
            }
            _ if !self.started => Err("a queue record before the start record".to_string().into()),
            Record::Inline { meta, segments } => {
                let msg = Incoming {
                    peer: self.conn.peer,
                    meta,
                    segments,
                    placed: None,
                };
                let msg = self.inbox.placing.place_now(msg).await;
                self.deliver(msg).await
            }
            Record::Ring { meta, descriptor } => {
                let Some(ring) = self.ring.get() else {
                    return Err("a ring record before a ring was offered".to_string().into());
                };
                let segments = ring.segments(&descriptor, &self.conn.control, &self.limits)?;
                let msg = Incoming {
                    peer: self.conn.peer,
                    meta,
                    segments,
                    placed: None,
                };
                let msg = self.inbox.placing.place_now(msg).await;
                self.deliver(msg).await
            }
            Record::Socket => {
                let msg = self.socket_frame().await?;
                self.deliver(msg).await
            }
        }
    }

    /// The queue is empty: hands on frames the socket sent before the queue started, polls
    /// a while, then sleeps until the sender signals or the socket ends.
    async fn idle(&mut self, idle_since: &mut Option<Instant>) -> Result<(), Stop> {
        // The queue was looked at after these frames were taken, and their markers (if any)
        // were published before they were written: no record now means they have none.
        if !self.early.is_empty() {
            if self.started {
                return Err("a message on the socket without its queue marker"
                    .to_string()
                    .into());
            }
            while let Some(msg) = self.early.pop_front() {
                self.delivered_unmarked += 1;
                self.deliver(msg).await?;
            }
            return Ok(());
        }
        if !self.frames_open {
            return Err(Stop::End(QueueEnd::Drained));
        }
        if !self.started {
            // Frames sent before the queue's first record go to the inbox as they come.
            self.ask();
        }
        match self.frames.try_recv() {
            Ok(msg) => {
                self.took();
                self.early.push_back(msg);
                return Ok(());
            }
            Err(mpsc::error::TryRecvError::Disconnected) => {
                self.frames_open = false;
                return Ok(());
            }
            Err(mpsc::error::TryRecvError::Empty) => {}
        }
        let since = *idle_since.get_or_insert_with(Instant::now);
        let (spurious, pause) = self.wakes.empty();
        if let Some(pause) = pause {
            if !std::mem::replace(&mut self.wakes.warned, true) {
                tracing::warn!(peer = %self.conn.peer, "the peer wakes this node's same-host \
                    queue more than {SPURIOUS_PER_SECOND} times a second with nothing in it: \
                    wake-ups from it are now rate limited");
            }
            tokio::time::sleep(pause).await;
        }
        // The clock is read every 8th poll only: a poll is cheaper than reading it here.
        self.polls = self.polls.wrapping_add(1);
        if !spurious && !self.spin.is_zero() && (self.polls % 8 != 0 || since.elapsed() < self.spin)
        {
            tokio::task::yield_now().await;
            return Ok(());
        }
        if !self.queue.consumer.sleep() {
            return Ok(());
        }
        let (woke, by_eventfd) = tokio::select! {
            woke = self.queue.wait() => (woke, true),
            msg = self.frames.recv() => {
                match msg {
                    Some(msg) => {
                        self.took();
                        self.early.push_back(msg);
                    }
                    None => self.frames_open = false,
                }
                (Ok(()), false)
            }
        };
        self.queue.consumer.wake();
        *idle_since = None;
        self.wakes.woken = by_eventfd && woke.is_ok();
        woke.map_err(|e| {
            Stop::End(QueueEnd::Failed(format!(
                "waiting on the queue's eventfd: {e}"
            )))
        })
    }

    /// The next data frame from the socket, in order.
    async fn socket_frame(&mut self) -> Result<Incoming, Stop> {
        if let Some(msg) = self.early.pop_front() {
            return Ok(msg);
        }
        if self.frames_open {
            self.ask();
            if let Some(msg) = self.frames.recv().await {
                self.took();
                return Ok(msg);
            }
            self.frames_open = false;
        }
        // The socket ended before the message its marker announced: the peer is gone.
        Err(Stop::End(QueueEnd::Drained))
    }

    /// Lets the socket reader hand over one more data frame, unless one is already asked for.
    fn ask(&mut self) {
        if self.outstanding == 0 {
            self.outstanding = 1;
            self.wanted.add_permits(1);
        }
    }

    fn took(&mut self) {
        self.outstanding = self.outstanding.saturating_sub(1);
    }

    /// Takes back a frame asked for and not yet taken by the socket reader. Asked for while
    /// idle before the queue started, it would otherwise stay good while this task waits for
    /// room in the inbox, and the reader would read one more frame, however large, on top of
    /// the one waiting (a 256 MiB send completed into a stalled receiver, 2 runs in 25).
    fn revoke(&mut self) {
        if self.outstanding > 0 {
            if let Ok(permit) = self.wanted.try_acquire() {
                permit.forget();
                self.outstanding -= 1;
            }
        }
    }

    async fn deliver(&mut self, msg: Incoming) -> Result<(), Stop> {
        self.revoke();
        tracing::trace!(peer = %self.conn.peer, "received message through the queue");
        if self.inbox.push_message(msg).await {
            Ok(())
        } else {
            Err(Stop::End(QueueEnd::Shutdown))
        }
    }
}

#[cfg(test)]
mod wake_tests {
    use super::*;

    #[test]
    fn a_flood_of_empty_wake_ups_is_paused_and_a_real_one_is_not() {
        let mut w = WakeLimit::default();
        // Not woken: an ordinary idle poll, spinning allowed.
        assert_eq!(w.empty(), (false, None));
        // Woken, then a record: the wake-up was real.
        w.woken = true;
        w.read();
        assert_eq!(w.empty(), (false, None));
        // Empty wake-ups: no spinning after them, and past the limit a pause before each wait.
        for i in 1..=SPURIOUS_PER_SECOND + 5 {
            w.woken = true;
            let (spurious, pause) = w.empty();
            assert!(spurious);
            assert_eq!(pause.is_some(), i > SPURIOUS_PER_SECOND, "wake-up {i}");
        }
        // A new second starts a new count.
        w.window = Some(Instant::now() - Duration::from_secs(2));
        w.woken = true;
        assert_eq!(w.empty(), (true, None));
    }
}
