//! Zero-copy receive over real verbs: a segment the receiver's placer puts in memory
//! registered with its NIC ([`VerbsTransport::host_landing`], the host twin of GPU memory
//! accepted with `accept_writes`) is written there by the sender's NIC, with no copy; a
//! destination without such a registration, or naming one it does not lie in, gets the
//! segment copied in instead, and the NIC never writes what it did not ask for. Runs where an
//! RDMA device exists (the Soft-RoCE guest); prints SKIPPED with the reason elsewhere.

mod common;

use common::{next_message, pair};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use psnet_transport::device::{CopyFuture, NicRegion, StagingBuf};
use psnet_transport::placement::SimulatedLanding;
use psnet_transport::{
    DeviceDest, DeviceError, NodeId, OutMessage, Placed, Placement, Placer, Segment, Transport,
};
use psnet_verbs::VerbsTransport;

const CASE_TIMEOUT: Duration = Duration::from_secs(120);

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(131).wrapping_add(seed) as u8)
        .collect()
}

/// Places, by the message's metadata, one segment into the destination set for it; counts
/// how often it was asked about each.
#[derive(Default)]
struct ByMeta {
    dests: Mutex<HashMap<Vec<u8>, Placement>>,
    asked: Mutex<HashMap<Vec<u8>, usize>>,
}

impl ByMeta {
    fn set(&self, meta: &[u8], segment: usize, dest: Arc<dyn DeviceDest>) {
        let p = Placement { segment, dest };
        self.dests.lock().unwrap().insert(meta.to_vec(), p);
    }

    fn asked(&self, meta: &[u8]) -> usize {
        self.asked.lock().unwrap().get(meta).copied().unwrap_or(0)
    }
}

impl Placer for ByMeta {
    fn place(&self, _: NodeId, meta: &[u8], _: &[u64]) -> Option<Placement> {
        *self.asked.lock().unwrap().entry(meta.to_vec()).or_default() += 1;
        self.dests.lock().unwrap().get(meta).cloned()
    }
}

/// A destination that names another's NIC registration at an address of its choosing, and
/// keeps what is copied into it in memory of its own.
#[derive(Debug)]
struct Claims {
    nic: NicRegion,
    own: SimulatedLanding,
}

impl DeviceDest for Claims {
    fn len(&self) -> usize {
        self.own.len()
    }
    fn ordinal(&self) -> u32 {
        5
    }
    fn nic(&self) -> Option<NicRegion> {
        Some(self.nic)
    }
    fn staging(&self, len: usize) -> Result<StagingBuf, DeviceError> {
        self.own.staging(len)
    }
    fn copy_from_host(&self, offset: usize, len: usize, buf: StagingBuf) -> CopyFuture<'_> {
        self.own.copy_from_host(offset, len, buf)
    }
}

/// Messages from `peer` with a segment `t`'s NIC wrote where the placer said.
fn placed_by_nic(t: &VerbsTransport, peer: NodeId) -> u64 {
    t.link_stats(peer).expect("a link").received_placed
}

