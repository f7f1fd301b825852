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
        // One request per server, listing the ranges of every part (or piece) it holds.
        let mut asked: Vec<Asked> = Vec::new();
        for (i, p) in layout.parts.iter().enumerate() {
            let ranges = ranges_in(p, &unique, width);
            if ranges.is_empty() {
                continue;
            }
            let at = match asked.iter().position(|a| a.server == p.server) {
                Some(at) => at,
                None => {
                    asked.push(Asked {
                        server: p.server,
                        ..Asked::default()
                    });
                    asked.len() - 1
                }
            };
            let a = &mut asked[at];
            for (start, len) in ranges {
                for word in [p.slot, start as u64, len as u64] {
                    a.list.extend_from_slice(&word.to_le_bytes());
                }
                a.n_ranges += 1;
                a.elems += len as u64;
            }
            a.parts.push(i);
        }
        let requests = asked
            .iter()
            .map(|a| Outgoing {
                to: self.shared.servers[a.server],
                ask: Ask::PullRanges {
                    key,
                    n_ranges: a.n_ranges,
                },
                value: Some(Segment::new(&a.list)),
            })
            .collect();
        // The rows asked for, in increasing order, as the servers' answers lay them out.
        let mut fetched = vec![<V as bytemuck::Zeroable>::zeroed(); unique.len() * width];
        let waits = self.shared.send_all(requests).await?;
        for (a, wait) in asked.iter().zip(waits) {
            let value: Option<Bytes> = self.shared.settle(wait).await?;
            let mut answered = vec![<V as bytemuck::Zeroable>::zeroed(); a.elems as usize];
            fill(key, &mut answered, value, self.shared.servers[a.server])?;
            // Scatter the answer back to the rows, part by part in the order listed.
            let mut next = answered.iter();
            for &i in &a.parts {
                let p = &layout.parts[i];
                let within = rows_within(p, &unique, width);
                for (u, &row) in unique
                    .iter()
                    .enumerate()
                    .skip(within.start)
                    .take(within.len())
                {
                    let (lo, hi) = overlap(p, row, width);
                    for slot in &mut fetched[u * width + lo..u * width + hi] {
                        *slot = *next.next().expect("the answer holds every range listed");
                    }
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

/// One server's share of a row pull: the ranges listed, their count and elements, and the
/// parts (indices in the key's layout) they are of, in the order listed.
#[derive(Default)]
struct Asked {
    server: usize,
    list: Vec<u8>,
    n_ranges: u64,
    elems: u64,
    parts: Vec<usize>,
}

/// The positions in `rows` (sorted) of the rows part `p` holds some of: a part of a large
/// table holds few of the rows a call asks for, and a table has many parts.
pub(super) fn rows_within(p: &Part, rows: &[u64], width: usize) -> std::ops::Range<usize> {
    let first = (p.offset / width) as u64;
    let end = (p.offset + p.len).div_ceil(width) as u64;
    rows.partition_point(|&r| r < first)..rows.partition_point(|&r| r < end)
}

/// The part of row `row` (of `width` elements) that part `p` holds, as offsets within the row
/// (`lo == hi`: none).
pub(super) fn overlap(p: &Part, row: u64, width: usize) -> (usize, usize) {
    let start = row as usize * width;
    let lo = start.max(p.offset);
    let hi = (start + width).min(p.offset + p.len);
    if lo >= hi {
        (0, 0)
    } else {
        (lo - start, hi - start)
    }
}

/// The ranges of part `p` (local to it, as `(start, len)`) that rows `rows` (sorted,
/// unique) cover, merged where they touch.
pub(super) fn ranges_in(p: &Part, rows: &[u64], width: usize) -> Vec<(usize, usize)> {
    let mut merged: Vec<(usize, usize)> = Vec::new();
    for &row in &rows[rows_within(p, rows, width)] {
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
    merged
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
        // Row 1 from element 6 (its last 2) and row 2 whole touch: 0..6; row 4 is 16..18,
        // its first 2, local 10..12. Rows 0 and 9 are not in the part.
        assert_eq!(ranges_in(&p, &[0, 1, 2, 4, 9], 4), vec![(0, 6), (10, 2)]);
        assert_eq!(overlap(&p, 1, 4), (2, 4));
        assert_eq!(overlap(&p, 4, 4), (0, 2));
        assert_eq!(overlap(&p, 9, 4), (0, 0));
        assert_eq!(rows_within(&p, &[0, 1, 2, 4, 9], 4), 1..4);
        let empty = Part { len: 0, ..p };
        assert!(ranges_in(&empty, &[0, 1, 2, 4, 9], 4).is_empty());
    }
}
