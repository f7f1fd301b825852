//! Row-sparse pushes (MXNet's push of a row_sparse gradient): a key declared row-sparse
//! ([`Worker::init_rows`]) is pushed by the rows a step touched, each server getting only
//! the ranges of its parts those rows cover, in one request listing every part it holds.

use psnet_transport::{Segment, Transport};

use super::rows::{overlap, ranges_in, rows_within};
use super::{Ask, Outgoing, Worker};
use crate::error::KvError;
use crate::value::{self, Value};

impl<T: Transport> Worker<T> {
    /// Initializes `key` as MXNet's row_sparse keys are: its value is `values` (rank 0's
    /// counts, as [`init`](Self::init)), read as rows of `width` elements, and from now on
    /// it is pushed by rows ([`push_rows`](Self::push_rows)); a dense push of it is
    /// refused. Pulls, dense and by rows, are as for any key.
    pub async fn init_rows<V: Value>(
        &self,
        key: u64,
        width: usize,
        values: &[V],
    ) -> Result<(), KvError> {
        if width == 0 || values.len() % width != 0 {
            return Err(KvError::Invalid(format!(
                "key {key}: rows of {width} elements do not divide its {} elements",
                values.len()
            )));
        }
        self.init(&[key], &[values]).await?;
        self.shared.state().declare_rows(key, width)
    }

    /// Pushes a row-sparse gradient of `key`: row `row_ids[i]` of it is
    /// `values[i * width..(i + 1) * width]`, every other row zero. Each server is sent the
    /// values of the rows in its parts and nothing else, and applies them to those rows only
    /// (MXNet's lazy update; without an optimizer the sum replaces the value, every other
    /// row zero, as MXNet's server does). In `dist_sync` the call returns once every worker
    /// pushed the key, whatever rows each sent. Ids may come in any order; an id given twice,
    /// one past the last row, a width other than the key's, another element type or a key
    /// not initialized by [`init_rows`](Self::init_rows) is refused, naming it.
    pub async fn push_rows<V: Value>(
        &self,
        key: u64,
        width: usize,
        row_ids: &[u64],
        values: &[V],
    ) -> Result<(), KvError> {
        let layout = {
            let state = self.shared.state();
            let layout = state.defined_layout(key).ok_or(KvError::UnknownKey(key))?;
            state.layout(key, layout.len, V::DTYPE)?.clone()
        };
        match layout.rows {
            Some(w) if w == width => {}
            Some(w) => {
                return Err(KvError::Invalid(format!(
                    "key {key} has rows of {w} elements, pushed rows of {width}"
                )))
            }
            None => {
                return Err(KvError::Invalid(format!(
                    "key {key} is dense: push it with push, or initialize it with init_rows"
                )))
            }
        }
        let rows = (layout.len / width) as u64;
        if values.len() != row_ids.len() * width {
            return Err(KvError::Invalid(format!(
                "key {key}: {} rows of {width} elements need {} values, given {}",
                row_ids.len(),
                row_ids.len() * width,
                values.len()
            )));
        }
        // The rows in increasing order, each with where its values are.
        let mut order: Vec<(u64, usize)> = row_ids.iter().copied().zip(0..).collect();
        order.sort_unstable();
        for pair in order.windows(2) {
            if pair[0].0 == pair[1].0 {
                return Err(KvError::Invalid(format!(
                    "key {key}: row {} is pushed twice in one row push: sum its gradients first",
                    pair[0].0
                )));
            }
        }
        if let Some(&(bad, _)) = order.last().filter(|(r, _)| *r >= rows) {
            return Err(KvError::Invalid(format!(
                "key {key}: row {bad} pushed, it has {rows} rows of {width} elements"
            )));
        }
        let sorted: Vec<u64> = order.iter().map(|&(r, _)| r).collect();
        // One request per server holding a part: every part it holds listed, touched or not.
        let mut asked: Vec<Asked> = Vec::new();
        for p in &layout.parts {
            let at = match asked.iter().position(|a| a.server == p.server) {
                Some(at) => at,
                None => {
                    asked.push(Asked {
                        server: p.server,
                        first: p.slot,
                        list: Vec::new(),
                        values: Vec::new(),
                        n_ranges: 0,
                    });
                    asked.len() - 1
                }
            };
            let a = &mut asked[at];
            let ranges = ranges_in(p, &sorted, width);
            if ranges.is_empty() {
                a.triple(p.slot, 0, 0);
            }
            for (start, len) in ranges {
                a.triple(p.slot, start as u64, len as u64);
            }
            // The values in the order of the ranges: row by row, as they were merged.
            for &(row, pos) in &order[rows_within(p, &sorted, width)] {
                let (lo, hi) = overlap(p, row, width);
                let row_values = &values[pos * width + lo..pos * width + hi];
                a.values.extend_from_slice(value::as_bytes(row_values));
            }
        }
        let payloads: Vec<Vec<u8>> = asked
            .iter_mut()
            .map(|a| {
                let mut bytes = std::mem::take(&mut a.list);
                bytes.append(&mut a.values);
                bytes
            })
            .collect();
        let requests = asked
            .iter()
            .zip(&payloads)
            .map(|(a, bytes)| Outgoing {
                to: self.shared.servers[a.server],
                ask: Ask::PushRanges {
                    key,
                    first: a.first,
                    dtype: V::DTYPE,
                    n_ranges: a.n_ranges,
                    retry: None,
                },
                value: Some(Segment::new(bytes)),
            })
            .collect();
        for wait in self.shared.send_all(requests).await? {
            self.shared.settle(wait).await?;
        }
        Ok(())
    }
}

/// One server's share of a row push: its list of ranges, their values, and the first part
/// listed (the one its pushes are counted by).
struct Asked {
    server: usize,
    first: u64,
    list: Vec<u8>,
    values: Vec<u8>,
    n_ranges: u64,
}

impl Asked {
    fn triple(&mut self, slot: u64, start: u64, len: u64) {
        for word in [slot, start, len] {
            self.list.extend_from_slice(&word.to_le_bytes());
        }
        self.n_ranges += 1;
    }
}
