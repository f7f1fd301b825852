//! Forming a communicator: every rank but 0 says hello to rank 0 at the root address with
//! the world size it expects, its settings and the address it listens at; rank 0 checks that
//! the ranks agree, then sends everyone the table: the job's communicator id (random, so
//! that nothing left over from an earlier job on the same transport is taken for this one's)
//! and every rank's address. The ranks connect to each other only when a call needs it
//! (`peers.rs`).
//!
//! A rank missing when the time is up is named on rank 0, which tells the ranks that did
//! join; rank 0 missing or lost is named on the others. The table also carries a secret drawn
//! by rank 0: from then on only the members, proving themselves with it, may connect
//! (`admission.rs`).

use std::hash::{BuildHasher, RandomState};
use std::net::SocketAddr;
use std::time::Duration;

use std::sync::Arc;

use psnet_transport::{NodeId, OutMessage, Segment, Transport};
use tokio::time::Instant;

use crate::admission::{self, CommSecret, Joining, Members};
use crate::comm::{node_of, Communicator};
use crate::drive::Teller;
use crate::error::CollectiveError;
use crate::mailbox::Arrival;
use crate::wire::{self, Kind};

/// How much longer than rank 0 the other ranks wait for the table.
const ROOT_VERDICT: Duration = Duration::from_secs(5);

/// The settings every rank must share: the algorithms and piece sizes they imply.
fn settings<T: Transport>(comm: &Communicator<T>) -> String {
    let c = &comm.config;
    format!(
        "PSNET_ALGO={} PSNET_COLL_SMALL={} PSNET_COLL_SMALL_SHM={} PSNET_COLL_PIECE={} \
         PSNET_COLL_HEARTBEAT_TIMEOUT={:?} PSNET_COLL_COMPRESSED_TWO_PHASE={} max_message={} \
         same_host_shm={}",
        c.algo,
        c.small_bytes,
        c.small_shm_bytes,
        c.piece_bytes,
        c.heartbeat_timeout,
        c.compressed_two_phase_bytes,
        comm.transport.capabilities().max_message,
        comm.transport.capabilities().same_host_shm
    )
}

/// Forms the communicator; returns its id, the ranks (this one included) that listen on
/// this rank's host, and every rank's address.
pub(crate) async fn join<T: Transport>(
    comm: &Communicator<T>,
    root: SocketAddr,
) -> Result<(u32, Vec<usize>, Vec<SocketAddr>), CollectiveError> {
    let size = comm.members.len();
    if size == 1 {
        return Ok((new_id(), vec![0], vec![comm.transport.listen_addr()]));
    }
    let deadline = Instant::now() + comm.config.join_timeout;
    let (id, secret, table) = if comm.rank == 0 {
        let addrs = match gather_hellos(comm, size, deadline).await {
            Ok(addrs) => addrs,
            Err(e) => {
                // The ranks that did join are waiting for the table: tell them why none comes.
                Teller::of(comm).tell(0, &format!("rank 0: {e}")).await;
                return Err(e);
            }
        };
        let id = new_id();
        let secret = admission::new_secret().map_err(CollectiveError::Join)?;
        // The id zero-padded: a table's size does not depend on the id drawn, so a simulated
        // job's traffic replays exactly.
        let text: String = std::iter::once(format!("{id:010} {}\n", admission::to_hex(&secret)))
            .chain(addrs.iter().map(|a| format!("{a}\n")))
            .collect();
        let header = wire::control(Kind::Table, comm.comm).encode();
        for rank in 1..size {
            let segment = [Segment::from(text.as_bytes())];
            send(comm, node_of(rank), OutMessage::new(&header, &segment))
                .await
                .map_err(|e| {
                    CollectiveError::Join(format!("sending rank {rank} the table: {e}"))
                })?;
        }
        (id, secret, addrs)
    } else {
        comm.transport
            .set_admission(Arc::new(Joining { root: node_of(0) }));
        say_hello(comm, root, size, deadline).await?
    };
    // From here on only members presenting the secret may connect. A rank dials another
    // only once it has the table, so it has the secret; one that has not got the table yet
    // refuses the dial (`Joining`), and the dialler tries again.
    comm.transport.set_admission(Arc::new(Members::checking(
        comm.members.clone(),
        secret,
        comm.mailbox.clone(),
    )));
    // A hello after rank 0 had every rank's: a second process says it is a rank in the table.
    let late = std::mem::take(&mut comm.mailbox.lock().joining)
        .into_iter()
        .find(|a| a.header.kind == Kind::Hello);
    if let (0, Some(hello)) = (comm.rank, late) {
        let rank = usize::try_from(hello.header.tag).unwrap_or(usize::MAX);
        let e = CollectiveError::Claimed {
            rank,
            node: hello.from,
            detail: "it said hello to rank 0 after rank 0 had every rank's".into(),
        };
        Teller::of(comm).tell(0, &format!("rank 0: {e}")).await;
        return Err(e);
    }
    let here = comm.transport.listen_addr().ip();
    let local = (0..size).filter(|&r| table[r].ip() == here).collect();
    Ok((id, local, table))
}

