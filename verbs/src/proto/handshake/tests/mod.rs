//! The handshakes without an RDMA device: each input on its own (here: the links table,
//! the socket handshake and the `connect` loop; `rdma_cm.rs`: rdma_cm's), and two nodes fed
//! each other's messages in any order (`socket_pair.rs`, `rdma_cm.rs`), ending with one link
//! per pair connected to each other, or with both sides failing with a reason.

mod rdma_cm;
mod socket_pair;

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use psnet_transport::NodeId;

use super::connect::{Connect, Poll, Step, CM_FALLBACK, REQUEST_RESEND};
use super::socket::{Answered, OnReply, OnRequest};
use super::{LinkHandle, Links, Phase};
use crate::control::Control;
use crate::qp::QpInfo;

/// A link as the handshakes see one: a queue-pair number, a nonce, and what the driver did
/// to it.
#[derive(Clone, Debug)]
pub(super) struct Fake(Rc<FakeState>);

#[derive(Debug)]
pub(super) struct FakeState {
    id: u32,
    /// Unique across the simulated nodes.
    qpn: u32,
    nonce: u64,
    /// The queue pair it was connected to.
    connected_to: RefCell<Option<u32>>,
    remote_ready: RefCell<bool>,
    failed: RefCell<Option<String>>,
}

impl Fake {
    pub(super) fn new(id: u32, qpn: u32, nonce: u64) -> Fake {
        Fake(Rc::new(FakeState {
            id,
            qpn,
            nonce,
            connected_to: RefCell::new(None),
            remote_ready: RefCell::new(false),
            failed: RefCell::new(None),
        }))
    }

    pub(super) fn connect_to(&self, qpn: u32) {
        *self.0.connected_to.borrow_mut() = Some(qpn);
    }

    pub(super) fn set_remote_ready(&self) {
        *self.0.remote_ready.borrow_mut() = true;
    }

    pub(super) fn fail(&self, reason: &str) {
        self.0.failed.borrow_mut().get_or_insert(reason.to_string());
    }

    pub(super) fn qpn(&self) -> u32 {
        self.0.qpn
    }

    pub(super) fn connected_to(&self) -> Option<u32> {
        *self.0.connected_to.borrow()
    }
}

