//! A misbehaving member of a kv job, built from the transport and the kv message codec: it
//! registers, gets its id and token like any worker, and is admitted by every node, so what
//! it sends really reaches the servers. Then it can send anything: raw metadata, wrong
//! sizes, commands the others disagree with. It answers nothing on its own (no heartbeats:
//! the jobs it joins run without them), except that with `PS_RESEND` it wraps what it sends
//! in envelopes and acknowledges what it receives, as a member must.

#![allow(dead_code)]

pub mod job;
pub mod watch;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use psnet_compression::CompressionParams;
use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_kv::proto::admission::{random_bytes, JobAdmission};
use psnet_kv::proto::ids::{self, Group, Role, SCHEDULER};
use psnet_kv::proto::msg::{decode_frame, CommandKind, Envelope, Msg, NodeInfo, PushFlags};
use psnet_transport::{Event, Identity, NodeId, OutMessage, Segment, Transport, TransportError};

/// How long any answer may take before the test fails (a hang is a failure, not a pass).
pub const PATIENCE: Duration = Duration::from_secs(30);

/// What a server answered to one request.
pub type Answer = Result<Option<Bytes>, String>;

/// An admitted worker that sends whatever it is told to.
pub struct Rogue {
    /// Its transport, under its assigned id.
    pub t: TcpTransport,
    /// Its assigned id.
    pub id: NodeId,
    /// Every node of the job, with their public identities.
    pub nodes: Vec<NodeInfo>,
    /// The seed of the identity it registered: it can sign as it likes with it.
    pub seed: [u8; 32],
    next_ts: u64,
    /// `PS_RESEND`: per peer, the last sequence number sent and the last one received.
    resend: Option<Mutex<HashMap<NodeId, (u64, u64)>>>,
}

impl Rogue {
    /// Joins the job whose scheduler listens at `root` as a worker wishing `rank`, over a
    /// transport with `config` (its limits may differ from the job's); `resend`: the job
    /// runs with `PS_RESEND`.
    pub async fn join(root: SocketAddr, rank: u32, config: TcpConfig, resend: bool) -> Rogue {
        let t = TcpTransport::bind(NodeId(0), config).await.expect("bind");
        let seed = random_bytes();
        t.set_local_id(ids::provisional_id(t.listen_addr()));
        t.connect(SCHEDULER, root)
            .await
            .expect("reach the scheduler");
        let register = Msg::Register {
            role: Role::Worker,
            addr: t.listen_addr(),
            rank_hint: Some(rank),
            recovery: None,
            identity: Identity::from_seed(seed).public(),
        };
        let meta = register.encode();
        t.send(SCHEDULER, OutMessage::new(&meta, &[]))
            .await
            .unwrap();
        let (id, nodes) = loop {
            let m = match tokio::time::timeout(PATIENCE, t.recv()).await {
                Ok(Ok(Event::Message(m))) => m,
                Ok(Ok(_)) => continue,
                other => panic!("no assignment: {other:?}"),
            };
            match Msg::decode(&m.meta).expect("a bare assignment") {
                Msg::Assign { your_id, nodes } => break (your_id, nodes),
                other => panic!("registration answered with {other:?}"),
            }
        };
        assert_eq!(ids::role_rank(id), Some((Role::Worker, rank)));
        t.set_admission(Arc::new(JobAdmission::member(
            id,
            Identity::from_seed(seed),
            &nodes,
        )));
        t.set_local_id(id);
        t.disconnect(SCHEDULER);
        t.connect(SCHEDULER, root)
            .await
            .expect("reconnect as a member");
        let rogue = Rogue {
            t,
            id,
            nodes,
            seed,
            next_ts: 1,
            resend: resend.then(|| Mutex::new(HashMap::new())),
        };
        rogue.barrier(Group::ALL).await;
        for s in rogue.servers() {
            let addr = rogue.addr_of(s);
            rogue.t.connect(s, addr).await.expect("connect to a server");
        }
        rogue
    }

    /// The servers' ids, by rank.
    pub fn servers(&self) -> Vec<NodeId> {
        let mut s: Vec<&NodeInfo> = self
            .nodes
            .iter()
            .filter(|n| n.role == Role::Server)
            .collect();
        s.sort_by_key(|n| n.rank);
        s.into_iter().map(|n| n.id).collect()
    }

