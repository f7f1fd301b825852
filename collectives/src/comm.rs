//! The communicator: n ranks over one transport; forming it, splitting it, and running each
//! call in its turn. The collectives' public calls are in `calls.rs`.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use psnet_recorder::{Recorder, Scope};
use psnet_transport::{NodeId, Transport};
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::element::{DType, Element};
use crate::error::CollectiveError;
use crate::mailbox::{self, Mailbox};
use crate::order::Order;
use crate::pieces::{HostPieces, Pieces};
use crate::plan::Plan;
use crate::wire::{Call, HEADER_LEN};

/// The node id of rank `rank`: ranks are node ids 1, 2, ... on the communicator's transport.
pub fn node_of(rank: usize) -> NodeId {
    NodeId(rank as u64 + 1)
}

/// Finished calls remembered, to describe a rank that sends for one of them.
const HISTORY: usize = 32;

/// n ranks that run collectives together over one transport, which is theirs alone (the
/// communicator reads everything it receives).
///
/// Every rank makes the same calls in the same order. A call takes its place in that order
/// when it is made — when the method is called, not when its future is first polled — and
/// runs once this rank's earlier calls are done; so several calls may be in flight, from
/// several tasks, as long as they are made in a known order.
///
/// The first call that fails fails the communicator: the other ranks are told why, and every
/// later call reports the same error. Dropping a call's future before it completes (a
/// timeout around it, a lost `select!`) fails it too: the other ranks would wait for it.
pub struct Communicator<T: Transport> {
    pub(crate) transport: Arc<T>,
    pub(crate) mailbox: Arc<Mailbox>,
    /// The task reading the transport, shared with the communicators split from this one.
    reader: Arc<Reader>,
    /// The task sending heartbeats and watching for silent ranks (`liveness.rs`), shared
    /// like the reader; `None` without a heartbeat timeout.
    watcher: Option<Arc<Reader>>,
    /// Device memory for the pieces of calls on the device, placed by the transport; shared,
    /// as the transport is, with the communicators split from this one.
    #[cfg(feature = "cuda")]
    pub(crate) placing: Arc<crate::placing::Placing<psnet_compression::cuda::CudaLandings>>,
    /// This communicator's id in every message header: random per job for the one `join`
    /// forms, derived from it for those split from it.
    pub(crate) comm: u32,
    /// Splits made so far, which name the communicators they make.
    splits: AtomicU64,
    /// The numbers of the next point-to-point messages (`p2p.rs`).
    pub(crate) p2p: crate::p2p::Counters,
    pub(crate) rank: usize,
    pub(crate) members: Vec<NodeId>,
    /// Where the members listen, and which this rank is connected to (`peers.rs`); shared
    /// with the communicators split from this one, which run over the same connections.
    pub(crate) peers: Arc<crate::peers::Peers>,
    pub(crate) config: Config,
    pub(crate) order: Order,
    pub(crate) failed: Mutex<Option<CollectiveError>>,
    /// The last calls finished, by number.
    pub(crate) history: Mutex<VecDeque<(u64, Call)>>,
    /// This host runs more ranks than it has cores: a waiting call that spins gives its core
    /// away between polls (`sched_yield`), so that the ranks with work get it.
    pub(crate) oversubscribed: bool,
    /// Every rank listens on this host.
    pub(crate) all_local: bool,
    /// The flight recorder of this rank's calls (`PSNET_RECORDER_ENTRIES`; `None`: off).
    pub(crate) recorder: Option<Arc<Recorder>>,
    /// Buffers the compressed allreduce keeps between calls.
    pub(crate) scratch: crate::scratch::Scratch,
}

/// Stops the task reading the transport when the last communicator using it goes.
struct Reader(JoinHandle<()>);

impl Drop for Reader {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A call's record while it waits for its turn: finished as failed if the call is dropped
/// there (a timeout around it, Ctrl-C), so no dump shows it queued for good.
struct Queued(Option<(Arc<Recorder>, u64)>);

impl Drop for Queued {
    fn drop(&mut self) {
        if let Some((r, id)) = self.0.take() {
            r.finish(id, &[], Some("dropped before its turn came"));
        }
    }
}

/// A call's place in the order of calls; see [`Communicator`].
pub(crate) struct Ticket<'a, T: Transport> {
    comm: &'a Communicator<T>,
    pub(crate) seq: u64,
    finished: bool,
}

