use std::net::SocketAddr;
use std::time::Duration;

use psnet_config::env;
use psnet_config::interface::{self, NodeAddress};
use psnet_config::ConfigError;
use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_transport::{Limits, NodeId, TransportError};
use psnet_verbs::discovery::{self, RdmaBinding};
use psnet_verbs::{DeviceSpec, VerbsConfig, VerbsTransport};

use crate::any::AnyTransport;
use crate::decide::{decide, Decision, RdmaUnavailable, TransportKind, TransportPref};

/// Where this node listens and over what, with the reasons.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// The address and the interface carrying it.
    pub address: NodeAddress,
    /// The transport.
    pub decision: Decision,
    /// What was asked for (`auto` falls back to TCP if the RDMA device cannot be opened).
    pub pref: TransportPref,
}

/// Why a node could not choose or build its transport.
#[derive(Debug, thiserror::Error)]
pub enum SelectError {
    /// The environment is wrong (bad value, unknown interface).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// RDMA was required but cannot be used.
    #[error(transparent)]
    Rdma(#[from] RdmaUnavailable),
    /// Building the transport failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

impl Selection {
    /// Chooses from the environment (`DMLC_NODE_HOST`, `DMLC_INTERFACE`, `PSNET_TRANSPORT`);
    /// `pref` (e.g. a command-line flag) beats `PSNET_TRANSPORT`.
    pub fn from_env(pref: Option<TransportPref>) -> Result<Self, SelectError> {
        Self::for_address(interface::node_address_from_env()?, pref)
    }

    /// Chooses the transport for a known address.
    pub fn for_address(
        address: NodeAddress,
        pref: Option<TransportPref>,
    ) -> Result<Self, SelectError> {
        let pref = match pref {
            Some(p) => p,
            None => env::PSNET_TRANSPORT.parse_or_default::<TransportPref>()?,
        };
        let binding = match env::PSNET_IB_DEVICE.get() {
            Some(device) => {
                let port = env::PSNET_IB_PORT.parse::<u32>()?.unwrap_or(1);
                Some(discovery::configured_binding(&device, port).ok_or_else(|| {
                    ConfigError::Invalid {
                        name: env::PSNET_IB_DEVICE.name,
                        value: device.clone(),
                        reason: format!(
                            "no such RDMA device (devices here: {:?})",
                            discovery::rdma_devices()
                        ),
                    }
                })?)
            }
            None => match address.interface.as_deref() {
                Some(name) => {
                    let sysfs = discovery::rdma_device_for_interface(name).unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "cannot read RDMA devices from sysfs");
                        None
                    });
                    discovery::reconcile(
                        sysfs,
                        psnet_verbs::cm::device_for_address(address.ip),
                        discovery::port_link_layer,
                    )
                }
                None => None,
            },
        };
        let decision = decide(pref, address.interface.as_deref(), binding, RDMA_DATA_PATH)?;
        Ok(Selection {
            address,
            decision,
            pref,
        })
    }
}

impl Selection {
    /// Logs the choice and the reasons (once, at start).
    pub fn log(&self) {
        tracing::info!(
            address = %self.address,
            transport = self.decision.kind.name(),
            reason = %self.decision.reason,
            "psnet transport selected"
        );
    }
}

/// Whether this build moves data over RDMA (the verbs data path).
const RDMA_DATA_PATH: bool = true;

/// TCP settings from the environment, listening on `bind`.
pub fn tcp_config_from_env(bind: SocketAddr) -> Result<TcpConfig, ConfigError> {
    let mut config = TcpConfig::new(bind);
    config.limits = Limits {
        max_message: env::PSNET_MAX_MESSAGE.parse_or_default()?,
        ..Limits::default()
    };
    config.connect_timeout = Duration::from_secs(env::PSNET_CONNECT_TIMEOUT.parse_or_default()?);
    config.inbox_bytes = env::PSNET_INBOX_BYTES.parse_or_default()?;
    config.inflight_bytes = env::PSNET_RECV_INFLIGHT_BYTES.parse_or_default()?;
    config.frame_stall = match env::PSNET_FRAME_STALL_TIMEOUT.parse_or_default::<u64>()? {
        0 => {
            return Err(ConfigError::Invalid {
                name: env::PSNET_FRAME_STALL_TIMEOUT.name,
                value: "0".into(),
                reason: "seconds, at least 1: a peer that stops inside a frame must not hold \
                         its memory for ever"
                    .into(),
            })
        }
        secs => Duration::from_secs(secs),
    };
    config.shm_ring = env::PSNET_SHM_RING.parse_or_default()?;
    config.shm_queue = env::PSNET_SHM_QUEUE.parse_or_default()?;
    if config.shm_queue != 0
        && !(config.shm_queue.is_power_of_two() && (4096..=64 << 20).contains(&config.shm_queue))
    {
        return Err(ConfigError::Invalid {
            name: env::PSNET_SHM_QUEUE.name,
            value: config.shm_queue.to_string(),
            reason: "0, or a power of two from 4096 to 67108864".into(),
        });
    }
    config.shm_spin = Duration::from_micros(env::PSNET_SHM_SPIN_US.parse_or_default()?);
    config.gpu_stage_chunk = env::PSNET_GPU_STAGE_CHUNK.parse_or_default()?;
    if config.gpu_stage_chunk < 4096 {
        return Err(ConfigError::Invalid {
            name: env::PSNET_GPU_STAGE_CHUNK.name,
            value: config.gpu_stage_chunk.to_string(),
            reason:
                "at least 4096 bytes: smaller chunks spend their time in the copies' fixed cost"
                    .into(),
        });
    }
    config.socket_buffer = match env::PSNET_TCP_BUFFER.parse_or_default::<usize>()? {
        0 => None,
        n => Some(n),
    };
    config.congestion = env::PSNET_TCP_CONGESTION.parse_or_default()?;
    config.faults = match env::PSNET_FAULTS.get() {
        None => None,
        Some(text) => Some(text.parse().map_err(|reason| ConfigError::Invalid {
            name: env::PSNET_FAULTS.name,
            value: text.clone(),
            reason,
        })?),
    };
    config.secret = crate::secret::secret_from_env()?;
    crate::secret::note_open_job(config.secret.as_ref(), bind.ip());
    config.encrypt = match env::PSNET_ENCRYPT.parse_or_default::<u8>()? {
        0 => false,
        1 if config.secret.is_some() => true,
        1 => {
            return Err(ConfigError::Invalid {
                name: env::PSNET_ENCRYPT.name,
                value: "1".into(),
                reason: "encryption needs the job's secret (PSNET_SECRET or PSNET_SECRET_FILE): \
                         the keys come from it"
                    .into(),
            })
        }
        other => {
            return Err(ConfigError::Invalid {
                name: env::PSNET_ENCRYPT.name,
                value: other.to_string(),
                reason: "0 or 1".into(),
            })
        }
    };
    Ok(config)
}

