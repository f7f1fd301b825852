//! The kv store's messages: their metadata encoding (versioned, little-endian, every length
//! bounded before use) and which data segments go with them.
//!
//! Values travel as data segments of the transport message, never inside the metadata: a push
//! carries its values (f32 little-endian, or compressed bytes) in segment 0; a pull answer and
//! a push-pull acknowledgement carry the value in segment 0.
//!
//! With `PS_RESEND` on, the metadata of messages between registered nodes starts with an
//! [`Envelope`] (a sequence number and/or an acknowledgement, see [`super::resend`]); its first
//! byte, [`ENVELOPE`], can never start a bare message, so [`decode_frame`] tells them apart
//! and a node without `PS_RESEND` refuses enveloped messages with a clear error.

use std::net::SocketAddr;

use psnet_transport::le::{LeReader, LeWriter};
use psnet_transport::{NodeId, PublicIdentity};

use super::ids::{Group, Role};
use super::pulled::Form;
use super::recovery::CREDENTIAL_LEN;
use crate::value::Dtype;

mod codec;

use codec::{Reader, Writer};

/// The kv protocol version in every message.
pub const VERSION: u8 = 9;
/// Longest string field (reasons, optimizer and compression specs).
pub const MAX_STRING: usize = 64 << 10;
/// Most nodes in an assignment.
pub const MAX_NODES: usize = 1 << 16;
/// First byte of a `PS_RESEND` envelope: `0xE0` marks an envelope, the low nibble is the
/// envelope's version (1). Bare messages start with [`VERSION`].
pub const ENVELOPE: u8 = 0xE1;
/// Most bytes an envelope adds in front of a message (marker, flags, sequence number, ack).
pub const ENVELOPE_LEN: usize = 18;

/// The request id of a `Failed` answer to metadata whose own request id could not be read:
/// workers number their requests from 1, so it never names one of theirs.
pub const NO_REQUEST: u64 = 0;

/// `Register`'s rank hint when the node wishes none.
const NO_RANK_HINT: u32 = u32::MAX;
const HAS_SEQ: u8 = 1;
const HAS_ACK: u8 = 2;

/// A node of the job, as the scheduler announces it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    /// Assigned id.
    pub id: NodeId,
    /// Role.
    pub role: Role,
    /// Rank within the role.
    pub rank: u32,
    /// Where it listens.
    pub addr: SocketAddr,
    /// The public half of the identity it proves its id with when it connects
    /// ([`super::admission`]): each node draws its own, and its private half never leaves the
    /// node, so a table gives nobody the means to prove another node's id.
    pub identity: PublicIdentity,
}

/// Commands a worker sends to every server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommandKind {
    /// Body: an optimizer spec (JSON) the servers build their updater from.
    SetOptimizer,
    /// Body: a gradient-compression spec (JSON), with the exact threshold.
    SetCompression,
    /// Body: `sync` or `async`.
    SetMode,
    /// Body: empty. Write a snapshot of the server's shard now (servers with
    /// `PSNET_CHECKPOINT_DIR`); answered once it is written.
    Checkpoint,
}

impl CommandKind {
    /// The command's code on the wire (and in server journals).
    pub fn code(self) -> u8 {
        match self {
            CommandKind::SetOptimizer => 0,
            CommandKind::SetCompression => 1,
            CommandKind::SetMode => 2,
            CommandKind::Checkpoint => 3,
        }
    }

    /// The command of a code, if any.
    pub fn from_code(c: u8) -> Option<Self> {
        match c {
            0 => Some(CommandKind::SetOptimizer),
            1 => Some(CommandKind::SetCompression),
            2 => Some(CommandKind::SetMode),
            3 => Some(CommandKind::Checkpoint),
            _ => None,
        }
    }
}

/// Flags of a push.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PushFlags {
    /// Initialization: store the value as is (no merge, no updater).
    pub init: bool,
    /// The payload is compressed with the servers' compression setting.
    pub compressed: bool,
    /// Answer with the updated value once the round completes (push-pull in one exchange).
    pub pull_back: bool,
    /// Sent again to a server that restarted and rejoined the job: how many of this worker's
    /// pushes of this key that server acknowledged before this one. The push is this
    /// worker's update number `n` (from 0) of the key, so a server whose key has taken that
    /// update already (it was applied and journaled, but the answer died with the server)
    /// answers it without applying it twice. An init sent again is answered without
    /// storing it when the key exists.
    pub retry: Option<u64>,
    /// The values' element type (an init's sets the key's; every other push must match it).
    pub dtype: Dtype,
    /// With compressed pulls and `pull_back`: the version of this worker's copy of the key
    /// (see [`crate::proto::pulled`]); `None`: it holds none.
    pub have: Option<u64>,
    /// A compressed push's codes are packed ([`crate::proto::packed`]).
    pub packed: bool,
}