/// `PSNET_RECORDER_DUMP=always`: a communicator that ends without a failure writes its
/// dump as it goes (a failed one wrote it when it failed).
impl<T: Transport> Drop for Communicator<T> {
    fn drop(&mut self) {
        if let (Some(r), None) = (&self.recorder, self.failure()) {
            r.dump_at_end();
        }
    }
}

impl<T: Transport> Drop for Ticket<'_, T> {
    fn drop(&mut self) {
        if !self.finished {
            self.comm.cancelled(self.seq);
        }
        self.comm.order.release(self.seq);
    }
}

impl<T: Transport> Communicator<T> {
    /// Forms a communicator of `size` ranks, this one `rank`, meeting at `root`: the address
    /// rank 0's transport listens at. Every rank's transport must be reachable at its
    /// `listen_addr()`, and every rank must have the same [`Config`] (checked). This process's
    /// transport takes node id [`node_of`]`(rank)`.
    pub async fn join(
        transport: Arc<T>,
        rank: usize,
        size: usize,
        root: SocketAddr,
        config: Config,
    ) -> Result<Self, CollectiveError> {
        if size == 0 || rank >= size {
            return Err(CollectiveError::Invalid(format!(
                "rank {rank} of a communicator of {size} ranks"
            )));
        }
        transport.set_local_id(node_of(rank));
        // SIGUSR1 (psnet-launch asking for dumps) must not end a rank still joining.
        if config.recorder.entries > 0 {
            psnet_recorder::install_signal_dump();
        }
        let mailbox = Arc::new(Mailbox::new(config.ahead_bytes));
        let reader = Arc::new(Reader(tokio::spawn(mailbox::read_all(
            transport.clone(),
            mailbox.clone(),
        ))));
        let mut comm = Communicator {
            transport,
            mailbox,
            reader,
            watcher: None,
            #[cfg(feature = "cuda")]
            placing: Arc::default(),
            comm: 0,
            splits: AtomicU64::new(0),
            p2p: Default::default(),
            rank,
            members: (0..size).map(node_of).collect(),
            peers: Arc::default(),
            config,
            order: Order::default(),
            failed: Mutex::new(None),
            history: Mutex::new(VecDeque::new()),
            scratch: Default::default(),
            oversubscribed: false,
            all_local: size == 1,
            recorder: None,
        };
        let (id, local, table) = crate::join::join(&comm, root).await?;
        comm.comm = id;
        comm.peers = Arc::new(crate::peers::Peers::new(
            &comm.members,
            &table,
            &comm.transport.connected_peers(),
        ));
        comm.recorder = comm.new_recorder();
        if let Some(r) = &comm.recorder {
            comm.mailbox.set_recorder(r.clone());
            // The connections the join made, as the communicator starts with them.
            let connected = comm.transport.connected_peers();
            for &m in comm.members.iter().filter(|m| connected.contains(m)) {
                comm.mailbox.record_event("connected", m);
            }
        }
        if let (Some(timeout), true) = (comm.config.heartbeat_timeout, size > 1) {
            let others = (0..size).filter(|&r| r != rank).map(node_of).collect();
            comm.watcher = Some(Arc::new(Reader(tokio::spawn(crate::liveness::watch(
                comm.transport.clone(),
                comm.mailbox.clone(),
                others,
                id,
                timeout,
            )))));
        }
        comm.all_local = local.len() == size;
        // Ranks that outnumber the CPUs they may use between them spin too, but give their
        // CPU away between polls, as Open MPI's yield_when_idle does when oversubscribed: a
        // rank that slept instead waits for the kernel to wake it, tens of microseconds per
        // message. Every rank's CPUs are gathered (the communicator's first call, on every
        // rank): ranks bound one to a CPU each see one CPU but do not share it.
        if size > 1 {
            let mut masks = vec![0u8; crate::cpus::MASK_BYTES * size];
            comm.allgather(&crate::cpus::own_mask(), &mut masks).await?;
            let cpus = crate::cpus::union_size(&masks, &local);
            comm.oversubscribed = local.len() > cpus;
            tracing::info!(
                ranks_here = local.len(),
                cpus,
                oversubscribed = comm.oversubscribed,
                "collectives: ranks on this host and the CPUs they may use between them"
            );
        }
        Ok(comm)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// The transport the ranks talk over.
    pub fn transport(&self) -> &Arc<T> {
        &self.transport
    }

    /// The error that failed this communicator, if one did.
    pub fn failure(&self) -> Option<CollectiveError> {
        self.failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Marks the communicator failed, unless it already was; true if this was the first.
    pub(crate) fn set_failed(&self, error: &CollectiveError) -> bool {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if failed.is_some() {
            return false;
        }
        *failed = Some(error.clone());
        true
    }

    /// Call `seq` was dropped before it finished: the communicator fails and the other ranks
    /// are told (from a task of its own, as this runs in a destructor).
    fn cancelled(&self, seq: u64) {
        let error = CollectiveError::Cancelled(format!(
            "call {seq} on rank {} was dropped before it finished",
            self.rank
        ));
        if !self.set_failed(&error) {
            return;
        }
        tracing::error!(rank = self.rank, error = %error, "collective failed");
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let teller = crate::drive::Teller::of(self);
            runtime.spawn(async move {
                teller
                    .tell(seq, &format!("rank {}: {error}", teller.rank))
                    .await
            });
        }
    }

    /// This rank's flight recorder for this communicator, as the environment says; `SIGUSR1`
    /// dumps it.
    fn new_recorder(&self) -> Option<Arc<Recorder>> {
        let scope = Scope::Collectives {
            comm: self.comm,
            rank: self.rank as u32,
            size: self.size() as u32,
        };
        let recorder = Recorder::with(scope, &self.config.recorder)?;
        psnet_recorder::install_signal_dump();
        Some(recorder)
    }

    /// Writes this rank's flight recorder dump for this communicator now (`reason`: why), as
    /// `SIGUSR1` does; returns the file, or `None` without a recorder or if it could not
    /// be written (logged).
    pub fn dump_flight_recorder(&self, reason: &str) -> Option<std::path::PathBuf> {
        self.recorder.as_ref()?.dump(reason)
    }

    /// Writes the flight recorder's dump, if there is one and the policy says so (a failure).
    pub(crate) fn dump_recorder(&self, why: &str) {
        if let Some(r) = &self.recorder {
            r.dump_on_failure(why);
        }
    }

    /// A place in the order of calls, for a call being made now.
    pub(crate) fn ticket(&self) -> Ticket<'_, T> {
        self.ticket_for(self.order.take())
    }