/// Builds the transport `selection` chose, as node `id`, listening on `port` (0: any free).
pub async fn bind(
    id: NodeId,
    selection: &Selection,
    port: u16,
) -> Result<AnyTransport, SelectError> {
    let addr = SocketAddr::new(selection.address.ip, port);
    match &selection.decision.kind {
        TransportKind::Tcp => Ok(AnyTransport::Tcp(
            TcpTransport::bind(id, tcp_config_from_env(addr)?).await?,
        )),
        TransportKind::Rdma(b) => {
            match VerbsTransport::bind(id, verbs_config_from_env(addr, b)?).await {
                Ok(t) => Ok(AnyTransport::Rdma(t)),
                Err(e) if selection.pref == TransportPref::Auto => {
                    tracing::warn!(device = %b.device, error = %e,
                        "RDMA device unusable, falling back to TCP (PSNET_TRANSPORT=rdma makes this an error)");
                    Ok(AnyTransport::Tcp(
                        TcpTransport::bind(id, tcp_config_from_env(addr)?).await?,
                    ))
                }
                Err(e) => Err(SelectError::Rdma(RdmaUnavailable {
                    why: format!("RDMA device {} cannot be used: {e}", b.device),
                })),
            }
        }
    }
}

/// RDMA settings from the environment for `binding`, listening (for the queue-pair handshake)
/// on `bind`.
pub fn verbs_config_from_env(
    bind: SocketAddr,
    binding: &RdmaBinding,
) -> Result<VerbsConfig, ConfigError> {
    let port = u8::try_from(binding.port).map_err(|_| ConfigError::Invalid {
        name: env::PSNET_IB_PORT.name,
        value: binding.port.to_string(),
        reason: "RDMA ports are numbered 1..=255".into(),
    })?;
    let spec = DeviceSpec {
        device: binding.device.clone(),
        port,
        gid_index: env::PSNET_GID_INDEX.parse::<u32>()?,
        ip: bind.ip(),
    };
    let mut config = VerbsConfig::new(bind, spec);
    config.tcp = tcp_config_from_env(bind)?;
    if config.tcp.secret.is_some() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            tracing::warn!(
                "PSNET_SECRET tags RDMA's control connections and every message of its queue \
                 pairs, but not the bytes of RDMA writes (the payload of large messages): a \
                 process able to inject RoCE packets on the path can change those \
                 (RELIABILITY.md, \"Not covered yet\")"
            );
            if config.tcp.encrypt {
                tracing::warn!(
                    "PSNET_ENCRYPT=1 encrypts RDMA's control connections only: the data of its \
                     queue pairs crosses the network in clear"
                );
            }
        });
    }
    config.eager_bytes = env::PSNET_RDMA_EAGER.parse_or_default()?;
    config.recv_depth = env::PSNET_RDMA_RECV_DEPTH.parse_or_default()?;
    config.reg_cache = env::PSNET_RDMA_REG_CACHE.parse_or_default()?;
    config.inline_bytes = env::PSNET_RDMA_INLINE.parse_or_default()?;
    config.spin_us = env::PSNET_RDMA_SPIN_US.parse_or_default()?;
    config.offer_bytes = env::PSNET_RDMA_OFFER_BYTES.parse_or_default()?;
    config.handshake = env::PSNET_RDMA_CONNECT.parse_or_default()?;
    Ok(config)
}

/// Chooses from the environment, logs the choice once, and builds the transport.
pub async fn bind_from_env(
    id: NodeId,
    port: u16,
    pref: Option<TransportPref>,
) -> Result<(AnyTransport, Selection), SelectError> {
    let selection = Selection::from_env(pref)?;
    selection.log();
    let transport = bind(id, &selection, port).await?;
    Ok((transport, selection))
}
