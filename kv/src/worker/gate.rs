//! A worker's sends to one server take turns by priority: when calls run at once (a
//! framework pushing each layer's gradients as its backward pass produces them, last layer
//! first), the request waiting with the highest priority goes next, equal ones in the order
//! they came, as BytePS's scheduler does. A send in progress is not interrupted.

use std::collections::BinaryHeap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

/// One server's turn: held while a request's bytes go out.
#[derive(Default)]
pub(crate) struct Gate {
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    busy: bool,
    waiting: BinaryHeap<Waiter>,
    next: u64,
}

struct Waiter {
    priority: i32,
    order: u64,
    wake: oneshot::Sender<Turn>,
}

impl Waiter {
    /// Greater goes sooner: higher priority, then earlier.
    fn rank(&self) -> (i32, std::cmp::Reverse<u64>) {
        (self.priority, std::cmp::Reverse(self.order))
    }
}

impl PartialEq for Waiter {
    fn eq(&self, other: &Self) -> bool {
        self.rank() == other.rank()
    }
}
impl Eq for Waiter {}
impl PartialOrd for Waiter {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Waiter {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.rank().cmp(&other.rank())
    }
}

/// The right to send to the gate's server; dropping it passes the turn on.
pub(crate) struct Turn {
    /// `None` once the turn was passed on.
    state: Option<Arc<Mutex<State>>>,
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // No method panics half-way through a change: a poisoned lock is consistent.
    state.lock().unwrap_or_else(|p| p.into_inner())
}

impl Gate {
    /// Waits for this server's turn at `priority`. Cancel-safe: a waiter dropped before or
    /// after its turn came passes the turn on.
    pub(crate) async fn turn(&self, priority: i32) -> Turn {
        let rx = {
            let mut s = lock(&self.state);
            if !s.busy {
                s.busy = true;
                return Turn {
                    state: Some(self.state.clone()),
                };
            }
            let (wake, rx) = oneshot::channel();
            let order = s.next;
            s.next += 1;
            s.waiting.push(Waiter {
                priority,
                order,
                wake,
            });
            rx
        };
        match rx.await {
            Ok(turn) => turn,
            // The sender is dropped only with the gate itself, which a caller holds.
            Err(_) => Turn {
                state: Some(self.state.clone()),
            },
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let Some(state) = self.state.take() else {
            return;
        };
        let mut s = lock(&state);
        while let Some(w) = s.waiting.pop() {
            let next = Turn {
                state: Some(state.clone()),
            };
            match w.wake.send(next) {
                Ok(()) => return,
                // That waiter was dropped: the turn came back unused, and is disarmed so
                // that dropping it does not lock again. The next waiter is tried.
                Err(mut unused) => {
                    unused.state = None;
                }
            }
        }
        s.busy = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt;
    use proptest::prelude::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    proptest! {
        /// Waiters queued while a turn is held get it highest priority first, the earliest
        /// among equals.
        #[test]
        fn turns_go_by_priority_then_arrival(priorities in proptest::collection::vec(-4i32..4, 1..40)) {
            let order = runtime().block_on(async {
                let gate = Arc::new(Gate::default());
                let first = gate.turn(0).await;
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
                let mut tasks = Vec::new();
                for (i, &p) in priorities.iter().enumerate() {
                    let (gate, tx) = (gate.clone(), tx.clone());
                    let (queued_tx, queued) = oneshot::channel();
                    tasks.push(tokio::spawn(async move {
                        let mut wait = Box::pin(gate.turn(p));
                        // Polled once, so it is queued, before the next waiter is made.
                        let turn = (&mut wait).now_or_never();
                        let _ = queued_tx.send(());
                        let _turn = match turn { Some(t) => t, None => wait.await };
                        tx.send((p, i)).unwrap();
                    }));
                    queued.await.unwrap();
                }
                drop(first);
                for t in tasks {
                    t.await.unwrap();
                }
                drop(tx);
                let mut order = Vec::new();
                while let Some(x) = rx.recv().await {
                    order.push(x);
                }
                order
            });
            let mut want: Vec<(i32, usize)> = priorities.iter().copied().zip(0..).collect();
            want.sort_by_key(|&(p, i)| (std::cmp::Reverse(p), i));
            prop_assert_eq!(order, want);
        }
    }

    #[test]
    fn a_waiter_dropped_before_or_after_its_turn_passes_the_turn_on() {
        runtime().block_on(async {
            let gate = Gate::default();
            let held = gate.turn(0).await;
            // Dropped while queued.
            {
                let mut wait = Box::pin(gate.turn(9));
                assert!((&mut wait).now_or_never().is_none());
            }
            // Granted, then dropped before it ran.
            let mut granted = Box::pin(gate.turn(5));
            assert!((&mut granted).now_or_never().is_none());
            let mut last = Box::pin(gate.turn(1));
            assert!((&mut last).now_or_never().is_none());
            drop(held);
            drop(granted);
            let turn = tokio::time::timeout(std::time::Duration::from_secs(5), last)
                .await
                .expect("the turn reached the last waiter");
            drop(turn);
            let again = tokio::time::timeout(std::time::Duration::from_secs(5), gate.turn(0))
                .await
                .expect("the gate is free again");
            drop(again);
        });
    }
}
