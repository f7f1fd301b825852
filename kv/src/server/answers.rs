//! The answers a server sends: one queue and one sending task per worker. Answers leave for
//! a worker in the order the state machine made them, and the server's loop only queues them:
//! a task per answer (hundreds of thousands in a round of many small keys) filled the
//! runtime's queue, held a future's memory each, and kept the loop itself, heartbeats
//! included, waiting behind them.

use std::collections::HashMap;
use std::sync::Arc;

use psnet_transport::Transport;
use tokio::sync::mpsc;

use crate::proto::ids::{self, Role};
use crate::proto::msg::Msg;
use crate::proto::server::AnswerValue;
use crate::reliable::Link;

type Answer = (Msg, Option<AnswerValue>);

/// Per-worker answer queues, each drained by its own task.
pub(crate) struct Answers<T: Transport> {
    link: Arc<Link<T>>,
    queues: HashMap<u32, mpsc::UnboundedSender<Answer>>,
}

impl<T: Transport> Answers<T> {
    pub(crate) fn new(link: Arc<Link<T>>) -> Self {
        Answers {
            link,
            queues: HashMap::new(),
        }
    }

    /// Queues `msg` (with the value it carries) for worker `rank`.
    pub(crate) fn send(&mut self, rank: u32, msg: Msg, value: Option<AnswerValue>) {
        let link = &self.link;
        let queue = self.queues.entry(rank).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(drain(link.clone(), rank, rx));
            tx
        });
        // The task ends only when the queue closes, so it is there to take this.
        let _ = queue.send((msg, value));
    }
}

/// Sends worker `rank`'s answers one after another until the queue closes.
async fn drain<T: Transport>(
    link: Arc<Link<T>>,
    rank: u32,
    mut queue: mpsc::UnboundedReceiver<Answer>,
) {
    let to = ids::node_id(Role::Worker, rank);
    while let Some((msg, value)) = queue.recv().await {
        let bytes = value.as_ref().map(AnswerValue::as_bytes);
        if let Err(e) = link.send(to, &msg, bytes).await {
            tracing::debug!(worker = rank, error = %e, "answer lost");
        }
    }
}
