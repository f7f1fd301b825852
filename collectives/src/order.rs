//! The order of calls. A call takes its number when it is made (when the method is called,
//! not when its future is first polled), and runs when every earlier call of this rank has
//! finished: calls made from one task, or in a known order, pair up across ranks by number.
//!
//! A call whose future is dropped before it finished (a timeout around it, a `select!` it
//! lost) leaves the other ranks waiting for its messages: it fails the communicator, and the
//! other ranks are told, as for any failed call.

use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard};

use tokio::sync::Notify;

/// Which call may run now.
#[derive(Debug, Default)]
pub(crate) struct Order {
    state: Mutex<State>,
    changed: Notify,
}

#[derive(Debug, Default)]
struct State {
    /// The number the next call made gets.
    next: u64,
    /// The call that may run now.
    serving: u64,
    /// Calls dropped before their turn came: skipped when it does.
    abandoned: BTreeSet<u64>,
}

impl Order {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A number for a call being made now.
    pub(crate) fn take(&self) -> u64 {
        let mut st = self.lock();
        st.next += 1;
        st.next - 1
    }

    /// Waits until call `seq` may run, calling `waiting` once if it has to wait (a call whose
    /// turn has come costs nothing more).
    pub(crate) async fn wait_turn(&self, seq: u64, waiting: impl FnOnce()) {
        let mut waiting = Some(waiting);
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.lock().serving == seq {
                return;
            }
            if let Some(note) = waiting.take() {
                note();
            }
            changed.await;
        }
    }

    /// Call `seq` is over (finished, failed, or dropped): later calls may run.
    pub(crate) fn release(&self, seq: u64) {
        let mut st = self.lock();
        if st.serving == seq {
            st.serving += 1;
            loop {
                let next = st.serving;
                if !st.abandoned.remove(&next) {
                    break;
                }
                st.serving += 1;
            }
        } else if st.serving < seq {
            st.abandoned.insert(seq);
        }
        drop(st);
        self.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_run_in_the_order_they_were_made_and_dropped_ones_are_skipped() {
        let order = Order::default();
        let (a, b, c) = (order.take(), order.take(), order.take());
        assert_eq!((a, b, c), (0, 1, 2));
        // b is dropped before its turn; c must run right after a.
        order.release(b);
        assert_eq!(order.lock().serving, 0);
        order.release(a);
        assert_eq!(order.lock().serving, 2);
        order.release(c);
        assert_eq!(order.lock().serving, 3);
    }
}
