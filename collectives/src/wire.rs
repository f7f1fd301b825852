//! The collectives' message header, carried as the transport message's metadata; a piece's
//! bytes travel as its one segment.
//!
//! Every data message names the collective it belongs to (kind, type, reduction, length,
//! root): a rank that receives one from a different call than its own reports a mismatch
//! naming the sender instead of reducing the wrong bytes.

use std::fmt;

use psnet_transport::le::{LeReader, LeWriter};

use crate::element::{DType, ReduceOp};

const MAGIC: u16 = 0x4c43;
/// 2: forming a communicator ends with an allgather of the ranks' CPU masks (`cpus.rs`), a
/// call that ranks of version 1 do not make. 3: heartbeats (`liveness.rs`), which a rank of
/// version 2 would take for a malformed message. 4: the two-phase compressed allreduce's
/// kinds of call.
const VERSION: u8 = 4;
/// Bytes of a header.
pub(crate) const HEADER_LEN: usize = 40;

/// Which collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Coll {
    Allreduce,
    ReduceScatter,
    Allgather,
    Broadcast,
    Reduce,
    Barrier,
    CompressedAllreduce,
    Alltoall,
    Gather,
    Scatter,
    Send,
    /// A two-phase compressed allreduce's first phase: codes to their chunk's rank.
    CompressedScatter,
    /// Its second phase: every chunk's codes to every rank.
    CompressedGather,
}

const COLLS: [Coll; 13] = [
    Coll::Allreduce,
    Coll::ReduceScatter,
    Coll::Allgather,
    Coll::Broadcast,
    Coll::Reduce,
    Coll::Barrier,
    Coll::CompressedAllreduce,
    Coll::Alltoall,
    Coll::Gather,
    Coll::Scatter,
    Coll::Send,
    Coll::CompressedScatter,
    Coll::CompressedGather,
];

impl Coll {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Coll::Allreduce => "allreduce",
            Coll::ReduceScatter => "reduce_scatter",
            Coll::Allgather => "allgather",
            Coll::Broadcast => "broadcast",
            Coll::Reduce => "reduce",
            Coll::Barrier => "barrier",
            Coll::CompressedAllreduce => "allreduce_compressed",
            Coll::Alltoall => "alltoall",
            Coll::Gather => "gather",
            Coll::Scatter => "scatter",
            Coll::Send => "send",
            Coll::CompressedScatter => "allreduce_compressed (phase 1, codes to chunk owners)",
            Coll::CompressedGather => "allreduce_compressed (phase 2, chunks' codes to all)",
        }
    }
}

/// One call of a collective, as every rank must make it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Call {
    pub coll: Coll,
    pub dtype: DType,
    pub op: ReduceOp,
    /// Elements of the buffer the plan runs over.
    pub count: u64,
    pub root: u32,
}

impl Call {
    /// The call as the flight recorder keeps it, as call number `seq`.
    pub(crate) fn recorded(&self, seq: u64) -> psnet_recorder::Op {
        let reduces = matches!(
            self.coll,
            Coll::Allreduce
                | Coll::ReduceScatter
                | Coll::Reduce
                | Coll::CompressedAllreduce
                | Coll::CompressedScatter
                | Coll::CompressedGather
        );
        psnet_recorder::Op::Call {
            seq,
            coll: self.coll.name(),
            dtype: self.dtype.name(),
            count: self.count,
            reduce: if reduces { self.op.name() } else { "" },
            root: self.root,
        }
    }
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.coll == Coll::Alltoall {
            // Each rank's sizes are its own: checked piece by piece, not here.
            return write!(f, "alltoall({})", self.dtype);
        }
        write!(f, "{}({} x {}", self.coll.name(), self.count, self.dtype)?;
        if matches!(
            self.coll,
            Coll::Allreduce | Coll::ReduceScatter | Coll::Reduce
        ) {
            write!(f, ", {}", self.op)?;
        }
        if matches!(
            self.coll,
            Coll::Broadcast | Coll::Reduce | Coll::Gather | Coll::Scatter
        ) {
            write!(f, ", root {}", self.root)?;
        }
        if matches!(
            self.coll,
            Coll::CompressedAllreduce | Coll::CompressedScatter | Coll::CompressedGather
        ) {
            write!(f, ", codes {:#x}", self.root)?;
        }
        f.write_str(")")
    }
}

/// What a message is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A piece of a collective's buffer.
    Data,
    /// The sender failed; the segment holds why (UTF-8).
    Abort,
    /// Joining: a rank's number and the address it listens at (segment: the address, text).
    Hello,
    /// Joining: every rank's address (segment: one address per line, in rank order).
    Table,
    /// The sender is alive (`liveness.rs`); no segment.
    Heartbeat,
    /// A piece of a point-to-point message (`p2p.rs`): `seq` numbers the message among the
    /// sender's to this rank with this `tag`, the call's `root` is the piece's index.
    P2p,
}

