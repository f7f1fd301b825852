//! What completions leave behind, done after each batch: receive buffers to post again,
//! requests deferred while the inbox was full, offers to make, writes and grants waiting for
//! room, and credits to return.

use super::{Grant, Link, Progress};
use crate::error::VerbsError;
use crate::proto::credits::Class;
use crate::proto::wire::{self, Base, Cts, Kind};

impl Link {
    /// After completions: retries, deferred work, credits; returns deliverable messages.
    pub(crate) fn pump(&self, inbox_full: bool) -> Progress {
        let mut progress = Progress::default();
        let mut st = self.lock();
        if st.failed.is_some() {
            // Messages received whole before the link failed (an error completion in the same
            // batch as the peer's last messages) are still the peer's: delivered before its
            // loss, as TCP delivers what came before a reset.
            while let Some(msg) = st.order.pop_ready() {
                progress.delivered.push(msg);
            }
            return progress;
        }
        let result = (|| -> Result<(), VerbsError> {
            for slot in std::mem::take(&mut st.repost) {
                self.post_recv(&mut st, slot);
            }
            if !inbox_full {
                st.credits.release_withheld();
                while let Some(rts) = st.deferred_rts.pop_front() {
                    self.accept_rts(&mut st, rts)?;
                }
                while let Some(class) = st.to_offer.pop_front() {
                    if st.offered.wants(class) {
                        let region = self.pool.take(class as usize)?;
                        let cts = Cts {
                            addr: region.addr(),
                            rkey: region.rkey(),
                            len: region.len() as u64,
                        };
                        let id = st.offered.offer(class, region);
                        st.offer_backlog.push_back((id, cts));
                    }
                }
            }
            while let Some(&seq) = st.write_backlog.front() {
                if !self.post_writes(&mut st, seq) {
                    break;
                }
                st.write_backlog.pop_front();
            }
            while let Some(&(seq, grant)) = st.cts_backlog.front() {
                let posted = self.try_post_small(&mut st, Class::Normal, |buf, credits| {
                    let base = |kind| Base { kind, credits, seq };
                    match grant {
                        Grant::Whole(cts) => wire::put_cts(buf, base(Kind::Cts), cts),
                        Grant::Placed(cts) => wire::put_placed_cts(buf, base(Kind::CtsPlaced), cts),
                    }
                });
                if !posted {
                    break;
                }
                st.cts_backlog.pop_front();
            }
            while let Some(&(id, offer)) = st.offer_backlog.front() {
                let posted = self.try_post_small(&mut st, Class::Normal, |buf, credits| {
                    let base = Base {
                        kind: Kind::Offer,
                        credits,
                        seq: id,
                    };
                    wire::put_cts(buf, base, offer)
                });
                if !posted {
                    break;
                }
                st.offer_backlog.pop_front();
            }
            if st.credits.wants_credit_message() {
                self.try_post_small(&mut st, Class::CreditReturn, |buf, credits| {
                    let base = Base {
                        kind: Kind::Credit,
                        credits,
                        seq: 0,
                    };
                    wire::put_base(buf, base);
                    wire::BASE_LEN
                });
            }
            Ok(())
        })()
        .and_then(|()| st.post());
        while let Some(msg) = st.order.pop_ready() {
            progress.delivered.push(msg);
        }
        drop(st);
        if let Err(reason) = result {
            progress.failure = Some(reason);
        }
        self.changed.notify_waiters();
        progress
    }
}
