use super::*;

/// A producer and a consumer over one memory file of `cap` bytes of records.
fn pair(cap: usize) -> (Producer, Consumer) {
    let (file, area, _) = create_file(cap).unwrap();
    let other = Arc::new(SharedArea::map(&file, cap + RECORDS).unwrap());
    (Producer::new(area).unwrap(), Consumer::new(other).unwrap())
}

fn inline(meta: &[u8], segs: &[&[u8]]) -> Vec<u8> {
    let mut v = inline_header(meta, segs).to_vec();
    v.extend_from_slice(meta);
    for s in segs {
        v.extend_from_slice(s);
    }
    v
}

#[test]
fn records_round_trip_and_wrap() {
    let (mut p, mut c) = pair(4096);
    let limits = Limits::default();
    assert!(c.next(&limits).unwrap().is_none());
    assert_eq!(
        p.push(Kind::Start, &[&3u64.to_le_bytes()], 0),
        Ok(Pushed::Done { wake: false })
    );
    assert!(matches!(c.next(&limits).unwrap(), Some(Record::Start(3))));
    // Many records of awkward sizes, through several wraps.
    for i in 0..2000usize {
        let a = vec![i as u8; i % 700];
        let b = vec![!(i as u8); i % 13];
        let body = inline(b"m", &[&a, &b]);
        assert_eq!(
            p.push(Kind::Inline, &[&body], 0),
            Ok(Pushed::Done { wake: false })
        );
        assert_eq!(
            p.push(Kind::Socket, &[], 0),
            Ok(Pushed::Done { wake: false })
        );
        match c.next(&limits).unwrap() {
            Some(Record::Inline { meta, segments }) => {
                assert_eq!(&meta[..], b"m");
                assert_eq!(segments.len(), 2);
                assert!(segments[0] == a[..] && segments[1] == b[..], "record {i}");
            }
            other => panic!("record {i}: {other:?}"),
        }
        assert!(matches!(c.next(&limits).unwrap(), Some(Record::Socket)));
        assert!(c.next(&limits).unwrap().is_none());
    }
}

#[test]
fn a_full_queue_refuses_until_consumed_and_keeps_the_reserve() {
    let (mut p, mut c) = pair(4096);
    let limits = Limits::default();
    let mut body = vec![7u8; 1000];
    body[..4].copy_from_slice(&0u32.to_le_bytes());
    let mut pushed = 0;
    while p.push(Kind::Ring, &[&body], 0) != Ok(Pushed::Full) {
        pushed += 1;
    }
    assert_eq!(pushed, 4, "4 records of 1008 bytes fit in 4096");
    assert_eq!(
        p.push(Kind::Socket, &[], 0),
        Ok(Pushed::Done { wake: false }),
        "a marker still fits"
    );
    assert!(
        matches!(c.next(&limits).unwrap(), Some(Record::Ring { meta, descriptor }) if meta.is_empty() && descriptor[..] == body[4..])
    );
    assert_eq!(
        p.push(Kind::Ring, &[&body], 100),
        Ok(Pushed::Full),
        "the reserve is kept"
    );
    assert_eq!(
        p.push(Kind::Ring, &[&body], 0),
        Ok(Pushed::Done { wake: false })
    );
    assert!(
        p.push(Kind::Ring, &[&vec![0; 1025]], 0).is_err(),
        "over a quarter of the area"
    );
}

#[test]
fn a_sleeping_receiver_is_woken_exactly_once() {
    let (mut p, c) = pair(4096);
    assert!(c.sleep());
    assert_eq!(
        p.push(Kind::Socket, &[], 0),
        Ok(Pushed::Done { wake: true })
    );
    assert_eq!(
        p.push(Kind::Socket, &[], 0),
        Ok(Pushed::Done { wake: false })
    );
    assert!(!c.sleep(), "records are waiting: no sleep");
}

