//! Collectives (allreduce, reduce-scatter, allgather, broadcast, reduce, barrier) on a
//! transport bound from the environment.
//!
//! A process learns its rank, the number of ranks and where they meet from whichever launcher
//! started it: psnet's own `PSNET_RANK` / `PSNET_WORLD_SIZE` / `PSNET_ROOT_ADDR`, torchrun's
//! `RANK` / `WORLD_SIZE` / `MASTER_ADDR` / `MASTER_PORT`, mpirun's `OMPI_COMM_WORLD_RANK` /
//! `OMPI_COMM_WORLD_SIZE` or `PMI_RANK` / `PMI_SIZE`, or Slurm's `SLURM_PROCID` /
//! `SLURM_NTASKS` (the last three need a root address from one of the first two).
//!
//! ```no_run
//! # async fn example() -> Result<(), psnet::collectives::CollectiveError> {
//! let comm = psnet::collectives::join_from_env().await?;
//! let mut grads = vec![1.0f32; 1 << 20];
//! comm.allreduce(&mut grads, psnet::collectives::ReduceOp::Avg).await?;
//! # Ok(())
//! # }
//! ```

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use psnet_config::env::{self, EnvVar};
use psnet_config::interface::{self, NodeAddress};
use psnet_config::rank;
use psnet_select::{AnyTransport, Selection};
use psnet_transport::Transport;

pub use psnet_collectives::{
    bf16, f16, node_of, Algo, CollectiveError, Communicator, Config, DType, Element, ReduceOp,
};

/// Where this process stands among the ranks, as its launcher said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct World {
    /// This process's rank.
    pub rank: usize,
    /// The number of ranks.
    pub size: usize,
    /// Where rank 0 listens.
    pub root: SocketAddr,
    /// Which variables said so, for messages.
    pub source: String,
}

fn invalid(msg: String) -> CollectiveError {
    CollectiveError::Join(msg)
}

impl World {
    /// From the environment (see the module's documentation).
    pub fn from_env() -> Result<World, CollectiveError> {
        World::from_lookup(|v| v.get())
    }

    /// From variables looked up by `get` (the environment, or a test's table).
    pub fn from_lookup(get: impl Fn(&EnvVar) -> Option<String>) -> Result<World, CollectiveError> {
        let found: Vec<(usize, usize, String)> = rank::ranks_with_size(&get, &rank::COLLECTIVES)
            .map_err(|e| invalid(e.to_string()))?
            .into_iter()
            .map(|f| {
                let size = f.size.unwrap_or_default();
                (f.rank as usize, size as usize, f.source())
            })
            .collect();
        let Some((rank, size, source)) = found.first().cloned() else {
            return Err(invalid(
                "no rank: set PSNET_RANK and PSNET_WORLD_SIZE, or start under torchrun (RANK, WORLD_SIZE), mpirun (OMPI_COMM_WORLD_RANK, PMI_RANK) or srun (SLURM_PROCID)".into(),
            ));
        };
        // psnet's own names are an explicit choice; the launchers' must agree with each other.
        if !source.starts_with("PSNET_") {
            if let Some((r, s, other)) = found.iter().find(|(r, s, _)| (*r, *s) != (rank, size)) {
                return Err(invalid(format!(
                    "{source} say rank {rank} of {size} but {other} say rank {r} of {s}; set PSNET_RANK and PSNET_WORLD_SIZE to choose"
                )));
            }
        }
        if size == 0 || rank >= size {
            return Err(invalid(format!("{source} say rank {rank} of {size} ranks")));
        }
        let root = match (get(&env::PSNET_ROOT_ADDR), get(&env::MASTER_ADDR)) {
            (Some(addr), _) => resolve(env::PSNET_ROOT_ADDR.name, &addr)?,
            (None, Some(host)) => {
                let port = get(&env::MASTER_PORT).ok_or_else(|| {
                    invalid("MASTER_ADDR is set but MASTER_PORT is not".into())
                })?;
                let joined = if host.contains(':') && !host.starts_with('[') {
                    format!("[{host}]:{port}")
                } else {
                    format!("{host}:{port}")
                };
                resolve("MASTER_ADDR and MASTER_PORT", &joined)?
            }
            (None, None) => {
                return Err(invalid(format!(
                    "rank {rank} of {size} ({source}) but no meeting point: set PSNET_ROOT_ADDR=host:port (or MASTER_ADDR and MASTER_PORT) to where rank 0 listens"
                )))
            }
        };
        Ok(World {
            rank,
            size,
            root,
            source,
        })
    }
}

