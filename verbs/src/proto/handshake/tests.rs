//! The handshakes without an RDMA device: each input on its own, and two nodes fed each
//! other's messages in any order, with losses, ending with one link per pair connected to
//! each other, or with both sides failing with a reason.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use psnet_transport::NodeId;

use super::connect::{Connect, Poll, Step, CM_FALLBACK, REQUEST_RESEND};
use super::socket::{Answered, OnReply, OnRequest};
use super::{LinkHandle, Links, Phase, REPLACED, SUPERSEDED};
use crate::control::Control;
use crate::proto::qp::QpInfo;

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

const A: NodeId = NodeId(1);
const B: NodeId = NodeId(2);

fn addr() -> SocketAddr {
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

/// One simulated node of the socket handshake: its links, its `connect` call (if it made
/// one), and the messages on their way to it. It does what the transport's drivers do.
struct Node {
    id: NodeId,
    links: Links<Fake>,
    made: Vec<Fake>,
    connect: Option<Connect<Fake>>,
    result: Option<Result<(), String>>,
    wake: Option<Instant>,
    inbox: VecDeque<Control>,
    nonces: VecDeque<u64>,
}

impl Node {
    fn new(id: NodeId, connects: bool, t0: Instant, nonces: Vec<u64>) -> Node {
        let peer = if id == A { B } else { A };
        Node {
            id,
            links: Links::new(),
            made: Vec::new(),
            connect: connects
                .then(|| Connect::new(peer, addr(), t0, Duration::from_secs(10), false, false)),
            result: None,
            wake: None,
            inbox: VecDeque::new(),
            nonces: nonces.into(),
        }
    }

    fn peer(&self) -> NodeId {
        if self.id == A {
            B
        } else {
            A
        }
    }

    fn new_link(&mut self) -> Fake {
        let id = self.made.len() as u32 + 1;
        let nonce = self
            .nonces
            .pop_front()
            .unwrap_or(u64::from(id) << 32 | self.id.0);
        let link = Fake::new(id, (self.id.0 as u32) * 1000 + id, nonce);
        self.made.push(link.clone());
        link
    }

    /// The `connect` loop's turn at `now`: messages it sends go to `out`.
    fn poll(&mut self, now: Instant, out: &mut VecDeque<Control>) {
        let Some(mut connect) = self.connect.take() else {
            return;
        };
        if self.result.is_none() && self.wake.is_some_and(|w| now >= w) {
            if let Some(reason) = connect.handle_timeout(now) {
                self.result = Some(Err(reason));
            }
        }
        if self.result.is_none() {
            let step = match connect.poll(&mut self.links, now, |_| false, || true) {
                Poll::Step(step) => step,
                Poll::NewLink => {
                    let link = self.new_link();
                    connect.handle_new_link(&mut self.links, link)
                }
            };
            self.wake = None;
            match step {
                Step::Done => self.result = Some(Ok(())),
                Step::Fail(reason) => self.result = Some(Err(reason)),
                Step::Send { msg, .. } => out.push_back(msg),
                Step::StartCm(_) => unreachable!("sockets only"),
                Step::Wait(until) => self.wake = Some(until),
            }
        }
        self.connect = Some(connect);
    }

    /// The control loop's turn: the next message that arrived, answers going to `out`.
    fn deliver(&mut self, out: &mut VecDeque<Control>) {
        let Some(msg) = self.inbox.pop_front() else {
            return;
        };
        let peer = self.peer();
        match msg {
            Control::Request { nonce, info } => match self.links.handle_request(peer, nonce) {
                OnRequest::Ignore => {}
                OnRequest::Resend(reply) => out.push_back(reply),
                OnRequest::Answer => {
                    let link = self.new_link();
                    link.connect_to(info.qpn);
                    match self.links.handle_answer_built(peer, nonce, link) {
                        Answered::Installed { retired, reply } => {
                            if let Some(old) = retired {
                                old.fail(REPLACED);
                            }
                            out.push_back(reply);
                        }
                        Answered::Superseded(link) => link.fail(SUPERSEDED),
                    }
                }
            },
            Control::Reply {
                request,
                nonce,
                info,
            } => match self.links.handle_reply(peer, request, nonce) {
                OnReply::Ignore => {}
                OnReply::Resend(ready) => out.push_back(ready),
                OnReply::Connect { link, ready } => {
                    link.connect_to(info.qpn);
                    self.links.handle_connected(peer, link.id());
                    out.push_back(ready);
                    link.set_remote_ready();
                }
            },
            Control::Ready { nonce } => {
                if let Some(link) = self.links.handle_ready(peer, nonce) {
                    link.set_remote_ready();
                }
            }
        }
    }

    fn done(&self) -> bool {
        self.connect.is_none() || self.result.is_some()
    }

    /// The links it made that were neither failed nor dropped.
    fn live(&self) -> Vec<&Fake> {
        self.made.iter().filter(|l| l.failure().is_none()).collect()
    }
}

/// Runs the socket handshake between A and B: `steps` picks who acts when (while both act),
/// with at most `drops` messages lost; then it runs to the end in order.
fn simulate(
    a_connects: bool,
    b_connects: bool,
    nonces: (u64, u64),
    steps: &[u8],
    mut drops: u32,
) -> (Node, Node) {
    let t0 = Instant::now();
    let mut now = t0;
    let mut a = Node::new(A, a_connects, t0, vec![nonces.0]);
    let mut b = Node::new(B, b_connects, t0, vec![nonces.1]);
    let turn = |a: &mut Node, b: &mut Node, choice: u8, now: &mut Instant, drops: &mut u32| {
        match choice % 7 {
            0 => a.poll(*now, &mut b.inbox),
            1 => b.poll(*now, &mut a.inbox),
            2 => a.deliver(&mut b.inbox),
            3 => b.deliver(&mut a.inbox),
            4 if *drops > 0 && !a.inbox.is_empty() => {
                *drops -= 1;
                a.inbox.pop_front();
            }
            5 if *drops > 0 && !b.inbox.is_empty() => {
                *drops -= 1;
                b.inbox.pop_front();
            }
            _ => {
                // Time passes to the next wake-up.
                if let Some(w) = [a.wake, b.wake].into_iter().flatten().min() {
                    *now = (*now).max(w);
                }
            }
        }
    };
    for &choice in steps {
        turn(&mut a, &mut b, choice, &mut now, &mut drops);
    }
    // Then every message arrives and every call runs to its end.
    for _ in 0..10_000 {
        if a.done() && b.done() && a.inbox.is_empty() && b.inbox.is_empty() {
            break;
        }
        for choice in [2, 3, 0, 1] {
            turn(&mut a, &mut b, choice, &mut now, &mut 0);
        }
        if a.inbox.is_empty() && b.inbox.is_empty() {
            turn(&mut a, &mut b, 6, &mut now, &mut 0);
        }
    }
    assert!(a.done() && b.done(), "the calls must end");
    (a, b)
}

/// Each side has exactly one live link, the peer's link in its table, connected to the
/// other side's, and ready; or both calls failed with a reason.
fn check_one_link_per_pair(a: &Node, b: &Node) -> Result<(), TestCaseError> {
    let results = [&a.result, &b.result];
    if results
        .iter()
        .all(|r| matches!(r, Some(Err(reason)) if !reason.is_empty()))
    {
        return Ok(());
    }
    for r in results.into_iter().flatten() {
        prop_assert!(r.is_ok(), "one side failed alone: {r:?}");
    }
    let (la, lb) = (a.live(), b.live());
    prop_assert_eq!(la.len(), 1, "A's live links");
    prop_assert_eq!(lb.len(), 1, "B's live links");
    let (la, lb) = (la[0], lb[0]);
    prop_assert_eq!(a.links.get(B).map(|s| s.link().id()), Some(la.id()));
    prop_assert_eq!(b.links.get(A).map(|s| s.link().id()), Some(lb.id()));
    prop_assert_eq!(la.connected_to(), Some(lb.qpn()));
    prop_assert_eq!(lb.connected_to(), Some(la.qpn()));
    prop_assert!(la.is_ready() && lb.is_ready());
    prop_assert!(a.links.get(B).is_some_and(|s| s.announced()));
    prop_assert!(b.links.get(A).is_some_and(|s| s.announced()));
    Ok(())
}

proptest! {
    #[test]
    fn crossing_connects_end_with_one_link_per_pair(
        na: u64,
        nb: u64,
        steps in proptest::collection::vec(any::<u8>(), 0..60),
        drops in 0u32..4,
    ) {
        prop_assume!(na != nb);
        let (a, b) = simulate(true, true, (na, nb), &steps, drops);
        prop_assert!(matches!(a.result, Some(Ok(()))), "A: {:?}", a.result);
        prop_assert!(matches!(b.result, Some(Ok(()))), "B: {:?}", b.result);
        check_one_link_per_pair(&a, &b)?;
    }

    #[test]
    fn one_sided_connects_end_with_one_link_per_pair(
        na: u64,
        nb: u64,
        steps in proptest::collection::vec(any::<u8>(), 0..40),
    ) {
        // Without a `connect` of its own the responder repeats nothing, so nothing is lost
        // here (over TCP, messages are lost only with a connection a crossing connect
        // closed).
        let (a, b) = simulate(true, false, (na, nb), &steps, 0);
        prop_assert!(matches!(a.result, Some(Ok(()))), "A: {:?}", a.result);
        check_one_link_per_pair(&a, &b)?;
    }
}

#[test]
fn equal_nonces_fail_on_both_sides_with_a_reason() {
    // Both sides answer each other and wait for confirmations that never match: the
    // deadline ends both calls (with 64-bit random nonces this does not happen).
    let (a, b) = simulate(true, true, (7, 7), &[0, 1, 2, 3], 0);
    for node in [&a, &b] {
        assert_eq!(
            node.result,
            Some(Err("RDMA queue-pair handshake timed out after 10s".into()))
        );
    }
}
