//! Every environment variable psnet reads, in one place.

use std::fmt::Display;
use std::str::FromStr;

/// One environment variable: its name, default and meaning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EnvVar {
    /// The variable's name.
    pub name: &'static str,
    /// The default, as the user would write it ("" = unset).
    pub default: &'static str,
    /// What it does.
    pub description: &'static str,
}

/// A variable with an unusable value, or a configuration that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The value does not parse.
    #[error("{name}={value:?} is not valid: {reason}")]
    Invalid {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// Why it was refused.
        reason: String,
    },
    /// A required variable is missing.
    #[error("{name} is not set: {description}")]
    Missing {
        /// The variable.
        name: &'static str,
        /// What it is for.
        description: &'static str,
    },
    /// `DMLC_INTERFACE` names no interface.
    #[error(
        "DMLC_INTERFACE={wanted:?} matches no network interface; interfaces here: {available}"
    )]
    NoSuchInterface {
        /// The name asked for.
        wanted: String,
        /// The interfaces that exist, with their addresses.
        available: String,
    },
    /// The interface has no usable address.
    #[error("no usable address: {0}")]
    NoAddress(String),
}

impl EnvVar {
    /// The raw value, if set and not empty.
    // The one place psnet reads its environment (clippy.toml disallows it elsewhere).
    #[allow(clippy::disallowed_methods)]
    pub fn get(&self) -> Option<String> {
        std::env::var(self.name)
            .ok()
            .filter(|v| !v.trim().is_empty())
    }

    /// Whether the variable is set at all (even to an empty or non-UTF-8 value).
    #[allow(clippy::disallowed_methods)]
    pub fn is_set(&self) -> bool {
        std::env::var_os(self.name).is_some()
    }

    /// The value parsed as `T`, `None` if unset; a parse failure names the variable.
    pub fn parse<T>(&self) -> Result<Option<T>, ConfigError>
    where
        T: FromStr,
        T::Err: Display,
    {
        self.get()
            .map(|raw| {
                raw.trim().parse::<T>().map_err(|e| ConfigError::Invalid {
                    name: self.name,
                    value: raw.clone(),
                    reason: e.to_string(),
                })
            })
            .transpose()
    }

    /// The value parsed as `T`, or the declared default.
    pub fn parse_or_default<T>(&self) -> Result<T, ConfigError>
    where
        T: FromStr,
        T::Err: Display,
    {
        match self.parse()? {
            Some(v) => Ok(v),
            None => self
                .default
                .parse()
                .map_err(|e: T::Err| ConfigError::Invalid {
                    name: self.name,
                    value: self.default.to_string(),
                    reason: format!("built-in default does not parse: {e}"),
                }),
        }
    }

    /// The value, or an error saying the variable is required.
    pub fn require(&self) -> Result<String, ConfigError> {
        self.get().ok_or(ConfigError::Missing {
            name: self.name,
            description: self.description,
        })
    }
}

/// A variable that is not one of psnet's (set by a test harness, for example), read through
/// the same door as the declared ones so that nothing else reads the environment.
pub fn harness_var(name: &'static str) -> Option<String> {
    EnvVar {
        name,
        default: "",
        description: "not psnet's: set by a test harness",
    }
    .get()
}

/// Declares environment variables once each, as `EnvVar` constants (documented with their
/// description), plus a list of them all for `--print-env`:
/// `declare_env_vars!(LIST; IDENT = "NAME", "default", "description"; ...)`.
#[macro_export]
macro_rules! declare_env_vars {
    ($list:ident; $($ident:ident = $name:literal, $default:literal, $desc:literal;)*) => {
        $(
            #[doc = $desc]
            pub const $ident: $crate::env::EnvVar = $crate::env::EnvVar {
                name: $name,
                default: $default,
                description: $desc,
            };
        )*
        /// Every variable declared here, in declaration order.
        pub const $list: &[$crate::env::EnvVar] = &[$($ident),*];
    };
}

