use super::*;
use crate::proto::ids::{node_id, provisional_id};
use psnet_transport::PublicIdentity;

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn drain(s: &mut SchedulerState) -> Vec<(NodeId, Msg)> {
    std::iter::from_fn(|| s.poll_transmit()).collect()
}

/// A scheduler with 2 servers and 2 workers registered out of port order.
fn assigned(now: Instant) -> SchedulerState {
    let mut s = SchedulerState::new(2, 2, addr(9000), Some(Duration::from_secs(10)), own());
    for (role, port) in [
        (Role::Worker, 9300),
        (Role::Server, 9200),
        (Role::Worker, 9100),
        (Role::Server, 9050),
    ] {
        s.register(provisional_id(addr(port)), role, addr(port), None, now);
    }
    drain(&mut s);
    s
}

fn out_id(m: &Msg) -> NodeId {
    match m {
        Msg::Assign { your_id, .. } => *your_id,
        other => panic!("{other:?}"),
    }
}

/// The scheduler's public identity in these tests.
fn own() -> PublicIdentity {
    PublicIdentity([0xee; psnet_transport::IDENTITY_LEN])
}

/// The public identity the node listening at `addr` registers in these tests: distinct per
/// node.
fn identity_of(addr: SocketAddr) -> PublicIdentity {
    let mut t = [0u8; psnet_transport::IDENTITY_LEN];
    t[..2].copy_from_slice(&addr.port().to_le_bytes());
    PublicIdentity(t)
}

/// Registrations as the tests spell them: each node registers [`identity_of`] its address.
trait Registers {
    fn register(
        &mut self,
        from: NodeId,
        role: Role,
        addr: SocketAddr,
        rank_hint: Option<u32>,
        now: Instant,
    );
    fn register_proving(
        &mut self,
        from: NodeId,
        role: Role,
        addr: SocketAddr,
        rank_hint: Option<u32>,
        recovery: Option<[u8; CREDENTIAL_LEN]>,
        now: Instant,
    );
}

impl Registers for SchedulerState {
    fn register(
        &mut self,
        from: NodeId,
        role: Role,
        addr: SocketAddr,
        rank_hint: Option<u32>,
        now: Instant,
    ) {
        self.register_proving(from, role, addr, rank_hint, None, now);
    }

    fn register_proving(
        &mut self,
        from: NodeId,
        role: Role,
        addr: SocketAddr,
        rank_hint: Option<u32>,
        recovery: Option<[u8; CREDENTIAL_LEN]>,
        now: Instant,
    ) {
        let reg = Registration {
            role,
            addr,
            rank_hint,
            recovery,
            identity: identity_of(addr),
        };
        SchedulerState::handle_register(self, from, reg, now);
    }
}

