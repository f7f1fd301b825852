//! Row-sparse pulls at a server: the element ranges of a key's part that a worker asks for
//! (the rows of an embedding table one step touches), answered without sending the rest.

use std::collections::HashMap;
use std::ops::Range;

use super::{Output, ServerState};

/// Bytes of one range in a request's list: key, start and length, little-endian u64s.
const RANGE_BYTES: usize = 24;

impl ServerState {
    /// Worker `rank` asks for `n_ranges` ranges (listed in `list`, see
    /// [`crate::proto::msg::Msg::PullRanges`]) of keys this server holds. Anything that does
    /// not add up is refused, naming it: a list of another size, an unknown key, a range
    /// past its key's end, empty, or before the key's previous range.
    pub fn handle_pull_ranges(&mut self, rank: u32, ts: u64, n_ranges: u64, list: &[u8]) {
        match self.ranges_of(n_ranges, list) {
            Ok(ranges) => self.out.push_back(Output::Rows { rank, ts, ranges }),
            Err(reason) => self.fail(rank, ts, reason),
        }
    }

    fn ranges_of(&self, n_ranges: u64, list: &[u8]) -> Result<Vec<(u64, Range<usize>)>, String> {
        // Checked before anything is allocated for the list.
        if n_ranges.checked_mul(RANGE_BYTES as u64) != Some(list.len() as u64) {
            return Err(format!(
                "a row pull announces {n_ranges} ranges and lists {} bytes",
                list.len()
            ));
        }
        let mut ranges: Vec<(u64, Range<usize>)> = Vec::with_capacity(list.len() / RANGE_BYTES);
        // Where each key's last range ended: a key's ranges never overlap, wherever they are
        // listed, so an answer holds no more than the values asked about.
        let mut ends: HashMap<u64, u64> = HashMap::new();
        for triple in list.chunks_exact(RANGE_BYTES) {
            let word = |i: usize| u64::from_le_bytes(triple[i..i + 8].try_into().expect("8"));
            let (key, start, len) = (word(0), word(8), word(16));
            let k = self
                .keys
                .get(&key)
                .ok_or_else(|| format!("key {key} was pulled before it was initialized"))?;
            let held = k.value.len() as u64;
            // A key's ranges in increasing order: after the end of its previous one.
            let after = ends.get(&key).copied().unwrap_or(0);
            let stop = start.checked_add(len).filter(|&s| s <= held);
            let Some(stop) = stop.filter(|_| len > 0 && start >= after) else {
                return Err(format!(
                    "key {key}: a row pull's range of {len} elements from {start} is empty, \
                     out of order or past the {held} elements this server holds"
                ));
            };
            ranges.push((key, start as usize..stop as usize));
            ends.insert(key, stop);
        }
        Ok(ranges)
    }

    /// The elements of `ranges`, one range after another, each in its key's type; an error
    /// naming a key no longer held.
    pub fn rows_value(&self, ranges: &[(u64, Range<usize>)]) -> Result<Vec<u8>, RowsGone> {
        let elems = ranges
            .iter()
            .map(|(_, r)| r.len())
            .fold(0usize, usize::saturating_add);
        let mut out = Vec::with_capacity(elems.saturating_mul(4));
        for (key, r) in ranges {
            let values = self
                .keys
                .get(key)
                .and_then(|k| Some((k.dtype, k.value.get(r.clone())?)));
            let Some((dtype, values)) = values else {
                return Err(RowsGone { key: *key });
            };
            out.extend_from_slice(&dtype.narrow(values));
        }
        Ok(out)
    }
}

/// Rows asked of a key that is no longer held as they were asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("key {key} is no longer held as it was asked for")]
pub struct RowsGone {
    /// The key.
    pub key: u64,
}

#[cfg(test)]
mod tests {
    use super::super::Push;
    use super::*;
    use crate::proto::msg::PushFlags;
    use crate::value::Dtype;

    fn list(ranges: &[(u64, u64, u64)]) -> Vec<u8> {
        ranges
            .iter()
            .flat_map(|(k, s, l)| [*k, *s, *l])
            .flat_map(u64::to_le_bytes)
            .collect()
    }

    /// Worker 0's init of `key` to `value` as `dtype`, answered.
    fn init(s: &mut ServerState, key: u64, value: &[f32], dtype: Dtype) -> bool {
        s.handle_push(Push {
            rank: 0,
            ts: 1,
            key,
            flags: PushFlags {
                init: true,
                dtype,
                ..PushFlags::default()
            },
            n_elems: value.len() as u64,
            payload: dtype.narrow(value).into(),
        });
        matches!(s.poll_output(), Some(Output::Done { .. }))
    }

    fn server_with(key: u64, value: &[f32], dtype: Dtype) -> ServerState {
        let mut s = ServerState::new(1);
        assert!(init(&mut s, key, value, dtype));
        s
    }