fn resolve(what: &str, text: &str) -> Result<SocketAddr, CollectiveError> {
    let mut addrs = text
        .to_socket_addrs()
        .map_err(|e| invalid(format!("{what}: {text:?} is not host:port ({e})")))?;
    addrs
        .next()
        .ok_or_else(|| invalid(format!("{what}: {text:?} resolves to no address")))
}

/// The settings from `PSNET_ALGO`, `PSNET_COLL_SMALL`, `PSNET_COLL_SMALL_SHM`, `PSNET_COLL_PIECE`,
/// `PSNET_COLL_JOIN_TIMEOUT`, `PSNET_COLL_TIMEOUT`, `PSNET_COLL_HEARTBEAT_TIMEOUT`,
/// `PSNET_COLL_SPIN_US`, `PSNET_COLL_AHEAD_BYTES`, `PSNET_COLL_COMPRESSED_TWO_PHASE` and the flight recorder's `PSNET_RECORDER_*`.
pub fn config_from_env() -> Result<Config, CollectiveError> {
    let bad = |e: psnet_config::ConfigError| CollectiveError::Invalid(e.to_string());
    let call_timeout = env::PSNET_COLL_TIMEOUT
        .parse_or_default::<u64>()
        .map_err(bad)?;
    Ok(Config {
        spin: Duration::from_micros(
            env::PSNET_COLL_SPIN_US
                .parse_or_default::<u64>()
                .map_err(bad)?,
        ),
        call_timeout: (call_timeout > 0).then(|| Duration::from_secs(call_timeout)),
        ahead_bytes: env::PSNET_COLL_AHEAD_BYTES
            .parse_or_default::<usize>()
            .map_err(bad)?,
        algo: env::PSNET_ALGO.parse_or_default::<Algo>().map_err(bad)?,
        small_bytes: env::PSNET_COLL_SMALL
            .parse_or_default::<usize>()
            .map_err(bad)?,
        small_shm_bytes: env::PSNET_COLL_SMALL_SHM
            .parse_or_default::<usize>()
            .map_err(bad)?,
        piece_bytes: env::PSNET_COLL_PIECE
            .parse_or_default::<usize>()
            .map_err(bad)?
            .max(1),
        join_timeout: Duration::from_secs(
            env::PSNET_COLL_JOIN_TIMEOUT
                .parse_or_default::<u64>()
                .map_err(bad)?,
        ),
        heartbeat_timeout: heartbeat_timeout()?,
        compressed_two_phase_bytes: env::PSNET_COLL_COMPRESSED_TWO_PHASE
            .parse_or_default::<usize>()
            .map_err(bad)?,
        recorder: psnet_recorder::Settings::from_env(),
    })
}

/// `PSNET_COLL_HEARTBEAT_TIMEOUT`: seconds (a fraction allowed), 0 for none.
fn heartbeat_timeout() -> Result<Option<Duration>, CollectiveError> {
    let secs: f64 = env::PSNET_COLL_HEARTBEAT_TIMEOUT
        .parse_or_default()
        .map_err(|e| CollectiveError::Invalid(e.to_string()))?;
    let invalid =
        |why: &str| CollectiveError::Invalid(format!("PSNET_COLL_HEARTBEAT_TIMEOUT={secs}: {why}"));
    if !secs.is_finite() || secs < 0.0 {
        return Err(invalid("seconds, 0 or more"));
    }
    if secs == 0.0 {
        return Ok(None);
    }
    if secs < 0.1 {
        return Err(invalid(
            "at least 0.1 s: shorter ones take a busy rank for a dead one",
        ));
    }
    Ok(Some(Duration::from_secs_f64(secs)))
}

