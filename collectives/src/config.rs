//! A communicator's settings. psnet's facade fills them from the environment (`PSNET_ALGO`,
//! `PSNET_COLL_PIECE`, ...); this crate reads no environment itself.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// Which allreduce algorithm to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Algo {
    /// Pipelined recursive doubling on 2 ranks, and on more up to [`Config::small_bytes`]; a
    /// pipelined ring above.
    #[default]
    Auto,
    /// Always the ring (reduce-scatter, then allgather): bandwidth-optimal for large buffers.
    Ring,
    /// Always recursive doubling: log2(n) exchanges of the whole buffer, latency-optimal for
    /// small ones.
    Doubling,
    /// Always recursive halving and doubling (Rabenseifner's): the ring's bytes in
    /// 2 log2(n) steps instead of 2(n - 1).
    Halving,
}

impl FromStr for Algo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(Algo::Auto),
            "ring" => Ok(Algo::Ring),
            "doubling" | "rd" | "recursive_doubling" => Ok(Algo::Doubling),
            "halving" | "rhd" | "rabenseifner" => Ok(Algo::Halving),
            _ => Err(format!(
                "unknown algorithm {s:?} (auto, ring, doubling, halving)"
            )),
        }
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Algo::Auto => "auto",
            Algo::Ring => "ring",
            Algo::Doubling => "doubling",
            Algo::Halving => "halving",
        })
    }
}

/// A communicator's settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// The allreduce algorithm.
    pub algo: Algo,
    /// Allreduces of at most this many bytes on more than 2 ranks use recursive doubling (with
    /// [`Algo::Auto`]). Doubling sends the whole buffer log2(n) times, the ring 2(n-1)/n of
    /// it in 2(n-1) steps. 4 ranks over TCP on one 2-core host, 6 alternating runs (medians):
    /// doubling 252 / 394 us at 128 / 256 KiB against the ring's 422 / 550, the ring 744 /
    /// 1,173 us at 512 KiB / 1 MiB against doubling's 1,012 / 2,637. (An earlier 64 KiB came
    /// from runs that had the ring faster from 128 KiB.)
    pub small_bytes: usize,
    /// The same when every rank is on this host and the transport reaches them through shared
    /// memory ([`psnet_transport::Capabilities::same_host_shm`]); the larger of the two counts.
    pub small_shm_bytes: usize,
    /// Large buffers move in pieces of at most this many bytes, each a message of its own, so
    /// that transfers and reductions overlap.
    pub piece_bytes: usize,
    /// How long forming the communicator may take before the ranks still missing are named.
    pub join_timeout: Duration,
    /// How long one call may wait for other ranks before failing, naming them; `None`: for
    /// ever. It includes the time the other ranks take to reach the call.
    pub call_timeout: Option<Duration>,
    /// A rank heard from neither by a message nor by a heartbeat for this long is lost, named
    /// with the reason (`PSNET_COLL_HEARTBEAT_TIMEOUT`); heartbeats go every quarter of it.
    /// `None`: no heartbeats, a stopped rank is noticed by `call_timeout` only.
    pub heartbeat_timeout: Option<Duration>,
    /// Bytes that may arrive for calls this rank has not made yet (other ranks running
    /// ahead); more fails the communicator instead of exhausting memory.
    pub ahead_bytes: usize,
    /// How long a call that waits for the other ranks polls before it sleeps (as MPI's and
    /// NCCL's progress loops do); zero: sleep at once.
    pub spin: Duration,
    /// Compressed allreduces of at least this many bytes (of float32) on more than 2 ranks
    /// take two phases ([`CompressedScheme::TwoPhase`](crate::CompressedScheme)), smaller ones
    /// the allgather of every rank's codes (`PSNET_COLL_COMPRESSED_TWO_PHASE`).
    pub compressed_two_phase_bytes: usize,
    /// The flight recorder of each rank's calls (`PSNET_RECORDER_*`).
    pub recorder: psnet_recorder::Settings,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            algo: Algo::Auto,
            small_bytes: 256 << 10,
            small_shm_bytes: 1 << 20,
            piece_bytes: 1 << 20,
            join_timeout: Duration::from_secs(120),
            call_timeout: Some(Duration::from_secs(600)),
            heartbeat_timeout: Some(Duration::from_secs(10)),
            ahead_bytes: 1 << 30,
            spin: Duration::from_micros(50),
            compressed_two_phase_bytes: 64 << 10,
            recorder: psnet_recorder::Settings::default(),
        }
    }
}
