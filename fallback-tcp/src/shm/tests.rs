use std::fs::File;
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};

use rustix::fs::MemfdFlags;
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

use super::handover::{fetch_descriptors, random, REQUIRED_SEALS, TOKEN};
use super::*;

#[test]
fn ring_allocation_wraps_and_frees_out_of_order() {
    let mut a = Alloc::default();
    assert_eq!(a.alloc(40, 100, None), Some(0));
    assert_eq!(a.alloc(40, 100, None), Some(40));
    assert_eq!(
        a.alloc(40, 100, None),
        None,
        "only 20 left at the end, 0 at the start"
    );
    assert!(a.free(40, 40));
    assert_eq!(
        a.alloc(30, 100, None),
        None,
        "the oldest region still blocks the start"
    );
    assert!(a.free(0, 40));
    assert_eq!(a.alloc(30, 100, None), Some(0), "empty ring restarts at 0");
    assert_eq!(a.alloc(60, 100, None), Some(30));
    assert!(a.free(0, 30));
    assert_eq!(
        a.alloc(20, 100, None),
        Some(0),
        "wraps before the live region at 30"
    );
    assert_eq!(a.alloc(10, 100, None), None, "head would meet the tail");
    assert!(!a.free(5, 5), "unknown region");
    assert_eq!(a.alloc(0, 100, None), None);
    assert_eq!(a.alloc(101, 100, None), None);
}

#[test]
fn a_steady_stream_reuses_the_start_of_the_ring() {
    // Two messages in flight at a time, each freed after the next is handed out: the
    // regions stay within the first four slots however long the stream runs (a region
    // goes back to the start only once the space there is strictly larger than it).
    let (len, size) = (256, 1 << 20);
    let mut a = Alloc {
        base: 8,
        head: 8,
        ..Alloc::default()
    };
    let mut live = VecDeque::new();
    let mut highest = 0;
    for _ in 0..10_000 {
        let off = a.alloc(len, size, Some(8)).expect("room");
        highest = highest.max(off + len);
        live.push_back(off);
        if live.len() > 2 {
            let oldest = live.pop_front().unwrap();
            assert!(a.free(oldest, len));
        }
    }
    assert!(highest <= 8 + 4 * len, "the stream reached byte {highest}");
}

#[test]
fn early_wraps_never_overlap_live_regions() {
    // Random sizes, frees in random order: every live region stays disjoint from the
    // others and inside the ring.
    let size = 4096;
    let mut a = Alloc {
        base: 8,
        head: 8,
        ..Alloc::default()
    };
    let mut live: Vec<(usize, usize)> = Vec::new();
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for _ in 0..20_000 {
        if next() % 3 != 0 {
            let len = 1 + (next() % 900) as usize;
            let phase = (next() % 70) as usize;
            let phase = (phase < RING_ALIGN).then_some(phase);
            if let Some(off) = a.alloc(len, size, phase) {
                assert!(off >= 8 && off + len <= size);
                if let Some(p) = phase {
                    assert_eq!(off % RING_ALIGN, p, "{off} is not at phase {p}");
                }
                for &(o, l) in &live {
                    assert!(off + len <= o || o + l <= off, "{off}+{len} meets {o}+{l}");
                }
                live.push((off, len));
            }
        } else if !live.is_empty() {
            let i = (next() % live.len() as u64) as usize;
            let (o, l) = live.swap_remove(i);
            assert!(a.free(o, l));
        }
    }
}

#[tokio::test]
async fn the_largest_segment_lands_as_aligned_as_in_the_senders_memory() {
    let send = SendRing::create(1 << 20).expect("memfd ring");
    let header = [7u8; 5];
    let data = vec![3u8; 100_000];
    for skip in 0..2 * RING_ALIGN {
        let body = &data[skip..];
        let segs = [Segment::new(&header), Segment::new(body)];
        let (off, total) = send.put(&segs).expect("room");
        assert_eq!(total, header.len() + body.len());
        assert_eq!(
            (off + header.len()) % RING_ALIGN,
            body.as_ptr() as usize % RING_ALIGN,
            "skip {skip}: the body is at ring offset {}",
            off + header.len()
        );
        assert!(send.free(off, total));
    }
}

#[tokio::test]
async fn a_ring_round_trips_through_shared_memory() {
    let send = SendRing::create(1 << 20).expect("memfd ring");
    let recv = Arc::new(RecvRing::fetch(&send.offer()).await.expect("same host"));
    send.activate();
    let a = vec![1u8; 300_000];
    let b = vec![2u8; 5];
    let segs = [Segment::new(&a), Segment::new(&b)];
    let (off, total) = send.put(&segs).unwrap();
    let control = Arc::new(Control::default());
    let got = recv
        .segments(&descriptor(off, &segs), &control, &Limits::default())
        .unwrap();
    assert_eq!(got.len(), 2);
    assert!(got[0] == a[..] && got[1] == b[..]);
    drop(got);
    let frames = control.take();
    assert_eq!(frames.len(), 1);
    assert_eq!(frames[0].0, FrameKind::ShmFree);
    let freed = parse_free(&frames[0].1).unwrap();
    assert_eq!(freed, vec![(off, total)]);
    assert!(send.free(off, total));
}

