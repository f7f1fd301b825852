//! A kv node's configuration, from the environment (ps-lite's and MXNet's variables) or from
//! code through [`KvConfig`]'s builder methods.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use psnet_config::env::{self, EnvVar};
use psnet_config::ConfigError;
use psnet_config::TransportPref;

use crate::proto::ids::Role;
use crate::proto::resend::MAX_TIMEOUT;

// The kv store's variables live in the one registry, psnet_config::env.
pub use psnet_config::env::{
    DMLC_NUM_SERVER, DMLC_NUM_WORKER, DMLC_PS_ROOT_PORT, DMLC_PS_ROOT_URI, DMLC_ROLE,
    DMLC_SERVER_ID, DMLC_WORKER_ID, MXNET_KVSTORE_BIGARRAY_BOUND, PSNET_BOOTSTRAP_TIMEOUT,
    PSNET_CHECKPOINT_DIR, PSNET_CHECKPOINT_EVERY, PSNET_CHECKPOINT_FSYNC,
    PSNET_KV_SERVER_KEY_BYTES, PSNET_PACK_CODES, PSNET_PARTITION_BYTES, PSNET_RECOVERY_TIMEOUT,
    PS_HEARTBEAT_INTERVAL, PS_HEARTBEAT_TIMEOUT, PS_RESEND, PS_RESEND_TIMEOUT,
};

/// The size of a key's pieces when `PSNET_PARTITION_BYTES` is unset and the job spans more
/// than one host: on the 4-host 1 Gbit/s rig, psnet-train's communication per epoch was 1.21x
/// the full-duplex wire bound with 64 KiB, 1.22x with 128 KiB, 1.30x with 256 KiB and 1.75x
/// unpartitioned (`scripts/bench-cluster.sh`); smaller pieces cost more per message.
pub const DEFAULT_PARTITION_BYTES: usize = 128 * 1024;

/// The size of a key's pieces in place of [`DEFAULT_PARTITION_BYTES`] for `f32` keys defined
/// once compressed pulls are on: both ways a piece then travels as codes, a sixteenth of its
/// bytes with 2-bit codes (less packed), and per-message costs outweigh the finer pipeline.
/// On the rig, `psnet-train --compression 2bit --compression-pull` took 1.39 s an epoch
/// with 128 KiB pieces, 1.22 s with 512 KiB, 1.26 s with 1 MiB and 1.35 s with 2 MiB (and
/// with 2-bit pushes only, whose pulls carry floats, 1 MiB pieces took 7.39 s against 6.57).
pub const DEFAULT_COMPRESSED_PULL_PARTITION_BYTES: usize = 512 * 1024;