async fn send(a: &VerbsTransport, to: NodeId, meta: &[u8], segments: &[&[u8]]) {
    let segs: Vec<Segment<'_>> = segments.iter().map(|s| Segment::new(s)).collect();
    a.send(to, OutMessage::new(meta, &segs))
        .await
        .unwrap_or_else(|e| panic!("send {:?}: {e}", String::from_utf8_lossy(meta)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placed_segments_are_written_by_the_nic_into_registered_memory() {
    // Offers on: a placed message must keep going by request-to-send (no offer of its size).
    let Some((a, b)) = pair(16 << 20).await else {
        return;
    };
    tokio::time::timeout(CASE_TIMEOUT, async {
        let to = b.local_id();
        let len = (2 << 20) + 5;
        let landing = b.host_landing(len).expect("a host landing");
        let placer = Arc::new(ByMeta::default());
        placer.set(b"nic", 1, landing.clone());
        assert!(b.set_placer(placer.clone()));
        let head = pattern(100, 1);

        for round in 0..3u64 {
            let data = pattern(len, 10 + round);
            send(&a, to, b"nic", &[&head, &data]).await;
            let m = next_message(&b).await;
            assert_eq!(&m.meta[..], b"nic");
            assert_eq!(
                m.placed,
                Some(Placed {
                    segment: 1,
                    len: len as u64,
                    result: Ok(())
                })
            );
            assert_eq!(&m.segments[0][..], &head[..]);
            assert!(m.segments[1].is_empty());
            assert!(
                landing.to_vec().expect("the write landed") == data,
                "round {round}: the NIC did not write the landing"
            );
            assert_eq!(placer.asked(b"nic"), round as usize + 1, "asked once each");
            assert_eq!(
                placed_by_nic(&b, a.local_id()),
                round + 1,
                "not written by the NIC"
            );
        }
        let sent = a.link_stats(to).expect("a link");
        assert_eq!((sent.sent_rendezvous, sent.sent_direct), (3, 0));

        // The placed segment first and alone: nothing goes to a host buffer.
        let solo = b.host_landing(len).expect("a host landing");
        placer.set(b"solo", 0, solo.clone());
        let data = pattern(len, 40);
        send(&a, to, b"solo", &[&data]).await;
        let m = next_message(&b).await;
        assert_eq!(m.placed.map(|p| (p.segment, p.result)), Some((0, Ok(()))));
        assert!(solo.to_vec().unwrap() == data);
        assert_eq!(placed_by_nic(&b, a.local_id()), 4);

        // No registration: copied in once the message has landed, the placer asked once.
        let sim = Arc::new(SimulatedLanding::new(len, 0));
        placer.set(b"sim", 1, sim.clone());
        let data = pattern(len, 50);
        send(&a, to, b"sim", &[&head, &data]).await;
        let m = next_message(&b).await;
        assert_eq!(m.placed.map(|p| p.result), Some(Ok(())));
        assert!(sim.bytes() == data);
        assert!(sim.copies() > 0);
        assert_eq!(placer.asked(b"sim"), 1);
        assert_eq!(placed_by_nic(&b, a.local_id()), 4);

        // Naming the landing's registration from outside it (one byte past its start, so it
        // would run past the end), or another transport's: copied into the claimant's own
        // memory; the landing keeps what it had.
        let before = landing.to_vec().unwrap();
        let registered = a.alloc_registered(len).expect("registered memory");
        let nic_of_landing = landing.nic().expect("a registration");
        for (name, nic) in [
            (
                &b"past"[..],
                NicRegion {
                    addr: nic_of_landing.addr + 1,
                    ..nic_of_landing
                },
            ),
            (
                &b"foreign"[..],
                NicRegion {
                    key: registered.key(),
                    addr: registered.as_ptr() as u64,
                },
            ),
        ] {
            let claims = Arc::new(Claims {
                nic,
                own: SimulatedLanding::new(len, 0),
            });
            placer.set(name, 1, claims.clone());
            let data = pattern(len, 60 + name.len() as u64);
            send(&a, to, name, &[&head, &data]).await;
            let m = next_message(&b).await;
            assert_eq!(m.placed.map(|p| p.result), Some(Ok(())), "{name:?}");
            assert!(claims.own.bytes() == data, "{name:?}");
            assert!(
                landing.to_vec().unwrap() == before,
                "{name:?}: the NIC wrote it"
            );
            assert_eq!(placer.asked(name), 1);
            assert_eq!(placed_by_nic(&b, a.local_id()), 4);
        }

        // Left in host memory: delivered whole, the placer asked once.
        let data = pattern(len, 70);
        send(&a, to, b"none", &[&head, &data]).await;
        let m = next_message(&b).await;
        assert!(m.placed.is_none());
        assert!(m.segments[1][..] == data[..]);
        assert_eq!(placer.asked(b"none"), 1);

        // The messages of this size left in host memory had buffers of their size offered
        // in advance: the next placed ones are written there and copied in, each using up an
        // offer that is not renewed, until one asks again and the NIC writes it in place.
        let offered = b.link_stats(a.local_id()).unwrap().offered_now;
        assert!(offered > 0, "no offer: the case below tests nothing");
        // Time for the offers to reach the sender, which then writes into them.
        tokio::time::sleep(Duration::from_millis(500)).await;
        for round in 0..=offered {
            let data = pattern(len, 80 + round);
            send(&a, to, b"nic", &[&head, &data]).await;
            let m = next_message(&b).await;
            assert_eq!(m.placed.map(|p| p.result), Some(Ok(())), "round {round}");
            assert!(landing.to_vec().unwrap() == data, "round {round}");
            if placed_by_nic(&b, a.local_id()) == 5 {
                break;
            }
        }
        assert_eq!(
            placed_by_nic(&b, a.local_id()),
            5,
            "the offers were renewed"
        );
        let after = b.link_stats(a.local_id()).unwrap();
        assert!(after.received_direct > 0, "no offer was used");
        assert!(after.offered_now < offered, "offers were renewed");
        let data = pattern(len, 99);
        let back = a.host_landing(len).expect("a host landing");
        let back_placer = Arc::new(ByMeta::default());
        back_placer.set(b"back", 1, back.clone());
        assert!(a.set_placer(back_placer));
        send(&b, a.local_id(), b"back", &[&head, &data]).await;
        let m = next_message(&a).await;
        assert_eq!(m.placed.map(|p| p.result), Some(Ok(())));
        assert!(back.to_vec().unwrap() == data);
        assert_eq!(placed_by_nic(&a, to), 1);
    })
    .await
    .expect("hung");
}

/// A landing cannot be read or written while a peer's write into it may be under way, and
/// reads and writes out of range are refused, never a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_landing_refuses_accesses_out_of_range() {
    let Some((a, _b)) = pair(0).await else {
        return;
    };
    let landing = a.host_landing(1000).expect("a host landing");
    assert!(landing.write(990, &[7; 10]));
    assert!(!landing.write(991, &[7; 10]));
    assert!(!landing.write(usize::MAX, &[7; 10]));
    let bytes = landing.to_vec().unwrap();
    assert_eq!(&bytes[990..], &[7; 10]);
    assert_eq!(landing.len(), 1000);
    assert_eq!(landing.ordinal(), psnet_verbs::HostLanding::ORDINAL);
}
