//! How each message is written to and read from its metadata bytes.

use std::net::SocketAddr;

use psnet_transport::le::{LeReader, LeWriter, Truncated};
use psnet_transport::{NodeId, PublicIdentity, IDENTITY_LEN};

use super::*;

/// The kv codec's fields over the shared bounded little-endian writer.
pub(super) struct Writer(pub(super) LeWriter);

impl Writer {
    pub(super) fn u8(&mut self, v: u8) -> &mut Self {
        self.0.u8(v);
        self
    }
    pub(super) fn u32(&mut self, v: u32) -> &mut Self {
        self.0.u32(v);
        self
    }
    pub(super) fn u64(&mut self, v: u64) -> &mut Self {
        self.0.u64(v);
        self
    }
    pub(super) fn str(&mut self, s: &str) -> &mut Self {
        // Encoding never fails: an over-long string is cut at a character boundary.
        let mut end = s.len().min(MAX_STRING);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u32(end as u32);
        self.0.bytes(&s.as_bytes()[..end]);
        self
    }
    pub(super) fn addr(&mut self, a: SocketAddr) -> &mut Self {
        self.str(&a.to_string())
    }
    pub(super) fn node(&mut self, n: &NodeInfo) -> &mut Self {
        self.u64(n.id.0).u8(n.role.code()).u32(n.rank).addr(n.addr);
        self.0.bytes(&n.identity.0);
        self
    }
}

/// The kv codec's fields over the shared bounded little-endian reader.
pub(super) struct Reader<'a>(pub(super) LeReader<'a>);

impl From<Truncated> for DecodeError {
    fn from(_: Truncated) -> Self {
        DecodeError::Truncated
    }
}

impl<'a> Reader<'a> {
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        Ok(self.0.take(n)?)
    }
    pub(super) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.0.u8()?)
    }
    pub(super) fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(self.0.u32()?)
    }
    pub(super) fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(self.0.u64()?)
    }
    pub(super) fn str(&mut self) -> Result<String, DecodeError> {
        let len = self.u32()? as usize;
        if len > MAX_STRING {
            return Err(DecodeError::Invalid("string longer than 64 KiB"));
        }
        String::from_utf8(self.take(len)?.to_vec())
            .map_err(|_| DecodeError::Invalid("string is not UTF-8"))
    }
    pub(super) fn addr(&mut self) -> Result<SocketAddr, DecodeError> {
        self.str()?
            .parse()
            .map_err(|_| DecodeError::Invalid("bad socket address"))
    }
    pub(super) fn credential(&mut self) -> Result<[u8; CREDENTIAL_LEN], DecodeError> {
        Ok(self.take(CREDENTIAL_LEN)?.try_into().expect("taken"))
    }
    pub(super) fn role(&mut self) -> Result<Role, DecodeError> {
        Role::from_code(self.u8()?).ok_or(DecodeError::Invalid("unknown role"))
    }
    pub(super) fn node(&mut self) -> Result<NodeInfo, DecodeError> {
        Ok(NodeInfo {
            id: NodeId(self.u64()?),
            role: self.role()?,
            rank: self.u32()?,
            addr: self.addr()?,
            identity: self.identity()?,
        })
    }
    pub(super) fn identity(&mut self) -> Result<PublicIdentity, DecodeError> {
        Ok(PublicIdentity(
            self.take(IDENTITY_LEN)?.try_into().expect("taken"),
        ))
    }
    pub(super) fn group(&mut self) -> Result<Group, DecodeError> {
        let g = self.u8()?;
        if g == 0 || g & !7 != 0 {
            return Err(DecodeError::Invalid("bad group"));
        }
        Ok(Group(g))
    }
}

impl Msg {
    pub(super) fn tag(&self) -> u8 {
        match self {
            Msg::Register { .. } => 1,
            Msg::RecoveryKey { .. } => 18,
            Msg::Assign { .. } => 2,
            Msg::Barrier { .. } => 3,
            Msg::BarrierDone { .. } => 4,
            Msg::BarrierFailed { .. } => 5,
            Msg::Heartbeat => 6,
            Msg::NodeFailed { .. } => 7,
            Msg::Finalize => 8,
            Msg::Shutdown => 9,
            Msg::Command { .. } => 10,
            Msg::Push { .. } => 11,
            Msg::Pull { .. } => 12,
            Msg::PullRanges { .. } => 21,
            Msg::PushRanges { .. } => 22,
            Msg::Done { .. } => 13,
            Msg::Pulled { .. } => 20,
            Msg::Failed { .. } => 14,
            Msg::PeerFailed { .. } => 19,
            Msg::Leaving { .. } => 15,
            Msg::Rejoined { .. } => 16,
            Msg::Reassign { .. } => 17,
        }
    }