/// Everything a kv node needs to join a job.
#[derive(Clone, Debug)]
pub struct KvConfig {
    /// This node's role.
    pub role: Role,
    /// The scheduler's address.
    pub root: SocketAddr,
    /// Number of servers.
    pub num_servers: u32,
    /// Number of workers.
    pub num_workers: u32,
    /// Heartbeat period (None: off).
    pub heartbeat_interval: Option<Duration>,
    /// Silence after which a node is dead (None: never).
    pub heartbeat_timeout: Option<Duration>,
    /// Elements from which an array is split over all servers.
    pub bigarray_bound: usize,
    /// A key larger than this many bytes goes as pieces of about this size
    /// (`PSNET_PARTITION_BYTES`; 0: MXNet's layout). None (unset): [`DEFAULT_PARTITION_BYTES`]
    /// when the job's servers and workers are on more than one host, 0 when they are all on
    /// one, where the link costs nothing and pieces only add messages. See
    /// [`crate::proto::worker::Layout`].
    pub partition_bytes: Option<usize>,
    /// Whether compressed codes travel packed ([`crate::proto::packed`], `PSNET_PACK_CODES`).
    /// None (unset): when the job's servers and workers are on more than one host.
    pub pack_codes: Option<bool>,
    /// How long registration may take.
    pub bootstrap_timeout: Duration,
    /// Transport preference (None: `PSNET_TRANSPORT`).
    pub transport: Option<TransportPref>,
    /// Listen on 127.0.0.1 instead of the address chosen from `DMLC_INTERFACE` /
    /// `DMLC_NODE_HOST` (single-host jobs started from code).
    pub loopback: bool,
    /// `PS_RESEND`: acknowledged delivery with this resend timeout (`PS_RESEND_TIMEOUT`);
    /// None: off. See [`crate::proto::resend`].
    pub resend: Option<Duration>,
    /// Bytes of key values one server may hold (`PSNET_KV_SERVER_KEY_BYTES`).
    pub server_key_bytes: u64,
    /// Workers send a call's requests one server after another (`PSNET_KV_SERIAL_SENDS`,
    /// for benchmarks) instead of to all servers at once.
    pub serial_sends: bool,
    /// Requests go, and are answered, by their key's declaration order (`PSNET_KV_PRIORITY`,
    /// on by default) rather than in the order they were made.
    pub priorities: bool,
    /// The flight recorder of this node's requests (`PSNET_RECORDER_*`).
    pub recorder: psnet_recorder::Settings,
    /// The rank this node wishes (`DMLC_WORKER_ID` / `DMLC_SERVER_ID`, set by psnet-launch so
    /// that its `[worker 1]` is kv's worker 1): the scheduler honours the wishes of a role
    /// when every node of it wishes a different rank in range, else ranks follow listening
    /// addresses (ps-lite's rule).
    pub rank_hint: Option<u32>,
    /// Servers keep their shard durably in this directory (`PSNET_CHECKPOINT_DIR`; None:
    /// no checkpoints). See [`crate::checkpoint`].
    pub checkpoint_dir: Option<PathBuf>,
    /// A fresh snapshot once a key has had this many updates since the last
    /// (`PSNET_CHECKPOINT_EVERY`; 0: only when a worker asks).
    pub checkpoint_every: u64,
    /// Flush the journal to disk before acknowledging (`PSNET_CHECKPOINT_FSYNC`).
    pub checkpoint_fsync: bool,
    /// How long the job waits for a lost server to be restarted and rejoin
    /// (`PSNET_RECOVERY_TIMEOUT`; None: a lost server ends the job at once). Every node must
    /// agree: the scheduler holds the server's rank for it, workers hold their requests.
    pub recovery_timeout: Option<Duration>,
}

/// `PSNET_RECOVERY_TIMEOUT`'s default with `PSNET_CHECKPOINT_DIR` set.
pub const DEFAULT_RECOVERY_TIMEOUT: Duration = Duration::from_secs(60);

/// Half the machine's memory (`MemTotal` in `/proc/meminfo`), or 16 GiB where it cannot be
/// read: the default bound on a server's key values.
fn half_the_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(16 << 30, |kib| kib * 1024 / 2)
}

fn seconds(var: EnvVar) -> Result<Option<Duration>, ConfigError> {
    let s: f64 = var.parse_or_default()?;
    if !s.is_finite() || s < 0.0 {
        return Err(ConfigError::Invalid {
            name: var.name,
            value: s.to_string(),
            reason: "must be a non-negative number of seconds".into(),
        });
    }
    Ok((s > 0.0).then(|| Duration::from_secs_f64(s)))
}

fn count(var: EnvVar, min: u32) -> Result<u32, ConfigError> {
    let raw = var.require()?;
    let n: u32 = var.parse()?.expect("required");
    if n < min {
        return Err(ConfigError::Invalid {
            name: var.name,
            value: raw,
            reason: format!("must be at least {min}"),
        });
    }
    Ok(n)
}

/// `PS_RESEND` (an integer, non-zero: on, as in ps-lite) and `PS_RESEND_TIMEOUT` (ms, > 0).
fn resend() -> Result<Option<Duration>, ConfigError> {
    let on = match PS_RESEND.get() {
        None => false,
        Some(raw) => {
            raw.trim()
                .parse::<i64>()
                .map_err(|_| ConfigError::Invalid {
                    name: PS_RESEND.name,
                    value: raw.clone(),
                    reason: "must be an integer (0: off, non-zero: on)".into(),
                })?
                != 0
        }
    };
    let ms: u64 = PS_RESEND_TIMEOUT.parse_or_default()?;
    if ms == 0 || ms > 3_600_000 {
        return Err(ConfigError::Invalid {
            name: PS_RESEND_TIMEOUT.name,
            value: ms.to_string(),
            reason: "must be between 1 and 3600000 milliseconds".into(),
        });
    }
    Ok(on.then(|| Duration::from_millis(ms)))
}

