use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

const MS: Duration = Duration::from_millis(1);

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// `hosts` hosts whose links carry `rate` bytes a second both ways and add `latency`, and
/// whose local paths carry ten times that with no latency.
fn model(hosts: usize, rate: f64, latency: Duration) -> LinkModel {
    let link = Link::new(rate, latency).unwrap();
    let local = Link::new(rate * 10.0, Duration::ZERO).unwrap();
    LinkModel::new(vec![HostLinks::symmetric(link, local); hosts])
}

/// Runs the model until nothing crosses; every landing, by message.
fn run_out(m: &mut LinkModel) -> HashMap<MessageId, Duration> {
    let mut landed = HashMap::new();
    for _ in 0..100_000 {
        while let Some((msg, at)) = m.poll_landed() {
            assert!(
                landed.insert(msg, at).is_none(),
                "message {msg} landed twice"
            );
        }
        match m.poll_timeout() {
            Some(t) => m.handle_time(t),
            None => return landed,
        }
    }
    panic!("the model did not run out");
}

/// Within a nanosecond: times are whole nanoseconds, rounded up.
fn near(got: Duration, want: Duration) -> bool {
    got.abs_diff(want) <= Duration::from_nanos(2)
}

#[test]
fn one_message_takes_its_bytes_over_the_rate_plus_both_links_latency() {
    let mut m = model(2, 125e6, 5 * MS);
    let a = m.handle_send(Duration::ZERO, 1, 0, 1, 125_000_000);
    let landed = run_out(&mut m);
    assert!(near(landed[&a], secs(1.010)), "{:?}", landed[&a]);
}

#[test]
fn a_gigabit_is_an_eighth_of_a_gigabyte_a_second() {
    let link = Link::gbit(1.0, Duration::ZERO).unwrap();
    assert_eq!(link.bytes_per_sec(), 125e6);
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let e = Link::new(bad, Duration::ZERO).unwrap_err();
        assert!(e.to_string().contains("positive, finite"), "{e}");
    }
}

#[test]
fn two_connections_from_one_host_share_its_uplink() {
    let mut m = model(3, 300.0, Duration::ZERO);
    let a = m.handle_send(Duration::ZERO, 1, 0, 1, 150);
    let b = m.handle_send(Duration::ZERO, 2, 0, 2, 150);
    let landed = run_out(&mut m);
    assert!(near(landed[&a], secs(1.0)), "{:?}", landed[&a]);
    assert!(near(landed[&b], secs(1.0)), "{:?}", landed[&b]);
}

#[test]
fn a_shorter_message_leaves_the_whole_link_to_the_longer_when_it_lands() {
    // Both at 150 B/s until the short one has crossed 60 bytes (0.4 s); the long one then
    // has 240 of its 300 bytes left, alone at 300 B/s: 0.8 s more.
    let mut m = model(3, 300.0, Duration::ZERO);
    let long = m.handle_send(Duration::ZERO, 1, 0, 1, 300);
    let short = m.handle_send(Duration::ZERO, 2, 0, 2, 60);
    let landed = run_out(&mut m);
    assert!(near(landed[&short], secs(0.4)), "{:?}", landed[&short]);
    assert!(near(landed[&long], secs(1.2)), "{:?}", landed[&long]);
}

#[test]
fn senders_into_one_host_share_its_downlink() {
    let mut m = model(4, 300.0, Duration::ZERO);
    let msgs: Vec<MessageId> = (1..4)
        .map(|from| m.handle_send(Duration::ZERO, from as u64, from, 0, 100))
        .collect();
    let landed = run_out(&mut m);
    for msg in msgs {
        assert!(near(landed[&msg], secs(1.0)), "{:?}", landed[&msg]);
    }
}

#[test]
fn what_a_slow_link_holds_back_goes_to_the_others() {
    // x: 0 -> 2 and y: 1 -> 2 share host 2's slow downlink (100 B/s: 50 each); z: 1 -> 3
    // shares host 1's uplink with y and gets the 250 B/s y cannot use, not half of 300.
    let fast = Link::new(300.0, Duration::ZERO).unwrap();
    let slow = Link::new(100.0, Duration::ZERO).unwrap();
    let mut hosts = vec![HostLinks::symmetric(fast, fast); 4];
    hosts[2].down = slow;
    let mut m = LinkModel::new(hosts);
    let x = m.handle_send(Duration::ZERO, 1, 0, 2, 50);
    let y = m.handle_send(Duration::ZERO, 2, 1, 2, 50);
    let z = m.handle_send(Duration::ZERO, 3, 1, 3, 250);
    let landed = run_out(&mut m);
    for msg in [x, y, z] {
        assert!(near(landed[&msg], secs(1.0)), "{msg}: {:?}", landed[&msg]);
    }
}

#[test]
fn a_connection_sends_its_messages_one_after_another() {
    let mut m = model(2, 100.0, 10 * MS);
    let first = m.handle_send(Duration::ZERO, 7, 0, 1, 100);
    let second = m.handle_send(Duration::ZERO, 7, 0, 1, 100);
    let landed = run_out(&mut m);
    assert!(near(landed[&first], secs(1.02)), "{:?}", landed[&first]);
    assert!(near(landed[&second], secs(2.02)), "{:?}", landed[&second]);
}