impl PushFlags {
    fn bits(self) -> u8 {
        u8::from(self.init)
            | (u8::from(self.compressed) << 1)
            | (u8::from(self.pull_back) << 2)
            | (u8::from(self.retry.is_some()) << 3)
            | (self.dtype.code() << 4)
            | (u8::from(self.have.is_some()) << 6)
            | (u8::from(self.packed) << 7)
    }

    /// The flags of `b`, whether a retry's count follows the push's other fields, and whether
    /// a copy's version follows that.
    fn from_bits(b: u8) -> Result<(Self, bool, bool), DecodeError> {
        let dtype =
            Dtype::from_code((b >> 4) & 0b11).ok_or(DecodeError::Invalid("unknown value type"))?;
        let flags = PushFlags {
            init: b & 1 != 0,
            compressed: b & 2 != 0,
            pull_back: b & 4 != 0,
            retry: None,
            dtype,
            have: None,
            packed: b & 128 != 0,
        };
        Ok((flags, b & 8 != 0, b & 64 != 0))
    }
}

/// One kv message's metadata.
#[derive(Clone, Debug, PartialEq)]
pub enum Msg {
    /// Node to scheduler: here I am.
    Register {
        /// Its role.
        role: Role,
        /// Where it listens.
        addr: SocketAddr,
        /// The rank it wishes (`DMLC_WORKER_ID` / `DMLC_SERVER_ID`).
        rank_hint: Option<u32>,
        /// A restarted server's recovery credential for its rank (read from its checkpoint
        /// directory): a lost rank is given back only to a server that shows the credential
        /// whose commitment the lost server sent ([`Msg::RecoveryKey`]).
        recovery: Option<[u8; CREDENTIAL_LEN]>,
        /// The public half of the identity the node drew for itself ([`super::admission`]).
        identity: PublicIdentity,
    },
    /// Server to scheduler, once assigned (or reassigned): the commitment to the recovery
    /// credential it keeps in its checkpoint directory ([`super::recovery`]).
    RecoveryKey {
        /// `commitment(credential)`.
        commit: [u8; CREDENTIAL_LEN],
    },
    /// Scheduler to node: your id, and everyone.
    Assign {
        /// The node's assigned id.
        your_id: NodeId,
        /// All nodes, scheduler included.
        nodes: Vec<NodeInfo>,
    },
    /// Scheduler to a restarted server that registered for the rank of a server the job lost:
    /// its old id again (with a fresh token) and every node; the job is running, so there is
    /// no start-up barrier.
    Reassign {
        /// The node's id, the lost server's.
        your_id: NodeId,
        /// All nodes, scheduler included.
        nodes: Vec<NodeInfo>,
    },
    /// Scheduler to the other members: a lost server was restarted and took its id back; it
    /// listens at a new address and proves its id with a new token.
    Rejoined {
        /// The server as it is now.
        node: NodeInfo,
    },
    /// Node to scheduler: entering a barrier of `group`.
    Barrier {
        /// The group.
        group: Group,
    },
    /// Scheduler to members: the barrier is complete.
    BarrierDone {
        /// The group.
        group: Group,
    },
    /// Scheduler to members: the barrier cannot complete.
    BarrierFailed {
        /// The group.
        group: Group,
        /// Why (names the dead node).
        reason: String,
    },
    /// Node to scheduler: alive; the scheduler answers in kind, so that nodes can tell a
    /// stopped scheduler from a quiet one.
    Heartbeat,
    /// Scheduler to everyone: a node died or stopped answering.
    NodeFailed {
        /// The node.
        id: NodeId,
        /// What was seen.
        reason: String,
    },
    /// Worker to scheduler: done; the job ends when every worker is.
    Finalize,
    /// Scheduler to everyone: the job is over, exit.
    Shutdown,
    /// A node to the peers it serves, just before it exits on an error: why, so that their
    /// errors name the cause rather than only the closed connection.
    Leaving {
        /// Why it leaves.
        reason: String,
    },
    /// Worker to server: a command, acknowledged with `Done`.
    Command {
        /// Request id.
        ts: u64,
        /// Which.
        kind: CommandKind,
        /// Its argument.
        body: String,
    },
    /// Worker to server: values for `key` in segment 0.
    Push {
        /// Request id.
        ts: u64,
        /// The key.
        key: u64,
        /// What kind of push.
        flags: PushFlags,
        /// Elements of this server's part (the payload may be compressed).
        n_elems: u64,
        /// Where the answer goes in the server's queue to this worker: higher first, equal
        /// ones in the order they came (MXNet's `priority`; psnet's worker sends a key's
        /// declaration order, first declared highest, as BytePS does).
        priority: i32,
    },
    /// Worker to server: send me `key`.
    Pull {
        /// Request id.
        ts: u64,
        /// The key.
        key: u64,
        /// Elements expected.
        n_elems: u64,
        /// With compressed pulls: the version of this worker's copy of the key; `None`: it
        /// holds none.
        have: Option<u64>,
        /// As a push's.
        priority: i32,
    },
    /// Worker to server: send me these element ranges of keys this server holds (a
    /// row-sparse pull: the rows asked for, in every part or piece of the table here), listed
    /// in segment 0 as `n_ranges` little-endian u64 triples `(key, start, len)`; a key's
    /// ranges come in increasing order, not overlapping. Answered `Done` with the elements of
    /// the ranges, one after another, each in its key's type.
    PullRanges {
        /// Request id.
        ts: u64,
        /// Ranges listed in segment 0.
        n_ranges: u64,
        /// As a push's.
        priority: i32,
    },
    /// Worker to server: a row-sparse push of the key `key` (an embedding table's rows one
    /// step touched), its values for the element ranges it lists, in every part or piece of
    /// the key this server holds. Segment 0 holds the list, `n_ranges` little-endian u64
    /// triples `(slot, start, len)` (a part's ranges in increasing order, not overlapping;
    /// `(slot, 0, 0)` names a part the push touches nowhere, so that every part of the key
    /// here is listed), then the values of the ranges one after another in `dtype`.
    /// Answered `Done` (in `dist_sync` once every worker pushed the key to this server).
    PushRanges {
        /// Request id.
        ts: u64,
        /// The key as the worker declared it (its parts are listed as slots).
        key: u64,
        /// The values' element type.
        dtype: Dtype,
        /// Sent again to a restarted server: as a push's [`PushFlags::retry`].
        retry: Option<u64>,
        /// Triples listed in segment 0.
        n_ranges: u64,
        /// As a push's.
        priority: i32,
    },
    /// Server to worker: request `ts` done, a compressed pull's answer: the copy of version
    /// `version` of the key, read as `form` says (in segment 0, but for [`Form::Same`]).
    Pulled {
        /// Request id.
        ts: u64,
        /// The version of the copy the worker holds once it applied the answer.
        version: u64,
        /// Whole values, codes of the change, or nothing.
        form: Form,
    },
    /// Server to worker: request `ts` done (a value, if any, in segment 0).
    Done {
        /// Request id.
        ts: u64,
    },
    /// Server to worker: request `ts` failed.
    Failed {
        /// Request id.
        ts: u64,
        /// Why.
        reason: String,
    },
    /// Server to worker: request `ts` cannot complete because node `lost` of the job is gone
    /// (a `dist_sync` round that waited for it): the worker fails on another's account.
    PeerFailed {
        /// Request id.
        ts: u64,
        /// The node that is gone.
        lost: NodeId,
        /// Why.
        reason: String,
    },
}

