//! Row pushes at a server: rounds summed in rank order and applied to the touched elements
//! only, against a model; the journal rebuilding the same state; bad lists refused, changing
//! nothing.

use bytes::Bytes;
use proptest::prelude::*;

use super::harness::{Disk, LIMIT};
use super::tests::{drain, failed_reason, push};
use super::{CommandError, Mode, Output, RowsPush, ServerState};
use crate::proto::msg::CommandKind;
use crate::updater::OptimizerSpec;
use crate::value::Dtype;

/// Key 10's second piece.
const P2: u64 = 10 + (1 << 48);
/// Key 10's parts: itself and its second piece, of 40 and 24 elements.
const PARTS: [(u64, usize); 2] = [(10, 40), (P2, 24)];

fn server(workers: u32, optimizer: Option<&str>) -> ServerState {
    let mut s = ServerState::new(workers).with_key_limit(LIMIT);
    for (slot, n) in PARTS {
        let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 3.0).collect();
        let mut p = push(0, 1000 + slot, slot, &values);
        p.flags.init = true;
        s.handle_push(p);
    }
    if let Some(spec) = optimizer {
        s.handle_command(CommandKind::SetOptimizer, spec).unwrap();
    }
    drain(&mut s);
    s
}

/// A worker's row push: per part its ranges (start, len), values drawn from `seed`.
fn rows_push(rank: u32, ts: u64, parts: &[(u64, Vec<(usize, usize)>)], seed: u32) -> RowsPush {
    let mut list = Vec::new();
    let mut values = Vec::new();
    let mut n_ranges = 0;
    for (slot, ranges) in parts {
        if ranges.is_empty() {
            for w in [*slot, 0, 0] {
                list.extend_from_slice(&w.to_le_bytes());
            }
            n_ranges += 1;
        }
        for &(start, len) in ranges {
            for w in [*slot, start as u64, len as u64] {
                list.extend_from_slice(&w.to_le_bytes());
            }
            n_ranges += 1;
            for i in 0..len {
                let v = ((seed as usize * 7 + start + i) % 13) as f32 - 6.0;
                values.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    list.extend_from_slice(&values);
    RowsPush {
        rank,
        ts,
        key: 10,
        dtype: Dtype::F32,
        retry: None,
        n_ranges,
        payload: Bytes::from(list),
    }
}

/// The push's gradient as dense parts.
fn dense(parts: &[(u64, Vec<(usize, usize)>)], seed: u32) -> Vec<Vec<f32>> {
    PARTS
        .iter()
        .map(|&(slot, n)| {
            let mut g = vec![0f32; n];
            let ranges = parts.iter().find(|(s, _)| *s == slot).map(|(_, r)| r);
            for &(start, len) in ranges.into_iter().flatten() {
                for (i, v) in g[start..start + len].iter_mut().enumerate() {
                    *v = ((seed as usize * 7 + start + i) % 13) as f32 - 6.0;
                }
            }
            g
        })
        .collect()
}

/// Sorted, non-overlapping ranges within `n` elements, drawn from a mask.
fn ranges_of(mask: &[bool]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (i, &on) in mask.iter().enumerate() {
        if !on {
            continue;
        }
        // Ranges that touch are sent apart now and then: the server takes both forms.
        match out.last_mut() {
            Some((s, l)) if *s + *l == i && i % 5 != 0 => *l += 1,
            _ => out.push((i, 1)),
        }
    }
    out
}

fn masks() -> impl Strategy<Value = Vec<Vec<bool>>> {
    // Per part a mask; touched densely or sparsely.
    (
        proptest::collection::vec(any::<bool>(), PARTS[0].1),
        proptest::collection::vec(prop::bool::weighted(0.2), PARTS[1].1),
    )
        .prop_map(|(a, b)| vec![a, b])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Three workers push random rows over two rounds; every touched element ends as the
    /// updater applied to it alone with the rank-order sum (an element's own key in a second
    /// updater: SGD's and the test optimizer's arithmetic is per element), every untouched
    /// element keeps its value. Without an optimizer the sum replaces the part, zeros
    /// elsewhere.
    #[test]
    fn a_round_updates_the_touched_elements_with_the_rank_order_sum(
        rounds in proptest::collection::vec(proptest::collection::vec(masks(), 3), 2),
        which in 0usize..3,
    ) {
        let spec = [
            Some(r#"{"type":"sgd","learning_rate":0.1,"momentum":0.9,"wd":0.01}"#),
            Some(r#"{"type":"test","rescale_grad":0.5}"#),
            None,
        ][which];
        let mut s = server(3, spec);
        let mut model: Vec<Vec<f32>> = PARTS.iter().map(|&(slot, _)| s.value(slot).unwrap().to_vec()).collect();
        let mut by_element = spec.map(|t| OptimizerSpec::parse(t).unwrap().build());
        let mut ts = 0;
        for (round, workers) in rounds.iter().enumerate() {
            let mut sum: Vec<Vec<Option<f32>>> = PARTS.iter().map(|&(_, n)| vec![None; n]).collect();
            for (rank, masks) in workers.iter().enumerate().rev() {
                let parts: Vec<(u64, Vec<(usize, usize)>)> = PARTS
                    .iter()
                    .zip(masks)
                    .map(|(&(slot, _), m)| (slot, ranges_of(m)))
                    .collect();
                ts += 1;
                let seed = (round * 3 + rank) as u32;
                s.handle_push_rows(rows_push(rank as u32, ts, &parts, seed));
                let out = drain(&mut s);
                // Every push is answered once the last (rank 0, sent last) is in.
                prop_assert_eq!(out.len(), if rank == 0 { 3 } else { 0 }, "{:?}", out);
                prop_assert!(out.iter().all(|o| matches!(o, Output::Done { .. })), "{:?}", out);
            }
            // The model: rank order.
            for (rank, masks) in workers.iter().enumerate() {
                let seed = (round * 3 + rank) as u32;
                let parts: Vec<(u64, Vec<(usize, usize)>)> = PARTS
                    .iter()
                    .zip(masks)
                    .map(|(&(slot, _), m)| (slot, ranges_of(m)))
                    .collect();
                for (j, g) in dense(&parts, seed).iter().enumerate() {
                    for (i, &on) in masks[j].iter().enumerate() {
                        if on {
                            sum[j][i] = Some(sum[j][i].map_or(g[i], |x| x + g[i]));
                        }
                    }
                }
            }
            for (j, &(slot, _)) in PARTS.iter().enumerate() {
                for (i, g) in sum[j].iter().enumerate() {
                    match (&mut by_element, g) {
                        (Some(u), Some(g)) => {
                            let key = slot * 1000 + i as u64;
                            u.update(key, &[*g], std::slice::from_mut(&mut model[j][i])).unwrap();
                        }
                        (Some(_), None) => {}
                        (None, g) => model[j][i] = g.unwrap_or(0.0),
                    }
                }
                prop_assert_eq!(s.value(slot).unwrap(), &model[j][..], "part {} round {}", slot, round);
                prop_assert_eq!(s.updates(slot), Some(round as u64 + 1));
            }
        }
    }
}

#[test]
fn adams_lazy_update_equals_its_dense_update_on_the_touched_elements_and_counts_one_step() {
    let spec = r#"{"type":"adam","learning_rate":0.01,"wd":0.1}"#;
    let mut s = server(1, Some(spec));
    let parts = vec![(10, vec![(3, 4), (20, 2)]), (P2, vec![])];
    s.handle_push_rows(rows_push(0, 1, &parts, 5));
    assert!(matches!(drain(&mut s)[..], [Output::Done { .. }]));
    let fresh = server(1, None);
    let mut u = OptimizerSpec::parse(spec).unwrap().build();
    let mut want = fresh.value(10).unwrap().to_vec();
    let before = want.clone();
    u.update(10, &dense(&parts, 5)[0], &mut want).unwrap();
    let got = s.value(10).unwrap();
    for i in 0..40 {
        let touched = (3..7).contains(&i) || (20..22).contains(&i);
        let expect = if touched { want[i] } else { before[i] };
        assert_eq!(got[i].to_bits(), expect.to_bits(), "element {i}");
    }
    // An untouched part takes its step too (MXNet counts the update of the key).
    assert_eq!(s.value(P2).unwrap(), fresh.value(P2).unwrap());
    assert_eq!(s.updates(P2), Some(1));
    assert_eq!(adam_steps(&s), vec![(10, 1), (P2, 1)]);
    s.handle_push_rows(rows_push(0, 2, &[(10, vec![]), (P2, vec![(0, 1)])], 5));
    drain(&mut s);
    assert_eq!(adam_steps(&s), vec![(10, 2), (P2, 2)]);
}

/// Each key's Adam step count `t`, read from the updater's exported state.
fn adam_steps(s: &ServerState) -> Vec<(u64, u64)> {
    let mut w = psnet_transport::le::LeWriter::with_capacity(64);
    s.updater.as_ref().unwrap().export_state(&mut w);
    let bytes = w.into_vec();
    let mut r = psnet_transport::le::LeReader::new(&bytes);
    assert_eq!(r.u8().unwrap(), 2, "adam's tag");
    let mut steps = Vec::new();
    for _ in 0..r.u64().unwrap() {
        let (key, t, len) = (r.u64().unwrap(), r.u64().unwrap(), r.u64().unwrap());
        r.take(8 * len as usize).unwrap();
        steps.push((key, t));
    }
    steps
}

#[test]
fn sgd_without_momentum_updates_rows_with_mxnets_row_sparse_kernel() {
    // MXNet's sgd_update of a row_sparse gradient: w = (1 - lr * wd) * w - lr * g.
    let spec = r#"{"type":"sgd","learning_rate":0.1,"wd":0.3}"#;
    let mut s = server(1, Some(spec));
    let parts = vec![(10, vec![(3, 4)]), (P2, vec![])];
    let before = s.value(10).unwrap().to_vec();
    s.handle_push_rows(rows_push(0, 1, &parts, 5));
    drain(&mut s);
    let g = &dense(&parts, 5)[0];
    let (lr, wd) = (0.1f32, 0.3f32);
    for (i, (&got, &w)) in s.value(10).unwrap().iter().zip(&before).enumerate() {
        let want = if (3..7).contains(&i) {
            (1.0 - lr * wd) * w - lr * g[i]
        } else {
            w
        };
        assert_eq!(got.to_bits(), want.to_bits(), "element {i}");
    }
}

#[test]
fn an_init_waits_for_no_row_round_holding_its_part() {
    let mut s = server(2, Some(r#"{"type":"test"}"#));
    s.handle_push_rows(rows_push(0, 1, &[(10, vec![(0, 2)]), (P2, vec![])], 1));
    let mut init = push(0, 2, P2, &[0.0; 24]);
    init.flags.init = true;
    s.handle_push(init);
    let reason = failed_reason(&drain(&mut s));
    assert!(reason.contains("row-push round of key 10"), "{reason}");
}

#[test]
fn the_journal_rebuilds_the_state_rounds_and_async_pushes_alike() {
    let spec = r#"{"type":"adam","learning_rate":0.01}"#;
    let mut s = server(2, Some(spec)).with_checkpoints(0);
    let mut disk = Disk::new(&s);
    let mut ts = 0;
    let push_and_log = |s: &mut ServerState, p: RowsPush, disk: &mut Disk| {
        s.handle_push_rows(p);
        for o in drain(s) {
            match o {
                Output::Journal(r) => disk.journal.push(r),
                Output::Done { .. } => {}
                other => panic!("{other:?}"),
            }
        }
    };
    for round in 0..3u32 {
        for rank in [1, 0] {
            ts += 1;
            let parts = vec![
                (10, vec![((round as usize * 5) % 30, 6)]),
                (P2, vec![(rank as usize, 3)]),
            ];
            push_and_log(&mut s, rows_push(rank, ts, &parts, round + rank), &mut disk);
        }
    }
    s.handle_command(CommandKind::SetMode, "async").unwrap();
    for o in drain(&mut s) {
        if let Output::Journal(r) = o {
            disk.journal.push(r);
        }
    }
    ts += 1;
    push_and_log(
        &mut s,
        rows_push(1, ts, &[(10, vec![(0, 2)]), (P2, vec![])], 9),
        &mut disk,
    );
    assert_eq!(disk.journal.len(), 3 + 1 + 1);
    let again = disk.recover(2);
    assert_eq!(again.snapshot(), s.snapshot());
    assert_eq!(again.mode(), Mode::Async);
}

fn assert_refused(s: &mut ServerState, p: RowsPush, wanted: &str) {
    let (before, round) = (s.snapshot(), s.row_round_in_progress());
    s.handle_push_rows(p);
    let reason = failed_reason(&drain(s));
    assert!(reason.contains(wanted), "{reason}");
    assert_eq!(s.snapshot(), before, "a refused push changes nothing");
    assert_eq!(s.row_round_in_progress(), round, "nor the round");
}

#[test]
fn lists_that_do_not_add_up_are_refused_and_change_nothing() {
    let mut s = server(2, Some(r#"{"type":"test"}"#));
    let good = || rows_push(0, 1, &[(10, vec![(2, 3)]), (P2, vec![])], 1);
    let mut p = good();
    p.n_ranges = 3;
    assert_refused(&mut s, p, "announces 3 ranges");
    let mut p = good();
    p.n_ranges = u64::MAX;
    assert_refused(&mut s, p, "announces");
    let mut p = good();
    p.payload = p.payload.slice(..p.payload.len() - 4);
    assert_refused(&mut s, p, "cover 3 float32 values, it carries 8 bytes");
    assert_refused(
        &mut s,
        rows_push(0, 1, &[(10 + (2 << 48), vec![(0, 1)])], 1),
        "was pushed before it was initialized",
    );
    assert_refused(
        &mut s,
        rows_push(0, 1, &[(11, vec![(0, 1)])], 1),
        "part 11 is not a part of key 10",
    );
    assert_refused(
        &mut s,
        rows_push(0, 1, &[(10, vec![(39, 2)])], 1),
        "past the 40 elements",
    );
    assert_refused(
        &mut s,
        rows_push(0, 1, &[(10, vec![(5, 2), (4, 1)])], 1),
        "out of order",
    );
    assert_refused(
        &mut s,
        rows_push(0, 1, &[(10, vec![(5, 2), (6, 1)])], 1),
        "out of order",
    );
    assert_refused(
        &mut s,
        rows_push(
            0,
            1,
            &[(10, vec![(1, 1)]), (P2, vec![]), (10, vec![(5, 1)])],
            1,
        ),
        "part 10 is listed twice",
    );
    assert_refused(&mut s, rows_push(0, 1, &[], 1), "lists no part");
    assert_refused(&mut s, rows_push(2, 1, &[(10, vec![])], 1), "worker 2");
    let mut p = good();
    p.dtype = Dtype::F16;
    assert_refused(&mut s, p, "holds float32 values, pushed float16");
    // A round's pushes must list the same parts.
    s.handle_push_rows(good());
    assert!(drain(&mut s).is_empty());
    s.handle_push_rows(rows_push(1, 2, &[(10, vec![(2, 3)])], 1));
    let reason = failed_reason(&drain(&mut s));
    assert!(
        reason.contains("the other pushes of its round list"),
        "{reason}"
    );
    // The round goes on with a push that agrees.
    s.handle_push_rows(rows_push(1, 3, &[(10, vec![]), (P2, vec![(0, 1)])], 1));
    assert_eq!(drain(&mut s).len(), 2);
}

#[test]
fn a_lost_worker_fails_the_row_round_and_a_retried_push_is_not_applied_twice() {
    let mut s = server(2, Some(r#"{"type":"test"}"#));
    let parts = vec![(10, vec![(0, 4)]), (P2, vec![])];
    s.handle_push_rows(rows_push(0, 1, &parts, 1));
    s.handle_worker_lost(1, "gone");
    let out = drain(&mut s);
    assert!(
        matches!(
            &out[..],
            [Output::PeerFailed {
                rank: 0,
                ts: 1,
                lost: 1,
                ..
            }]
        ),
        "{out:?}"
    );
    assert!(s.row_round_in_progress().is_none());

    // A push sent again to a restarted server that had applied it: answered, not applied.
    let mut s = server(1, Some(r#"{"type":"test"}"#));
    s.handle_push_rows(rows_push(0, 1, &parts, 1));
    drain(&mut s);
    let after = s.value(10).unwrap().to_vec();
    let mut again = rows_push(0, 2, &parts, 1);
    again.retry = Some(0);
    s.handle_push_rows(again);
    assert!(matches!(drain(&mut s)[..], [Output::Done { ts: 2, .. }]));
    assert_eq!(s.value(10).unwrap(), &after[..]);
    // Its next one is applied.
    let mut next = rows_push(0, 3, &parts, 1);
    next.retry = Some(1);
    s.handle_push_rows(next);
    drain(&mut s);
    assert_ne!(s.value(10).unwrap(), &after[..]);
    // A switch to dist_async waits for no row round: refused while one holds pushes.
    let mut s = server(2, Some(r#"{"type":"test"}"#));
    s.handle_push_rows(rows_push(0, 1, &parts, 1));
    let e = s.handle_command(CommandKind::SetMode, "async").unwrap_err();
    assert!(
        matches!(e, CommandError::RoundInProgress { key: 10, .. }),
        "{e}"
    );
}