#[test]
fn a_connection_that_starts_later_slows_the_one_crossing() {
    // a crosses 100 of its 200 bytes alone in 1 s; b's 100 bytes and a's last 100 then
    // share the downlink at 50 B/s each: both land 2 s later.
    let mut m = model(3, 100.0, Duration::ZERO);
    let a = m.handle_send(Duration::ZERO, 1, 0, 2, 200);
    let b = m.handle_send(secs(1.0), 2, 1, 2, 100);
    let landed = run_out(&mut m);
    assert!(near(landed[&a], secs(3.0)), "{:?}", landed[&a]);
    assert!(near(landed[&b], secs(3.0)), "{:?}", landed[&b]);
}

#[test]
fn endpoints_of_one_host_use_its_local_path_not_its_links() {
    let mut m = model(2, 100.0, 5 * MS);
    let local = m.handle_send(Duration::ZERO, 1, 0, 0, 1000);
    let remote = m.handle_send(Duration::ZERO, 2, 0, 1, 100);
    let landed = run_out(&mut m);
    assert!(near(landed[&local], secs(1.0)), "{:?}", landed[&local]);
    assert!(near(landed[&remote], secs(1.01)), "{:?}", landed[&remote]);
}

#[test]
fn empty_messages_land_after_the_latency_alone_and_in_their_turn() {
    let mut m = model(2, 100.0, 5 * MS);
    let empty = m.handle_send(Duration::ZERO, 1, 0, 1, 0);
    let full = m.handle_send(Duration::ZERO, 1, 0, 1, 100);
    let after = m.handle_send(Duration::ZERO, 1, 0, 1, 0);
    let landed = run_out(&mut m);
    assert!(near(landed[&empty], secs(0.01)), "{:?}", landed[&empty]);
    assert!(near(landed[&full], secs(1.01)), "{:?}", landed[&full]);
    assert!(near(landed[&after], secs(1.01)), "{:?}", landed[&after]);
}

#[test]
fn a_closed_connection_lands_nothing_more_and_frees_its_share() {
    let mut m = model(3, 100.0, Duration::ZERO);
    let lost = m.handle_send(Duration::ZERO, 1, 0, 2, 1000);
    let other = m.handle_send(Duration::ZERO, 2, 1, 2, 100);
    // 50 B/s each for 1 s, then the other alone: its last 50 bytes take 0.5 s.
    m.handle_close(secs(1.0), 1);
    let landed = run_out(&mut m);
    assert!(!landed.contains_key(&lost));
    assert!(near(landed[&other], secs(1.5)), "{:?}", landed[&other]);
}

/// One send of a generated run: when, on which connection, between which hosts, how long.
#[derive(Clone, Debug)]
struct Send {
    after_ms: u64,
    conn: u64,
    from: usize,
    to: usize,
    bytes: u64,
}

fn sends() -> impl Strategy<Value = Vec<Send>> {
    proptest::collection::vec(
        (0u64..50, 0u64..6, 0u64..5000).prop_map(|(after_ms, conn, bytes)| Send {
            after_ms,
            conn,
            // A connection joins the same two hosts for its life, as a real one does.
            from: conn as usize % 4,
            to: (conn as usize + 1 + conn as usize / 4) % 4,
            bytes,
        }),
        0..40,
    )
}

/// Plays `sends` on a fresh 4-host model (1000 B/s links, 2 ms latency), polling as a
/// network would; every landing by message, and what each message was.
/// Each message with when it was sent and how.
type Sent = Vec<(MessageId, Duration, Send)>;

fn play(sends: &[Send]) -> (HashMap<MessageId, Duration>, Sent) {
    let mut m = model(4, 1000.0, 2 * MS);
    let mut now = Duration::ZERO;
    let mut landed = HashMap::new();
    let mut sent = Vec::new();
    for s in sends {
        now += Duration::from_millis(s.after_ms);
        let msg = m.handle_send(now, s.conn, s.from, s.to, s.bytes);
        sent.push((msg, now, s.clone()));
        while let Some((msg, at)) = m.poll_landed() {
            landed.insert(msg, at);
        }
    }
    landed.extend(run_out(&mut m));
    (landed, sent)
}

proptest! {
    /// Every message lands once, in its connection's order, no sooner than its bytes
    /// could cross alone; no link carries more than its rate over any run; and the same
    /// sends land at the same times.
    #[test]
    fn messages_land_once_in_order_and_no_link_runs_over_its_rate(sends in sends()) {
        let (landed, sent) = play(&sends);
        let (again, _) = play(&sends);
        prop_assert_eq!(&landed, &again);
        prop_assert_eq!(landed.len(), sent.len());
        let mut last: HashMap<u64, Duration> = HashMap::new();
        for (msg, at, s) in &sent {
            let land = landed[msg];
            let alone = Duration::from_secs_f64(s.bytes as f64 / 1000.0) + 4 * MS;
            prop_assert!(land + Duration::from_nanos(2) >= *at + alone, "{s:?} at {at:?} landed {land:?}");
            if let Some(&before) = last.get(&s.conn) {
                prop_assert!(land >= before, "{s:?} landed before its connection's previous message");
            }
            last.insert(s.conn, land);
        }
        // Each host's uplink: what crossed it by the last landing, against its rate since
        // the first send over it.
        for host in 0..4 {
            let over: Vec<_> = sent.iter().filter(|(_, _, s)| s.from == host && s.to != host).collect();
            if let (Some(first), Some(end)) = (
                over.iter().map(|(_, at, _)| *at).min(),
                over.iter().map(|(msg, _, _)| landed[msg]).max(),
            ) {
                let bytes: u64 = over.iter().map(|(_, _, s)| s.bytes).sum();
                let capacity = (end - first).as_secs_f64() * 1000.0;
                prop_assert!(bytes as f64 <= capacity + 1.0, "host {host}: {bytes} bytes in {capacity} bytes' time");
            }
        }
    }
}