    /// Where `id` listens.
    pub fn addr_of(&self, id: NodeId) -> SocketAddr {
        self.nodes.iter().find(|n| n.id == id).expect("a node").addr
    }

    /// A fresh request id.
    pub fn ts(&mut self) -> u64 {
        let ts = self.next_ts;
        self.next_ts += 1;
        ts
    }

    /// Sends raw metadata and segments to `to` (in a `PS_RESEND` envelope when the job
    /// runs with it).
    pub async fn send_raw(
        &self,
        to: NodeId,
        meta: &[u8],
        segments: &[&[u8]],
    ) -> Result<(), TransportError> {
        let meta = match &self.resend {
            Some(links) => {
                let seq = {
                    let mut links = links.lock().unwrap();
                    let link = links.entry(to).or_default();
                    link.0 += 1;
                    link.0
                };
                Envelope {
                    seq: Some(seq),
                    ack: None,
                }
                .encode(meta)
            }
            None => meta.to_vec(),
        };
        let segs: Vec<Segment<'_>> = segments.iter().map(|s| Segment::new(s)).collect();
        self.t.send(to, OutMessage::new(&meta, &segs)).await
    }

    /// Sends a kv message with these segments.
    pub async fn send(&self, to: NodeId, msg: &Msg, segments: &[&[u8]]) {
        self.send_raw(to, &msg.encode(), segments)
            .await
            .unwrap_or_else(|e| panic!("sending {msg:?}: {e}"));
    }

    /// The next kv message, whoever sends it (events that are not messages, acknowledgements
    /// and duplicates are skipped; with `PS_RESEND` every message is acknowledged).
    pub async fn next(&self) -> (NodeId, Msg, Vec<Bytes>) {
        tokio::time::timeout(PATIENCE, async {
            loop {
                let m = match self.t.recv().await.expect("rogue transport open") {
                    Event::Message(m) => m,
                    Event::PeerLost { peer, reason } => {
                        tracing::info!(%peer, %reason, "rogue: connection lost");
                        continue;
                    }
                    Event::PeerConnected { .. } => continue,
                };
                let (envelope, msg) = decode_frame(&m.meta).expect("kv metadata from the job");
                if let (Some(links), Some(Envelope { seq: Some(seq), .. })) =
                    (&self.resend, envelope)
                {
                    let (fresh, last) = {
                        let mut links = links.lock().unwrap();
                        let link = links.entry(m.peer).or_default();
                        let fresh = seq > link.1;
                        link.1 = link.1.max(seq);
                        (fresh, link.1)
                    };
                    let ack = Envelope {
                        seq: None,
                        ack: Some(last + 1),
                    }
                    .encode(&[]);
                    let _ = self.t.send(m.peer, OutMessage::new(&ack, &[])).await;
                    if !fresh {
                        continue;
                    }
                }
                if let Some(msg) = msg {
                    return (m.peer, msg, m.segments.into_iter().collect());
                }
            }
        })
        .await
        .expect("no answer in time: the job hangs")
    }

    /// Waits for the answer to request `ts` from `server`; other messages are skipped.
    pub async fn answer(&self, server: NodeId, ts: u64) -> Answer {
        loop {
            let (from, msg, mut segments) = self.next().await;
            match msg {
                Msg::Done { ts: t } if t == ts && from == server => {
                    return Ok((!segments.is_empty()).then(|| segments.remove(0)));
                }
                Msg::Failed { ts: t, reason } if t == ts && from == server => return Err(reason),
                _ => {}
            }
        }
    }

    /// Sends `msg` (built for a fresh request id) with `segments` to `server` and waits for
    /// its answer.
    pub async fn request(
        &mut self,
        server: NodeId,
        msg: impl FnOnce(u64) -> Msg,
        segments: &[&[u8]],
    ) -> Answer {
        let ts = self.ts();
        self.send(server, &msg(ts), segments).await;
        self.answer(server, ts).await
    }

    /// A push of `values` to `key`, as an honest worker sends it.
    pub async fn push(&mut self, server: NodeId, key: u64, values: &[f32]) -> Answer {
        let bytes = f32_bytes(values);
        self.request(
            server,
            |ts| Msg::Push {
                ts,
                key,
                flags: PushFlags::default(),
                n_elems: values.len() as u64,
                priority: 0,
            },
            &[&bytes],
        )
        .await
    }

