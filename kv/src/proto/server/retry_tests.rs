//! Pushes sent again to a server that restarted ([`PushFlags::retry`]): one the server had
//! applied before is answered without being applied twice; any other is applied as usual.

use super::tests::{drain, push};
use super::*;

fn again(mut p: Push, place: u64) -> Push {
    p.flags.retry = Some(place);
    p
}

fn done(rank: u32, ts: u64, value: Option<u64>) -> Output {
    Output::Done {
        rank,
        ts,
        value,
        have: None,
    }
}

fn with_key(workers: u32) -> ServerState {
    let mut s = ServerState::new(workers);
    let mut p = push(0, 1, 7, &[1.0, 2.0]);
    p.flags.init = true;
    s.handle_push(p);
    drain(&mut s);
    s
}

#[test]
fn dist_sync_a_round_taken_before_the_restart_is_not_taken_again() {
    let mut s = with_key(2);
    s.handle_push(push(0, 2, 7, &[1.0, 1.0]));
    s.handle_push(push(1, 2, 7, &[2.0, 2.0]));
    drain(&mut s);
    assert_eq!(s.value(7), Some(&[3.0, 3.0][..]), "no updater: the sum");
    // Both answers were lost with the server: each worker's push 0 comes again.
    let mut p = again(push(0, 9, 7, &[1.0, 1.0]), 0);
    p.flags.pull_back = true;
    s.handle_push(p);
    s.handle_push(again(push(1, 9, 7, &[2.0, 2.0]), 0));
    assert_eq!(drain(&mut s), vec![done(0, 9, Some(7)), done(1, 9, None)]);
    assert_eq!(s.value(7), Some(&[3.0, 3.0][..]));
    assert_eq!(s.updates(7), Some(1));
    // Push 1 of worker 0 was never applied: it waits for worker 1's, as any push.
    s.handle_push(again(push(0, 10, 7, &[5.0, 5.0]), 1));
    assert!(drain(&mut s).is_empty());
    s.handle_push(push(1, 10, 7, &[1.0, 1.0]));
    assert_eq!(drain(&mut s).len(), 2);
    assert_eq!(s.value(7), Some(&[6.0, 6.0][..]));
    // An init sent again finds its key and changes nothing.
    let mut p = again(push(0, 11, 7, &[0.0, 0.0]), 0);
    p.flags.init = true;
    s.handle_push(p);
    assert_eq!(drain(&mut s), vec![done(0, 11, None)]);
    assert_eq!(s.value(7), Some(&[6.0, 6.0][..]));
}

#[test]
fn dist_async_counts_each_workers_pushes_and_a_snapshot_keeps_the_counts() {
    let mut s = with_key(2);
    s.handle_command(CommandKind::SetMode, "async").unwrap();
    s.handle_command(
        CommandKind::SetOptimizer,
        r#"{"type":"test","rescale_grad":1.0}"#,
    )
    .unwrap();
    s.handle_push(push(0, 2, 7, &[1.0, 1.0]));
    drain(&mut s);
    assert_eq!(s.value(7), Some(&[2.0, 3.0][..]));
    // Worker 0's push 0 again: applied before. Worker 1's push 0: never seen, applied.
    s.handle_push(again(push(0, 3, 7, &[1.0, 1.0]), 0));
    s.handle_push(again(push(1, 3, 7, &[10.0, 10.0]), 0));
    assert_eq!(drain(&mut s), vec![done(0, 3, None), done(1, 3, None)]);
    assert_eq!(s.value(7), Some(&[12.0, 13.0][..]));
    // The counts survive a snapshot, as the restarted server needs them.
    let mut r = ServerState::restore(&s.snapshot(), 2, u64::MAX).unwrap();
    r.handle_push(again(push(1, 4, 7, &[10.0, 10.0]), 0));
    r.handle_push(again(push(1, 5, 7, &[100.0, 100.0]), 1));
    assert_eq!(drain(&mut r), vec![done(1, 4, None), done(1, 5, None)]);
    assert_eq!(r.value(7), Some(&[112.0, 113.0][..]));
    // A snapshot naming counts for another number of workers is refused.
    assert!(ServerState::restore(&s.snapshot(), 3, u64::MAX).is_err());
}