/// A 0/1 switch.
fn flag(var: EnvVar) -> Result<bool, ConfigError> {
    match var.parse_or_default::<u8>()? {
        0 => Ok(false),
        1 => Ok(true),
        n => Err(ConfigError::Invalid {
            name: var.name,
            value: n.to_string(),
            reason: "must be 0 or 1".into(),
        }),
    }
}

/// Resolves `host:port` for the scheduler.
pub fn resolve_root(host: &str, port: u16) -> Result<SocketAddr, ConfigError> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| ConfigError::Invalid {
            name: DMLC_PS_ROOT_URI.name,
            value: host.to_string(),
            reason: format!("cannot resolve: {e}"),
        })?
        .next()
        .ok_or_else(|| ConfigError::Invalid {
            name: DMLC_PS_ROOT_URI.name,
            value: host.to_string(),
            reason: "resolves to no address".into(),
        })
}

impl KvConfig {
    /// A configuration for a job on this host (loopback), with defaults; set the rest with the
    /// builder methods.
    pub fn local(role: Role, root: SocketAddr, num_servers: u32, num_workers: u32) -> Self {
        KvConfig {
            role,
            root,
            num_servers,
            num_workers,
            heartbeat_interval: Some(Duration::from_secs(1)),
            heartbeat_timeout: Some(Duration::from_secs(10)),
            bigarray_bound: 1_000_000,
            partition_bytes: None,
            pack_codes: None,
            bootstrap_timeout: Duration::from_secs(120),
            transport: None,
            loopback: true,
            resend: None,
            server_key_bytes: half_the_memory(),
            serial_sends: false,
            priorities: true,
            recorder: psnet_recorder::Settings::default(),
            rank_hint: None,
            checkpoint_dir: None,
            checkpoint_every: 100,
            checkpoint_fsync: false,
            recovery_timeout: None,
        }
    }

    /// Reads `DMLC_ROLE`, `DMLC_PS_ROOT_URI`, `DMLC_PS_ROOT_PORT`, `DMLC_NUM_SERVER`,
    /// `DMLC_NUM_WORKER`, `PS_HEARTBEAT_INTERVAL`, `PS_HEARTBEAT_TIMEOUT`,
    /// `MXNET_KVSTORE_BIGARRAY_BOUND`, `PSNET_PARTITION_BYTES`, `PSNET_BOOTSTRAP_TIMEOUT`, `PS_RESEND`,
    /// `PS_RESEND_TIMEOUT`, `PSNET_KV_SERVER_KEY_BYTES`, `DMLC_WORKER_ID` / `DMLC_SERVER_ID`,
    /// `PSNET_CHECKPOINT_DIR`, `PSNET_CHECKPOINT_EVERY`, `PSNET_CHECKPOINT_FSYNC`,
    /// `PSNET_RECOVERY_TIMEOUT`. A missing or malformed variable is an error naming it.
    pub fn from_env() -> Result<Self, ConfigError> {
        let role_text = DMLC_ROLE.require()?;
        let role = Role::parse(&role_text).ok_or_else(|| ConfigError::Invalid {
            name: DMLC_ROLE.name,
            value: role_text.clone(),
            reason: "must be scheduler, server or worker".into(),
        })?;
        let host = DMLC_PS_ROOT_URI.require()?;
        DMLC_PS_ROOT_PORT.require()?;
        let port: u16 = DMLC_PS_ROOT_PORT.parse()?.expect("required");
        let bound: usize = MXNET_KVSTORE_BIGARRAY_BOUND.parse_or_default()?;
        if bound == 0 {
            return Err(ConfigError::Invalid {
                name: MXNET_KVSTORE_BIGARRAY_BOUND.name,
                value: "0".into(),
                reason: "must be at least 1".into(),
            });
        }
        Ok(KvConfig {
            role,
            root: resolve_root(&host, port)?,
            num_servers: count(DMLC_NUM_SERVER, 1)?,
            num_workers: count(DMLC_NUM_WORKER, 1)?,
            heartbeat_interval: seconds(PS_HEARTBEAT_INTERVAL)?,
            heartbeat_timeout: seconds(PS_HEARTBEAT_TIMEOUT)?,
            bigarray_bound: bound,
            partition_bytes: PSNET_PARTITION_BYTES.parse()?,
            pack_codes: PSNET_PACK_CODES.parse::<u8>()?.map(|v| v != 0),
            bootstrap_timeout: seconds(PSNET_BOOTSTRAP_TIMEOUT)?
                .unwrap_or(Duration::from_secs(u64::from(u32::MAX))),
            transport: env::PSNET_TRANSPORT.parse()?,
            loopback: false,
            resend: resend()?,
            server_key_bytes: match PSNET_KV_SERVER_KEY_BYTES.parse_or_default::<u64>()? {
                0 => half_the_memory(),
                n => n,
            },
            serial_sends: env::PSNET_KV_SERIAL_SENDS.parse_or_default::<u8>()? != 0,
            priorities: env::PSNET_KV_PRIORITY.parse_or_default::<u8>()? != 0,
            recorder: psnet_recorder::Settings::from_env(),
            rank_hint: match role {
                Role::Worker => DMLC_WORKER_ID.parse()?,
                Role::Server => DMLC_SERVER_ID.parse()?,
                Role::Scheduler => None,
            },
            checkpoint_dir: PSNET_CHECKPOINT_DIR.get().map(PathBuf::from),
            checkpoint_every: PSNET_CHECKPOINT_EVERY.parse_or_default()?,
            checkpoint_fsync: flag(PSNET_CHECKPOINT_FSYNC)?,
            recovery_timeout: match PSNET_RECOVERY_TIMEOUT.get() {
                Some(_) => seconds(PSNET_RECOVERY_TIMEOUT)?,
                None => PSNET_CHECKPOINT_DIR.get().map(|_| DEFAULT_RECOVERY_TIMEOUT),
            },
        })
    }