/// Malformed kv metadata.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Ended early.
    #[error("kv message truncated")]
    Truncated,
    /// Another protocol version.
    #[error("kv protocol version {0}, this build speaks {VERSION}")]
    Version(u8),
    /// Unknown message tag.
    #[error("unknown kv message tag {0}")]
    UnknownTag(u8),
    /// A field out of range.
    #[error("invalid kv message: {0}")]
    Invalid(&'static str),
    /// Bytes left over after the message.
    #[error("{0} trailing bytes after the kv message")]
    Trailing(usize),
    /// More data segments than the message carries.
    #[error("a kv {what} carries {got} data segment(s), at most {most}")]
    Segments {
        /// The message's kind.
        what: &'static str,
        /// Segments received.
        got: usize,
        /// Segments it may carry.
        most: usize,
    },
    /// A `PS_RESEND` envelope reached a decoder of bare messages.
    #[error(
        "the message carries a PS_RESEND envelope but this node runs without PS_RESEND \
         (set PS_RESEND the same on every node)"
    )]
    Enveloped,
}

/// `PS_RESEND`'s envelope around a kv message: the message's sequence number on its
/// sender-to-receiver direction, an acknowledgement for the opposite direction, or both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Envelope {
    /// Sequence number of the enclosed message (from 1); None: no message, an ack alone.
    pub seq: Option<u64>,
    /// Cumulative acknowledgement: every message with a lower sequence number sent by the
    /// receiver of this envelope to its sender has arrived (at least 1).
    pub ack: Option<u64>,
}