    /// Enters a barrier of `group` and waits for it.
    pub async fn barrier(&self, group: Group) {
        self.send(SCHEDULER, &Msg::Barrier { group }, &[]).await;
        loop {
            let (from, msg, _) = self.next().await;
            match msg {
                Msg::BarrierDone { group: g } if g == group && from == SCHEDULER => return,
                Msg::BarrierFailed { reason, .. } => panic!("barrier failed: {reason}"),
                _ => {}
            }
        }
    }

    /// Waits until the connection to `peer` is lost, and returns why.
    pub async fn wait_lost(&self, peer: NodeId) -> String {
        tokio::time::timeout(PATIENCE, async {
            loop {
                match self.t.recv().await.expect("rogue transport open") {
                    Event::PeerLost { peer: p, reason } if p == peer => return reason,
                    _ => {}
                }
            }
        })
        .await
        .expect("the connection stays up")
    }

    /// Leaves the job as a worker does: `Finalize`, then wait for the scheduler's shutdown.
    pub async fn finalize(self) {
        self.send(SCHEDULER, &Msg::Finalize, &[]).await;
        loop {
            if let (SCHEDULER, Msg::Shutdown, _) = self.next().await {
                break;
            }
        }
        self.t.shutdown();
    }
}

/// The wire bytes of f32 values (little-endian).
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The error text of a refused request (a `Done` where a refusal was due fails the test).
pub fn refused(answer: Answer) -> String {
    match answer {
        Err(reason) => reason,
        Ok(v) => panic!("the server accepted a bad request (answered {v:?})"),
    }
}

/// Asserts that `reason` names every one of `parts`.
pub fn assert_names(reason: &str, parts: &[&str]) {
    for p in parts {
        assert!(reason.contains(p), "{reason:?} does not name {p:?}");
    }
}

/// A push of `n_elems` elements to `key`, for a request id.
pub fn push_msg(key: u64, n_elems: u64) -> impl FnOnce(u64) -> Msg {
    move |ts| Msg::Push {
        ts,
        key,
        flags: PushFlags::default(),
        n_elems,
        priority: 0,
    }
}

/// A pull of `n_elems` elements of `key`, for a request id.
pub fn pull_msg(key: u64, n_elems: u64) -> impl FnOnce(u64) -> Msg {
    move |ts| Msg::Pull {
        ts,
        key,
        n_elems,
        have: None,
        priority: 0,
    }
}

/// An init of `n_elems` elements of `key`, for a request id.
pub fn init_msg(key: u64, n_elems: u64) -> impl FnOnce(u64) -> Msg {
    move |ts| Msg::Push {
        ts,
        key,
        flags: PushFlags {
            init: true,
            ..PushFlags::default()
        },
        n_elems,
        priority: 0,
    }
}

/// `values` compressed with 2-bit compression at `threshold`, from a zero residual.
pub fn two_bit(threshold: f32, values: &[f32]) -> Vec<u8> {
    let params = CompressionParams::two_bit(threshold).unwrap();
    let c = params.compressor().unwrap().expect("a compressor");
    let mut residual = vec![0.0; values.len()];
    let mut out = vec![0u8; c.compressed_len(values.len())];
    c.quantize(values, &mut residual, &mut out).unwrap();
    out
}

/// A compressed push of `n_elems` elements of key 1, for a request id.
pub fn compressed_push(n_elems: u64) -> impl FnOnce(u64) -> Msg {
    move |ts| Msg::Push {
        ts,
        key: 1,
        flags: PushFlags {
            compressed: true,
            ..PushFlags::default()
        },
        n_elems,
        priority: 0,
    }
}

/// A compressed push of packed codes (`psnet_kv::proto::packed`) of `n_elems` elements to key
/// 1, for a request id.
pub fn packed_push(n_elems: u64) -> impl FnOnce(u64) -> Msg {
    move |ts| Msg::Push {
        ts,
        key: 1,
        flags: PushFlags {
            compressed: true,
            packed: true,
            ..PushFlags::default()
        },
        n_elems,
        priority: 0,
    }
}

/// A compression command, for a request id.
pub fn set_compression(params: CompressionParams) -> impl FnOnce(u64) -> Msg {
    move |ts| Msg::Command {
        ts,
        kind: CommandKind::SetCompression,
        body: params.to_string(),
    }
}