/// The address this rank listens at: `DMLC_NODE_HOST` / `DMLC_INTERFACE` if set; otherwise
/// rank 0 takes the root address, and on a one-host job (a loopback root) every rank takes
/// loopback; otherwise the default interface.
fn listen_address(world: &World) -> Result<NodeAddress, CollectiveError> {
    let chosen = env::DMLC_NODE_HOST.is_set() || env::DMLC_INTERFACE.is_set();
    let root_ip: IpAddr = world.root.ip();
    let result = if !chosen && (world.rank == 0 || root_ip.is_loopback()) {
        interface::list_interfaces().and_then(|ifaces| {
            interface::select(Some(&root_ip.to_string()), None, &ifaces).map(|mut a| {
                a.reason = "the root address (PSNET_ROOT_ADDR or MASTER_ADDR)".into();
                a
            })
        })
    } else {
        interface::node_address_from_env()
    };
    result.map_err(|e| CollectiveError::Invalid(e.to_string()))
}

/// Binds this rank's transport (rank 0 at the root address's port) and forms the
/// communicator of `world`.
pub async fn join(
    world: &World,
    config: Config,
) -> Result<Communicator<AnyTransport>, CollectiveError> {
    let address = listen_address(world)?;
    let selection = Selection::for_address(address, None)
        .map_err(|e| CollectiveError::Invalid(e.to_string()))?;
    selection.log();
    let port = if world.rank == 0 {
        world.root.port()
    } else {
        0
    };
    let transport = psnet_select::bind(node_of(world.rank), &selection, port)
        .await
        .map_err(|e| {
            CollectiveError::Transport(format!(
                "rank {} cannot listen at {}:{port}: {e}",
                world.rank, selection.address.ip
            ))
        })?;
    tracing::info!(rank = world.rank, size = world.size, root = %world.root, source = %world.source,
        "joining the collectives' communicator");
    Communicator::join(
        Arc::new(transport),
        world.rank,
        world.size,
        world.root,
        config,
    )
    .await
}

/// Characters of a root address carried through the kv store (one per value).
const ROOT_TEXT: usize = 64;

/// Forms a communicator of a kv job's workers, each worker's kv rank its rank (the job
/// `psnet-launch` or a `DMLC_*` launcher started). Worker 0 binds the collectives' transport
/// beside its kv one and gives the others its address through the kv store itself (a key
/// initialised with it, then pulled). Every worker calls it, in the same order as its other
/// kv calls.
pub async fn join_kv_workers<T: Transport>(
    kv: &psnet_kv::Worker<T>,
    config: Config,
) -> Result<Communicator<AnyTransport>, CollectiveError> {
    static JOINS: AtomicU32 = AtomicU32::new(0);
    let joins = JOINS.fetch_add(1, Ordering::Relaxed);
    let kv_err = |e: psnet_kv::KvError| CollectiveError::Join(format!("through the kv store: {e}"));
    let (rank, size) = (kv.rank() as usize, kv.num_workers() as usize);
    let ip = kv.listen_addr().ip();
    let address = interface::list_interfaces()
        .and_then(|ifaces| interface::select(Some(&ip.to_string()), None, &ifaces))
        .map_err(|e| CollectiveError::Invalid(e.to_string()))?;
    let selection = Selection::for_address(address, None)
        .map_err(|e| CollectiveError::Invalid(e.to_string()))?;
    let transport = psnet_select::bind(node_of(rank), &selection, 0)
        .await
        .map_err(|e| {
            CollectiveError::Transport(format!("rank {rank} cannot listen at {ip}: {e}"))
        })?;
    let key = kv.key(&format!("psnet.collectives.root.{joins}"));
    let mut text = [0f32; ROOT_TEXT];
    if rank == 0 {
        let addr = transport.listen_addr().to_string();
        for (slot, byte) in text.iter_mut().zip(addr.bytes()) {
            *slot = f32::from(byte);
        }
    }
    kv.init(&[key], &[&text]).await.map_err(kv_err)?;
    let mut got = [0f32; ROOT_TEXT];
    kv.pull(key, &mut got).await.map_err(kv_err)?;
    let addr: String = got
        .iter()
        .take_while(|&&c| c > 0.0)
        .map(|&c| char::from(c as u8))
        .collect();
    let root: SocketAddr = addr.parse().map_err(|_| {
        CollectiveError::Join(format!(
            "worker 0's address came through the kv store as {addr:?}"
        ))
    })?;
    Communicator::join(Arc::new(transport), rank, size, root, config).await
}