    /// The ticket of place `seq`, taken earlier with [`Order::take`] (by a call whose future
    /// owns the communicator).
    pub(crate) fn ticket_for(&self, seq: u64) -> Ticket<'_, T> {
        Ticket {
            comm: self,
            seq,
            finished: false,
        }
    }

    /// Runs call `call`'s `plan` over `buf` in the ticket's turn; a call whose arguments were
    /// refused (`prepared` an error) fails in its turn like any other.
    pub(crate) async fn run<E: Element>(
        &self,
        ticket: Ticket<'_, T>,
        prepared: Result<(Call, Plan), CollectiveError>,
        buf: &mut [E],
    ) -> Result<(), CollectiveError> {
        self.run_with(ticket, prepared, |plan| Ok(HostPieces::new(buf, plan)))
            .await
    }

    /// [`run`](Self::run) over the pieces `split` makes of the call's buffer for its plan
    /// (a GPU buffer's, say).
    pub(crate) async fn run_with<P: Pieces>(
        &self,
        mut ticket: Ticket<'_, T>,
        prepared: Result<(Call, Plan), CollectiveError>,
        split: impl FnOnce(&Plan) -> Result<P, CollectiveError>,
    ) -> Result<(), CollectiveError> {
        // A call that has to wait behind an earlier one is recorded queued; one whose turn
        // has come is recorded when it starts (one lock and one clock read); the driver ends
        // the record.
        let mut queued = Queued(None);
        self.order
            .wait_turn(ticket.seq, || {
                if let (Some(r), Ok((call, _))) = (&self.recorder, &prepared) {
                    queued.0 = Some((r.clone(), r.begin(call.recorded(ticket.seq))));
                }
            })
            .await;
        let result = match (self.failure(), prepared) {
            (Some(earlier), _) => {
                if let Some((r, id)) = queued.0.take() {
                    r.finish(id, &[], Some(&earlier.to_string()));
                }
                Err(earlier)
            }
            (None, Err(refused)) => Err(refused),
            (None, Ok((call, plan))) => {
                let record = self.recorder.as_ref().map(|r| match queued.0.take() {
                    // A record the ring let go while the call waited is made again.
                    Some((_, id)) if r.started(id) => id,
                    _ => r.start(call.recorded(ticket.seq)),
                });
                let result = match split(&plan) {
                    Ok(pieces) => {
                        crate::drive::drive(self, ticket.seq, call, plan, pieces, record).await
                    }
                    Err(e) => {
                        crate::drive::finish_call(self, ticket.seq);
                        if let (Some(r), Some(id)) = (&self.recorder, record) {
                            r.finish(id, &[], Some(&e.to_string()));
                        }
                        Err(e)
                    }
                };
                let mut history = self.history.lock().unwrap_or_else(|p| p.into_inner());
                history.push_back((ticket.seq, call));
                if history.len() > HISTORY {
                    history.pop_front();
                }
                result
            }
        };
        if let Err(e) = &result {
            crate::drive::fail(self, ticket.seq, e).await;
            self.dump_recorder(&format!("call {} failed: {e}", ticket.seq));
        }
        ticket.finished = true;
        result
    }

    /// Elements per piece for elements of `dtype`: the configured piece size, within what one
    /// message of the transport may carry.
    pub(crate) fn piece_elems(&self, dtype: DType) -> usize {
        let max = (self.transport.capabilities().max_message as usize).saturating_sub(HEADER_LEN);
        (self.config.piece_bytes.min(max) / dtype.size()).max(1)
    }

    /// Splits the ranks by `colour`, as `MPI_Comm_split`: the ranks that pass the same colour
    /// form a new communicator, ranked by `key` (ties by rank here), sharing this one's
    /// transport. A rank that passes `None` joins none and gets `None`. Every rank calls it.
    pub fn split(
        &self,
        colour: Option<u32>,
        key: i64,
    ) -> impl std::future::Future<Output = Result<Option<Communicator<T>>, CollectiveError>> + Send + '_
    {
        let ticket = self.ticket();
        let split = self.splits.fetch_add(1, Ordering::Relaxed);
        async move { self.split_in_turn(ticket, split, colour, key).await }
    }

    async fn split_in_turn(
        &self,
        ticket: Ticket<'_, T>,
        split: u64,
        colour: Option<u32>,
        key: i64,
    ) -> Result<Option<Communicator<T>>, CollectiveError> {
        let n = self.size();
        let mine = [colour.map_or(-1, i64::from), key];
        let mut all = vec![0i64; 2 * n];
        self.allgather_in_turn(ticket, &mine, &mut all).await?;
        let Some(colour) = colour else {
            return Ok(None);
        };
        let mut members: Vec<(i64, usize)> = (0..n)
            .filter(|&r| all[2 * r] == i64::from(colour))
            .map(|r| (all[2 * r + 1], r))
            .collect();
        members.sort_unstable();
        let rank = members
            .iter()
            .position(|&(_, r)| r == self.rank)
            .expect("this rank is among its colour");
        let mut child = Communicator {
            transport: self.transport.clone(),
            mailbox: self.mailbox.clone(),
            reader: self.reader.clone(),
            watcher: self.watcher.clone(),
            #[cfg(feature = "cuda")]
            placing: self.placing.clone(),
            comm: child_id(self.comm, split, colour),
            splits: AtomicU64::new(0),
            p2p: Default::default(),
            rank,
            members: members.iter().map(|&(_, r)| self.members[r]).collect(),
            peers: self.peers.clone(),
            config: self.config.clone(),
            order: Order::default(),
            failed: Mutex::new(None),
            history: Mutex::new(VecDeque::new()),
            scratch: Default::default(),
            oversubscribed: self.oversubscribed,
            // A subset of ranks all on this host is too; otherwise every member keeps the
            // parent's answer, so that all of them choose the same algorithms.
            all_local: self.all_local,
            recorder: None,
        };
        child.recorder = child.new_recorder();
        Ok(Some(child))
    }
}

/// The id of the communicator of `colour` made by split number `split` of communicator
/// `parent`: the same on every member, and different from its siblings' (FNV-1a; never 0,
/// which joining uses).
fn child_id(parent: u32, split: u64, colour: u32) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    let bytes = parent
        .to_le_bytes()
        .into_iter()
        .chain(split.to_le_bytes())
        .chain(colour.to_le_bytes());
    for b in bytes {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h.max(1)
}