const KINDS: [Kind; 6] = [
    Kind::Data,
    Kind::Abort,
    Kind::Hello,
    Kind::Table,
    Kind::Heartbeat,
    Kind::P2p,
];

/// A message's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: Kind,
    /// The communicator (sub-communicators share a transport).
    pub comm: u32,
    /// The call's number on its communicator (calls are made in the same order everywhere).
    pub seq: u64,
    /// Which transfer of the call's plan.
    pub tag: u64,
    pub call: Call,
}

impl Header {
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut w = LeWriter::with_capacity(HEADER_LEN);
        let kind = KINDS.iter().position(|&k| k == self.kind).expect("listed") as u8;
        let coll = COLLS
            .iter()
            .position(|&c| c == self.call.coll)
            .expect("listed") as u8;
        w.u16(MAGIC)
            .u8(VERSION)
            .u8(kind)
            .u32(self.comm)
            .u64(self.seq)
            .u64(self.tag)
            .u8(coll)
            .u8(self.call.dtype.code())
            .u8(self.call.op.code())
            .u8(0)
            .u64(self.call.count)
            .u32(self.call.root);
        w.into_vec()
            .try_into()
            .expect("the header's fields fill it")
    }

    pub(crate) fn decode(meta: &[u8]) -> Result<Header, String> {
        if meta.len() != HEADER_LEN {
            return Err(format!(
                "a header of {} bytes (want {HEADER_LEN})",
                meta.len()
            ));
        }
        let mut r = LeReader::new(meta);
        let truncated = |_| "a truncated header".to_string();
        let magic = r.u16().map_err(truncated)?;
        let version = r.u8().map_err(truncated)?;
        if magic != MAGIC || version != VERSION {
            return Err(format!(
                "not a psnet collectives message of version {VERSION} (magic {magic:#06x}, version {version})"
            ));
        }
        let kind = r.u8().map_err(truncated)?;
        let kind = *KINDS
            .get(kind as usize)
            .ok_or_else(|| format!("unknown message kind {kind}"))?;
        let comm = r.u32().map_err(truncated)?;
        let seq = r.u64().map_err(truncated)?;
        let tag = r.u64().map_err(truncated)?;
        let coll = r.u8().map_err(truncated)?;
        let coll = *COLLS
            .get(coll as usize)
            .ok_or_else(|| format!("unknown collective {coll}"))?;
        let dtype = r.u8().map_err(truncated)?;
        let dtype = DType::from_code(dtype).ok_or_else(|| format!("unknown data type {dtype}"))?;
        let op = r.u8().map_err(truncated)?;
        let op = ReduceOp::from_code(op).ok_or_else(|| format!("unknown reduction {op}"))?;
        let _pad = r.u8().map_err(truncated)?;
        let count = r.u64().map_err(truncated)?;
        let root = r.u32().map_err(truncated)?;
        Ok(Header {
            kind,
            comm,
            seq,
            tag,
            call: Call {
                coll,
                dtype,
                op,
                count,
                root,
            },
        })
    }
}

/// A header for messages that belong to no call (abort, joining).
pub(crate) fn control(kind: Kind, comm: u32) -> Header {
    Header {
        kind,
        comm,
        seq: 0,
        tag: 0,
        call: Call {
            coll: Coll::Barrier,
            dtype: DType::U8,
            op: ReduceOp::Sum,
            count: 0,
            root: 0,
        },
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn headers_round_trip(kind in 0usize..6, comm: u32, seq: u64, tag: u64, coll in 0usize..11,
                              dtype in 0usize..7, op in 0usize..5, count: u64, root: u32) {
            let h = Header {
                kind: KINDS[kind],
                comm,
                seq,
                tag,
                call: Call { coll: COLLS[coll], dtype: DType::ALL[dtype], op: ReduceOp::ALL[op], count, root },
            };
            prop_assert_eq!(Header::decode(&h.encode()), Ok(h));
        }

        #[test]
        fn garbage_is_an_error_not_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..60)) {
            let _ = Header::decode(&bytes);
        }
    }

    #[test]
    fn a_header_of_another_version_is_refused_naming_both() {
        let mut bytes = control(Kind::Hello, 7).encode();
        assert_eq!(bytes[2], 4, "the version byte");
        bytes[2] = 3;
        let err = Header::decode(&bytes).unwrap_err();
        assert!(
            err.contains("version 4") && err.contains("version 3)"),
            "{err}"
        );
    }
}
