//! rdma_cm's decisions without a device: admission and refusals, the accept, events, and two
//! nodes connecting through rdma_cm in any order, crossing requests and a control connection
//! that comes late included.

use std::collections::VecDeque;
use std::time::Instant;

use proptest::prelude::*;
use psnet_transport::NodeId;

use super::socket_pair::{check_one_link_per_pair, Node};
use super::{Fake, A, B};
use crate::control::{CmMessage, Refusal};
use crate::error::VerbsError;
use crate::proto::handshake::connect::{Poll, Step};
use crate::proto::handshake::rdma_cm::{
    admit_hello, check_route, handle_rejected, hello, on_event, target, CmAnswered, Hello, OnEvent,
    OnHello, OnWelcome,
};
use crate::proto::handshake::{LinkHandle, Links, REPLACED, SUPERSEDED};
use crate::rdmacm::kind;

fn hello_bytes(from: NodeId, nonce: u64) -> Vec<u8> {
    CmMessage::Hello {
        from: from.0,
        nonce,
        recv_depth: 16,
        slot_size: 4096,
    }
    .encode()
}

#[test]
fn admission_checks_come_first_in_order() {
    // Not psnet's: refused before anything else is looked at.
    let asked = std::cell::Cell::new(false);
    let seen = |_| {
        asked.set(true);
        true
    };
    assert_eq!(admit_hello(b"nonsense", seen), Err(Refusal::Malformed));
    assert!(!asked.get());
    assert_eq!(
        admit_hello(&hello_bytes(B, 5), |_| false),
        Err(Refusal::NoControlConnection)
    );
    let hello = admit_hello(&hello_bytes(B, 5), |peer| peer == B).expect("admitted");
    assert_eq!(
        hello,
        Hello {
            peer: B,
            nonce: 5,
            recv_depth: 16,
            slot_size: 4096
        }
    );

    // Crossing requests: ours (nonce 10) wins over a smaller nonce only.
    let mut links = Links::<Fake>::new();
    assert_eq!(links.handle_hello(hello), OnHello::Answer(hello));
    let mut connect = crate::proto::handshake::connect::Connect::new(
        B,
        super::addr(),
        Instant::now(),
        std::time::Duration::from_secs(5),
        true,
        false,
    );
    connect.poll(&mut links, Instant::now(), |_| false, || true);
    connect.handle_new_link(&mut links, Fake::new(1, 101, 10));
    assert_eq!(links.handle_hello(hello), OnHello::Refuse(Refusal::Crossed));
    let larger = Hello { nonce: 11, ..hello };
    assert_eq!(links.handle_hello(larger), OnHello::Answer(larger));

    // The answer replaces our request and carries our buffers.
    let answer = Fake::new(2, 102, 77);
    let CmAnswered::Accept { retired, welcome } =
        links.handle_cm_answer_built(B, 11, answer, 32, 8192)
    else {
        panic!("the answer must be installed");
    };
    assert_eq!(retired.map(|l| l.id()), Some(1));
    assert_eq!(
        welcome,
        CmMessage::Welcome {
            nonce: 77,
            recv_depth: 32,
            slot_size: 8192
        }
    );
    assert!(links.get(B).is_some_and(|s| s.via_cm() && s.announced()));
    // A connected link wins over any later request.
    assert_eq!(
        links.handle_hello(larger),
        OnHello::Refuse(Refusal::Crossed)
    );
    assert!(matches!(
        links.handle_cm_answer_built(B, 12, Fake::new(3, 103, 78), 32, 8192),
        CmAnswered::Refuse { link, why: Refusal::Crossed } if link.id() == 3
    ));
}

#[test]
fn a_welcome_connects_only_the_current_request() {
    let mut links = Links::<Fake>::new();
    let welcome = CmMessage::Welcome {
        nonce: 9,
        recv_depth: 16,
        slot_size: 4096,
    }
    .encode();
    let err = links
        .handle_welcome(B, 1, b"PS\x01\x03\x01")
        .expect_err("a refusal is no welcome");
    assert_eq!(
        err.to_string(),
        "the peer accepted the RDMA connection without psnet's reply"
    );
    assert_eq!(links.handle_welcome(B, 1, &welcome), Ok(OnWelcome::LetGo));
    let mut connect = crate::proto::handshake::connect::Connect::new(
        B,
        super::addr(),
        Instant::now(),
        std::time::Duration::from_secs(5),
        true,
        false,
    );
    connect.poll(&mut links, Instant::now(), |_| false, || true);
    connect.handle_new_link(&mut links, Fake::new(1, 101, 10));
    assert_eq!(
        links.handle_welcome(B, 1, &welcome),
        Ok(OnWelcome::Connect {
            recv_depth: 16,
            slot_size: 4096,
            nonce: 9,
        })
    );
    assert_eq!(links.handle_welcome(B, 2, &welcome), Ok(OnWelcome::LetGo));
    links.handle_connected(B, 1);
    assert_eq!(links.handle_welcome(B, 1, &welcome), Ok(OnWelcome::LetGo));
}