/// [`World::from_env`], [`config_from_env`] and [`join`] in one.
pub async fn join_from_env() -> Result<Communicator<AnyTransport>, CollectiveError> {
    let world = World::from_env()?;
    join(&world, config_from_env()?).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn world(vars: &[(&str, &str)]) -> Result<World, CollectiveError> {
        World::from_lookup(|v| {
            vars.iter()
                .find(|(name, _)| *name == v.name)
                .map(|(_, value)| value.to_string())
        })
    }

    #[test]
    fn each_launchers_variables_are_read() {
        let w = world(&[
            ("PSNET_RANK", "2"),
            ("PSNET_WORLD_SIZE", "4"),
            ("PSNET_ROOT_ADDR", "127.0.0.1:7000"),
        ])
        .unwrap();
        assert_eq!(
            (w.rank, w.size, w.root),
            (2, 4, "127.0.0.1:7000".parse().unwrap())
        );
        let w = world(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!((w.rank, w.size, w.root.port()), (1, 2, 29500));
        let w = world(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("PSNET_ROOT_ADDR", "127.0.0.1:1"),
        ])
        .unwrap();
        assert_eq!((w.rank, w.size), (3, 8));
        let w = world(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("PSNET_ROOT_ADDR", "localhost:5"),
        ])
        .unwrap();
        assert_eq!((w.rank, w.size, w.root.port()), (0, 1, 5));
        // srun running an MPI program sets both, agreeing.
        let w = world(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("PSNET_ROOT_ADDR", "127.0.0.1:1"),
        ])
        .unwrap();
        assert_eq!((w.rank, w.size), (1, 2));
        // psnet's own names win over a launcher's.
        let w = world(&[
            ("PSNET_RANK", "0"),
            ("PSNET_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "6"),
            ("PSNET_ROOT_ADDR", "127.0.0.1:1"),
        ])
        .unwrap();
        assert_eq!((w.rank, w.size), (0, 2));
    }

    #[test]
    fn missing_or_contradictory_settings_name_the_variables() {
        let err = |vars: &[(&str, &str)]| world(vars).unwrap_err().to_string();
        assert!(err(&[]).contains("set PSNET_RANK and PSNET_WORLD_SIZE"));
        assert!(err(&[("RANK", "1")]).contains("RANK is set but WORLD_SIZE is not"));
        assert!(err(&[("PSNET_RANK", "1"), ("PSNET_WORLD_SIZE", "2")]).contains("PSNET_ROOT_ADDR"));
        assert!(err(&[
            ("PSNET_RANK", "2"),
            ("PSNET_WORLD_SIZE", "2"),
            ("PSNET_ROOT_ADDR", "127.0.0.1:1")
        ])
        .contains("rank 2 of 2"));
        assert!(err(&[("PSNET_RANK", "x"), ("PSNET_WORLD_SIZE", "2")]).contains("PSNET_RANK=\"x\""));
        assert!(err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1")
        ])
        .contains("MASTER_PORT is not"));
        let text = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1"),
        ]);
        assert!(
            text.contains(
                "RANK/WORLD_SIZE say rank 0 of 2 but SLURM_PROCID/SLURM_NTASKS say rank 1 of 2"
            ),
            "{text}"
        );
        assert!(err(&[
            ("PSNET_RANK", "0"),
            ("PSNET_WORLD_SIZE", "2"),
            ("PSNET_ROOT_ADDR", "nohost")
        ])
        .contains("not host:port"));
    }
}
