//! The worker: MXNet's kvstore API (`init`, `push`, `pull`, `pushpull`, `barrier`, ...) over
//! the servers, with gradient compression and per-key error-feedback residuals.
//!
//! The logic lives in [`WorkerState`](crate::proto::worker::WorkerState), behind one lock;
//! this driver only moves bytes. Every call sends all its requests first, to all servers at
//! once, and then waits for the answers, so the parts of one array (and the keys of one call)
//! are served by all servers in parallel. Values are sent straight from the caller's slices.

use std::sync::{Arc, Mutex};

use crate::proto::pulled::KvCompression;
use bytes::Bytes;
use psnet_transport::{NodeId, Segment, Transport};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::bootstrap::{self, heartbeat_period};
use crate::config::KvConfig;
use crate::error::KvError;
use crate::placement::Placement;
use crate::proto::ids::{describe, Group, Role, SCHEDULER};
use crate::proto::msg::{CommandKind, Msg, PushFlags};
use crate::proto::resend::Stats;
use crate::proto::server::Mode;
use crate::proto::worker::{PreparedPart, WorkerState};
use crate::updater::OptimizerSpec;
use crate::value::{self, Value};
use crate::wire::Received;

mod device;
mod gate;
mod join;
mod row_push;
mod rows;
mod shared;

pub(crate) use shared::{Ask, Outgoing, Sent, Shared};

/// A worker of a kv job, over any transport.
///
/// Its heartbeats and its receiving run as tasks on the runtime it was joined on. On a
/// current-thread runtime, a caller that computes for longer than `PS_HEARTBEAT_TIMEOUT`
/// without awaiting starves them, and the scheduler declares this worker dead: compute in
/// `spawn_blocking` / `block_in_place` on a multi-thread runtime, or use the blocking front
/// end ([`crate::blocking::KvStore`]), which runs its own runtime threads.
pub struct Worker<T: Transport> {
    pub(crate) shared: Arc<Shared<T>>,
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

    /// How many servers a key of `len` elements is spread over (1 below
    /// `MXNET_KVSTORE_BIGARRAY_BOUND`, every server from it).
    pub fn servers_for(&self, key: u64, len: usize) -> usize {
        self.shared.state().servers_for(key, len)
    }

    /// How an initialized key is laid out: its parts, each with its server and the key it
    /// is stored under there (MXNet's shares, or pieces with `PSNET_PARTITION_BYTES`).
    pub fn layout(&self, key: u64) -> Option<crate::proto::worker::Layout> {
        let state = self.shared.state();
        let layout = state.defined_layout(key)?;
        Some(layout.clone())
    }

