//! The worker: MXNet's kvstore API (`init`, `push`, `pull`, `pushpull`, `barrier`, ...) over
//! the servers, with gradient compression and per-key error-feedback residuals.
//!
//! Every call sends all its requests first and then waits for the answers, so the parts of
//! one array (and the keys of one call) are served by all servers at once. Values are sent
//! straight from the caller's slices.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use psnet_compression::{CompressionParams, Compressor};
use psnet_transport::{NodeId, Transport};
use tokio::sync::{oneshot, Notify};
use tokio::task::JoinHandle;

use crate::bootstrap::{self, heartbeat_period, Heard};
use crate::config::KvConfig;
use crate::error::KvError;
use crate::placement::Placement;
use crate::proto::ids::{describe, Group, Role, SCHEDULER};
use crate::proto::msg::{CommandKind, Msg, PushFlags};
use crate::proto::resend::Stats;
use crate::proto::server::Mode;
use crate::proto::sum;
use crate::reliable::Link;
use crate::updater::OptimizerSpec;
use crate::wire::Received;

type Reply = Result<Option<Bytes>, KvError>;
/// Requests waiting for an answer: request id to (server, where the answer goes).
type PendingMap = HashMap<u64, (NodeId, oneshot::Sender<Reply>)>;
/// The barrier in progress, if any.
type BarrierSlot = Option<(Group, oneshot::Sender<Result<(), KvError>>)>;

/// One server's share of a key.
#[derive(Clone, Copy, Debug)]
struct Part {
    server: usize,
    offset: usize,
    len: usize,
}

/// What one request asks of a server; its id is given when it is sent.
enum Ask {
    Push {
        key: u64,
        flags: PushFlags,
        n_elems: u64,
    },
    Pull {
        key: u64,
        n_elems: u64,
    },
    Command {
        kind: CommandKind,
        body: String,
    },
}

impl Ask {
    fn into_msg(self, ts: u64) -> Msg {
        match self {
            Ask::Push {
                key,
                flags,
                n_elems,
            } => Msg::Push {
                ts,
                key,
                flags,
                n_elems,
            },
            Ask::Pull { key, n_elems } => Msg::Pull { ts, key, n_elems },
            Ask::Command { kind, body } => Msg::Command { ts, kind, body },
        }
    }
}

/// One request of a call, with the bytes it carries (borrowed from the caller).
struct Outgoing<'a> {
    to: NodeId,
    ask: Ask,
    value: Option<&'a [u8]>,
}

/// One server's part of a push, ready to send.
struct PreparedPart {
    key: u64,
    part: Part,
    flags: PushFlags,
    /// The part's compressed bytes; None: sent straight from the caller's values.
    compressed: Option<Vec<u8>>,
}

#[derive(Clone, Debug)]
struct Layout {
    len: usize,
    parts: Vec<Part>,
}

struct Shared<T: Transport> {
    link: Arc<Link<T>>,
    rank: u32,
    servers: Vec<NodeId>,
    num_workers: u32,
    placement: Placement,
    next_ts: AtomicU64,
    pending: Mutex<PendingMap>,
    barrier: Mutex<BarrierSlot>,
    keys: Mutex<HashMap<u64, Layout>>,
    residuals: Mutex<HashMap<u64, Vec<f32>>>,
    compressor: Mutex<Option<Arc<dyn Compressor>>>,
    dead: Mutex<BTreeMap<NodeId, String>>,
    shutdown: AtomicBool,
    shutdown_seen: Notify,
    names: Mutex<HashMap<String, u64>>,
    /// When the scheduler was last heard from (it answers every heartbeat).
    scheduler_heard: Heard,
}