crate::declare_env_vars! {
    ALL;
    DMLC_NODE_HOST = "DMLC_NODE_HOST", "",
        "This node's IP address (or host name), used verbatim; beats DMLC_INTERFACE.";
    DMLC_INTERFACE = "DMLC_INTERFACE", "",
        "Network interface to use: exact name first, then the first name starting with it (so `ib` finds `ib0`). Unset: the first non-loopback IPv4 interface, else IPv6.";
    PSNET_TRANSPORT = "PSNET_TRANSPORT", "auto",
        "auto | rdma | tcp. auto: RDMA when an RDMA device is bound to the chosen interface, TCP otherwise.";
    PSNET_IB_DEVICE = "PSNET_IB_DEVICE", "",
        "RDMA device to use (e.g. mlx5_0, rxe0) instead of the one bound to the interface.";
    PSNET_IB_PORT = "PSNET_IB_PORT", "",
        "RDMA port number to use (1-based) instead of the one bound to the interface.";
    PSNET_GID_INDEX = "PSNET_GID_INDEX", "",
        "RoCE GID index to use instead of the one carrying the interface's address.";
    PSNET_MAX_MESSAGE = "PSNET_MAX_MESSAGE", "1073741824",
        "Largest message in bytes; longer frames are refused before any allocation.";
    PSNET_CONNECT_TIMEOUT = "PSNET_CONNECT_TIMEOUT", "30",
        "Seconds a connect keeps retrying a peer that is not up yet.";
    PSNET_SECRET = "PSNET_SECRET", "",
        "The job's shared secret: every connection (registration with the scheduler, every peer link, TCP and RDMA control) first proves it by HMAC-SHA256 over both sides' nonces; a process without it is refused and logged with its address. Every process of the job must have the same one. Unset (and no PSNET_SECRET_FILE): the job is open to any process that reaches it. Prefer PSNET_SECRET_FILE where the environment may be seen by others.";
    PSNET_SECRET_FILE = "PSNET_SECRET_FILE", "",
        "A file holding the job's shared secret (see PSNET_SECRET; one trailing newline is ignored; at most 4096 bytes; a warning if others may read it). Setting both is an error.";
    PSNET_ENCRYPT = "PSNET_ENCRYPT", "0",
        "1: encrypt every data frame this process sends over TCP (ChaCha20 under the connection's session keys, then the session tag: an AEAD), not only tag it; needs PSNET_SECRET or PSNET_SECRET_FILE, from which the keys come. A receiver opens encrypted frames whatever its own setting. Not covered: the same-host shared-memory paths (no network path), and the bytes of RDMA queue pairs (RDMA jobs encrypt only their TCP control connections). 0: frames are tagged, not encrypted.";
    PSNET_RECORDER_ENTRIES = "PSNET_RECORDER_ENTRIES", "4096",
        "Flight recorder: operations each node keeps (collective calls, kv requests, connection events), a fixed ring; the oldest go first. 0: no recorder.";
    PSNET_RECORDER_DIR = "PSNET_RECORDER_DIR", "",
        "Flight recorder: where dumps are written (psnet-<scope>-<pid>.json). Unset: psnet-recorder in the system's temporary directory. Read them with psnet-doctor DIR.";
    PSNET_TIMELINE = "PSNET_TIMELINE", "",
        "A folder: at its clean end every psnet process writes there a Chrome trace of its flight recorder (<scope>-<pid>.trace.json: a track per communicator or kv peer, an event per collective call and kv request, for chrome://tracing or ui.perfetto.dev) and its dump; psnet-doctor --timeline DIR -o job.json merges a job's. The last PSNET_RECORDER_ENTRIES operations of each: raise it for longer runs.";
    PSNET_RECORDER_DUMP = "PSNET_RECORDER_DUMP", "failure",
        "Flight recorder: when a node writes its dump: failure (an operation fails or times out, a peer is lost, and on SIGUSR1), always (also at a clean end), never (only on SIGUSR1).";
    PSNET_FAULTS = "PSNET_FAULTS", "",
        "Reliability testing only: faults the TCP transport injects into its sends, e.g. drop=0.01,delay=2ms,reset_every=500,seed=7 (drop: probability that a send drops its connection, the message lost with it; delay: each send waits up to this long; reset_every: every N-th send closes its connection after writing; seed: of the draws). Unset: none, at no cost.";
    PSNET_TCP_BUFFER = "PSNET_TCP_BUFFER", "0",
        "TCP socket send/receive buffer in bytes; 0 keeps the kernel's autotuning.";
    PSNET_TCP_CONGESTION = "PSNET_TCP_CONGESTION", "auto",
        "TCP congestion control: auto (connections between processes of one host use cubic, or reno where cubic is not allowed: pacing algorithms such as BBR reorder loopback traffic and retransmit what was never lost; connections to other hosts keep the system's), system (the system's everywhere), or an algorithm's name for every connection (one the kernel refuses fails the connection, naming it).";
    PSNET_SHM_RING = "PSNET_SHM_RING", "67108864",
        "Bytes of shared memory (a sealed anonymous memory file, passed by descriptor) a node offers a peer on the same host, per direction, for large messages; 0: only sockets.";
    PSNET_SHM_QUEUE = "PSNET_SHM_QUEUE", "1048576",
        "Bytes of the shared-memory message queue a node offers a peer on the same host when they connect, per direction (a power of two from 4096 to 67108864): every message then goes through it, small ones copied in whole, large ones as descriptors of the ring, so none waits for the kernel's TCP stack; 0, or PSNET_SHM_RING=0: none.";
    PSNET_SHM_SPIN_US = "PSNET_SHM_SPIN_US", "50",
        "Microseconds a connection's reader polls the shared-memory queue after its last message before it sleeps on an eventfd (the sender wakes it).";
    PSNET_GPU_STAGE_CHUNK = "PSNET_GPU_STAGE_CHUNK", "1048576",
        "TCP: bytes per chunk when device (GPU) memory in a message is staged through page-locked host buffers, sent or received into device memory; two chunks are in flight, one crossing PCIe while the other is written or read off the socket (at least 4096).";
    PSNET_INBOX_BYTES = "PSNET_INBOX_BYTES", "268435456",
        "Bytes of received messages that may wait for the application before connections stop reading (back-pressure).";
    PSNET_FRAME_STALL_TIMEOUT = "PSNET_FRAME_STALL_TIMEOUT", "60",
        "Seconds a frame being received may go without a byte before its connection is closed, naming the stall, and its share of PSNET_RECV_INFLIGHT_BYTES is given back (a connection may be idle between frames for ever)";
    PSNET_RECV_INFLIGHT_BYTES = "PSNET_RECV_INFLIGHT_BYTES", "2147483648",
        "Bytes of large incoming frames not yet complete that all connections of a node together may hold; a connection whose frame does not fit waits for room (60 s at most, then it is closed naming this limit); a larger frame is refused at once.";
    PSNET_RDMA_EAGER = "PSNET_RDMA_EAGER", "16384",
        "RDMA: bytes of each pre-posted receive buffer; messages up to this size (header included) are copied (eager), larger ones are written by RDMA (rendezvous). Must match on every node.";
    PSNET_RDMA_RECV_DEPTH = "PSNET_RDMA_RECV_DEPTH", "64",
        "RDMA: receive buffers posted per peer (the peer's send credits).";
    PSNET_RDMA_REG_CACHE = "PSNET_RDMA_REG_CACHE", "0",
        "RDMA: registrations of plain (unregistered) user buffers kept for reuse, keyed by address and length; 0 registers per send. Only safe if sent buffers are not freed and reallocated at the same address while cached.";
    PSNET_RDMA_INLINE = "PSNET_RDMA_INLINE", "128",
        "RDMA: messages up to this many bytes (header included) are sent inline (copied into the work request; no DMA read of a buffer); 0: never. Lowered to 0 if the device refuses it.";
    PSNET_RDMA_SPIN_US = "PSNET_RDMA_SPIN_US", "200",
        "RDMA: microseconds the completion poller keeps polling after the last completion before it sleeps on the completion channel (latency against idle CPU).";
    PSNET_RDMA_OFFER_BYTES = "PSNET_RDMA_OFFER_BYTES", "16777216",
        "RDMA: bytes of receive buffers a node offers each peer in advance, sized like the large messages it received from it, so that a repeated message (the same key pushed or pulled again) is written straight in without a request-to-send round trip; 0: always rendezvous.";
    PSNET_RDMA_CONNECT = "PSNET_RDMA_CONNECT", "auto",
        "RDMA: how this node connects queue pairs: auto (rdma_cm where available, else socket; a connection rdma_cm has not completed within 6 s, or that failed before it was established, is made over the socket instead), rdma_cm (route resolved from the interface's address; REQ/REP/RTU with psnet's handshake in private data; disconnects arrive as rdma_cm events) or socket (queue-pair numbers exchanged over the TCP control connection). Every node accepts both.";
    PSNET_GPUDIRECT = "PSNET_GPUDIRECT", "auto",
        "RDMA with GPU buffers (psnet-verbs feature `cuda`): how GPU memory is registered with the NIC: auto (dma-buf, else nvidia-peermem, else staged through pinned host memory), dmabuf, peermem, staged, or off.";
    // The kv store (ps-lite's and MXNet's names).
    DMLC_ROLE = "DMLC_ROLE", "", "scheduler | server | worker";
    DMLC_PS_ROOT_URI = "DMLC_PS_ROOT_URI", "", "the scheduler's IP address or host name";
    DMLC_PS_ROOT_PORT = "DMLC_PS_ROOT_PORT", "", "the scheduler's port";
    DMLC_NUM_SERVER = "DMLC_NUM_SERVER", "", "number of server processes";
    DMLC_NUM_WORKER = "DMLC_NUM_WORKER", "", "number of worker processes";
    DMLC_WORKER_ID = "DMLC_WORKER_ID", "",
        "a worker's wished rank (BytePS's name; psnet-launch sets it): honoured when every worker names a different rank below DMLC_NUM_WORKER, else ranks follow listening addresses";
    DMLC_SERVER_ID = "DMLC_SERVER_ID", "",
        "a server's wished rank (psnet-launch sets it): honoured when every server names a different rank below DMLC_NUM_SERVER, else ranks follow listening addresses";
    PS_HEARTBEAT_INTERVAL = "PS_HEARTBEAT_INTERVAL", "1",
        "seconds between heartbeats to the scheduler (0: off)";
    PS_HEARTBEAT_TIMEOUT = "PS_HEARTBEAT_TIMEOUT", "10",
        "seconds of silence after which the scheduler declares a node dead (0: never)";
    MXNET_KVSTORE_BIGARRAY_BOUND = "MXNET_KVSTORE_BIGARRAY_BOUND", "1000000",
        "arrays with at least this many elements are split over all servers";
    PSNET_PARTITION_BYTES = "PSNET_PARTITION_BYTES", "",
        "a kv key larger than this many bytes goes as pieces of about this size (multiples of 128 elements), spread over the servers in turn, each stored, summed and answered on its own, so that the answers to a key's first pieces travel while its later pieces are still pushed (BytePS's BYTEPS_PARTITION_BYTES); 0: MXNet's layout. Unset: 131072 when the job's servers and workers are on more than one host (524288 for f32 keys defined while compressed pulls are on: both ways their pieces travel as codes), 0 when they are all on one. With pieces, keys of 2^48 and above are refused: the pieces of key k are stored under k + j * 2^48";
    PSNET_PACK_CODES = "PSNET_PACK_CODES", "",
        "1: this worker's compressed pushes travel coded losslessly: sparse codes as the gaps between their nonzero fields (a 2-bit push of psnet-train's gradients in 1-3% of its bytes), denser ones as two bit planes, which fields are nonzero and the low bit of each (a compressed pull's codes in about 64%), noise as is; and where it is worker 0, the servers answer compressed pulls so too; 0: this worker's pushes as quantized (answers still follow worker 0's setting, which every worker reads). Unset: 1 when the job's servers and workers are on more than one host, 0 when they are all on one. Also the compression setting's \"pack\": true";
    PSNET_BOOTSTRAP_TIMEOUT = "PSNET_BOOTSTRAP_TIMEOUT", "120",
        "seconds the scheduler waits for every node to register (and nodes for their rank)";
    PS_RESEND = "PS_RESEND", "0",
        "non-zero: acknowledged delivery; unacknowledged messages are resent, duplicates dropped, a peer silent past the retry limit fails what depends on it";
    PS_RESEND_TIMEOUT = "PS_RESEND_TIMEOUT", "1000",
        "milliseconds before an unacknowledged message is resent (with PS_RESEND); a peer is given up after 10 resends";
    PSNET_KV_SERVER_KEY_BYTES = "PSNET_KV_SERVER_KEY_BYTES", "0",
        "bytes of key values one server may hold; an init beyond it fails naming this limit (0: half the machine's memory)";

    PSNET_CHECKPOINT_DIR = "PSNET_CHECKPOINT_DIR", "",
        "kv servers: a directory where server rank r keeps its shard durably, server-<r>.snapshot (values, optimizer state, update counts) and server-<r>.journal (every change it acknowledged since, written before the acknowledgement); created if missing. Unset: no checkpoints, nothing written.";
    PSNET_CHECKPOINT_EVERY = "PSNET_CHECKPOINT_EVERY", "100",
        "kv servers with PSNET_CHECKPOINT_DIR: a fresh snapshot (and empty journal) once some key has had this many updates (dist_sync rounds or dist_async pushes) since the last; 0: only when a worker asks (save_checkpoint). The journal holds up to about this many updates of every key.";
    PSNET_CHECKPOINT_FSYNC = "PSNET_CHECKPOINT_FSYNC", "0",
        "kv servers with PSNET_CHECKPOINT_DIR: 1 flushes the journal to disk (fdatasync) before acknowledging what it records, so that acknowledged updates survive a machine crash; 0 only writes it to the kernel first, which survives the server process dying. Snapshots are always flushed.";
    PSNET_MAX_RESTARTS = "PSNET_MAX_RESTARTS", "0",
        "psnet-launch (local jobs; also --max-restarts): restart a kv server that dies up to this many times each, with its rank (DMLC_SERVER_ID), so that it rejoins the job from its checkpoint; needs PSNET_CHECKPOINT_DIR. 0: a dying server stops the job.";
    PSNET_RECOVERY_TIMEOUT = "PSNET_RECOVERY_TIMEOUT", "",
        "kv: seconds the job waits for a lost server to be restarted with the same DMLC_SERVER_ID and PSNET_CHECKPOINT_DIR and rejoin (it reloads its shard; workers hold their requests to it and send again what it had not answered); past it the loss ends the job. Default: 60 with PSNET_CHECKPOINT_DIR set, else 0 (a lost server ends the job at once). Set it the same on every node.";
    PSNET_KV_SERIAL_SENDS = "PSNET_KV_SERIAL_SENDS", "0",
        "Benchmarks only: 1 makes a worker send a call's requests one server after another (the parts of a sharded key wait for each other's sends) instead of to all servers at once, to measure what sending in parallel gains.";
    PSNET_KV_PRIORITY = "PSNET_KV_PRIORITY", "1",
        "kv workers: 1 sends requests, and has servers answer them, by priority: the order the job declared (initialized) its keys, first declared first, as BytePS schedules (a send in progress is not interrupted). 0: in the order they were made, for comparison.";
    PSNET_COMPRESSION_SIMD = "PSNET_COMPRESSION_SIMD", "",
        "Caps gradient compression's SIMD level: avx2, sse2 or scalar (default: the best this CPU has).";
    RUST_LOG = "RUST_LOG", "",
        "tracing's filter (e.g. psnet_kv=debug); wins over PS_VERBOSE.";
    PS_VERBOSE = "PS_VERBOSE", "0",
        "Logging: 0 warnings and start-up choices, 1 lifecycle, 2 every message. RUST_LOG, if set, wins.";
    // Collectives: who this rank is and where the ranks meet (psnet's names first, then
    // torchrun's; mpirun's and Slurm's below are read too).
    PSNET_RANK = "PSNET_RANK", "",
        "collectives: this process's rank, 0 .. PSNET_WORLD_SIZE - 1 (beats RANK, OMPI_COMM_WORLD_RANK, PMI_RANK and SLURM_PROCID)";
    PSNET_WORLD_SIZE = "PSNET_WORLD_SIZE", "",
        "collectives: the number of ranks (with PSNET_RANK)";
    PSNET_ROOT_ADDR = "PSNET_ROOT_ADDR", "",
        "collectives: host:port where rank 0 listens and every rank meets it (beats MASTER_ADDR and MASTER_PORT)";
    RANK = "RANK", "", "torchrun's rank of this process (collectives: as PSNET_RANK)";
    WORLD_SIZE = "WORLD_SIZE", "", "torchrun's number of processes (as PSNET_WORLD_SIZE)";
    MASTER_ADDR = "MASTER_ADDR", "", "torchrun's rendezvous host (collectives: rank 0's address)";
    MASTER_PORT = "MASTER_PORT", "", "torchrun's rendezvous port (collectives: rank 0's port)";
    PSNET_BIND = "PSNET_BIND", "auto",
        "psnet-perf --np: binds each rank it starts to a CPU: auto (one CPU each when the ranks are no more than the CPUs it may use, as mpirun binds 2 ranks to cores; none when more), core (one CPU each, round robin when more ranks than CPUs) or none";
    PSNET_ALGO = "PSNET_ALGO", "auto",
        "collectives: allreduce algorithm: auto (pipelined recursive doubling on 2 ranks, and on more up to PSNET_COLL_SMALL bytes; a pipelined ring above), ring, doubling or halving (recursive halving and doubling)";
    PSNET_COLL_SMALL = "PSNET_COLL_SMALL", "262144",
        "collectives: allreduces of at most this many bytes on more than 2 ranks use recursive doubling (with PSNET_ALGO=auto)";
    PSNET_COLL_SMALL_SHM = "PSNET_COLL_SMALL_SHM", "1048576",
        "collectives: the same as PSNET_COLL_SMALL when every rank is on this host and the transport reaches them through shared memory";
    PSNET_COLL_PIECE = "PSNET_COLL_PIECE", "1048576",
        "collectives: large buffers move in pieces of at most this many bytes, so that transfers and reductions overlap";
    PSNET_COLL_COMPRESSED_TWO_PHASE = "PSNET_COLL_COMPRESSED_TWO_PHASE", "65536",
        "collectives: compressed allreduces of at least this many bytes (float32) on more than 2 ranks take two phases (codes to each chunk's rank, summed and quantized again there with a server residual, then allgathered: 2(n-1)/n of the codes each way per rank); smaller ones allgather every rank's codes";
    PSNET_COLL_JOIN_TIMEOUT = "PSNET_COLL_JOIN_TIMEOUT", "120",
        "collectives: seconds the ranks wait for each other to join before naming the missing ones";
    PSNET_COLL_TIMEOUT = "PSNET_COLL_TIMEOUT", "600",
        "collectives: seconds one call may wait for the other ranks (including for them to reach it) before failing, naming the ranks it waits for; 0: for ever";
    PSNET_COLL_HEARTBEAT_TIMEOUT = "PSNET_COLL_HEARTBEAT_TIMEOUT", "10",
        "collectives: seconds (a fraction allowed) after which a rank heard from by neither a message nor a heartbeat is lost, named with the reason, instead of waiting PSNET_COLL_TIMEOUT for a stopped or frozen process; heartbeats go every quarter of it on each open connection; 0: none";
    PSNET_COLL_SPIN_US = "PSNET_COLL_SPIN_US", "50",
        "collectives: microseconds a call waiting for other ranks polls before it sleeps (0: sleep at once); with more ranks on the host than cores it yields its core (sched_yield) between polls";
    PSNET_COLL_AHEAD_BYTES = "PSNET_COLL_AHEAD_BYTES", "1073741824",
        "collectives: bytes that may arrive for calls this rank has not made yet (other ranks running ahead, as a broadcast's root may); more fails the communicator";
    PSNET_CUDA_TENSORS = "PSNET_CUDA_TENSORS", "device",
        "Python: how the collectives and a dist kvstore take contiguous CUDA tensors: device (sent from GPU memory; reduced, or quantized, on the GPU by psnet's kernels) or staged (copied to host memory for the call and back)";
    // Read by `psnet-launch --role-from-env` under mpirun or srun (set by them, not by users).
    OMPI_COMM_WORLD_RANK = "OMPI_COMM_WORLD_RANK", "",
        "Open MPI's rank of this process (psnet-launch --role-from-env: 0 scheduler, then servers, then workers)";
    OMPI_COMM_WORLD_SIZE = "OMPI_COMM_WORLD_SIZE", "", "Open MPI's number of processes";
    PMI_RANK = "PMI_RANK", "", "MPICH / Intel MPI's rank of this process (as OMPI_COMM_WORLD_RANK)";
    PMI_SIZE = "PMI_SIZE", "", "MPICH / Intel MPI's number of processes";
    SLURM_PROCID = "SLURM_PROCID", "", "Slurm's rank of this task (as OMPI_COMM_WORLD_RANK)";
    SLURM_NTASKS = "SLURM_NTASKS", "", "Slurm's number of tasks";
    SGE_TASK_ID = "SGE_TASK_ID", "",
        "Grid Engine's array task id (psnet-launch --launcher sge: task i is rank i, 1 the first server; the scheduler runs with the launcher)";
    PBS_ARRAY_INDEX = "PBS_ARRAY_INDEX", "", "PBS Pro's array index (as SGE_TASK_ID)";
    PBS_ARRAYID = "PBS_ARRAYID", "", "Torque's array id (as SGE_TASK_ID)";
    SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST", "",
        "the Slurm allocation's nodes (psnet-launch --launcher slurm puts the scheduler on the first)";
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEST_VAR: EnvVar = EnvVar {
        name: "PSNET_CONFIG_TEST_VAR",
        default: "7",
        description: "test",
    };

    #[test]
    fn parse_errors_name_the_variable_and_value() {
        std::env::set_var(TEST_VAR.name, "seven");
        let err = TEST_VAR.parse::<u32>().unwrap_err();
        std::env::remove_var(TEST_VAR.name);
        let text = err.to_string();
        assert!(
            text.contains("PSNET_CONFIG_TEST_VAR") && text.contains("seven"),
            "{text}"
        );
        assert_eq!(TEST_VAR.parse_or_default::<u32>(), Ok(7));
        assert!(matches!(
            TEST_VAR.require(),
            Err(ConfigError::Missing { .. })
        ));
    }

    #[test]
    fn every_default_parses_where_numeric() {
        for var in ALL {
            assert!(
                !var.description.is_empty(),
                "{} lacks a description",
                var.name
            );
        }
        assert!(PSNET_MAX_MESSAGE.parse_or_default::<u64>().is_ok());
        assert!(PSNET_INBOX_BYTES.parse_or_default::<usize>().is_ok());
        assert!(PSNET_TCP_BUFFER.parse_or_default::<usize>().is_ok());
        assert!(PSNET_CONNECT_TIMEOUT.parse_or_default::<u64>().is_ok());
        assert!(PS_VERBOSE.parse_or_default::<u8>().is_ok());
    }
}