    /// The transport this worker runs on (`"tcp"`, `"rdma"`).
    pub fn transport_name(&self) -> &'static str {
        self.shared.link.transport().capabilities().name
    }

    /// The address this worker listens at (the one the scheduler gave the other nodes).
    pub fn listen_addr(&self) -> std::net::SocketAddr {
        self.shared.link.transport().listen_addr()
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
        self.shared.state().key(name)
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
        for wait in self.shared.send_all(requests).await? {
            self.shared.settle(wait).await?;
        }
        Ok(())
    }

    /// Sets the servers' optimizer (`dist_async` needs one; with `dist_sync` and none, a round's
    /// sum replaces the value). Every worker may call it, as MXNet's do; servers apply worker
    /// 0's, and another worker's call returns once worker 0's is in force (it fails if it
    /// differs).
    pub async fn set_optimizer(&self, spec: &OptimizerSpec) -> Result<(), KvError> {
        self.command_all(CommandKind::SetOptimizer, spec.to_json())
            .await
    }

    /// `dist_sync` (default) or `dist_async`. Set it before pushing: a server refuses to switch
    /// to `dist_async` while a `dist_sync` round holds pushes. Servers take worker 0's; another
    /// worker's call returns once worker 0's is in force (it fails if it differs).
    pub async fn set_mode(&self, mode: Mode) -> Result<(), KvError> {
        let body = match mode {
            Mode::Sync => "sync",
            Mode::Async => "async",
        };
        self.command_all(CommandKind::SetMode, body.into()).await
    }

    /// Turns on gradient compression for pushes. Set it before `init` to get MXNet's split of
    /// big arrays for compressed pushes; servers get the exact threshold (MXNet rounds it to six
    /// decimals on the way). Every worker must set the same settings: a server takes worker
    /// 0's, once, and refuses others (it could not tell which pushes were made with which), and
    /// this worker then goes on as before. Another worker's call returns once worker 0's is in
    /// force.
    ///
    /// With [`KvCompression::pull`] (`{"type": "2bit", "threshold": 0.5, "pull": true}`),
    /// pulls are compressed too, `dist_sync` only (lossy: see [`crate::proto::pulled`]):
    /// servers answer a worker's pull with the codes of the weights' change since its last
    /// one. Every worker then holds the same weights, bit for bit; they differ from the
    /// servers' master copy by the servers' residual.
    pub async fn set_gradient_compression(
        &self,
        params: impl Into<KvCompression>,
    ) -> Result<(), KvError> {
        let mut params: KvCompression = params.into();
        params.pack |= self.shared.pack_codes && params.params.scheme().is_some();
        let compressor = params
            .params
            .compressor()
            .map_err(|e| KvError::Invalid(e.to_string()))?;
        self.command_all(CommandKind::SetCompression, params.to_string())
            .await?;
        let mut state = self.shared.state();
        state.set_compressor(compressor.map(Arc::from));
        state.set_pull_compression(params.pull_scheme());
        state.set_packing(params.pack);
        Ok(())
    }

    /// Asks every server to write a snapshot of its shard now (servers with
    /// `PSNET_CHECKPOINT_DIR`, see [`crate::checkpoint`]) and waits until all have: every
    /// update acknowledged before the call is then in the snapshots. Fails, naming the
    /// server, where checkpoints are off or a snapshot cannot be written.
    pub async fn save_checkpoint(&self) -> Result<(), KvError> {
        self.command_all(CommandKind::Checkpoint, String::new())
            .await
    }

    /// Initializes keys: rank 0's values are stored on the servers, other ranks' values are
    /// ignored (MXNet), and all workers wait for each other.
    pub async fn init<V: Value>(&self, keys: &[u64], values: &[&[V]]) -> Result<(), KvError> {
        if keys.len() != values.len() {
            return Err(KvError::Invalid(format!(
                "init: {} keys but {} values",
                keys.len(),
                values.len()
            )));
        }
        {
            let mut state = self.shared.state();
            for (&key, v) in keys.iter().zip(values) {
                state.define_key(key, v.len(), V::DTYPE)?;
            }
        }
        tracing::debug!(rank = self.shared.rank, keys = keys.len(), "init");
        if self.shared.rank == 0 {
            let flags = PushFlags {
                init: true,
                dtype: V::DTYPE,
                ..PushFlags::default()
            };
            let mut parts = Vec::new();
            {
                let state = self.shared.state();
                for (&key, v) in keys.iter().zip(values) {
                    let layout = state.layout(key, v.len(), V::DTYPE)?;
                    parts.extend(layout.parts.iter().map(|p| (key, *v, *p)));
                }
            }
            let requests = parts
                .iter()
                .map(|(_, v, p)| Outgoing {
                    to: self.shared.servers[p.server],
                    ask: Ask::Push {
                        key: p.slot,
                        flags,
                        n_elems: p.len as u64,
                    },
                    value: Some(Segment::new(value::as_bytes(
                        &v[p.offset..p.offset + p.len],
                    ))),
                })
                .collect();
            for wait in self.shared.send_all(requests).await? {
                self.shared.settle(wait).await?;
            }
        }
        self.barrier().await
    }

    /// Sends every prepared part of the call's pushes (`values[i]` is key i's array), all
    /// servers at once; the receivers come back in the parts' order.
    pub(crate) async fn send_pushes<'a, V: Value>(
        &self,
        parts: &'a [(usize, PreparedPart)],
        values: &[&'a [V]],
    ) -> Result<Sent<'a>, KvError> {
        self.send_push_parts(parts, |_, (i, pp)| {
            let p = pp.part;
            Segment::new(value::as_bytes(&values[*i][p.offset..p.offset + p.len]))
        })
        .await
    }

    /// [`send_pushes`](Self::send_pushes) with each uncompressed part's value given by
    /// `value(index of the part, part)`: host bytes or device memory.
    pub(crate) async fn send_push_parts<'a>(
        &self,
        parts: &'a [(usize, PreparedPart)],
        value: impl Fn(usize, &'a (usize, PreparedPart)) -> Segment<'a>,
    ) -> Result<Sent<'a>, KvError> {
        let requests = parts
            .iter()
            .enumerate()
            .map(|(k, part)| {
                let pp = &part.1;
                let p = pp.part;
                Outgoing {
                    to: self.shared.servers[p.server],
                    ask: Ask::Push {
                        key: p.slot,
                        flags: pp.flags,
                        n_elems: p.len as u64,
                    },
                    value: Some(match &pp.compressed {
                        Some(bytes) => Segment::new(bytes),
                        None => value(k, part),
                    }),
                }
            })
            .collect();
        self.shared.send_all(requests).await
    }

    /// Pushes `values` for `key` and waits until the servers have applied it (in `dist_sync`,
    /// until every worker pushed this round).
    pub async fn push<V: Value>(&self, key: u64, values: &[V]) -> Result<(), KvError> {
        self.push_many(&[key], &[values]).await
    }

    /// Pushes several keys at once.
    pub async fn push_many<V: Value>(&self, keys: &[u64], values: &[&[V]]) -> Result<(), KvError> {
        check_lengths("push", keys.len(), values.len())?;
        let mut parts = Vec::new();
        for (i, (&key, v)) in keys.iter().zip(values).enumerate() {
            let prepared = self.shared.state().prepare_push(key, v, false)?;
            parts.extend(prepared.into_iter().map(|p| (i, p)));
        }
        for wait in self.send_pushes(&parts, values).await? {
            self.shared.settle(wait).await?;
        }
        Ok(())
    }

    /// Pulls `key` into `out`.
    pub async fn pull<V: Value>(&self, key: u64, out: &mut [V]) -> Result<(), KvError> {
        self.pull_many(&[key], &mut [out]).await
    }

    /// Pulls several keys at once.
    pub async fn pull_many<V: Value>(
        &self,
        keys: &[u64],
        outs: &mut [&mut [V]],
    ) -> Result<(), KvError> {
        check_lengths("pull", keys.len(), outs.len())?;
        let mut parts = Vec::new();
        {
            let state = self.shared.state();
            for (i, (&key, out)) in keys.iter().zip(outs.iter()).enumerate() {
                let layout = state.layout(key, out.len(), V::DTYPE)?;
                parts.extend(layout.parts.iter().map(|p| (i, key, *p)));
            }
        }
        let requests = parts
            .iter()
            .map(|&(_, _, p)| Outgoing {
                to: self.shared.servers[p.server],
                ask: Ask::Pull {
                    key: p.slot,
                    n_elems: p.len as u64,
                },
                value: None,
            })
            .collect();
        let waits = self.shared.send_all(requests).await?;
        for ((i, key, p), wait) in parts.into_iter().zip(waits) {
            let value = self.shared.settle(wait).await?;
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
    pub async fn pushpull<V: Value>(
        &self,
        key: u64,
        values: &[V],
        out: &mut [V],
    ) -> Result<(), KvError> {
        self.pushpull_many(&[key], &[values], &mut [out]).await
    }

    /// `pushpull` for several keys at once.
    pub async fn pushpull_many<V: Value, O: AsMut<[V]>>(
        &self,
        keys: &[u64],
        values: &[&[V]],
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
            let prepared = self.shared.state().prepare_push(key, v, true)?;
            parts.extend(prepared.into_iter().map(|p| (i, p)));
        }
        let waits = self.send_pushes(&parts, values).await?;
        for ((i, pp), wait) in parts.iter().zip(waits) {
            let value = self.shared.settle(wait).await?;
            let p = pp.part;
            fill(
                pp.key,
                &mut outs[*i].as_mut()[p.offset..p.offset + p.len],
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
        let rx = self.shared.state().begin_barrier(group)?;
        if let Err(e) = self
            .shared
            .link
            .send(SCHEDULER, &Msg::Barrier { group }, None)
            .await
        {
            self.shared.state().abandon_barrier();
            return Err(e);
        }
        rx.await.unwrap_or(Err(KvError::Shutdown))
    }

    /// Leaves the job cleanly: tells the scheduler this worker is done and waits until the
    /// scheduler ends the job (once every worker is done).
    pub async fn finalize(self) -> Result<(), KvError> {
        self.shared.state().handle_finalize_sent();
        self.shared
            .link
            .send(SCHEDULER, &Msg::Finalize, None)
            .await?;
        loop {
            {
                let state = self.shared.state();
                if state.is_shutdown() {
                    tracing::info!(rank = self.shared.rank, "worker done");
                    if let Some(r) = &self.shared.recorder {
                        r.dump_at_end();
                    }
                    return Ok(());
                }
                if let Some(reason) = state.scheduler_lost() {
                    return Err(KvError::NodeLost {
                        node: describe(SCHEDULER),
                        reason: format!("lost before the job ended: {reason}"),
                    });
                }
            }
            // `notify_one` keeps a permit, so an end that lands between the checks above and
            // this wait is not missed.
            self.shared.ended.notified().await;
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
pub(crate) fn fill<V: Value>(
    key: u64,
    out: &mut [V],
    value: Option<Bytes>,
    from: NodeId,
) -> Result<(), KvError> {
    let bytes = value.unwrap_or_default();
    if bytes.len() != out.len() * V::DTYPE.size() {
        return Err(KvError::Protocol {
            node: describe(from),
            reason: format!(
                "key {key}: answered {} bytes for {} elements",
                bytes.len(),
                out.len()
            ),
        });
    }
    value::copy_from_le(out, &bytes);
    Ok(())
}

/// `PSNET_PARTITION_BYTES` as set, else [`crate::config::DEFAULT_PARTITION_BYTES`] when the
/// job's servers and workers listen on more than one address (more than one host), else 0.
/// Every worker reads the same table from the scheduler, so all choose alike.
fn partition_bytes(config: &KvConfig, nodes: &[crate::proto::msg::NodeInfo]) -> usize {
    config.partition_bytes.unwrap_or_else(|| {
        if spans_hosts(nodes) {
            crate::config::DEFAULT_PARTITION_BYTES
        } else {
            0
        }
    })
}

/// Whether the job's servers and workers listen on more than one address (more than one
/// host; the scheduler carries no values, so its host does not count).
fn spans_hosts(nodes: &[crate::proto::msg::NodeInfo]) -> bool {
    let hosts: std::collections::BTreeSet<std::net::IpAddr> = nodes
        .iter()
        .filter(|n| n.role != Role::Scheduler)
        .map(|n| n.addr.ip())
        .collect();
    hosts.len() > 1
}

#[cfg(test)]
mod tests;