/// Whether a worker takes `msg` from `from`.
fn entitled(from: NodeId, msg: &Msg, pending: &PendingMap) -> bool {
    match msg {
        Msg::Done { ts } | Msg::Failed { ts, .. } => {
            pending.get(ts).is_none_or(|(asked, _)| *asked == from)
        }
        Msg::NodeFailed { .. }
        | Msg::BarrierDone { .. }
        | Msg::BarrierFailed { .. }
        | Msg::Heartbeat
        | Msg::Shutdown => from == SCHEDULER,
        _ => true,
    }
}

/// Whether losing `node` leaves nothing this worker waits for able to finish: a server takes
/// its shard with it, and without the scheduler the job cannot end.
fn is_fatal(node: NodeId) -> bool {
    node == SCHEDULER || is_server(node)
}

/// How long a failed send waits for the receiver to report the peer's loss with its cause.
const LOSS_GRACE: std::time::Duration = std::time::Duration::from_millis(250);

fn is_server(node: NodeId) -> bool {
    matches!(crate::proto::ids::role_rank(node), Some((Role::Server, _)))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Nothing panics while holding these locks; a poisoned one is still consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<T: Transport> Shared<T> {
    /// Fails every request waiting on `node` (every request at all when `all`).
    fn fail_pending_to(&self, node: NodeId, reason: &str, all: bool) {
        let failed: Vec<oneshot::Sender<Reply>> = {
            let mut pending = lock(&self.pending);
            let ts: Vec<u64> = pending
                .iter()
                .filter(|(_, (to, _))| all || *to == node)
                .map(|(ts, _)| *ts)
                .collect();
            ts.into_iter()
                .filter_map(|ts| pending.remove(&ts).map(|(_, tx)| tx))
                .collect()
        };
        for tx in failed {
            let _ = tx.send(Err(KvError::NodeLost {
                node: describe(node),
                reason: reason.to_string(),
            }));
        }
    }

    fn fail_barrier(&self, reason: String) {
        if let Some((_, tx)) = lock(&self.barrier).take() {
            let _ = tx.send(Err(KvError::Barrier(reason)));
        }
    }

    fn on_node_lost(&self, node: NodeId, reason: String) {
        if self.shutdown.load(Ordering::Acquire) {
            return;
        }
        tracing::warn!(node = %describe(node), %reason, "node lost");
        lock(&self.dead).insert(node, reason.clone());
        // A lost server takes its shard with it: the keys with a part there, and the
        // dist_sync rounds that other workers (failing on it too) will never finish, cannot
        // complete on any server, so every request fails now rather than wait forever.
        self.fail_pending_to(node, &reason, is_fatal(node));
        if is_server(node) {
            // Nor can a barrier the other workers may never reach.
            self.fail_barrier(format!("{} is gone: {reason}", describe(node)));
        }
        if node == SCHEDULER {
            self.fail_barrier(format!("{} is gone: {reason}", describe(node)));
            self.shutdown_seen.notify_one();
        }
    }

    /// Dispatches one received event. Each kind of message is taken only from the node
    /// entitled to send it: answers from the server that was asked, job control from the
    /// scheduler; anything else is refused and logged.
    fn handle(&self, event: Received) {
        if matches!(&event, Received::Msg { from, .. } | Received::Connected(from) if *from == SCHEDULER)
        {
            self.scheduler_heard.mark(crate::clock::now());
        }
        match event {
            Received::Msg { from, msg, .. } if !entitled(from, &msg, &lock(&self.pending)) => {
                tracing::warn!(from = %describe(from), ?msg,
                    "refused: this node may not send this message to a worker");
            }
            Received::Msg { from, msg, value } => match msg {
                Msg::Done { ts } => {
                    if let Some((_, tx)) = lock(&self.pending).remove(&ts) {
                        let _ = tx.send(Ok(value));
                    }
                }
                Msg::Failed { ts, reason } => {
                    if let Some((_, tx)) = lock(&self.pending).remove(&ts) {
                        let _ = tx.send(Err(KvError::Remote {
                            node: describe(from),
                            reason,
                        }));
                    }
                }
                Msg::BarrierDone { group } => {
                    let mut b = lock(&self.barrier);
                    if matches!(&*b, Some((g, _)) if *g == group) {
                        if let Some((_, tx)) = b.take() {
                            let _ = tx.send(Ok(()));
                        }
                    }
                }
                Msg::BarrierFailed { reason, .. } => self.fail_barrier(reason),
                Msg::NodeFailed { id, reason } => self.on_node_lost(id, reason),
                Msg::Shutdown => {
                    self.shutdown.store(true, Ordering::Release);
                    self.shutdown_seen.notify_one();
                }
                // The scheduler's answer to a heartbeat: heard above.
                Msg::Heartbeat => {}
                Msg::Leaving { reason } => self.on_node_lost(from, format!("it left: {reason}")),
                other => {
                    tracing::warn!(from = %describe(from), ?other, "unexpected message at a worker")
                }
            },
            Received::Lost { peer, reason } => self.on_node_lost(peer, reason),
            Received::Connected(_) => {}
        }
    }

    /// Sends a call's requests: to each server in the call's order, to all servers at once.
    /// (A large send completes only once its bytes are out, after its RDMA WRITE on verbs: one
    /// server after another would serialize the parts of a sharded key.) The receivers come
    /// back in the requests' order.
    async fn send_all(
        &self,
        requests: Vec<Outgoing<'_>>,
    ) -> Result<Vec<oneshot::Receiver<Reply>>, KvError> {
        let total = requests.len();
        let mut by_server: Vec<(NodeId, Vec<(usize, Outgoing<'_>)>)> = Vec::new();
        for (i, r) in requests.into_iter().enumerate() {
            match by_server.iter_mut().find(|(to, _)| *to == r.to) {
                Some((_, queue)) => queue.push((i, r)),
                None => by_server.push((r.to, vec![(i, r)])),
            }
        }
        let sends = by_server.into_iter().map(|(_, queue)| async move {
            let mut sent = Vec::with_capacity(queue.len());
            for (i, r) in queue {
                let ask = r.ask;
                sent.push((
                    i,
                    self.request(r.to, move |ts| ask.into_msg(ts), r.value)
                        .await?,
                ));
            }
            Ok::<_, KvError>(sent)
        });
        let mut slots: Vec<Option<oneshot::Receiver<Reply>>> = (0..total).map(|_| None).collect();
        for sent in futures_util::future::join_all(sends).await {
            for (i, rx) in sent? {
                slots[i] = Some(rx);
            }
        }
        // Every slot is filled: each request was sent, or the call failed above.
        Ok(slots.into_iter().flatten().collect())
    }

    /// Registers a request and sends it; the receiver yields the answer.
    async fn request(
        &self,
        to: NodeId,
        msg: impl FnOnce(u64) -> Msg,
        value: Option<&[u8]>,
    ) -> Result<oneshot::Receiver<Reply>, KvError> {
        if let Some((node, reason)) = lock(&self.dead)
            .iter()
            .find(|(id, _)| **id == to || is_fatal(**id))
        {
            return Err(KvError::NodeLost {
                node: describe(*node),
                reason: reason.clone(),
            });
        }
        let ts = self.next_ts.fetch_add(1, Ordering::Relaxed);
        let (tx, mut rx) = oneshot::channel();
        lock(&self.pending).insert(ts, (to, tx));
        if let Err(e) = self.link.send(to, &msg(ts), value).await {
            // The peer's loss, with its cause (a `Leaving` or the scheduler's word), may be
            // on its way through the receiver: an error naming the cause beats "not connected".
            if let Ok(Ok(Err(cause))) = tokio::time::timeout(LOSS_GRACE, &mut rx).await {
                return Err(cause);
            }
            lock(&self.pending).remove(&ts);
            if let Some((node, reason)) = lock(&self.dead)
                .iter()
                .find(|(id, _)| **id == to || is_fatal(**id))
            {
                return Err(KvError::NodeLost {
                    node: describe(*node),
                    reason: reason.clone(),
                });
            }
            return Err(e);
        }
        Ok(rx)
    }
}

async fn answer(rx: oneshot::Receiver<Reply>) -> Reply {
    rx.await.unwrap_or(Err(KvError::Shutdown))
}

/// A worker of a kv job, over any transport.
pub struct Worker<T: Transport> {
    shared: Arc<Shared<T>>,
    tasks: Vec<JoinHandle<()>>,
}

impl<T: Transport> Drop for Worker<T> {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        self.shared.link.close();
    }
}

impl<T: Transport> Worker<T> {
    /// Joins the job described by `config` (its role must be worker) over `transport` (bound
    /// and listening; the `psnet` crate binds one from the environment). Needs a tokio
    /// runtime.
    pub async fn join(config: &KvConfig, transport: T) -> Result<Worker<T>, KvError> {
        if config.role != Role::Worker {
            return Err(KvError::Invalid(format!(
                "Worker::join with role {}",
                config.role
            )));
        }
        let joined = bootstrap::join(config, transport).await?;
        let placement = Placement::new(joined.servers().len(), config.bigarray_bound)
            .map_err(|e| KvError::Invalid(e.to_string()))?;
        let (servers, num_workers) = (joined.servers(), joined.num_workers());
        let shared = Arc::new(Shared {
            link: joined.link,
            rank: joined.rank,
            servers,
            num_workers,
            placement,
            next_ts: AtomicU64::new(1),
            pending: Mutex::new(HashMap::new()),
            barrier: Mutex::new(None),
            keys: Mutex::new(HashMap::new()),
            residuals: Mutex::new(HashMap::new()),
            compressor: Mutex::new(None),
            dead: Mutex::new(BTreeMap::new()),
            shutdown: AtomicBool::new(false),
            shutdown_seen: Notify::new(),
            names: Mutex::new(HashMap::new()),
            scheduler_heard: Heard::new(crate::clock::now()),
        });
        for event in joined.early {
            shared.handle(event);
        }
        let receiver = {
            let shared = shared.clone();
            tokio::spawn(async move {
                while let Ok(event) = shared.link.recv().await {
                    shared.handle(event);
                }
                // Transport closed: nothing more will be answered, barriers included.
                let all: Vec<_> = lock(&shared.pending).drain().collect();
                for (_, (_, tx)) in all {
                    let _ = tx.send(Err(KvError::Shutdown));
                }
                shared.fail_barrier("this worker's transport is closed".into());
            })
        };
        let heartbeat = {
            let shared = shared.clone();
            let period = heartbeat_period(config);
            let (enabled, limit) = (
                config.heartbeat_interval.is_some(),
                config.heartbeat_timeout,
            );
            tokio::spawn(async move {
                if !enabled {
                    return;
                }
                let mut tick = tokio::time::interval(period);
                loop {
                    tick.tick().await;
                    if shared.shutdown.load(Ordering::Acquire) {
                        break;
                    }
                    if let Some(reason) = shared.scheduler_heard.silent(crate::clock::now(), limit)
                    {
                        shared.on_node_lost(SCHEDULER, reason);
                        break;
                    }
                    // A stopped scheduler stops reading: the send must not hold up the check.
                    let send = shared.link.send(SCHEDULER, &Msg::Heartbeat, None);
                    if let Ok(Err(_)) = tokio::time::timeout(period, send).await {
                        break;
                    }
                }
            })
        };
        tracing::info!(rank = shared.rank, "worker ready");
        Ok(Worker {
            shared,
            tasks: vec![receiver, heartbeat],
        })
    }

    /// This worker's rank.
    pub fn rank(&self) -> u32 {
        self.shared.rank
    }

    /// Number of workers in the job.
    pub fn num_workers(&self) -> u32 {
        self.shared.num_workers
    }

    /// Number of servers in the job.
    pub fn num_servers(&self) -> u32 {
        self.shared.servers.len() as u32
    }

    /// The transport this worker runs on (`"tcp"`, `"rdma"`).
    pub fn transport_name(&self) -> &'static str {
        self.shared.link.transport().capabilities().name
    }

    /// Test hook: the transport, e.g. to drop a connection (`disconnect`).
    #[doc(hidden)]
    pub fn debug_transport(&self) -> &T {
        self.shared.link.transport()
    }

    /// Test hook: `PS_RESEND`'s counters (None when it is off).
    #[doc(hidden)]
    pub fn debug_resend_stats(&self) -> Option<Stats> {
        self.shared.link.resend_stats()
    }

    /// The integer key for a string key: assigned in order of first use on this worker,
    /// from 0 (MXNet's rule, so every worker must name its keys in the same order).
    pub fn key(&self, name: &str) -> u64 {
        let mut names = lock(&self.shared.names);
        let next = names.len() as u64;
        *names.entry(name.to_string()).or_insert(next)
    }

    fn layout(&self, key: u64, len: usize) -> Result<Layout, KvError> {
        let layout = lock(&self.shared.keys)
            .get(&key)
            .cloned()
            .ok_or(KvError::UnknownKey(key))?;
        if layout.len != len {
            return Err(KvError::SizeMismatch {
                key,
                expected: layout.len,
                got: len,
            });
        }
        Ok(layout)
    }

    /// Sends one command to every server and waits for all answers.
    async fn command_all(&self, kind: CommandKind, body: String) -> Result<(), KvError> {
        let requests = self
            .shared
            .servers
            .iter()
            .map(|&to| Outgoing {
                to,
                ask: Ask::Command {
                    kind,
                    body: body.clone(),
                },
                value: None,
            })
            .collect();
        for rx in self.shared.send_all(requests).await? {
            answer(rx).await?;
        }
        Ok(())
    }

    /// Sets the servers' optimizer (`dist_async` needs one; with `dist_sync` and none, a round's
    /// sum replaces the value). Every worker may call it; servers keep one updater.
    pub async fn set_optimizer(&self, spec: &OptimizerSpec) -> Result<(), KvError> {
        self.command_all(CommandKind::SetOptimizer, spec.to_json())
            .await
    }

    /// `dist_sync` (default) or `dist_async`.
    pub async fn set_mode(&self, mode: Mode) -> Result<(), KvError> {
        let body = match mode {
            Mode::Sync => "sync",
            Mode::Async => "async",
        };
        self.command_all(CommandKind::SetMode, body.into()).await
    }

    /// Turns on gradient compression for pushes. Set it before `init` to get MXNet's split of
    /// big arrays for compressed pushes; servers get the exact threshold (MXNet rounds it to six
    /// decimals on the way).
    pub async fn set_gradient_compression(&self, params: CompressionParams) -> Result<(), KvError> {
        let compressor = params
            .compressor()
            .map_err(|e| KvError::Invalid(e.to_string()))?;
        self.command_all(CommandKind::SetCompression, params.to_string())
            .await?;
        *lock(&self.shared.compressor) = compressor.map(Arc::from);
        lock(&self.shared.residuals).clear();
        Ok(())
    }

    /// Initializes keys: rank 0's values are stored on the servers, other ranks' values are
    /// ignored (MXNet), and all workers wait for each other.
    pub async fn init(&self, keys: &[u64], values: &[&[f32]]) -> Result<(), KvError> {
        if keys.len() != values.len() {
            return Err(KvError::Invalid(format!(
                "init: {} keys but {} values",
                keys.len(),
                values.len()
            )));
        }
        let per_word = lock(&self.shared.compressor)
            .as_ref()
            .map(|c| c.scheme().factor());
        for (&key, v) in keys.iter().zip(values) {
            let parts: Vec<Part> = match per_word {
                Some(w) => self
                    .shared
                    .placement
                    .compressed_parts(key, v.len(), w)
                    .iter()
                    .map(|p| Part {
                        server: p.server,
                        offset: p.offset,
                        len: p.len,
                    })
                    .collect(),
                None => self
                    .shared
                    .placement
                    .parts(key, v.len())
                    .iter()
                    .map(|p| Part {
                        server: p.server,
                        offset: p.offset,
                        len: p.len,
                    })
                    .collect(),
            };
            lock(&self.shared.keys).insert(
                key,
                Layout {
                    len: v.len(),
                    parts,
                },
            );
        }
        tracing::debug!(rank = self.shared.rank, keys = keys.len(), "init");
        if self.shared.rank == 0 {
            let flags = PushFlags {
                init: true,
                ..PushFlags::default()
            };
            let mut parts = Vec::new();
            for (&key, v) in keys.iter().zip(values) {
                let layout = self.layout(key, v.len())?;
                parts.extend(layout.parts.into_iter().map(|p| (key, *v, p)));
            }
            let requests = parts
                .iter()
                .map(|(key, v, p)| Outgoing {
                    to: self.shared.servers[p.server],
                    ask: Ask::Push {
                        key: *key,
                        flags,
                        n_elems: p.len as u64,
                    },
                    value: Some(sum::as_bytes(&v[p.offset..p.offset + p.len])),
                })
                .collect();
            for rx in self.shared.send_all(requests).await? {
                answer(rx).await?;
            }
        }
        self.barrier().await
    }

    /// The parts of a push of `values` to `key`, ready to send: each part's range, flags and,
    /// when compression is on, its compressed bytes (the residual updated as MXNet does).
    fn prepare_push(
        &self,
        key: u64,
        values: &[f32],
        pull_back: bool,
    ) -> Result<Vec<PreparedPart>, KvError> {
        let layout = self.layout(key, values.len())?;
        let compressor = lock(&self.shared.compressor).clone();
        let mut parts = Vec::with_capacity(layout.parts.len());
        for p in &layout.parts {
            let slice = &values[p.offset..p.offset + p.len];
            let compressed = match &compressor {
                Some(c) => {
                    let mut out = vec![0u8; c.compressed_len(p.len)];
                    let mut residuals = lock(&self.shared.residuals);
                    let residual = residuals
                        .entry(key)
                        .or_insert_with(|| vec![0.0; layout.len]);
                    c.quantize(slice, &mut residual[p.offset..p.offset + p.len], &mut out)
                        .map_err(|e| KvError::Invalid(e.to_string()))?;
                    Some(out)
                }
                None => None,
            };
            let flags = PushFlags {
                init: false,
                compressed: compressed.is_some(),
                pull_back,
            };
            parts.push(PreparedPart {
                key,
                part: *p,
                flags,
                compressed,
            });
        }
        Ok(parts)
    }

    /// Sends every prepared part of the call's pushes (`values[i]` is key i's array), all
    /// servers at once; the receivers come back in the parts' order.
    async fn send_pushes(
        &self,
        parts: &[(usize, PreparedPart)],
        values: &[&[f32]],
    ) -> Result<Vec<oneshot::Receiver<Reply>>, KvError> {
        let requests = parts
            .iter()
            .map(|(i, pp)| {
                let p = pp.part;
                Outgoing {
                    to: self.shared.servers[p.server],
                    ask: Ask::Push {
                        key: pp.key,
                        flags: pp.flags,
                        n_elems: p.len as u64,
                    },
                    value: Some(match &pp.compressed {
                        Some(bytes) => &bytes[..],
                        None => sum::as_bytes(&values[*i][p.offset..p.offset + p.len]),
                    }),
                }
            })
            .collect();
        self.shared.send_all(requests).await
    }

    /// Pushes `values` for `key` and waits until the servers have applied it (in `dist_sync`,
    /// until every worker pushed this round).
    pub async fn push(&self, key: u64, values: &[f32]) -> Result<(), KvError> {
        self.push_many(&[key], &[values]).await
    }

    /// Pushes several keys at once.
    pub async fn push_many(&self, keys: &[u64], values: &[&[f32]]) -> Result<(), KvError> {
        check_lengths("push", keys.len(), values.len())?;
        let mut parts = Vec::new();
        for (i, (&key, v)) in keys.iter().zip(values).enumerate() {
            parts.extend(
                self.prepare_push(key, v, false)?
                    .into_iter()
                    .map(|p| (i, p)),
            );
        }
        for rx in self.send_pushes(&parts, values).await? {
            answer(rx).await?;
        }
        Ok(())
    }

    /// Pulls `key` into `out`.
    pub async fn pull(&self, key: u64, out: &mut [f32]) -> Result<(), KvError> {
        self.pull_many(&[key], &mut [out]).await
    }

    /// Pulls several keys at once.
    pub async fn pull_many(&self, keys: &[u64], outs: &mut [&mut [f32]]) -> Result<(), KvError> {
        check_lengths("pull", keys.len(), outs.len())?;
        let mut parts = Vec::new();
        for (i, (&key, out)) in keys.iter().zip(outs.iter()).enumerate() {
            let layout = self.layout(key, out.len())?;
            parts.extend(layout.parts.into_iter().map(|p| (i, key, p)));
        }
        let requests = parts
            .iter()
            .map(|&(_, key, p)| Outgoing {
                to: self.shared.servers[p.server],
                ask: Ask::Pull {
                    key,
                    n_elems: p.len as u64,
                },
                value: None,
            })
            .collect();
        let waits = self.shared.send_all(requests).await?;
        for ((i, key, p), rx) in parts.into_iter().zip(waits) {
            let value = answer(rx).await?;
            fill(
                key,
                &mut outs[i][p.offset..p.offset + p.len],
                value,
                self.shared.servers[p.server],
            )?;
        }
        Ok(())
    }

    /// Pushes `values` and pulls the updated value into `out` in one exchange per server.
    pub async fn pushpull(&self, key: u64, values: &[f32], out: &mut [f32]) -> Result<(), KvError> {
        self.pushpull_many(&[key], &[values], &mut [out]).await
    }

    /// `pushpull` for several keys at once.
    pub async fn pushpull_many<O: AsMut<[f32]>>(
        &self,
        keys: &[u64],
        values: &[&[f32]],
        outs: &mut [O],
    ) -> Result<(), KvError> {
        check_lengths("pushpull", keys.len(), values.len())?;
        check_lengths("pushpull", keys.len(), outs.len())?;
        let mut parts = Vec::new();
        for (i, ((&key, v), out)) in keys.iter().zip(values).zip(outs.iter_mut()).enumerate() {
            if out.as_mut().len() != v.len() {
                return Err(KvError::SizeMismatch {
                    key,
                    expected: v.len(),
                    got: out.as_mut().len(),
                });
            }
            parts.extend(self.prepare_push(key, v, true)?.into_iter().map(|p| (i, p)));
        }
        let waits = self.send_pushes(&parts, values).await?;
        for ((i, pp), rx) in parts.into_iter().zip(waits) {
            let value = answer(rx).await?;
            let p = pp.part;
            fill(
                pp.key,
                &mut outs[i].as_mut()[p.offset..p.offset + p.len],
                value,
                self.shared.servers[p.server],
            )?;
        }
        Ok(())
    }

    /// Waits until every worker reaches this barrier (MXNet's `kv._barrier()`).
    pub async fn barrier(&self) -> Result<(), KvError> {
        self.barrier_of(Group::WORKERS).await
    }

    async fn barrier_of(&self, group: Group) -> Result<(), KvError> {
        tracing::debug!(rank = self.shared.rank, group = group.0, "entering barrier");
        let (tx, rx) = oneshot::channel();
        {
            let mut b = lock(&self.shared.barrier);
            if b.is_some() {
                return Err(KvError::Invalid("a barrier is already in progress".into()));
            }
            *b = Some((group, tx));
        }
        if let Some((node, reason)) = lock(&self.shared.dead).iter().next() {
            lock(&self.shared.barrier).take();
            return Err(KvError::Barrier(format!(
                "{} is gone: {reason}",
                describe(*node)
            )));
        }
        if let Err(e) = self
            .shared
            .link
            .send(SCHEDULER, &Msg::Barrier { group }, None)
            .await
        {
            lock(&self.shared.barrier).take();
            return Err(e);
        }
        rx.await.unwrap_or(Err(KvError::Shutdown))
    }

    /// Leaves the job cleanly: tells the scheduler this worker is done and waits until the
    /// scheduler ends the job (once every worker is done).
    pub async fn finalize(self) -> Result<(), KvError> {
        self.shared
            .link
            .send(SCHEDULER, &Msg::Finalize, None)
            .await?;
        loop {
            if self.shared.shutdown.load(Ordering::Acquire) {
                tracing::info!(rank = self.shared.rank, "worker done");
                return Ok(());
            }
            if let Some(reason) = lock(&self.shared.dead).get(&SCHEDULER) {
                return Err(KvError::NodeLost {
                    node: describe(SCHEDULER),
                    reason: format!("lost before the job ended: {reason}"),
                });
            }
            // `notify_one` keeps a permit, so a shutdown that lands between the checks above
            // and this wait is not missed.
            self.shared.shutdown_seen.notified().await;
        }
    }
}

fn check_lengths(op: &str, keys: usize, values: usize) -> Result<(), KvError> {
    if keys == values {
        Ok(())
    } else {
        Err(KvError::Invalid(format!(
            "{op}: {keys} keys but {values} value buffers"
        )))
    }
}

/// Copies an answer's value into `out`, checking its size.
fn fill(key: u64, out: &mut [f32], value: Option<Bytes>, from: NodeId) -> Result<(), KvError> {
    let bytes = value.unwrap_or_default();
    if bytes.len() != out.len() * 4 {
        return Err(KvError::Protocol {
            node: describe(from),
            reason: format!(
                "key {key}: answered {} bytes for {} elements",
                bytes.len(),
                out.len()
            ),
        });
    }
    sum::copy_from_le(out, &bytes);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::ids::node_id;

    #[test]
    fn job_control_is_taken_only_from_the_node_entitled_to_send_it() {
        let server0 = node_id(Role::Server, 0);
        let server1 = node_id(Role::Server, 1);
        let worker1 = node_id(Role::Worker, 1);
        let (tx, _rx) = oneshot::channel();
        let pending: PendingMap = HashMap::from([(7, (server0, tx))]);
        let control = [
            Msg::Shutdown,
            Msg::Heartbeat,
            Msg::NodeFailed {
                id: server0,
                reason: "x".into(),
            },
            Msg::BarrierDone {
                group: Group::WORKERS,
            },
            Msg::BarrierFailed {
                group: Group::WORKERS,
                reason: "x".into(),
            },
        ];
        for msg in &control {
            assert!(entitled(SCHEDULER, msg, &pending), "{msg:?}");
            for other in [server0, worker1] {
                assert!(!entitled(other, msg, &pending), "{msg:?} from {other}");
            }
        }
        // An answer only from the server that was asked.
        let done = Msg::Done { ts: 7 };
        assert!(entitled(server0, &done, &pending));
        assert!(!entitled(server1, &done, &pending));
        assert!(!entitled(
            server1,
            &Msg::Failed {
                ts: 7,
                reason: "x".into()
            },
            &pending
        ));
    }
}