/// A communicator id for a new job: random, never 0 (the id joining itself uses).
fn new_id() -> u32 {
    (RandomState::new().hash_one(std::process::id()) as u32).max(1)
}

/// A rank other than 0: hello to rank 0, then its table.
async fn say_hello<T: Transport>(
    comm: &Communicator<T>,
    root: SocketAddr,
    size: usize,
    deadline: Instant,
) -> Result<(u32, CommSecret, Vec<SocketAddr>), CollectiveError> {
    let root_node = node_of(0);
    tokio::time::timeout_at(deadline, comm.transport.connect(root_node, root))
        .await
        .map_err(|_| timed_out_on_root(comm, root))?
        .map_err(|e| CollectiveError::Join(format!("connecting to rank 0 at {root}: {e}")))?;
    let mut header = wire::control(Kind::Hello, comm.comm);
    header.tag = comm.rank as u64;
    header.seq = size as u64;
    let header = header.encode();
    let hello = format!("{}\n{}", comm.transport.listen_addr(), settings(comm));
    let segment = [Segment::from(hello.as_bytes())];
    send(comm, root_node, OutMessage::new(&header, &segment))
        .await
        .map_err(|e| CollectiveError::Join(format!("saying hello to rank 0 at {root}: {e}")))?;
    // Longer than rank 0 waits for the others, so that its verdict (who never joined)
    // arrives before this rank gives up.
    wait_for(comm, deadline + ROOT_VERDICT, Some(root_node), |a| {
        (a.header.kind == Kind::Table && a.from == root_node).then(|| parse_table(a, size))
    })
    .await
    .map_err(|end| match end {
        WaitEnd::Deadline => timed_out_on_root(comm, root),
        WaitEnd::Aborted(why) => CollectiveError::Join(why),
        WaitEnd::Lost(why) => CollectiveError::Join(format!("rank 0 at {root} was lost: {why}")),
    })?
}

fn timed_out_on_root<T: Transport>(comm: &Communicator<T>, root: SocketAddr) -> CollectiveError {
    CollectiveError::Join(format!(
        "rank 0 at {root} did not answer within {:?} (is it running, with the same root address?)",
        comm.config.join_timeout
    ))
}

async fn send<T: Transport>(
    comm: &Communicator<T>,
    to: NodeId,
    msg: OutMessage<'_>,
) -> Result<(), psnet_transport::TransportError> {
    comm.transport.send(to, msg).await
}

