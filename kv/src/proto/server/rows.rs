//! Row-sparse pulls at a server: the element ranges of a key's part that a worker asks for
//! (the rows of an embedding table one step touches), answered without sending the rest.

use std::ops::Range;

use super::{Output, ServerState};

/// Bytes of one range in a request's list: start and length, little-endian u64s.
const RANGE_BYTES: usize = 16;

impl ServerState {
    /// Worker `rank` asks for `n_ranges` ranges of `key` (listed in `list`, see
    /// [`crate::proto::msg::Msg::PullRanges`]) of the `n_elems` it believes this server holds.
    /// Anything that does not add up is refused, naming it: an unknown key, another length,
    /// a list of another size, a range past the end, empty, or out of order.
    pub fn handle_pull_ranges(
        &mut self,
        rank: u32,
        ts: u64,
        key: u64,
        n_elems: u64,
        n_ranges: u64,
        list: &[u8],
    ) {
        match self.ranges_of(key, n_elems, n_ranges, list) {
            Ok(ranges) => self.out.push_back(Output::Rows {
                rank,
                ts,
                key,
                ranges,
            }),
            Err(reason) => self.fail(rank, ts, reason),
        }
    }

    fn ranges_of(
        &self,
        key: u64,
        n_elems: u64,
        n_ranges: u64,
        list: &[u8],
    ) -> Result<Vec<Range<usize>>, String> {
        let k = self
            .keys
            .get(&key)
            .ok_or_else(|| format!("key {key} was pulled before it was initialized"))?;
        let held = k.value.len();
        if n_elems != held as u64 {
            return Err(format!(
                "key {key}: pulled rows of {n_elems} elements, this server holds {held}"
            ));
        }
        // Checked before anything is allocated for the list.
        if n_ranges.checked_mul(RANGE_BYTES as u64) != Some(list.len() as u64) {
            return Err(format!(
                "key {key}: a row pull announces {n_ranges} ranges and lists {} bytes",
                list.len()
            ));
        }
        let mut ranges = Vec::with_capacity(list.len() / RANGE_BYTES);
        let mut end = 0u64;
        for pair in list.chunks_exact(RANGE_BYTES) {
            let start = u64::from_le_bytes(pair[..8].try_into().expect("8 bytes"));
            let len = u64::from_le_bytes(pair[8..].try_into().expect("8 bytes"));
            let stop = start.checked_add(len).filter(|&s| s <= held as u64);
            let Some(stop) = stop.filter(|_| len > 0 && start >= end) else {
                return Err(format!(
                    "key {key}: a row pull's range of {len} elements from {start} is empty, \
                     out of order or past the {held} elements this server holds"
                ));
            };
            ranges.push(start as usize..stop as usize);
            end = stop;
        }
        Ok(ranges)
    }

    /// The elements of `ranges` of `key`, one range after another, in the key's type; None
    /// if the key is gone.
    pub fn rows_value(&self, key: u64, ranges: &[Range<usize>]) -> Option<Vec<u8>> {
        let k = self.keys.get(&key)?;
        let mut out = Vec::with_capacity(ranges.iter().map(|r| r.len()).sum::<usize>() * 4);
        for r in ranges {
            out.extend_from_slice(&k.dtype.narrow(k.value.get(r.clone())?));
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::super::Push;
    use super::*;
    use crate::proto::msg::PushFlags;
    use crate::value::Dtype;

    fn list(ranges: &[(u64, u64)]) -> Vec<u8> {
        ranges
            .iter()
            .flat_map(|(s, l)| s.to_le_bytes().into_iter().chain(l.to_le_bytes()))
            .collect()
    }

    fn server_with(key: u64, value: &[f32], dtype: Dtype) -> ServerState {
        let mut s = ServerState::new(1);
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
        assert!(matches!(s.poll_output(), Some(Output::Done { .. })));
        s
    }

    #[test]
    fn the_ranges_asked_for_are_answered_one_after_another_in_the_keys_type() {
        let value: Vec<f32> = (0..12).map(|v| v as f32).collect();
        for dtype in [Dtype::F32, Dtype::F16] {
            let mut s = server_with(3, &value, dtype);
            s.handle_pull_ranges(0, 2, 3, 12, 2, &list(&[(1, 2), (8, 4)]));
            let Some(Output::Rows {
                rank,
                ts,
                key,
                ranges,
            }) = s.poll_output()
            else {
                panic!("a rows answer");
            };
            assert_eq!((rank, ts, key), (0, 2, 3));
            assert_eq!(ranges, vec![1..3, 8..12]);
            let want = dtype.narrow(&[1.0, 2.0, 8.0, 9.0, 10.0, 11.0]);
            assert_eq!(s.rows_value(3, &ranges), Some(want));
        }
    }

    proptest::proptest! {
        /// Whatever a member lists, the server answers it (rows within what it holds, in
        /// order, not overlapping) or refuses it; it never panics or answers past its value.
        #[test]
        fn any_list_is_answered_within_the_value_or_refused(
            n_ranges in 0u64..6,
            pairs in proptest::collection::vec((0u64..20, 0u64..20), 0..6),
            junk in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..3),
        ) {
            let mut s = server_with(3, &[1.0; 12], Dtype::F32);
            let mut bytes = list(&pairs);
            bytes.extend(junk);
            s.handle_pull_ranges(0, 2, 3, 12, n_ranges, &bytes);
            match s.poll_output() {
                Some(Output::Rows { ranges, .. }) => {
                    proptest::prop_assert_eq!(ranges.len() as u64, n_ranges);
                    let mut end = 0;
                    for r in &ranges {
                        proptest::prop_assert!(r.start >= end && r.start < r.end && r.end <= 12);
                        end = r.end;
                    }
                    let got = s.rows_value(3, &ranges).unwrap();
                    proptest::prop_assert_eq!(got.len(), ranges.iter().map(|r| r.len() * 4).sum::<usize>());
                }
                Some(Output::Failed { .. }) => {}
                other => proptest::prop_assert!(false, "{:?}", other),
            }
        }
    }

    #[test]
    fn row_pulls_that_do_not_add_up_are_refused_naming_the_problem() {
        let mut s = server_with(3, &[0.0; 12], Dtype::F32);
        let refused = |s: &mut ServerState, key, n, count, ranges: &[u8]| {
            s.handle_pull_ranges(0, 9, key, n, count, ranges);
            match s.poll_output() {
                Some(Output::Failed { reason, .. }) => reason,
                other => panic!("refused, not {other:?}"),
            }
        };
        let one = list(&[(0, 1)]);
        assert!(refused(&mut s, 4, 12, 1, &one).contains("before it was initialized"));
        assert!(refused(&mut s, 3, 13, 1, &one).contains("holds 12"));
        assert!(refused(&mut s, 3, 12, 2, &one).contains("announces 2 ranges"));
        assert!(refused(&mut s, 3, 12, u64::MAX, &one).contains("announces"));
        for bad in [[(0, 0)], [(11, 2)], [(u64::MAX, 2)], [(12, 1)]] {
            let reason = refused(&mut s, 3, 12, 1, &list(&bad));
            assert!(
                reason.contains("key 3: a row pull's range"),
                "{bad:?}: {reason}"
            );
        }
        let reason = refused(&mut s, 3, 12, 2, &list(&[(4, 2), (5, 1)]));
        assert!(reason.contains("out of order"), "{reason}");
        // Nothing was answered but the refusals.
        assert!(s.poll_output().is_none());
    }
}