#[test]
fn corrupt_queues_are_errors_not_panics() {
    let limits = Limits::default();
    let (mut p, mut c) = pair(4096);
    // A head beyond what the area can hold.
    counters(&p.area).head.store(1 << 40, Ordering::SeqCst);
    assert!(c.next(&limits).is_err());
    // A record header claiming more than was published, an unknown kind, lengths that do
    // not add up, limits exceeded.
    let cases: Vec<(u32, Vec<u8>)> = vec![
        (99, vec![]),
        (Kind::Start as u32, vec![1, 2, 3]),
        (Kind::Socket as u32, vec![1]),
        (Kind::Inline as u32, vec![0; 3]),
        (Kind::Inline as u32, {
            let mut v = inline_header(b"", &[&[0; 10]]).to_vec();
            v.extend_from_slice(&[0; 9]);
            v
        }),
        (Kind::Inline as u32, {
            let mut v = 0u32.to_le_bytes().to_vec();
            v.extend_from_slice(&u32::MAX.to_le_bytes());
            v
        }),
    ];
    for (kind, body) in cases {
        let (p2, mut c2) = pair(4096);
        let mut h = kind.to_le_bytes().to_vec();
        h.extend_from_slice(&(body.len() as u32).to_le_bytes());
        p2.area.write(RECORDS, &h);
        p2.area.write(RECORDS + RECORD_HEADER, &body);
        counters(&p2.area).head.store(
            (RECORD_HEADER + align8(body.len())) as u64,
            Ordering::SeqCst,
        );
        assert!(c2.next(&limits).is_err(), "kind {kind} body {body:?}");
    }
    // A length past the published bytes.
    let (p3, mut c3) = pair(4096);
    let mut h = (Kind::Ring as u32).to_le_bytes().to_vec();
    h.extend_from_slice(&4000u32.to_le_bytes());
    p3.area.write(RECORDS, &h);
    counters(&p3.area).head.store(16, Ordering::SeqCst);
    assert!(c3.next(&limits).is_err());
    // The receiver's tail moved past the head: the producer refuses to go on.
    counters(&c.area).tail.store(1 << 41, Ordering::SeqCst);
    p.head = 0;
    assert_eq!(
        p.push(Kind::Socket, &[], 0).unwrap_err(),
        QueueError::CorruptCounter("receiver's")
    );
    // Over the receiver's limits.
    let (mut p4, mut c4) = pair(4096);
    let small = Limits {
        max_message: 10,
        ..Limits::default()
    };
    p4.push(Kind::Inline, &[&inline(b"", &[&[0; 11]])], 0)
        .unwrap();
    let e = c4.next(&small).unwrap_err();
    assert_eq!(e, QueueError::MessageTooLarge { len: 11, limit: 10 });
    assert!(e.to_string().contains("PSNET_MAX_MESSAGE"), "{e}");
}

#[test]
fn random_bytes_in_the_queue_never_panic_the_reader() {
    // Whatever a peer writes (records, counters), reading gives records or an error.
    let limits = Limits {
        max_segments: 8,
        max_meta: 64,
        ..Limits::default()
    };
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for _ in 0..3000 {
        let (p, mut c) = pair(4096);
        let mut junk = vec![0u8; 4096];
        for b in junk.iter_mut() {
            *b = next() as u8;
        }
        // Plausible headers now and then, so parsing goes past the first check.
        for at in (0..4096).step_by(8 * (1 + next() as usize % 64)) {
            junk[at..at + 4].copy_from_slice(&(1 + next() as u32 % 6).to_le_bytes());
            junk[at + 4..at + 8].copy_from_slice(&(next() as u32 % 300).to_le_bytes());
        }
        p.area.write(RECORDS, &junk);
        let head = match next() % 3 {
            0 => next(),
            _ => next() % 4097,
        };
        counters(&p.area).head.store(head, Ordering::SeqCst);
        for _ in 0..64 {
            match c.next(&limits) {
                Ok(Some(_)) => continue,
                Ok(None) | Err(_) => break,
            }
        }
    }
}

#[test]
fn two_threads_pass_every_record_in_order() {
    // The producer pushes as fast as room allows, the consumer sleeps whenever the queue
    // is empty; with the wake-up flag alone (no eventfd) a lost wake-up would hang here,
    // so the consumer only waits while `sleep()` said it may and the producer saw it.
    let (mut p, mut c) = pair(8192);
    let woken = std::sync::Arc::new((std::sync::Mutex::new(0u64), std::sync::Condvar::new()));
    let w = woken.clone();
    const N: u64 = 200_000;
    let producer = std::thread::spawn(move || {
        for i in 0..N {
            let body = i.to_le_bytes();
            let len = (i % 300) as usize;
            let pad = vec![i as u8; len];
            loop {
                match p
                    .push(Kind::Ring, &[&0u32.to_le_bytes(), &body, &pad], 0)
                    .unwrap()
                {
                    Pushed::Full => std::thread::yield_now(),
                    Pushed::Done { wake } => {
                        if wake {
                            let (m, cv) = &*w;
                            *m.lock().unwrap() += 1;
                            cv.notify_one();
                        }
                        break;
                    }
                }
            }
        }
    });
    let limits = Limits::default();
    let mut next = 0u64;
    let mut seen_wakes = 0u64;
    while next < N {
        match c.next(&limits).unwrap() {
            Some(Record::Ring { descriptor: b, .. }) => {
                assert_eq!(u64::from_le_bytes(b[..8].try_into().unwrap()), next);
                assert_eq!(b.len(), 8 + (next % 300) as usize);
                next += 1;
            }
            Some(other) => panic!("{other:?}"),
            None => {
                if c.sleep() {
                    let (m, cv) = &*woken;
                    let mut g = m.lock().unwrap();
                    while *g == seen_wakes {
                        let (next, waited) = cv
                            .wait_timeout(g, std::time::Duration::from_secs(20))
                            .unwrap();
                        assert!(!waited.timed_out(), "a wake-up was lost");
                        g = next;
                    }
                    seen_wakes = *g;
                    c.wake();
                }
            }
        }
    }
    producer.join().unwrap();
}