impl Envelope {
    /// The metadata block: the envelope, then `msg` (an encoded [`Msg`]; empty exactly when
    /// `seq` is None).
    pub fn encode(&self, msg: &[u8]) -> Vec<u8> {
        let mut w = Writer(LeWriter::with_capacity(ENVELOPE_LEN + msg.len()));
        let flags = self.seq.map_or(0, |_| HAS_SEQ) | self.ack.map_or(0, |_| HAS_ACK);
        w.u8(ENVELOPE).u8(flags);
        if let Some(seq) = self.seq {
            w.u64(seq);
        }
        if let Some(ack) = self.ack {
            w.u64(ack);
        }
        w.0.bytes(msg);
        w.0.into_vec()
    }
}

/// Parses a metadata block that may start with an [`Envelope`]: a bare message gives
/// `(None, Some(msg))`, an enveloped one `(Some(envelope), msg)` where `msg` is present
/// exactly when the envelope has a sequence number. Any malformed input is an error.
pub fn decode_frame(bytes: &[u8]) -> Result<(Option<Envelope>, Option<Msg>), DecodeError> {
    let (envelope, body) = split_frame(bytes)?;
    Ok((envelope, body.map(Msg::decode).transpose()?))
}

/// Splits a metadata block into its [`Envelope`], if any, and the bytes of the message it
/// carries, still to decode (None: an acknowledgement alone). A malformed envelope is an
/// error; the message bytes are not looked at, so that a receiver can take the envelope's
/// sequence number even when the message turns out to be unreadable.
pub fn split_frame(bytes: &[u8]) -> Result<(Option<Envelope>, Option<&[u8]>), DecodeError> {
    if bytes.first() != Some(&ENVELOPE) {
        return Ok((None, Some(bytes)));
    }
    let mut r = Reader(LeReader::new(&bytes[1..]));
    let flags = r.u8()?;
    if flags == 0 || flags & !(HAS_SEQ | HAS_ACK) != 0 {
        return Err(DecodeError::Invalid("bad envelope flags"));
    }
    let seq = if flags & HAS_SEQ != 0 {
        Some(r.u64()?)
    } else {
        None
    };
    let ack = if flags & HAS_ACK != 0 {
        Some(r.u64()?)
    } else {
        None
    };
    if seq == Some(0) || ack == Some(0) {
        return Err(DecodeError::Invalid("envelope numbers start at 1"));
    }
    let rest = r.0.rest();
    let body = match (seq, rest.is_empty()) {
        (Some(_), true) => return Err(DecodeError::Invalid("envelope without its message")),
        (Some(_), false) => {
            if rest[0] == ENVELOPE {
                return Err(DecodeError::Invalid("nested envelope"));
            }
            Some(rest)
        }
        (None, true) => None,
        (None, false) => return Err(DecodeError::Trailing(rest.len())),
    };
    Ok((Some(Envelope { seq, ack }), body))
}

/// Which exchange unreadable metadata belongs to, as far as its first bytes tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exchange {
    /// A request (`Command`, `Push`, `Pull`) with this request id: answer it `Failed`.
    Request(u64),
    /// An answer (`Done`, `Failed`) to this request id: fail that request.
    Answer(u64),
}

/// The request id of metadata that [`Msg::decode`] refused, when it starts like a message of
/// this version that carries one (version, tag, then the id): a receiver can still answer the
/// request, or fail the request it answers, instead of leaving its sender waiting.
pub fn peek_exchange(bytes: &[u8]) -> Option<Exchange> {
    let mut r = LeReader::new(bytes);
    if r.u8().ok()? != VERSION {
        return None;
    }
    let tag = r.u8().ok()?;
    let ts = r.u64().ok()?;
    match tag {
        10..=12 | 21 | 22 => Some(Exchange::Request(ts)),
        13 | 14 | 20 => Some(Exchange::Answer(ts)),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
