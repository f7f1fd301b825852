//! Row-sparse pulls (MXNet's `row_sparse_pull`): a key read as rows of `width` elements (an
//! embedding table), of which a call fetches only the rows it names, from each server only
//! the ranges of its part those rows cover.

use bytes::Bytes;
use psnet_transport::{Segment, Transport};

use super::{fill, Ask, Outgoing, Worker};
use crate::error::KvError;
use crate::proto::worker::Part;
use crate::value::Value;

impl<T: Transport> Worker<T> {
    /// Pulls rows `row_ids` of `key`, read as rows of `width` elements, into `out` (row
    /// `row_ids[i]` into `out[i * width..(i + 1) * width]`). Ids may repeat and come in any
    /// order; each row is fetched once. Refused, naming the problem: an unknown key, another
    /// element type, a width that does not divide the key, an id past its last row, or an
    /// `out` of another length.
    pub async fn pull_rows<V: Value>(
        &self,
        key: u64,
        width: usize,
        row_ids: &[u64],
        out: &mut [V],
    ) -> Result<(), KvError> {
        let layout = {
            let state = self.shared.state();
            let layout = state.defined_layout(key).ok_or(KvError::UnknownKey(key))?;
            state.layout(key, layout.len, V::DTYPE)?.clone()
        };
        if width == 0 || layout.len % width != 0 {
            return Err(KvError::Invalid(format!(
                "key {key}: rows of {width} elements do not divide its {} elements",
                layout.len
            )));
        }
        let rows = (layout.len / width) as u64;
        if let Some(bad) = row_ids.iter().find(|&&r| r >= rows) {
            return Err(KvError::Invalid(format!(
                "key {key}: row {bad} asked for, it has {rows} rows of {width} elements"
            )));
        }
        if out.len() != row_ids.len() * width {
            return Err(KvError::Invalid(format!(
                "key {key}: {} rows of {width} elements go into {} elements, not {}",
                row_ids.len(),
                row_ids.len() * width,
                out.len()
            )));
        }
        let mut unique = row_ids.to_vec();
        unique.sort_unstable();
        unique.dedup();
        let asked: Vec<(Part, Vec<u8>, u64, u64)> = layout
            .parts
            .iter()
            .filter_map(|p| {
                let (list, n_ranges, elems) = ranges_in(p, &unique, width);
                (n_ranges > 0).then_some((*p, list, n_ranges, elems))
            })
            .collect();
        let requests = asked
            .iter()
            .map(|(p, list, n_ranges, elems)| Outgoing {
                to: self.shared.servers[p.server],
                ask: Ask::PullRanges {
                    key: p.slot,
                    n_elems: p.len as u64,
                    n_ranges: *n_ranges,
                    elems: *elems,
                },
                value: Some(Segment::new(list)),
            })
            .collect();
        // The rows asked for, in increasing order, as the servers' answers lay them out.
        let mut fetched = vec![<V as bytemuck::Zeroable>::zeroed(); unique.len() * width];
        let waits = self.shared.send_all(requests).await?;
        for ((p, _, _, elems), wait) in asked.iter().zip(waits) {
            let value: Option<Bytes> = self.shared.settle(wait).await?;
            let n = *elems as usize;
            let from = self.shared.servers[p.server];
            let mut answered = vec![<V as bytemuck::Zeroable>::zeroed(); n];
            fill(key, &mut answered, value, from)?;
            // Scatter this part's ranges back to the rows they belong to.
            let mut next = answered.iter();
            for (i, &row) in unique.iter().enumerate() {
                let (lo, hi) = overlap(p, row, width);
                for slot in &mut fetched[i * width + lo..i * width + hi] {
                    *slot = *next
                        .next()
                        .expect("the answer was checked to hold every range");
                }
            }
        }
        for (i, id) in row_ids.iter().enumerate() {
            let u = unique
                .binary_search(id)
                .expect("every id is in the unique list");
            out[i * width..(i + 1) * width].copy_from_slice(&fetched[u * width..(u + 1) * width]);
        }
        Ok(())
    }
}

/// The part of row `row` (of `width` elements) that part `p` holds, as offsets within the row
/// (`lo == hi`: none).
fn overlap(p: &Part, row: u64, width: usize) -> (usize, usize) {
    let start = row as usize * width;
    let lo = start.max(p.offset);
    let hi = (start + width).min(p.offset + p.len);
    if lo >= hi {
        (0, 0)
    } else {
        (lo - start, hi - start)
    }
}

/// The ranges of part `p` (local to it) that rows `rows` (sorted, unique) cover, merged where
/// they touch, as a row pull lists them; with their count and their elements in all.
fn ranges_in(p: &Part, rows: &[u64], width: usize) -> (Vec<u8>, u64, u64) {
    let mut merged: Vec<(usize, usize)> = Vec::new();
    for &row in rows {
        let (lo, hi) = overlap(p, row, width);
        if lo == hi {
            continue;
        }
        let start = row as usize * width + lo - p.offset;
        let len = hi - lo;
        match merged.last_mut() {
            Some((s, l)) if *s + *l == start => *l += len,
            _ => merged.push((start, len)),
        }
    }
    let elems = merged.iter().map(|(_, l)| *l as u64).sum();
    let list = merged
        .iter()
        .flat_map(|&(s, l)| {
            (s as u64)
                .to_le_bytes()
                .into_iter()
                .chain((l as u64).to_le_bytes())
        })
        .collect();
    (list, merged.len() as u64, elems)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parts_ranges_cover_the_rows_it_holds_merged_where_they_touch() {
        // Rows of 4 elements; a part holding elements 6..18 (rows 1 to 4, partly).
        let p = Part {
            server: 0,
            offset: 6,
            len: 12,
            slot: 0,
        };
        let (list, n, elems) = ranges_in(&p, &[0, 1, 2, 4, 9], 4);
        let pairs: Vec<(u64, u64)> = list
            .chunks_exact(16)
            .map(|c| {
                let v = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap());
                (v(&c[..8]), v(&c[8..]))
            })
            .collect();
        // Row 1 from element 6 (its last 2) and row 2 whole touch: 0..6; row 4 is 16..18,
        // its first 2, local 10..12. Rows 0 and 9 are not in the part.
        assert_eq!(pairs, vec![(0, 6), (10, 2)]);
        assert_eq!((n, elems), (2, 8));
        assert_eq!(overlap(&p, 1, 4), (2, 4));
        assert_eq!(overlap(&p, 4, 4), (0, 2));
        assert_eq!(overlap(&p, 9, 4), (0, 0));
    }
}
