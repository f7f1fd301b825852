//! The queue between the connections' reader tasks and `Transport::recv`, bounded in bytes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use psnet_transport::placement::ReceivePlacing;
use psnet_transport::{Event, Incoming, TransportError};
use tokio::sync::{mpsc, Mutex, OwnedSemaphorePermit, Semaphore};

/// Fixed cost charged per message on top of its bytes, so that floods of empty messages are
/// bounded too.
const PER_MESSAGE_COST: usize = 256;

type Entry = (Event, Option<OwnedSemaphorePermit>);

pub(crate) struct Inbox {
    tx: mpsc::UnboundedSender<Entry>,
    rx: Mutex<mpsc::UnboundedReceiver<Entry>>,
    budget: Arc<Semaphore>,
    capacity: usize,
    closed: AtomicBool,
    /// Received segments placed in device memory (`Transport::set_placer`), staged in
    /// chunks of `PSNET_GPU_STAGE_CHUNK`.
    pub(crate) placing: ReceivePlacing,
}

impl Inbox {
    pub(crate) fn new(capacity: usize, stage_chunk: usize) -> Self {
        let capacity = capacity.clamp(PER_MESSAGE_COST, Semaphore::MAX_PERMITS);
        let (tx, rx) = mpsc::unbounded_channel();
        Inbox {
            tx,
            rx: Mutex::new(rx),
            budget: Arc::new(Semaphore::new(capacity)),
            capacity,
            closed: AtomicBool::new(false),
            placing: ReceivePlacing::new("tcp", stage_chunk),
        }
    }

    /// Queues a message once the byte budget allows; waiting here is what stops the connection
    /// from reading further. Returns false once the inbox is closed.
    pub(crate) async fn push_message(&self, msg: Incoming) -> bool {
        let bytes = msg.meta.len() + msg.segments.iter().map(|s| s.len()).sum::<usize>();
        // A message larger than the whole budget waits for the queue to drain, then goes alone.
        let cost = (bytes + PER_MESSAGE_COST).min(self.capacity);
        let permits = u32::try_from(cost).unwrap_or(u32::MAX);
        let Ok(permit) = self.budget.clone().acquire_many_owned(permits).await else {
            return false;
        };
        self.tx.send((Event::Message(msg), Some(permit))).is_ok()
    }

    /// Queues a connection event (never blocks: there are at most two per connection).
    pub(crate) fn push_event(&self, event: Event) {
        if !self.closed.load(Ordering::Acquire) {
            let _ = self.tx.send((event, None));
        }
    }

    pub(crate) async fn recv(&self) -> Result<Event, TransportError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(TransportError::Closed);
        }
        let mut rx = self.rx.lock().await;
        match rx.recv().await {
            // Dropping the permit returns the message's bytes to the budget.
            Some((event, _permit)) if !self.closed.load(Ordering::Acquire) => Ok(event),
            _ => Err(TransportError::Closed),
        }
    }

    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.budget.close();
        // Wake a pending `recv` by sending a marker it will discard as closed.
        let _ = self.tx.send((
            Event::PeerLost {
                peer: psnet_transport::NodeId(u64::MAX),
                reason: "transport shut down".into(),
            },
            None,
        ));
    }
}