    #[test]
    fn the_ranges_asked_for_are_answered_one_after_another_in_their_keys_types() {
        let value: Vec<f32> = (0..12).map(|v| v as f32).collect();
        for dtype in [Dtype::F32, Dtype::F16] {
            let mut s = server_with(3, &value, dtype);
            let other: Vec<f32> = value.iter().map(|v| v + 100.0).collect();
            assert!(init(&mut s, 5, &other, Dtype::F32));
            // Two keys, each in increasing order; keys may come back to back in any order.
            s.handle_pull_ranges(0, 3, 3, &list(&[(5, 0, 1), (3, 1, 2), (3, 8, 4)]));
            let Some(Output::Rows { rank, ts, ranges }) = s.poll_output() else {
                panic!("a rows answer");
            };
            assert_eq!((rank, ts), (0, 3));
            assert_eq!(ranges, vec![(5, 0..1), (3, 1..3), (3, 8..12)]);
            let mut want = Dtype::F32.narrow(&[100.0]);
            want.extend(dtype.narrow(&[1.0, 2.0, 8.0, 9.0, 10.0, 11.0]));
            assert_eq!(s.rows_value(&ranges), Ok(want));
        }
    }

    proptest::proptest! {
        /// Whatever a member lists, over two keys in any interleaving, the server answers it
        /// (each key's ranges within its value, in order, never overlapping) or refuses it;
        /// it never panics or answers more than the values asked about.
        #[test]
        fn any_list_is_answered_within_the_values_or_refused(
            n_ranges in 0u64..8,
            triples in proptest::collection::vec((2u64..6, 0u64..20, 0u64..20), 0..8),
            junk in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..3),
        ) {
            let mut s = server_with(3, &[1.0; 12], Dtype::F32);
            proptest::prop_assert!(init(&mut s, 5, &[2.0; 7], Dtype::F32), "key 5 initialized");
            let held = |key: u64| if key == 3 { 12 } else { 7 };
            let mut bytes = list(&triples);
            bytes.extend(junk);
            s.handle_pull_ranges(0, 3, n_ranges, &bytes);
            match s.poll_output() {
                Some(Output::Rows { ranges, .. }) => {
                    proptest::prop_assert_eq!(ranges.len() as u64, n_ranges);
                    let mut ends = std::collections::HashMap::new();
                    for (key, r) in &ranges {
                        proptest::prop_assert!(*key == 3 || *key == 5);
                        let end = ends.entry(*key).or_insert(0);
                        proptest::prop_assert!(r.start >= *end && r.start < r.end);
                        proptest::prop_assert!(r.end <= held(*key));
                        *end = r.end;
                    }
                    let got = s.rows_value(&ranges).unwrap();
                    let want: usize = ranges.iter().map(|(_, r)| r.len() * 4).sum();
                    proptest::prop_assert_eq!(got.len(), want);
                    proptest::prop_assert!(want <= (12 + 7) * 4);
                }
                Some(Output::Failed { .. }) => {}
                other => proptest::prop_assert!(false, "{:?}", other),
            }
        }
    }

    #[test]
    fn row_pulls_that_do_not_add_up_are_refused_naming_the_problem() {
        let mut s = server_with(3, &[0.0; 12], Dtype::F32);
        let refused = |s: &mut ServerState, count, ranges: &[u8]| {
            s.handle_pull_ranges(0, 9, count, ranges);
            match s.poll_output() {
                Some(Output::Failed { reason, .. }) => reason,
                other => panic!("refused, not {other:?}"),
            }
        };
        let one = list(&[(3, 0, 1)]);
        assert!(refused(&mut s, 1, &list(&[(4, 0, 1)])).contains("key 4 was pulled before"));
        assert!(refused(&mut s, 2, &one).contains("announces 2 ranges"));
        assert!(refused(&mut s, u64::MAX, &one).contains("announces"));
        for bad in [(3, 0, 0), (3, 11, 2), (3, u64::MAX, 2), (3, 12, 1)] {
            let reason = refused(&mut s, 1, &list(&[bad]));
            assert!(
                reason.contains("key 3: a row pull's range"),
                "{bad:?}: {reason}"
            );
        }
        let reason = refused(&mut s, 2, &list(&[(3, 4, 2), (3, 5, 1)]));
        assert!(reason.contains("out of order"), "{reason}");
        // Another key in between does not let a key's range be asked for again.
        let mut two = server_with(3, &[0.0; 12], Dtype::F32);
        assert!(init(&mut two, 5, &[1.0], Dtype::F32));
        let again = list(&[(3, 0, 12), (5, 0, 1), (3, 0, 12)]);
        let reason = refused(&mut two, 3, &again);
        assert!(
            reason.contains("key 3: a row pull's range of 12 elements from 0"),
            "{reason}"
        );
        // Nothing was answered but the refusals.
        assert!(s.poll_output().is_none());
    }
}