/// Rank 0: every other rank's hello, checked; the table of addresses in rank order.
async fn gather_hellos<T: Transport>(
    comm: &Communicator<T>,
    size: usize,
    deadline: Instant,
) -> Result<Vec<SocketAddr>, CollectiveError> {
    let mut addrs: Vec<Option<SocketAddr>> = vec![None; size];
    addrs[0] = Some(comm.transport.listen_addr());
    let ours = settings(comm);
    while addrs.iter().any(Option::is_none) {
        let hello = wait_for(comm, deadline, None, |a| {
            (a.header.kind == Kind::Hello).then(|| {
                (
                    a.from,
                    a.header.tag,
                    a.header.seq,
                    String::from_utf8_lossy(&a.data).into_owned(),
                )
            })
        })
        .await;
        let (from, rank, their_size, text) = match hello {
            Ok(h) => h,
            Err(_) => {
                let missing: Vec<usize> = (0..size).filter(|&r| addrs[r].is_none()).collect();
                return Err(CollectiveError::Join(format!(
                    "ranks {missing:?} of {size} did not join within {:?}",
                    comm.config.join_timeout
                )));
            }
        };
        if their_size != size as u64 {
            return Err(CollectiveError::Join(format!(
                "node {from} expects {their_size} ranks, rank 0 expects {size}: check the world size every rank was given"
            )));
        }
        let rank = rank as usize;
        if rank == 0 || rank >= size || from != node_of(rank) {
            return Err(CollectiveError::Join(format!(
                "node {from} says it is rank {rank} of {size}: ranks are 1..{size} besides rank 0, each one process"
            )));
        }
        if addrs[rank].is_some() {
            return Err(CollectiveError::Join(format!(
                "rank {rank} joined twice: two processes were given the same rank"
            )));
        }
        let (addr, theirs) = text.split_once('\n').unwrap_or((&text, ""));
        if theirs != ours {
            return Err(CollectiveError::Join(format!(
                "rank {rank} has settings {theirs:?} where rank 0 has {ours:?}: every rank needs the same"
            )));
        }
        let addr: SocketAddr = addr.parse().map_err(|_| {
            CollectiveError::Join(format!("rank {rank} listens at {addr:?}, not an address"))
        })?;
        addrs[rank] = Some(addr);
    }
    Ok(addrs.into_iter().map(|a| a.expect("all present")).collect())
}

fn parse_table(
    a: &Arrival,
    size: usize,
) -> Result<(u32, CommSecret, Vec<SocketAddr>), CollectiveError> {
    let text = String::from_utf8_lossy(&a.data);
    let mut lines = text.lines();
    let first = lines.next().and_then(|l| l.split_once(' '));
    let id = first.and_then(|(id, _)| id.parse::<u32>().ok());
    let secret = first.and_then(|(_, hex)| admission::from_hex(hex));
    let addrs: Result<Vec<SocketAddr>, _> = lines.map(str::parse).collect();
    match (id, secret, addrs) {
        (Some(id), Some(secret), Ok(addrs)) if id != 0 && addrs.len() == size => {
            Ok((id, secret, addrs))
        }
        _ => Err(CollectiveError::Join(format!(
            "rank 0 sent a table this rank cannot read ({} bytes)",
            a.data.len()
        ))),
    }
}

/// Why a wait for a joining message ended without one.
enum WaitEnd {
    Deadline,
    /// Another rank gave up on joining, and said why.
    Aborted(String),
    /// The node waited on was lost.
    Lost(String),
}

/// The first joining message `pick` accepts (taken out of the mail); stops early if `from`
/// (the node it should come from, if one) is lost.
async fn wait_for<R>(
    comm: &Communicator<impl Transport>,
    deadline: Instant,
    from: Option<NodeId>,
    mut pick: impl FnMut(&Arrival) -> Option<R>,
) -> Result<R, WaitEnd> {
    loop {
        let changed = comm.mailbox.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        {
            let mut mail = comm.mailbox.lock();
            if let Some(abort) = mail.aborted.get(&comm.comm) {
                return Err(WaitEnd::Aborted(abort.reason.clone()));
            }
            let found = mail
                .joining
                .iter()
                .enumerate()
                .find_map(|(i, a)| pick(a).map(|r| (i, r)));
            if let Some((i, r)) = found {
                mail.joining.remove(i);
                return Ok(r);
            }
            if let Some(why) = from.and_then(|node| mail.lost.get(&node)) {
                return Err(WaitEnd::Lost(why.clone()));
            }
            if let Some(why) = &mail.closed {
                return Err(WaitEnd::Lost(format!(
                    "this rank's transport closed: {why}"
                )));
            }
        }
        if tokio::time::timeout_at(deadline, &mut changed)
            .await
            .is_err()
        {
            return Err(WaitEnd::Deadline);
        }
    }
}