#[tokio::test]
async fn bad_offers_and_descriptors_are_refused() {
    assert!(RecvRing::fetch(b"short").await.is_err());
    // An offer naming a file, as the old path-based offers did: refused, nothing opened.
    let mut offer = (DEFAULT_RING as u64).to_le_bytes().to_vec();
    offer.extend_from_slice(&7u64.to_le_bytes());
    offer.extend_from_slice(&[0; TOKEN]);
    offer.extend_from_slice(b"/etc/passwd");
    assert!(RecvRing::fetch(&offer).await.is_err());
    let send = SendRing::create(1 << 20).unwrap();
    let mut wrong = send.offer();
    wrong[8] ^= 1;
    assert!(RecvRing::fetch(&wrong).await.is_err(), "cookie mismatch");
    let send = SendRing::create(1 << 20).unwrap();
    let recv = Arc::new(RecvRing::fetch(&send.offer()).await.unwrap());
    let control = Arc::new(Control::default());
    let mut d = (1u64 << 20).to_le_bytes().to_vec();
    d.extend_from_slice(&1u32.to_le_bytes());
    d.extend_from_slice(&1u64.to_le_bytes());
    assert!(
        recv.segments(&d, &control, &Limits::default()).is_err(),
        "past the end"
    );
    let small = Limits {
        max_message: 100,
        ..Limits::default()
    };
    let mut big = (COOKIE as u64).to_le_bytes().to_vec();
    big.extend_from_slice(&1u32.to_le_bytes());
    big.extend_from_slice(&200u64.to_le_bytes());
    assert!(recv.segments(&big, &control, &Limits::default()).is_ok());
    let e = recv.segments(&big, &control, &small).unwrap_err();
    assert!(e.contains("PSNET_MAX_MESSAGE"), "{e}");
    assert!(recv
        .segments(&[0; 5], &control, &Limits::default())
        .is_err());
    assert!(parse_free(&[0; 15]).is_none());
}

/// An offer whose socket is served by `serve`, which hands over `fd` to whoever asks.
fn rogue_offer(size: u64, fd: OwnedFd) -> Vec<u8> {
    let name = format!(
        "psnet-rogue-{:032x}",
        u128::from_le_bytes(random::<16>().unwrap())
    );
    let listener = UnixListener::bind_addr(&UnixAddr::from_abstract_name(&name).unwrap()).unwrap();
    std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let fds = [fd.as_fd()];
        control.push(SendAncillaryMessage::ScmRights(&fds));
        let mut token = [0u8; TOKEN];
        let _ = std::io::Read::read_exact(&mut &stream, &mut token);
        let _ = rustix::net::sendmsg(
            &stream,
            &[IoSlice::new(&[1])],
            &mut control,
            SendFlags::empty(),
        );
    });
    let mut offer = size.to_le_bytes().to_vec();
    offer.extend_from_slice(&0u64.to_le_bytes());
    offer.extend_from_slice(&[0; TOKEN]);
    offer.extend_from_slice(name.as_bytes());
    offer
}

#[tokio::test]
async fn an_unsealed_or_wrongly_sized_file_is_never_mapped() {
    // A plain file handed over (it could be truncated under the mapping: SIGBUS).
    let path = std::env::temp_dir().join(format!("psnet-unsealed-{}", std::process::id()));
    let file = File::create(&path).unwrap();
    file.set_len(1 << 20).unwrap();
    let _ = std::fs::remove_file(&path);
    let err = RecvRing::fetch(&rogue_offer(1 << 20, OwnedFd::from(file)))
        .await
        .err()
        .expect("refused");
    assert!(err.to_string().contains("sealed"), "{err}");
    // A memory file without seals.
    let fd = rustix::fs::memfd_create("rogue", MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, 1 << 20).unwrap();
    let err = RecvRing::fetch(&rogue_offer(1 << 20, fd))
        .await
        .err()
        .expect("refused");
    assert!(err.to_string().contains("sealed"), "{err}");
    // Sealed, but not the announced size.
    let fd =
        rustix::fs::memfd_create("rogue", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, 4096).unwrap();
    rustix::fs::fcntl_add_seals(&fd, REQUIRED_SEALS).unwrap();
    let err = RecvRing::fetch(&rogue_offer(1 << 20, fd))
        .await
        .err()
        .expect("refused");
    assert!(err.to_string().contains("wrong size"), "{err}");
}

#[tokio::test]
async fn the_descriptor_goes_only_to_the_token_and_cannot_be_resized() {
    let send = SendRing::create(1 << 20).unwrap();
    let offer = send.offer();
    let name = offer[16 + TOKEN..].to_vec();
    // Without the token: refused, and the real receiver still gets the ring after.
    let wrong = [0u8; TOKEN];
    let n = name.clone();
    let stolen = tokio::task::spawn_blocking(move || fetch_descriptors(&n, &wrong))
        .await
        .unwrap();
    assert!(stolen.is_err(), "handed to a connection without the token");
    let token: [u8; TOKEN] = offer[16..16 + TOKEN].try_into().unwrap();
    let fd = tokio::task::spawn_blocking(move || fetch_descriptors(&name, &token))
        .await
        .unwrap()
        .expect("the token fetches the ring")
        .pop()
        .unwrap();
    // The sender's seals hold for whoever has the descriptor: no truncation, no growth.
    assert!(rustix::fs::ftruncate(&fd, 0).is_err());
    assert!(rustix::fs::ftruncate(&fd, 2 << 20).is_err());
    // Nothing was ever created in /dev/shm.
    let leftovers = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().starts_with("psnet"))
                .count()
        })
        .unwrap_or(0);
    assert_eq!(leftovers, 0);
}
