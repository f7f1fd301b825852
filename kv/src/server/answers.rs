//! The answers a server sends: one backlog and one sending task per worker. The server's
//! loop only queues answers: a task per answer (hundreds of thousands in a round of many
//! small keys) filled the runtime's queue, held a future's memory each, and kept the loop
//! itself, heartbeats included, waiting behind them.
//!
//! A worker's backlog goes out by the priority its request carried, higher first, equal ones
//! in the order they were queued: when the link to a worker is the bottleneck, the keys the
//! next forward pass needs first (declared first) overtake answers still waiting, as in
//! BytePS. An answer already being sent is not interrupted.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, Mutex};

use psnet_transport::Transport;
use tokio::sync::Notify;

use crate::proto::ids::{self, Role};
use crate::proto::msg::Msg;
use crate::proto::server::AnswerValue;
use crate::reliable::Link;

type Answer = (Msg, Option<AnswerValue>);

/// Priority of answers to requests that carry none (commands, snapshots): ahead of data.
const CONTROL: i32 = i32::MAX;

/// Per-worker answer backlogs, each drained by its own task.
pub(crate) struct Answers<T: Transport> {
    link: Arc<Link<T>>,
    queues: HashMap<u32, Arc<Queue>>,
    /// The priority each request waiting for its answer carried, by (worker, request id).
    priorities: HashMap<(u32, u64), i32>,
}

impl<T: Transport> Answers<T> {
    pub(crate) fn new(link: Arc<Link<T>>) -> Self {
        Answers {
            link,
            queues: HashMap::new(),
            priorities: HashMap::new(),
        }
    }

    /// Notes the priority of worker `rank`'s request `ts`, for its answer.
    pub(crate) fn expect(&mut self, rank: u32, ts: u64, priority: i32) {
        self.priorities.insert((rank, ts), priority);
    }

    /// Forgets what worker `rank` asked: it is gone, and its requests will not be answered.
    pub(crate) fn forget(&mut self, rank: u32) {
        self.priorities.retain(|(r, _), _| *r != rank);
    }

    /// Queues `msg` (with the value it carries) for worker `rank`, at the priority of the
    /// request it answers.
    pub(crate) fn send(&mut self, rank: u32, msg: Msg, value: Option<AnswerValue>) {
        let priority = answered(&msg)
            .and_then(|ts| self.priorities.remove(&(rank, ts)))
            .unwrap_or(CONTROL);
        let link = &self.link;
        let queue = self.queues.entry(rank).or_insert_with(|| {
            let queue = Arc::new(Queue::default());
            tokio::spawn(drain(link.clone(), rank, queue.clone()));
            queue
        });
        queue.push(priority, (msg, value));
    }
}

impl<T: Transport> Drop for Answers<T> {
    fn drop(&mut self) {
        for queue in self.queues.values() {
            queue.close();
        }
    }
}

/// The request an answer settles.
fn answered(msg: &Msg) -> Option<u64> {
    match msg {
        Msg::Done { ts }
        | Msg::Pulled { ts, .. }
        | Msg::Failed { ts, .. }
        | Msg::PeerFailed { ts, .. } => Some(*ts),
        _ => None,
    }
}

/// One worker's waiting answers.
#[derive(Default)]
struct Queue {
    backlog: Mutex<Backlog<Answer>>,
    ready: Notify,
}

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Backlog<Answer>> {
        // Pushing and popping a heap does not panic half-way: a poisoned lock is consistent.
        self.backlog.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, priority: i32, answer: Answer) {
        self.lock().push(priority, answer);
        self.ready.notify_one();
    }

    fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_one();
    }
}

/// Sends worker `rank`'s answers, highest priority first, until the server's loop is done
/// and the backlog is empty.
async fn drain<T: Transport>(link: Arc<Link<T>>, rank: u32, queue: Arc<Queue>) {
    let to = ids::node_id(Role::Worker, rank);
    loop {
        let next = {
            let mut backlog = queue.lock();
            match backlog.pop() {
                Some(answer) => Some(answer),
                None if backlog.closed => return,
                None => None,
            }
        };
        let Some((msg, value)) = next else {
            // `notify_one` keeps a wake-up given while nobody waited: none is lost.
            queue.ready.notified().await;
            continue;
        };
        let bytes = value.as_ref().map(AnswerValue::as_bytes);
        if let Err(e) = link.send(to, &msg, bytes).await {
            tracing::debug!(worker = rank, error = %e, "answer lost");
        }
    }
}

/// Items by priority, higher first, and in the order they came among equals.
pub(crate) struct Backlog<A> {
    heap: BinaryHeap<Entry<A>>,
    next: u64,
    closed: bool,
}

impl<A> Default for Backlog<A> {
    fn default() -> Self {
        Backlog {
            heap: BinaryHeap::new(),
            next: 0,
            closed: false,
        }
    }
}

impl<A> Backlog<A> {
    pub(crate) fn push(&mut self, priority: i32, item: A) {
        self.heap.push(Entry {
            priority,
            order: self.next,
            item,
        });
        self.next += 1;
    }

    pub(crate) fn pop(&mut self) -> Option<A> {
        self.heap.pop().map(|e| e.item)
    }
}

struct Entry<A> {
    priority: i32,
    order: u64,
    item: A,
}

impl<A> Entry<A> {
    /// Greater is sent sooner: higher priority, then queued earlier.
    fn rank(&self) -> (i32, std::cmp::Reverse<u64>) {
        (self.priority, std::cmp::Reverse(self.order))
    }
}

impl<A> PartialEq for Entry<A> {
    fn eq(&self, other: &Self) -> bool {
        self.rank() == other.rank()
    }
}

impl<A> Eq for Entry<A> {}

impl<A> PartialOrd for Entry<A> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<A> Ord for Entry<A> {
    fn cmp(&self, other: &Self) -> Ordering {
        self.rank().cmp(&other.rank())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever is queued, and however pushes and pops interleave, every pop takes the
        /// highest priority waiting, and the earliest queued among equals.
        #[test]
        fn a_backlog_pops_the_highest_priority_then_the_oldest(
            ops in proptest::collection::vec(proptest::option::of(-3i32..3), 1..200),
        ) {
            let mut backlog = Backlog::default();
            let mut model: Vec<(i32, usize)> = Vec::new();
            for (n, op) in ops.into_iter().enumerate() {
                match op {
                    Some(p) => {
                        backlog.push(p, (p, n));
                        model.push((p, n));
                    }
                    None => {
                        let best = model
                            .iter()
                            .enumerate()
                            .max_by_key(|(_, (p, n))| (*p, std::cmp::Reverse(*n)))
                            .map(|(i, _)| i);
                        let want = best.map(|i| model.remove(i));
                        prop_assert_eq!(backlog.pop(), want);
                    }
                }
            }
        }
    }
}