/// The same link, not an equal one.
impl PartialEq for Fake {
    fn eq(&self, other: &Fake) -> bool {
        Rc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Fake {}

impl LinkHandle for Fake {
    fn id(&self) -> u32 {
        self.0.id
    }

    fn nonce(&self) -> u64 {
        self.0.nonce
    }

    fn local_info(&self) -> QpInfo {
        QpInfo {
            qpn: self.0.qpn,
            psn: 0,
            lid: 0,
            gid: [0; 16],
            mtu: 4,
            recv_depth: 16,
            slot_size: 4096,
        }
    }

    fn is_ready(&self) -> bool {
        *self.0.remote_ready.borrow() && self.0.failed.borrow().is_none()
    }

    fn failure(&self) -> Option<String> {
        self.0.failed.borrow().clone()
    }
}

pub(super) const A: NodeId = NodeId(1);
pub(super) const B: NodeId = NodeId(2);

pub(super) fn addr() -> SocketAddr {
    SocketAddr::from(([10, 0, 0, 2], 9000))
}

fn request(link: &Fake) -> Control {
    Control::Request {
        nonce: link.nonce(),
        info: link.local_info(),
    }
}

#[test]
fn a_request_is_answered_unless_a_link_wins_over_it() {
    let mut links = Links::<Fake>::new();
    assert_eq!(links.handle_request(B, 5), OnRequest::Answer);

    // Our own request, nonce 10: a smaller nonce loses, a larger (or equal) one wins.
    let mut connect = Connect::new(B, addr(), Instant::now(), REQUEST_RESEND * 10, false, false);
    assert_eq!(
        connect.poll(&mut links, Instant::now(), |_| false, || true),
        Poll::NewLink
    );
    let mine = Fake::new(1, 101, 10);
    connect.handle_new_link(&mut links, mine.clone());
    assert_eq!(links.handle_request(B, 5), OnRequest::Ignore);
    assert_eq!(links.handle_request(B, 11), OnRequest::Answer);

    // The answer replaces our request, and is recorded to be sent again.
    let answer = Fake::new(2, 102, 77);
    let Answered::Installed { retired, reply } = links.handle_answer_built(B, 11, answer.clone())
    else {
        panic!("the answer must be installed");
    };
    assert_eq!(retired.map(|l| l.id()), Some(1));
    assert_eq!(
        reply,
        Control::Reply {
            request: 11,
            nonce: 77,
            info: answer.local_info()
        }
    );
    assert_eq!(links.get(B).map(|s| s.phase()), Some(Phase::Connected));
    assert!(links.get(B).is_some_and(|s| s.announced()));
    assert_eq!(links.handle_request(B, 11), OnRequest::Resend(reply));
    // Any other request meets a connected link: ignored.
    assert_eq!(links.handle_request(B, 12), OnRequest::Ignore);
    // A second answer to a request is superseded by the connected link.
    let late = Fake::new(3, 103, 78);
    assert!(matches!(
        links.handle_answer_built(B, 12, late),
        Answered::Superseded(l) if l.id() == 3
    ));
}

#[test]
fn a_reply_connects_our_request_once_and_repeats_the_confirmation() {
    let mut links = Links::<Fake>::new();
    assert_eq!(links.handle_reply(B, 10, 20), OnReply::Ignore);
    let mut connect = Connect::new(B, addr(), Instant::now(), REQUEST_RESEND * 10, false, false);
    connect.poll(&mut links, Instant::now(), |_| false, || true);
    connect.handle_new_link(&mut links, Fake::new(1, 101, 10));
    // A reply to another request.
    assert_eq!(links.handle_reply(B, 9, 20), OnReply::Ignore);
    let OnReply::Connect { link, ready } = links.handle_reply(B, 10, 20) else {
        panic!("the reply must connect our link");
    };
    assert_eq!((link.id(), ready), (1, Control::Ready { nonce: 20 }));
    assert!(!links.get(B).is_some_and(|s| s.announced()));
    links.handle_connected(B, 1);
    assert!(links.get(B).is_some_and(|s| s.announced()));
    assert_eq!(
        links.handle_reply(B, 10, 20),
        OnReply::Resend(Control::Ready { nonce: 20 })
    );
    // Readiness for our link only.
    assert!(links.handle_ready(B, 11).is_none());
    assert_eq!(links.handle_ready(B, 10).map(|l| l.id()), Some(1));
}

#[test]
fn removal_and_reconnects_name_the_link() {
    let mut links = Links::<Fake>::new();
    assert!(links
        .install_answer(B, 1, Fake::new(4, 104, 9), None, false)
        .is_ok_and(|old| old.is_none()));
    assert_eq!(
        links.handle_control_connected(B),
        Some((4, "the peer reconnected"))
    );
    assert!(links.remove(B, Some(5)).is_none());
    let gone = links.remove(B, Some(4)).expect("link 4 is the peer's");
    assert!(gone.announced());
    assert!(links.get(B).is_none());
    assert!(links.handle_control_connected(B).is_none());
}

#[test]
fn an_unanswered_request_is_repeated_until_the_deadline() {
    let t0 = Instant::now();
    let timeout = Duration::from_secs(2);
    let mut links = Links::<Fake>::new();
    let mut connect = Connect::new(B, addr(), t0, timeout, false, false);
    assert_eq!(
        connect.poll(&mut links, t0, |_| false, || true),
        Poll::NewLink
    );
    let link = Fake::new(1, 101, 10);
    assert_eq!(
        connect.handle_new_link(&mut links, link.clone()),
        Step::Send {
            msg: request(&link),
            abandon_cm: None
        }
    );
    assert_eq!(
        connect.poll(&mut links, t0, |_| false, || true),
        Poll::Step(Step::Wait(t0 + REQUEST_RESEND))
    );
    assert!(connect.handle_timeout(t0 + REQUEST_RESEND).is_none());
    let later = t0 + REQUEST_RESEND;
    assert_eq!(
        connect.poll(&mut links, later, |_| false, || true),
        Poll::Step(Step::Send {
            msg: request(&link),
            abandon_cm: None
        })
    );
    assert_eq!(
        connect.poll(&mut links, later, |_| false, || true),
        Poll::Step(Step::Wait(later + REQUEST_RESEND))
    );
    let reason = connect
        .handle_timeout(t0 + timeout)
        .expect("the deadline passed");
    assert_eq!(reason, "RDMA queue-pair handshake timed out after 2s");
    // The deadline bounds the wait.
    let near = t0 + timeout - Duration::from_millis(100);
    assert_eq!(
        connect.poll(&mut links, near, |_| false, || true),
        Poll::Step(Step::Send {
            msg: request(&link),
            abandon_cm: None
        })
    );
    assert_eq!(
        connect.poll(&mut links, near, |_| false, || true),
        Poll::Step(Step::Wait(t0 + timeout))
    );
}

#[test]
fn connect_ends_with_the_links_readiness_or_failure() {
    let t0 = Instant::now();
    let mut links = Links::<Fake>::new();
    let mut connect = Connect::new(B, addr(), t0, Duration::from_secs(5), false, false);
    // No control connection: nothing to ask over.
    assert_eq!(
        connect.poll(&mut links, t0, |_| false, || false),
        Poll::Step(Step::Fail(
            "control connection closed during the RDMA handshake".into()
        ))
    );
    connect.poll(&mut links, t0, |_| false, || true);
    let link = Fake::new(1, 101, 10);
    connect.handle_new_link(&mut links, link.clone());
    link.set_remote_ready();
    assert_eq!(
        connect.poll(&mut links, t0, |_| false, || true),
        Poll::Step(Step::Done)
    );
    link.fail("boom");
    assert_eq!(
        connect.poll(&mut links, t0, |_| false, || true),
        Poll::Step(Step::Fail("boom".into()))
    );
    // Gone from the table (a refusal removed it): its failure is the answer, no new request.
    links.remove(B, Some(1));
    assert_eq!(
        connect.poll(&mut links, t0, |_| false, || true),
        Poll::Step(Step::Fail("boom".into()))
    );
}

#[test]
fn a_connected_answer_repeats_its_reply_until_confirmed() {
    let t0 = Instant::now();
    let mut links = Links::<Fake>::new();
    let answer = Fake::new(1, 101, 10);
    let Answered::Installed { reply, .. } = links.handle_answer_built(B, 5, answer.clone()) else {
        panic!("nothing wins over the request");
    };
    let mut connect = Connect::new(B, addr(), t0, Duration::from_secs(5), false, false);
    assert_eq!(
        connect.poll(&mut links, t0, |_| false, || true),
        Poll::Step(Step::Wait(t0 + REQUEST_RESEND))
    );
    assert_eq!(
        connect.poll(&mut links, t0 + REQUEST_RESEND, |_| false, || true),
        Poll::Step(Step::Send {
            msg: reply,
            abandon_cm: None
        })
    );
    answer.set_remote_ready();
    assert_eq!(
        connect.poll(&mut links, t0 + REQUEST_RESEND, |_| false, || true),
        Poll::Step(Step::Done)
    );
}

#[test]
fn rdma_cm_requests_are_retried_and_fall_back_to_sockets() {
    let t0 = Instant::now();
    let mut links = Links::<Fake>::new();
    let mut connect = Connect::new(B, addr(), t0, Duration::from_secs(20), true, true);
    connect.poll(&mut links, t0, |_| false, || true);
    let link = Fake::new(1, 101, 10);
    assert_eq!(
        connect.handle_new_link(&mut links, link.clone()),
        Step::StartCm(link.clone())
    );
    assert!(links.get(B).is_some_and(|s| s.via_cm()));
    // While its request is under way nothing happens; once refused, it asks again.
    let t1 = t0 + REQUEST_RESEND;
    assert_eq!(
        connect.poll(&mut links, t1, |_| true, || true),
        Poll::Step(Step::Wait(t1 + REQUEST_RESEND))
    );
    let t2 = t1 + REQUEST_RESEND;
    assert!(matches!(
        connect.poll(&mut links, t2, |id| id != 1, || true),
        Poll::Step(Step::StartCm(l)) if l.id() == 1
    ));
    // rdma_cm stays silent: the same link goes over the control connection.
    let t3 = t0 + CM_FALLBACK;
    assert_eq!(
        connect.poll(&mut links, t3, |_| true, || true),
        Poll::Step(Step::Send {
            msg: request(&link),
            abandon_cm: Some(1)
        })
    );
    assert!(links.get(B).is_some_and(|s| !s.via_cm()));

    // Without the fall-back (PSNET_RDMA_CONNECT=rdma_cm) it keeps to rdma_cm.
    let mut links = Links::<Fake>::new();
    let mut connect = Connect::new(B, addr(), t0, Duration::from_secs(20), true, false);
    connect.poll(&mut links, t0, |_| false, || true);
    connect.handle_new_link(&mut links, link);
    assert!(matches!(
        connect.poll(&mut links, t3, |_| false, || true),
        Poll::Step(Step::StartCm(_))
    ));
}

#[test]
fn a_failed_rdma_cm_link_is_made_again_over_sockets_once() {
    let t0 = Instant::now();
    let mut links = Links::<Fake>::new();
    let mut connect = Connect::new(B, addr(), t0, Duration::from_secs(20), true, true);
    connect.poll(&mut links, t0, |_| false, || true);
    let first = Fake::new(1, 101, 10);
    connect.handle_new_link(&mut links, first.clone());
    // It fails during the rdma_cm handshake: the call waits for the driver to remove it...
    first.fail("rdma_establish: Invalid argument");
    assert!(matches!(
        connect.poll(&mut links, t0, |_| true, || true),
        Poll::Step(Step::Wait(_))
    ));
    links.remove(B, Some(1));
    // ...then builds a new link, asked for over the control connection.
    assert_eq!(
        connect.poll(&mut links, t0, |_| false, || true),
        Poll::NewLink
    );
    let second = Fake::new(2, 102, 11);
    assert_eq!(
        connect.handle_new_link(&mut links, second.clone()),
        Step::Send {
            msg: request(&second),
            abandon_cm: None
        }
    );
    assert!(links.get(B).is_some_and(|s| !s.via_cm()));
    // Once only: its failure is the call's.
    second.fail("boom");
    assert_eq!(
        connect.poll(&mut links, t0, |_| false, || true),
        Poll::Step(Step::Fail("boom".into()))
    );

    // Without the fall-back (PSNET_RDMA_CONNECT=rdma_cm) the first failure is the call's.
    let mut links = Links::<Fake>::new();
    let mut connect = Connect::new(B, addr(), t0, Duration::from_secs(20), true, false);
    connect.poll(&mut links, t0, |_| false, || true);
    let link = Fake::new(3, 103, 12);
    connect.handle_new_link(&mut links, link.clone());
    link.fail("rdma_establish: Invalid argument");
    assert_eq!(
        connect.poll(&mut links, t0, |_| true, || true),
        Poll::Step(Step::Fail("rdma_establish: Invalid argument".into()))
    );
}