    /// Servers keep their shard durably in `dir` (`PSNET_CHECKPOINT_DIR`), or not (None).
    pub fn checkpoint_dir(mut self, dir: Option<PathBuf>) -> Self {
        self.checkpoint_dir = dir;
        self
    }

    /// A fresh snapshot once a key has had `every` updates since the last
    /// (`PSNET_CHECKPOINT_EVERY`; 0: only when a worker asks).
    pub fn checkpoint_every(mut self, every: u64) -> Self {
        self.checkpoint_every = every;
        self
    }

    /// How long a lost server may take to restart and rejoin (`PSNET_RECOVERY_TIMEOUT`;
    /// None: a lost server ends the job at once).
    pub fn recovery_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.recovery_timeout = timeout;
        self
    }

    /// Flush the journal to disk before acknowledging (`PSNET_CHECKPOINT_FSYNC`).
    pub fn checkpoint_fsync(mut self, fsync: bool) -> Self {
        self.checkpoint_fsync = fsync;
        self
    }

    /// Sets the bound on one server's key values (`PSNET_KV_SERVER_KEY_BYTES`).
    pub fn server_key_bytes(mut self, bytes: u64) -> Self {
        self.server_key_bytes = bytes;
        self
    }

    /// Sets the heartbeat period and timeout (None: off).
    pub fn heartbeats(mut self, interval: Option<Duration>, timeout: Option<Duration>) -> Self {
        self.heartbeat_interval = interval;
        self.heartbeat_timeout = timeout;
        self
    }

    /// Sets `PSNET_PARTITION_BYTES` (0: MXNet's layout), in place of the default chosen by
    /// the job's hosts.
    pub fn partition_bytes(mut self, bytes: usize) -> Self {
        self.partition_bytes = Some(bytes);
        self
    }

    /// Sets `MXNET_KVSTORE_BIGARRAY_BOUND`.
    pub fn bigarray_bound(mut self, bound: usize) -> Self {
        self.bigarray_bound = bound.max(1);
        self
    }

    /// Turns `PS_RESEND` on with this resend timeout (`PS_RESEND_TIMEOUT`, kept within 1 ms
    /// and one hour), or off (None).
    pub fn resend(mut self, timeout: Option<Duration>) -> Self {
        self.resend = timeout.map(|t| t.clamp(Duration::from_millis(1), MAX_TIMEOUT));
        self
    }

    /// Sets the registration timeout.
    pub fn bootstrap_timeout(mut self, timeout: Duration) -> Self {
        self.bootstrap_timeout = timeout;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_parse_and_zero_means_off() {
        std::env::set_var("PS_HEARTBEAT_INTERVAL", "0");
        assert_eq!(seconds(PS_HEARTBEAT_INTERVAL), Ok(None));
        std::env::set_var("PS_HEARTBEAT_INTERVAL", "0.5");
        assert_eq!(
            seconds(PS_HEARTBEAT_INTERVAL),
            Ok(Some(Duration::from_millis(500)))
        );
        std::env::set_var("PS_HEARTBEAT_INTERVAL", "-1");
        assert!(seconds(PS_HEARTBEAT_INTERVAL).is_err());
        std::env::remove_var("PS_HEARTBEAT_INTERVAL");
        assert_eq!(
            seconds(PS_HEARTBEAT_INTERVAL),
            Ok(Some(Duration::from_secs(1)))
        );
    }

    #[test]
    fn checkpoint_settings_are_off_by_default_and_fsync_is_a_switch() {
        let c = KvConfig::local(Role::Server, "127.0.0.1:1".parse().unwrap(), 1, 1);
        assert_eq!(c.checkpoint_dir, None);
        assert_eq!(c.checkpoint_every, 100);
        assert!(!c.checkpoint_fsync);
        assert_eq!(PSNET_CHECKPOINT_EVERY.parse_or_default::<u64>(), Ok(100));
        std::env::remove_var("PSNET_CHECKPOINT_FSYNC");
        assert_eq!(flag(PSNET_CHECKPOINT_FSYNC), Ok(false));
        std::env::set_var("PSNET_CHECKPOINT_FSYNC", "1");
        assert_eq!(flag(PSNET_CHECKPOINT_FSYNC), Ok(true));
        std::env::set_var("PSNET_CHECKPOINT_FSYNC", "2");
        let err = flag(PSNET_CHECKPOINT_FSYNC).unwrap_err().to_string();
        assert!(err.contains("PSNET_CHECKPOINT_FSYNC"), "{err}");
        std::env::remove_var("PSNET_CHECKPOINT_FSYNC");
        for var in [
            PSNET_CHECKPOINT_DIR,
            PSNET_CHECKPOINT_EVERY,
            PSNET_CHECKPOINT_FSYNC,
        ] {
            assert!(env::ALL.contains(&var));
        }
        let c = c
            .checkpoint_dir(Some("/tmp/x".into()))
            .checkpoint_every(7)
            .checkpoint_fsync(true);
        assert_eq!(
            c.checkpoint_dir.as_deref(),
            Some(std::path::Path::new("/tmp/x"))
        );
        assert_eq!((c.checkpoint_every, c.checkpoint_fsync), (7, true));
    }

    #[test]
    fn resend_is_off_by_default_and_parses_like_ps_lite() {
        std::env::remove_var("PS_RESEND");
        std::env::remove_var("PS_RESEND_TIMEOUT");
        assert_eq!(resend(), Ok(None));
        std::env::set_var("PS_RESEND", "1");
        assert_eq!(resend(), Ok(Some(Duration::from_millis(1000))));
        std::env::set_var("PS_RESEND_TIMEOUT", "250");
        assert_eq!(resend(), Ok(Some(Duration::from_millis(250))));
        std::env::set_var("PS_RESEND", "0");
        assert_eq!(resend(), Ok(None));
        std::env::set_var("PS_RESEND", "yes");
        let err = resend().unwrap_err().to_string();
        assert!(err.contains("PS_RESEND"), "{err}");
        std::env::set_var("PS_RESEND", "1");
        for bad in ["0", "3600001", "soon"] {
            std::env::set_var("PS_RESEND_TIMEOUT", bad);
            let err = resend().unwrap_err().to_string();
            assert!(err.contains("PS_RESEND_TIMEOUT"), "{err}");
        }
        std::env::remove_var("PS_RESEND");
        std::env::remove_var("PS_RESEND_TIMEOUT");
        assert!(env::ALL.contains(&PS_RESEND) && env::ALL.contains(&PS_RESEND_TIMEOUT));
        let c = KvConfig::local(Role::Worker, "127.0.0.1:1".parse().unwrap(), 1, 1);
        assert_eq!(c.resend, None);
        let c = c.resend(Some(Duration::from_millis(300)));
        assert_eq!(c.resend, Some(Duration::from_millis(300)));
    }
}
