//! In-order delivery of messages whose data arrive out of order.
//!
//! Messages to one peer are delivered in the order they were sent. An eager message is
//! complete when it arrives; a rendezvous message takes its place in the order when its
//! request-to-send arrives and completes later, when the sender's write lands. Messages behind
//! an incomplete one wait for it.

use std::collections::VecDeque;

enum Entry<T> {
    Ready(T),
    Pending(u32),
}

/// Messages waiting for delivery, in send order.
pub struct Reorder<T> {
    queue: VecDeque<Entry<T>>,
}

impl<T> Default for Reorder<T> {
    fn default() -> Self {
        Reorder {
            queue: VecDeque::new(),
        }
    }
}

impl<T> Reorder<T> {
    /// A complete message, next in order.
    pub fn push_ready(&mut self, item: T) {
        self.queue.push_back(Entry::Ready(item));
    }

    /// A message whose data will come later, named by its rendezvous `seq`.
    pub fn push_pending(&mut self, seq: u32) {
        self.queue.push_back(Entry::Pending(seq));
    }

    /// Completes pending message `seq`; false if no such message waits.
    pub fn complete(&mut self, seq: u32, item: T) -> bool {
        match self
            .queue
            .iter_mut()
            .find(|e| matches!(e, Entry::Pending(s) if *s == seq))
        {
            Some(slot) => {
                *slot = Entry::Ready(item);
                true
            }
            None => false,
        }
    }

    /// The next message if it is complete.
    pub fn pop_ready(&mut self) -> Option<T> {
        if matches!(self.queue.front(), Some(Entry::Ready(_))) {
            match self.queue.pop_front() {
                Some(Entry::Ready(item)) => Some(item),
                _ => None,
            }
        } else {
            None
        }
    }

    /// Messages waiting (complete or not).
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever order rendezvous data land in, messages come out in send order, each once.
        #[test]
        fn delivers_in_send_order(kinds in proptest::collection::vec(any::<bool>(), 0..60),
                                  completion_order in any::<proptest::sample::Index>()) {
            let mut r = Reorder::default();
            let mut pending = Vec::new();
            let mut out = Vec::new();
            for (i, rendezvous) in kinds.iter().enumerate() {
                if *rendezvous {
                    r.push_pending(i as u32);
                    pending.push(i as u32);
                } else {
                    r.push_ready(i);
                }
                while let Some(x) = r.pop_ready() { out.push(x); }
            }
            // Complete the pending ones in a rotated order.
            if !pending.is_empty() {
                let k = completion_order.index(pending.len());
                pending.rotate_left(k);
            }
            for seq in pending {
                prop_assert!(r.complete(seq, seq as usize));
                prop_assert!(!r.complete(seq, 0), "completed twice");
                while let Some(x) = r.pop_ready() { out.push(x); }
            }
            prop_assert_eq!(out, (0..kinds.len()).collect::<Vec<_>>());
            prop_assert!(r.is_empty());
        }
    }

    #[test]
    fn unknown_sequence_is_refused() {
        let mut r: Reorder<u8> = Reorder::default();
        r.push_pending(3);
        assert!(!r.complete(4, 0));
        assert!(r.pop_ready().is_none());
        assert_eq!(r.len(), 1);
    }
}