#[test]
fn ranks_follow_address_order_not_registration_order() {
    let now = Instant::now();
    let mut s = SchedulerState::new(2, 2, addr(9000), None, own());
    let regs = [
        (Role::Worker, 9300),
        (Role::Server, 9200),
        (Role::Worker, 9100),
    ];
    for (role, port) in regs {
        s.register(provisional_id(addr(port)), role, addr(port), None, now);
        assert!(
            drain(&mut s).is_empty(),
            "assigned before everyone registered"
        );
    }
    s.register(
        provisional_id(addr(9050)),
        Role::Server,
        addr(9050),
        None,
        now,
    );
    let out = drain(&mut s);
    assert_eq!(out.len(), 4);
    let assigned: std::collections::HashMap<NodeId, NodeId> = out
        .iter()
        .map(|(to, m)| match m {
            Msg::Assign { your_id, nodes } => {
                assert_eq!(nodes.len(), 5, "everyone, scheduler included");
                (*to, *your_id)
            }
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        assigned[&provisional_id(addr(9050))],
        node_id(Role::Server, 0)
    );
    assert_eq!(
        assigned[&provisional_id(addr(9200))],
        node_id(Role::Server, 1)
    );
    assert_eq!(
        assigned[&provisional_id(addr(9100))],
        node_id(Role::Worker, 0)
    );
    assert_eq!(
        assigned[&provisional_id(addr(9300))],
        node_id(Role::Worker, 1)
    );
}

#[test]
fn extra_nodes_are_refused_with_the_reason() {
    let now = Instant::now();
    let mut s = SchedulerState::new(1, 1, addr(9000), None, own());
    s.register(provisional_id(addr(1)), Role::Worker, addr(1), None, now);
    s.register(provisional_id(addr(2)), Role::Worker, addr(2), None, now);
    match drain(&mut s).as_slice() {
        [(to, Msg::NodeFailed { reason, .. })] => {
            assert_eq!(*to, provisional_id(addr(2)));
            assert!(reason.contains("DMLC_NUM_WORKER=1"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn barrier_releases_when_the_group_is_in() {
    let now = Instant::now();
    let mut s = assigned(now);
    let (w0, w1) = (node_id(Role::Worker, 0), node_id(Role::Worker, 1));
    s.handle_barrier(w0, Group::WORKERS, now);
    assert!(drain(&mut s).is_empty());
    s.handle_barrier(w1, Group::WORKERS, now);
    let out = drain(&mut s);
    assert_eq!(out.len(), 2);
    assert!(out.iter().all(|(_, m)| *m
        == Msg::BarrierDone {
            group: Group::WORKERS
        }));

    // The all-group barrier counts the scheduler as present.
    for id in [w0, w1, node_id(Role::Server, 0), node_id(Role::Server, 1)] {
        s.handle_barrier(id, Group::ALL, now);
    }
    assert_eq!(drain(&mut s).len(), 4);
}

#[test]
fn a_dead_member_fails_the_barrier_and_everyone_hears() {
    let now = Instant::now();
    let mut s = assigned(now);
    let (w0, w1) = (node_id(Role::Worker, 0), node_id(Role::Worker, 1));
    s.handle_barrier(w0, Group::WORKERS, now);
    s.handle_lost(w1, "connection closed by the peer");
    let out = drain(&mut s);
    let failed: Vec<_> = out
        .iter()
        .filter(|(_, m)| matches!(m, Msg::BarrierFailed { .. }))
        .collect();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].0, w0);
    let notified = out
        .iter()
        .filter(|(_, m)| matches!(m, Msg::NodeFailed { id, .. } if *id == w1))
        .count();
    assert_eq!(notified, 3, "the three live nodes hear of it");
    if let Msg::BarrierFailed { reason, .. } = &failed[0].1 {
        assert!(reason.contains("worker 1 (node 11)"), "{reason}");
    }
    // A later barrier fails at once.
    s.handle_barrier(w0, Group::WORKERS, now);
    assert!(matches!(
        drain(&mut s).as_slice(),
        [(_, Msg::BarrierFailed { .. })]
    ));
}

#[test]
fn silence_past_the_heartbeat_timeout_is_death() {
    let t0 = Instant::now();
    let mut s = assigned(t0);
    let later = t0 + Duration::from_secs(8);
    for id in [
        node_id(Role::Worker, 0),
        node_id(Role::Server, 0),
        node_id(Role::Server, 1),
    ] {
        s.handle_alive(id, later);
    }
    s.handle_timeout(t0 + Duration::from_secs(9));
    assert!(s.dead().is_empty());
    s.handle_timeout(t0 + Duration::from_secs(11));
    let dead: Vec<NodeId> = s.dead().keys().copied().collect();
    assert_eq!(dead, vec![node_id(Role::Worker, 1)]);
    assert!(s.dead()[&node_id(Role::Worker, 1)].contains("no heartbeat"));
}

#[test]
fn shutdown_when_every_worker_finalized_or_died() {
    let now = Instant::now();
    let mut s = assigned(now);
    s.handle_finalize(node_id(Role::Worker, 0), now);
    assert!(!s.is_finished());
    assert!(drain(&mut s).is_empty());
    s.handle_lost(node_id(Role::Worker, 1), "killed");
    assert!(s.is_finished());
    let shutdowns = drain(&mut s)
        .into_iter()
        .filter(|(_, m)| *m == Msg::Shutdown)
        .count();
    assert_eq!(shutdowns, 3, "servers and the finalized worker");
    // Losses during shutdown are expected.
    s.handle_lost(node_id(Role::Server, 0), "closed");
    assert_eq!(s.dead().len(), 1);
}

#[test]
fn tables_carry_only_the_commitments_nodes_registered_and_heartbeats_are_answered() {
    let now = Instant::now();
    let mut s = SchedulerState::new(1, 1, addr(9000), None, own());
    s.register(
        provisional_id(addr(9100)),
        Role::Server,
        addr(9100),
        None,
        now,
    );
    s.register(
        provisional_id(addr(9200)),
        Role::Worker,
        addr(9200),
        None,
        now,
    );
    let out = drain(&mut s);
    assert_eq!(out.len(), 2);
    assert_ne!(out_id(&out[0].1), out_id(&out[1].1));
    for (_, msg) in &out {
        let Msg::Assign { nodes, .. } = msg else {
            panic!("{out:?}")
        };
        // Every entry is the public identity the node registered (the scheduler's own
        // first): a table carries nothing that proves an id (see `admission`).
        let identities: Vec<PublicIdentity> = nodes.iter().map(|n| n.identity).collect();
        assert_eq!(
            identities,
            vec![own(), identity_of(addr(9100)), identity_of(addr(9200))]
        );
    }
    let w0 = node_id(Role::Worker, 0);
    s.handle_heartbeat(w0, now);
    assert!(matches!(drain(&mut s)[..], [(to, Msg::Heartbeat)] if to == w0));
    // Nobody the job assigned: not answered.
    s.handle_heartbeat(NodeId(99), now);
    assert!(drain(&mut s).is_empty());
}

#[test]
fn a_scheduler_that_was_stopped_does_not_declare_the_job_dead() {
    let t0 = Instant::now();
    let mut s = assigned(t0);
    s.handle_timeout(t0 + Duration::from_secs(1));
    // Stopped for a minute (SIGSTOP): the silence is the scheduler's own.
    s.handle_timeout(t0 + Duration::from_secs(61));
    assert!(s.dead().is_empty(), "{:?}", s.dead());
    assert!(drain(&mut s).is_empty());
    // Running again, nodes that stay silent past the timeout are declared dead.
    let mut t = t0 + Duration::from_secs(61);
    for _ in 0..11 {
        t += Duration::from_secs(1);
        s.handle_timeout(t);
    }
    assert_eq!(s.dead().len(), 4);
}

#[test]
fn only_registered_workers_finalize_and_only_members_enter_barriers() {
    let now = Instant::now();
    let mut s = assigned(now);
    // A server, an unknown id and a provisional id cannot end the job for the workers.
    for id in [
        node_id(Role::Server, 0),
        NodeId(99),
        provisional_id(addr(9999)),
    ] {
        s.handle_finalize(id, now);
    }
    s.handle_finalize(node_id(Role::Worker, 0), now);
    assert!(!s.is_finished());
    s.handle_barrier(NodeId(99), Group::ALL, now);
    assert!(drain(&mut s).is_empty(), "a stranger's barrier is ignored");
    s.handle_finalize(node_id(Role::Worker, 1), now);
    assert!(s.is_finished());
}

/// The worker ranks assigned when three workers at ports 9100, 9200, 9300 wish `hints`.
fn worker_ranks(hints: [Option<u32>; 3]) -> Vec<(u16, u32)> {
    let now = Instant::now();
    let mut s = SchedulerState::new(1, 3, addr(9000), None, own());
    s.register(
        provisional_id(addr(9050)),
        Role::Server,
        addr(9050),
        Some(5),
        now,
    );
    for (port, hint) in [9100, 9200, 9300].into_iter().zip(hints) {
        s.register(
            provisional_id(addr(port)),
            Role::Worker,
            addr(port),
            hint,
            now,
        );
    }
    let Some((_, Msg::Assign { nodes, .. })) = drain(&mut s).into_iter().next() else {
        panic!("no assignment");
    };
    let mut ranks: Vec<(u16, u32)> = nodes
        .iter()
        .filter(|n| n.role == Role::Worker)
        .map(|n| (n.addr.port(), n.rank))
        .collect();
    ranks.sort_unstable();
    assert!(
        nodes.iter().any(|n| n.role == Role::Server && n.rank == 0),
        "a lone server's out-of-range wish is not granted"
    );
    ranks
}

#[test]
fn wished_ranks_are_granted_only_as_a_whole_permutation() {
    // Every worker wishes a different rank in range: granted.
    assert_eq!(
        worker_ranks([Some(2), Some(0), Some(1)]),
        [(9100, 2), (9200, 0), (9300, 1)]
    );
    // Anything else: ps-lite's address order.
    let by_address = [(9100, 0), (9200, 1), (9300, 2)];
    assert_eq!(
        worker_ranks([Some(1), Some(1), Some(0)]),
        by_address,
        "a duplicate"
    );
    assert_eq!(
        worker_ranks([Some(2), Some(0), Some(3)]),
        by_address,
        "out of range"
    );
    assert_eq!(
        worker_ranks([Some(2), None, Some(1)]),
        by_address,
        "one without"
    );
    assert_eq!(worker_ranks([None, None, None]), by_address);
}

#[test]
fn a_worker_that_left_over_a_lost_server_is_reported_with_that_cause() {
    let now = Instant::now();
    let mut s = assigned(now);
    let (w0, server) = (node_id(Role::Worker, 0), node_id(Role::Server, 0));
    // The worker's word arrives before its connection's end; the server's end comes later.
    s.handle_leaving(
        w0,
        format!("{} is gone: closed by the peer", describe(server)),
    );
    s.handle_lost(w0, "closed by the peer");
    let told = drain(&mut s);
    let reason = told
        .iter()
        .find_map(|(_, m)| match m {
            Msg::NodeFailed { id, reason } if *id == w0 => Some(reason.clone()),
            _ => None,
        })
        .expect("the others hear of the worker");
    assert_eq!(
        reason,
        "it left: server 0 (node 8) is gone: closed by the peer"
    );
    assert_eq!(s.dead()[&w0], reason);
    // A stranger's word is not taken.
    s.handle_leaving(NodeId(99), "forged".into());
    s.handle_lost(NodeId(99), "closed");
    assert!(!s.dead().contains_key(&NodeId(99)));
}

#[test]
fn a_member_registering_again_is_refused_by_name_and_nothing_changes() {
    let now = Instant::now();
    let mut s = assigned(now);
    let w1 = node_id(Role::Worker, 1);
    for role in [Role::Worker, Role::Server, Role::Scheduler] {
        s.register(w1, role, addr(9999), Some(0), now);
        match drain(&mut s).as_slice() {
            [(to, Msg::NodeFailed { id, reason })] => {
                assert_eq!((*to, *id), (w1, w1));
                assert!(
                    reason.contains("worker 1 (node 11) is already registered"),
                    "{reason}"
                );
            }
            other => panic!("answered {other:?}"),
        }
    }
    // Nobody was declared dead, and the job ends as usual.
    assert!(s.dead().is_empty());
    s.handle_finalize(node_id(Role::Worker, 0), now);
    s.handle_finalize(w1, now);
    assert!(s.is_finished());
}

#[test]
fn unreadable_messages_are_answered_never_dropped_silently() {
    let now = Instant::now();
    let mut s = SchedulerState::new(1, 1, addr(9000), None, own());
    let prov = provisional_id(addr(9100));
    s.handle_malformed(prov, "kv protocol version 3, this build speaks 2");
    match drain(&mut s).as_slice() {
        [(to, Msg::NodeFailed { id, reason })] => {
            assert_eq!((*to, *id), (prov, prov));
            assert!(reason.contains("could not read the registration: kv protocol version 3"));
        }
        other => panic!("answered {other:?}"),
    }
    let mut s = assigned(now);
    let w0 = node_id(Role::Worker, 0);
    s.handle_malformed(w0, "invalid kv message: bad group");
    assert_eq!(
        drain(&mut s),
        vec![(
            w0,
            Msg::Failed {
                ts: NO_REQUEST,
                reason: "the scheduler could not read a message of this node: invalid kv \
                         message: bad group"
                    .into()
            }
        )]
    );
    // Nothing changed: nobody is dead, the job goes on.
    assert!(s.dead().is_empty());
    assert!(!s.is_finished());
}

#[test]
fn a_lost_server_rank_is_held_and_a_restarted_server_takes_it_back() {
    let t0 = Instant::now();
    let mut s = assigned(t0).with_recovery(Some(Duration::from_secs(30)));
    let s1 = node_id(Role::Server, 1);
    let credential = crate::proto::recovery::fresh();
    s.handle_recovery_key(s1, crate::proto::recovery::commitment(&credential));
    assert!(!s.takes_registrations());
    s.handle_lost(s1, "killed");
    assert!(
        drain(&mut s).is_empty(),
        "nobody is told while the rank is held"
    );
    assert_eq!(s.recovering(), vec![s1]);
    assert!(s.takes_registrations());
    // Its heartbeats stop (the others' go on), which is no second loss.
    for id in [0, 1]
        .map(|r| node_id(Role::Worker, r))
        .into_iter()
        .chain([node_id(Role::Server, 0)])
    {
        s.handle_alive(id, t0 + Duration::from_secs(15));
    }
    s.handle_timeout(t0 + Duration::from_secs(20));
    assert!(drain(&mut s).is_empty());
    // A server wishing another rank, one wishing none: refused and taken, in turn.
    let (a, b) = (addr(9400), addr(9500));
    s.register(provisional_id(a), Role::Server, a, Some(0), t0);
    let out = drain(&mut s);
    assert!(
        matches!(&out[..], [(to, Msg::NodeFailed { reason, .. })]
            if *to == provisional_id(a) && reason.contains("server 0") && reason.contains("not lost")),
        "{out:?}"
    );
    // Without the lost server's credential, or with another, a server is refused.
    for shown in [None, Some(crate::proto::recovery::fresh())] {
        s.register_proving(provisional_id(b), Role::Server, b, None, shown, t0);
        let out = drain(&mut s);
        assert!(
            matches!(&out[..], [(to, Msg::NodeFailed { reason, .. })]
                if *to == provisional_id(b) && reason.contains("recovery credential")),
            "{out:?}"
        );
    }
    s.register_proving(
        provisional_id(b),
        Role::Server,
        b,
        None,
        Some(credential),
        t0,
    );
    let out = drain(&mut s);
    let [(to, Msg::Reassign { your_id, nodes })] = &out[..] else {
        panic!("{out:?}");
    };
    assert_eq!((*to, *your_id), (provisional_id(b), s1));
    let info = nodes.iter().find(|n| n.id == s1).unwrap().clone();
    assert_eq!(info.addr, b, "the new address");
    assert!(!s.takes_registrations());
    // Announced to the workers (only) once it connects under its id.
    s.handle_alive(s1, t0);
    let out = drain(&mut s);
    let told: Vec<NodeId> = out.iter().map(|(to, _)| *to).collect();
    assert_eq!(
        told,
        vec![node_id(Role::Worker, 0), node_id(Role::Worker, 1)]
    );
    // The workers learn the public identity it registered (see `admission`).
    assert_eq!(info.identity, identity_of(b));
    let announced = info.clone();
    assert!(out
        .iter()
        .all(|(_, m)| matches!(m, Msg::Rejoined { node } if *node == announced)));
    // A member again: a second registration is refused; its silence counts again.
    s.register(provisional_id(a), Role::Server, a, None, t0);
    assert!(
        matches!(&drain(&mut s)[..], [(_, Msg::NodeFailed { reason, .. })] if reason.contains("none is lost"))
    );
    assert!(s.dead().is_empty());
}

#[test]
fn a_lost_server_not_back_in_time_fails_the_job_and_workers_are_never_held() {
    let t0 = Instant::now();
    let mut s = assigned(t0).with_recovery(Some(Duration::from_secs(30)));
    let s0 = node_id(Role::Server, 0);
    s.handle_lost(s0, "killed");
    s.handle_timeout(t0 + Duration::from_secs(1)); // the wait starts
    s.handle_timeout(t0 + Duration::from_secs(30));
    assert!(drain(&mut s).is_empty(), "still within the timeout");
    s.handle_timeout(t0 + Duration::from_secs(32));
    let out = drain(&mut s);
    assert_eq!(out.len(), 3, "every other member is told: {out:?}");
    for (_, m) in &out {
        let Msg::NodeFailed { id, reason } = m else {
            panic!("{m:?}")
        };
        assert_eq!(*id, s0);
        assert!(
            reason.contains("killed") && reason.contains("PSNET_RECOVERY_TIMEOUT"),
            "{reason}"
        );
    }
    assert!(!s.takes_registrations());
    // A lost worker is failed at once, recovery or not.
    let w1 = node_id(Role::Worker, 1);
    s.handle_lost(w1, "killed");
    assert!(s.dead().contains_key(&w1));
}

#[test]
fn without_recovery_a_server_registering_late_is_refused_naming_the_setting() {
    let t0 = Instant::now();
    let mut s = assigned(t0);
    s.handle_lost(node_id(Role::Server, 0), "killed");
    drain(&mut s);
    let a = addr(9400);
    s.register(provisional_id(a), Role::Server, a, Some(0), t0);
    let out = drain(&mut s);
    assert!(
        matches!(&out[..], [(_, Msg::NodeFailed { reason, .. })] if reason.contains("PSNET_RECOVERY_TIMEOUT")),
        "{out:?}"
    );
}

/// The attack of the second hardening round: a stranger (or a member holding the job's
/// secret) registering as a server while a lost server's rank is held used to get that rank
/// and every node's token. Now only the credential the lost server committed to takes it,
/// once; a commitment is taken only from a server for itself.
#[test]
fn a_lost_rank_goes_only_to_its_credential_once() {
    use crate::proto::recovery::{commitment, fresh};
    let t0 = Instant::now();
    let mut s = assigned(t0).with_recovery(Some(Duration::from_secs(30)));
    let (s0, s1) = (node_id(Role::Server, 0), node_id(Role::Server, 1));
    let (c0, c1) = (fresh(), fresh());
    s.handle_recovery_key(s0, commitment(&c0));
    s.handle_recovery_key(s1, commitment(&c1));
    // A worker (or anyone else) cannot commit for a server.
    let forged = fresh();
    s.handle_recovery_key(node_id(Role::Worker, 0), commitment(&forged));
    s.handle_recovery_key(provisional_id(addr(9999)), commitment(&forged));
    s.handle_lost(s0, "killed");
    s.handle_lost(s1, "killed");
    drain(&mut s);
    let stranger = addr(9600);
    for (hint, shown) in [(None, None), (Some(0), Some(forged)), (Some(0), Some(c1))] {
        s.register_proving(
            provisional_id(stranger),
            Role::Server,
            stranger,
            hint,
            shown,
            t0,
        );
        let out = drain(&mut s);
        assert!(
            matches!(&out[..], [(_, Msg::NodeFailed { reason, .. })] if reason.contains("refused")),
            "{hint:?}: {out:?}"
        );
    }
    // s1's credential, without a wish, takes s1's rank, not s0's.
    let a = addr(9700);
    s.register_proving(provisional_id(a), Role::Server, a, None, Some(c1), t0);
    assert!(matches!(&drain(&mut s)[..], [(_, Msg::Reassign { your_id, .. })] if *your_id == s1));
    // Replayed by someone who saw it: refused (the rejoined server commits anew).
    let b = addr(9800);
    s.register_proving(provisional_id(b), Role::Server, b, None, Some(c1), t0);
    assert!(matches!(&drain(&mut s)[..], [(_, Msg::NodeFailed { .. })]));
    s.register_proving(provisional_id(b), Role::Server, b, Some(0), Some(c0), t0);
    assert!(matches!(&drain(&mut s)[..], [(_, Msg::Reassign { your_id, .. })] if *your_id == s0));
}

/// The second hardening round: a server that could not reload its checkpoint (or write
/// one) stopped with the cause, while the others waited out the recovery timeout and then
/// dropped the cause. A server that says why it stops is declared failed at once, with it.
#[test]
fn a_server_that_says_why_it_stops_is_not_waited_for() {
    let t0 = Instant::now();
    let mut s = assigned(t0).with_recovery(Some(Duration::from_secs(60)));
    let s0 = node_id(Role::Server, 0);
    s.handle_leaving(
        s0,
        "server 0 cannot rejoin: checksum mismatch in server-0.snapshot".into(),
    );
    s.handle_lost(s0, "connection closed by the peer");
    assert!(s.recovering().is_empty(), "its rank is not held");
    let out = drain(&mut s);
    assert_eq!(out.len(), 3, "every other member is told at once: {out:?}");
    for (_, m) in &out {
        let Msg::NodeFailed { id, reason } = m else {
            panic!("{m:?}")
        };
        assert_eq!(*id, s0);
        assert!(reason.contains("checksum mismatch"), "{reason}");
    }
    // A server lost without a word is still held for its restart.
    let s1 = node_id(Role::Server, 1);
    s.handle_lost(s1, "connection reset");
    assert_eq!(s.recovering(), vec![s1]);
}