#[test]
fn refusals_for_now_are_retried_and_the_others_say_why() {
    let refused = |why: Refusal| CmMessage::Refused(why).encode();
    for why in [Refusal::Crossed, Refusal::NoControlConnection] {
        assert_eq!(
            handle_rejected(B, "10.0.0.2:9000", &refused(why), 28),
            Ok(())
        );
    }
    let err = handle_rejected(B, "10.0.0.2:9000", &refused(Refusal::CannotConnect), 28)
        .expect_err("final");
    assert_eq!(
        err,
        VerbsError::Refused {
            target: "10.0.0.2:9000".into(),
            refusal: Some(Refusal::CannotConnect),
            status: 28
        }
    );
    assert!(err.to_string().contains("PSNET_RDMA_EAGER"));
    // Nobody listening through rdma_cm: no private data of psnet's.
    let err = handle_rejected(B, "10.0.0.2:9000", &[], 8).expect_err("final");
    assert_eq!(
        err,
        VerbsError::Refused {
            target: "10.0.0.2:9000".into(),
            refusal: None,
            status: 8
        }
    );
}

#[test]
fn events_map_to_steps() {
    let t = "10.0.0.2:9000";
    assert_eq!(
        on_event(kind::ADDR_RESOLVED, 0, true, t),
        OnEvent::ResolveRoute
    );
    assert_eq!(
        on_event(kind::ROUTE_RESOLVED, 0, true, t),
        OnEvent::SendHello
    );
    assert_eq!(
        on_event(kind::CONNECT_RESPONSE, 0, true, t),
        OnEvent::Welcome
    );
    assert_eq!(on_event(kind::REJECTED, 8, true, t), OnEvent::Rejected);
    // Only the passive side waits for the connection to come up.
    assert_eq!(on_event(kind::ESTABLISHED, 0, false, t), OnEvent::PeerReady);
    assert_eq!(on_event(kind::ESTABLISHED, 0, true, t), OnEvent::Ignore);
    assert_eq!(
        on_event(kind::DISCONNECTED, 0, false, "node 2"),
        OnEvent::Disconnected("node 2 disconnected (RDMA_CM_EVENT_DISCONNECTED)".into())
    );
    for (event, name) in [
        (kind::ADDR_ERROR, "RDMA_CM_EVENT_ADDR_ERROR"),
        (kind::ROUTE_ERROR, "RDMA_CM_EVENT_ROUTE_ERROR"),
        (kind::CONNECT_ERROR, "RDMA_CM_EVENT_CONNECT_ERROR"),
        (kind::UNREACHABLE, "RDMA_CM_EVENT_UNREACHABLE"),
        (kind::DEVICE_REMOVAL, "RDMA_CM_EVENT_DEVICE_REMOVAL"),
    ] {
        let OnEvent::Fail(e) = on_event(event, -110, true, t) else {
            panic!("{name} fails the link");
        };
        assert_eq!(e.raw_os_error(), Some(110));
        assert!(matches!(e, VerbsError::Os { op, .. } if op == name));
        assert!(
            e.to_string()
                .starts_with(&format!("rdma_cm: {name} for {t}: ")),
            "{e}"
        );
    }
    for event in [kind::ADDR_CHANGE, kind::TIMEWAIT_EXIT, 99] {
        assert_eq!(on_event(event, 0, true, t), OnEvent::Ignore);
    }
}