    /// Whether the message carries a secret (a restarted server's recovery credential): the
    /// transport then seals it where it has a session, `PSNET_ENCRYPT` or not.
    pub fn is_confidential(&self) -> bool {
        matches!(
            self,
            Msg::Register {
                recovery: Some(_),
                ..
            }
        )
    }

    /// Refuses more data segments than this message carries: a push and a `Done` carry at
    /// most one (the values), every other message none.
    pub fn check_segments(&self, got: usize) -> Result<(), DecodeError> {
        let (what, most) = match self {
            Msg::Push { .. } => ("push", 1),
            Msg::Done { .. } | Msg::Pulled { .. } => ("answer", 1),
            Msg::Pull { .. } => ("pull", 0),
            Msg::PullRanges { .. } => ("row pull", 1),
            Msg::PushRanges { .. } => ("row push", 1),
            Msg::Command { .. } => ("command", 0),
            _ => ("control message", 0),
        };
        if got > most {
            return Err(DecodeError::Segments { what, got, most });
        }
        Ok(())
    }

    /// The metadata bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer(LeWriter::with_capacity(32));
        w.u8(VERSION).u8(self.tag());
        match self {
            Msg::Register {
                role,
                addr,
                rank_hint,
                recovery,
                identity,
            } => {
                w.u8(role.code())
                    .addr(*addr)
                    .u32(rank_hint.unwrap_or(NO_RANK_HINT));
                w.0.bytes(&identity.0);
                match recovery {
                    Some(c) => {
                        w.u8(1);
                        w.0.bytes(c);
                    }
                    None => {
                        w.u8(0);
                    }
                }
            }
            Msg::RecoveryKey { commit } => {
                w.0.bytes(commit);
            }
            Msg::Assign { your_id, nodes } | Msg::Reassign { your_id, nodes } => {
                w.u64(your_id.0).u32(nodes.len().min(MAX_NODES) as u32);
                for n in nodes.iter().take(MAX_NODES) {
                    w.node(n);
                }
            }
            Msg::Rejoined { node } => {
                w.node(node);
            }
            Msg::Barrier { group } | Msg::BarrierDone { group } => {
                w.u8(group.0);
            }
            Msg::BarrierFailed { group, reason } => {
                w.u8(group.0).str(reason);
            }
            Msg::Heartbeat | Msg::Finalize | Msg::Shutdown => {}
            Msg::NodeFailed { id, reason } => {
                w.u64(id.0).str(reason);
            }
            Msg::Leaving { reason } => {
                w.str(reason);
            }
            Msg::Command { ts, kind, body } => {
                w.u64(*ts).u8(kind.code()).str(body);
            }
            Msg::Push {
                ts,
                key,
                flags,
                n_elems,
                priority,
            } => {
                w.u64(*ts).u64(*key).u8(flags.bits()).u64(*n_elems);
                if let Some(n) = flags.retry {
                    w.u64(n);
                }
                if let Some(v) = flags.have {
                    w.u64(v);
                }
                w.u32(*priority as u32);
            }
            Msg::Pull {
                ts,
                key,
                n_elems,
                have,
                priority,
            } => {
                w.u64(*ts).u64(*key).u64(*n_elems);
                match have {
                    Some(v) => w.u8(1).u64(*v),
                    None => w.u8(0),
                };
                w.u32(*priority as u32);
            }
            Msg::PullRanges {
                ts,
                n_ranges,
                priority,
            } => {
                w.u64(*ts).u64(*n_ranges).u32(*priority as u32);
            }
            Msg::PushRanges {
                ts,
                key,
                dtype,
                retry,
                n_ranges,
                priority,
            } => {
                w.u64(*ts).u64(*key).u8(dtype.code());
                match retry {
                    Some(n) => w.u8(1).u64(*n),
                    None => w.u8(0),
                };
                w.u64(*n_ranges).u32(*priority as u32);
            }
            Msg::Pulled { ts, version, form } => {
                w.u64(*ts).u64(*version);
                match form {
                    Form::Full => w.u8(0),
                    Form::Delta { scale } => w.u8(1).u32(scale.to_bits()),
                    Form::Same => w.u8(2),
                    Form::Packed { scale } => w.u8(3).u32(scale.to_bits()),
                };
            }
            Msg::Done { ts } => {
                w.u64(*ts);
            }
            Msg::Failed { ts, reason } => {
                w.u64(*ts).str(reason);
            }
            Msg::PeerFailed { ts, lost, reason } => {
                w.u64(*ts).u64(lost.0).str(reason);
            }
        }
        w.0.into_vec()
    }

    /// Parses metadata; any malformed input is an error.
    pub fn decode(bytes: &[u8]) -> Result<Msg, DecodeError> {
        let mut r = Reader(LeReader::new(bytes));
        let version = r.u8()?;
        if version == ENVELOPE {
            return Err(DecodeError::Enveloped);
        }
        if version != VERSION {
            return Err(DecodeError::Version(version));
        }
        let msg = match r.u8()? {
            1 => Msg::Register {
                role: r.role()?,
                addr: r.addr()?,
                rank_hint: Some(r.u32()?).filter(|&h| h != NO_RANK_HINT),
                identity: r.identity()?,
                recovery: match r.u8()? {
                    0 => None,
                    1 => Some(r.credential()?),
                    _ => return Err(DecodeError::Invalid("bad recovery flag")),
                },
            },
            18 => Msg::RecoveryKey {
                commit: r.credential()?,
            },
            tag @ (2 | 17) => {
                let your_id = NodeId(r.u64()?);
                let count = r.u32()? as usize;
                if count > MAX_NODES {
                    return Err(DecodeError::Invalid("too many nodes"));
                }
                // Each entry takes at least 33 bytes: bound the allocation by the input.
                let mut nodes = Vec::with_capacity(count.min(r.0.remaining() / 33));
                for _ in 0..count {
                    nodes.push(r.node()?);
                }
                if tag == 2 {
                    Msg::Assign { your_id, nodes }
                } else {
                    Msg::Reassign { your_id, nodes }
                }
            }
            16 => Msg::Rejoined { node: r.node()? },
            3 => Msg::Barrier { group: r.group()? },
            4 => Msg::BarrierDone { group: r.group()? },
            5 => Msg::BarrierFailed {
                group: r.group()?,
                reason: r.str()?,
            },
            6 => Msg::Heartbeat,
            7 => Msg::NodeFailed {
                id: NodeId(r.u64()?),
                reason: r.str()?,
            },
            8 => Msg::Finalize,
            9 => Msg::Shutdown,
            15 => Msg::Leaving { reason: r.str()? },
            10 => Msg::Command {
                ts: r.u64()?,
                kind: CommandKind::from_code(r.u8()?)
                    .ok_or(DecodeError::Invalid("unknown command"))?,
                body: r.str()?,
            },
            11 => {
                let ts = r.u64()?;
                let key = r.u64()?;
                let (mut flags, retry, have) = PushFlags::from_bits(r.u8()?)?;
                let n_elems = r.u64()?;
                if retry {
                    flags.retry = Some(r.u64()?);
                }
                if have {
                    flags.have = Some(r.u64()?);
                }
                Msg::Push {
                    ts,
                    key,
                    flags,
                    n_elems,
                    priority: r.u32()? as i32,
                }
            }
            12 => Msg::Pull {
                ts: r.u64()?,
                key: r.u64()?,
                n_elems: r.u64()?,
                have: match r.u8()? {
                    0 => None,
                    1 => Some(r.u64()?),
                    _ => return Err(DecodeError::Invalid("bad copy version flag")),
                },
                priority: r.u32()? as i32,
            },
            21 => Msg::PullRanges {
                ts: r.u64()?,
                n_ranges: r.u64()?,
                priority: r.u32()? as i32,
            },
            22 => Msg::PushRanges {
                ts: r.u64()?,
                key: r.u64()?,
                dtype: Dtype::from_code(r.u8()?)
                    .ok_or(DecodeError::Invalid("unknown value type"))?,
                retry: match r.u8()? {
                    0 => None,
                    1 => Some(r.u64()?),
                    _ => return Err(DecodeError::Invalid("bad retry flag")),
                },
                n_ranges: r.u64()?,
                priority: r.u32()? as i32,
            },
            20 => Msg::Pulled {
                ts: r.u64()?,
                version: r.u64()?,
                form: match r.u8()? {
                    0 => Form::Full,
                    form @ (1 | 3) => {
                        let scale = f32::from_bits(r.u32()?);
                        if !scale.is_finite() || scale < 0.0 {
                            return Err(DecodeError::Invalid("a pulled change's scale"));
                        }
                        match form {
                            1 => Form::Delta { scale },
                            _ => Form::Packed { scale },
                        }
                    }
                    2 => Form::Same,
                    _ => return Err(DecodeError::Invalid("unknown pulled form")),
                },
            },
            13 => Msg::Done { ts: r.u64()? },
            14 => Msg::Failed {
                ts: r.u64()?,
                reason: r.str()?,
            },
            19 => Msg::PeerFailed {
                ts: r.u64()?,
                lost: NodeId(r.u64()?),
                reason: r.str()?,
            },
            tag => return Err(DecodeError::UnknownTag(tag)),
        };
        if !r.0.is_empty() {
            return Err(DecodeError::Trailing(r.0.remaining()));
        }
        Ok(msg)
    }
}