#[test]
fn the_request_names_us_and_the_route_must_be_ours() {
    let link = Fake::new(1, 101, 10);
    assert_eq!(
        hello(A, &link, 16, 4096),
        CmMessage::Hello {
            from: 1,
            nonce: 10,
            recv_depth: 16,
            slot_size: 4096
        }
    );
    assert_eq!(target(Some(super::addr()), B), "10.0.0.2:9000");
    assert_eq!(target(None, B), B.to_string());
    assert_eq!(check_route("t", None, ("rxe0", 1)), Ok(()));
    assert_eq!(check_route("t", Some(("rxe0", 1)), ("rxe0", 1)), Ok(()));
    assert_eq!(
        check_route("10.0.0.2:9000", Some(("mlx5_1", 1)), ("rxe0", 1))
            .expect_err("another device")
            .to_string(),
        "rdma_cm cannot connect to 10.0.0.2:9000: rdma_cm routes to it through mlx5_1 port 1, \
         but this transport runs on rxe0 port 1 (check DMLC_INTERFACE and PSNET_IB_DEVICE)"
    );
}

/// What travels between the simulated nodes' rdma_cm ids.
#[derive(Clone, Debug)]
enum Wire {
    /// A connect request from link `from` (queue pair `qpn`).
    Req { from: u32, qpn: u32, data: Vec<u8> },
    /// The accept of request `to`, by link `from` (queue pair `qpn`).
    Rep {
        to: u32,
        from: u32,
        qpn: u32,
        data: Vec<u8>,
    },
    /// The reject of request `to`.
    Rej { to: u32, data: Vec<u8> },
    /// The exchange completed (RTU) for accepted link `to`.
    Rtu { to: u32 },
}

/// A simulated node's rdma_cm side: its ids (active: requests under way; passive: accepted
/// links) and what arrived for them. It does what the transport's rdma_cm driver does.
struct CmNode {
    node: Node,
    active: Vec<u32>,
    passive: Vec<u32>,
    control_seen: bool,
    inbox: VecDeque<Wire>,
}

impl CmNode {
    fn drop_cm(&mut self, link: u32) {
        self.active.retain(|&l| l != link);
        self.passive.retain(|&l| l != link);
    }

    /// A link failed (fail_link and the control loop's removal).
    fn fail(&mut self, link: &Fake, reason: String) {
        link.fail(&reason);
        let peer = self.node.peer();
        self.node.links.remove(peer, Some(link.id()));
        self.drop_cm(link.id());
    }

    fn poll(&mut self, now: Instant, out: &mut VecDeque<Wire>) {
        let Some(mut connect) = self.node.connect.take() else {
            return;
        };
        if self.node.result.is_none() && self.node.wake.is_some_and(|w| now >= w) {
            if let Some(reason) = connect.handle_timeout(now) {
                self.node.result = Some(Err(reason));
            }
        }
        if self.node.result.is_none() {
            let active = self.active.clone();
            let polled = connect.poll(&mut self.node.links, now, |l| active.contains(&l), || true);
            let step = match polled {
                Poll::Step(step) => step,
                Poll::NewLink => {
                    let link = self.node.new_link();
                    connect.handle_new_link(&mut self.node.links, link)
                }
            };
            self.node.wake = None;
            match step {
                Step::Done => self.node.result = Some(Ok(())),
                Step::Fail(reason) => self.node.result = Some(Err(reason)),
                // Address and route resolve at once here.
                Step::StartCm(link) => {
                    self.active.push(link.id());
                    out.push_back(Wire::Req {
                        from: link.id(),
                        qpn: link.qpn(),
                        data: hello(self.node.id, &link, 16, 4096).encode(),
                    });
                }
                Step::Send { .. } => unreachable!("no fall-back here"),
                Step::Wait(until) => self.node.wake = Some(until),
            }
        }
        self.node.connect = Some(connect);
    }

    fn deliver(&mut self, out: &mut VecDeque<Wire>) {
        let Some(wire) = self.inbox.pop_front() else {
            return;
        };
        let peer = self.node.peer();
        match wire {
            Wire::Req { from, qpn, data } => {
                let seen = self.control_seen;
                let step = match admit_hello(&data, |_| seen) {
                    Ok(hello) => self.node.links.handle_hello(hello),
                    Err(why) => OnHello::Refuse(why),
                };
                let reject = |why: Refusal| Wire::Rej {
                    to: from,
                    data: CmMessage::Refused(why).encode(),
                };
                let hello = match step {
                    OnHello::Refuse(why) => return out.push_back(reject(why)),
                    OnHello::Answer(hello) => hello,
                };
                let link = self.node.new_link();
                link.connect_to(qpn);
                match self.node.links.handle_cm_answer_built(
                    hello.peer,
                    hello.nonce,
                    link.clone(),
                    16,
                    4096,
                ) {
                    CmAnswered::Accept { retired, welcome } => {
                        if let Some(old) = retired {
                            old.fail(REPLACED);
                            self.drop_cm(old.id());
                        }
                        self.passive.push(link.id());
                        out.push_back(Wire::Rep {
                            to: from,
                            from: link.id(),
                            qpn: link.qpn(),
                            data: welcome.encode(),
                        });
                    }
                    CmAnswered::Refuse { link, why } => {
                        link.fail(SUPERSEDED);
                        out.push_back(reject(why));
                    }
                }
            }
            // Events for ids dropped meanwhile are not seen.
            Wire::Rep { to, .. } | Wire::Rej { to, .. } if !self.active.contains(&to) => {}
            Wire::Rep {
                to,
                from,
                qpn,
                data,
            } => {
                let link = self.node.made[to as usize - 1].clone();
                match self.node.links.handle_welcome(peer, to, &data) {
                    Err(e) => self.fail(&link, e.to_string()),
                    Ok(OnWelcome::LetGo) => self.drop_cm(to),
                    Ok(OnWelcome::Connect { .. }) => {
                        link.connect_to(qpn);
                        out.push_back(Wire::Rtu { to: from });
                        self.node.links.handle_connected(peer, to);
                        link.set_remote_ready();
                    }
                }
            }
            Wire::Rej { to, data } => {
                let link = self.node.made[to as usize - 1].clone();
                match handle_rejected(peer, "peer", &data, 28) {
                    Ok(()) => self.active.retain(|&l| l != to),
                    Err(e) => self.fail(&link, e.to_string()),
                }
            }
            Wire::Rtu { to } => {
                if self.passive.contains(&to) {
                    if let OnEvent::PeerReady = on_event(kind::ESTABLISHED, 0, false, "peer") {
                        self.node.made[to as usize - 1].set_remote_ready();
                    }
                }
            }
        }
    }
}

/// Runs rdma_cm connects between A and B, `steps` picking who acts when; B's control
/// connection from A is seen only after `late_control` steps.
fn simulate(
    b_connects: bool,
    nonces: (u64, u64),
    steps: &[u8],
    late_control: usize,
) -> (CmNode, CmNode) {
    let t0 = Instant::now();
    let mut now = t0;
    let node = |id, connects, nonce| CmNode {
        node: Node::new(id, connects, true, t0, vec![nonce]),
        active: Vec::new(),
        passive: Vec::new(),
        control_seen: true,
        inbox: VecDeque::new(),
    };
    let mut a = node(A, true, nonces.0);
    let mut b = node(B, b_connects, nonces.1);
    b.control_seen = late_control == 0;
    let turn = |a: &mut CmNode, b: &mut CmNode, choice: u8, now: &mut Instant| match choice % 5 {
        0 => a.poll(*now, &mut b.inbox),
        1 => b.poll(*now, &mut a.inbox),
        2 => a.deliver(&mut b.inbox),
        3 => b.deliver(&mut a.inbox),
        _ => {
            if let Some(w) = [a.node.wake, b.node.wake].into_iter().flatten().min() {
                *now = (*now).max(w);
            }
        }
    };
    for (i, &choice) in steps.iter().enumerate() {
        if i == late_control {
            b.control_seen = true;
        }
        turn(&mut a, &mut b, choice, &mut now);
    }
    b.control_seen = true;
    for _ in 0..10_000 {
        if a.node.done() && b.node.done() && a.inbox.is_empty() && b.inbox.is_empty() {
            break;
        }
        for choice in [2, 3, 0, 1] {
            turn(&mut a, &mut b, choice, &mut now);
        }
        if a.inbox.is_empty() && b.inbox.is_empty() {
            turn(&mut a, &mut b, 4, &mut now);
        }
    }
    assert!(a.node.done() && b.node.done(), "the calls must end");
    (a, b)
}

proptest! {
    #[test]
    fn rdma_cm_connects_end_with_one_link_per_pair(
        na: u64,
        nb: u64,
        b_connects: bool,
        steps in proptest::collection::vec(any::<u8>(), 0..60),
        late_control in 0usize..20,
    ) {
        prop_assume!(na != nb);
        let (a, b) = simulate(b_connects, (na, nb), &steps, late_control);
        prop_assert!(matches!(a.node.result, Some(Ok(()))), "A: {:?}", a.node.result);
        if b_connects {
            prop_assert!(matches!(b.node.result, Some(Ok(()))), "B: {:?}", b.node.result);
        }
        check_one_link_per_pair(&a.node, &b.node)?;
    }
}
