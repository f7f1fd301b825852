//! The parameter server on a transport chosen from the environment.
//!
//! `psnet_kv`'s [`Worker`](psnet_kv::Worker), [`Scheduler`](psnet_kv::Scheduler) and
//! [`run_server`](psnet_kv::run_server) take any bound [`Transport`](psnet_transport::Transport);
//! the functions here bind the one a process should use (RDMA or TCP, on the address
//! `DMLC_INTERFACE` / `DMLC_NODE_HOST` names, or 127.0.0.1 for [`KvConfig::local`] jobs) and
//! hand it over. The type aliases name the kv types on that transport.

use std::net::{IpAddr, Ipv4Addr};

use psnet_config::{interface, NodeAddress};
use psnet_select::{AnyTransport, SelectError, Selection};
use psnet_transport::NodeId;

pub use psnet_kv::blocking::Handle;
pub use psnet_kv::proto::ids::SCHEDULER;
pub use psnet_kv::{
    bf16, config, f16, placement, updater, Dtype, KvCompression, KvConfig, KvError, Mode, Role,
    Value, EXIT_FAILED, EXIT_PEER_FAILED,
};

/// A worker on the transport [`bind_node`] chose.
pub type Worker = psnet_kv::Worker<AnyTransport>;
/// A scheduler on the transport [`bind_scheduler`] chose.
pub type Scheduler = psnet_kv::Scheduler<AnyTransport>;
/// The blocking front end on the transport [`bind_node`] chose.
pub type KvStore = psnet_kv::blocking::KvStore<AnyTransport>;
/// A worker's push and pull of GPU buffers (feature `cuda`), on the transport [`bind_node`]
/// chose.
#[cfg(feature = "cuda")]
pub type GpuKv<'w> = psnet_kv::gpu::GpuKv<'w, AnyTransport>;

fn setup(e: SelectError) -> KvError {
    match e {
        SelectError::Config(c) => KvError::Config(c),
        SelectError::Transport(t) => KvError::Transport(t),
        other => KvError::Setup(Box::new(other)),
    }
}

/// Where a server or worker listens and over what: 127.0.0.1 for a loopback job, else the
/// address and transport the environment names.
pub fn node_selection(config: &KvConfig) -> Result<Selection, KvError> {
    let selection = if config.loopback {
        let address = NodeAddress {
            ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            interface: Some("lo".into()),
            reason: "single-host job".into(),
        };
        Selection::for_address(address, config.transport)
    } else {
        Selection::from_env(config.transport)
    }
    .map_err(setup)?;
    selection.log();
    Ok(selection)
}

/// Binds a server's or worker's transport (any free port; the node learns its id when it
/// joins).
pub async fn bind_node(config: &KvConfig) -> Result<AnyTransport, KvError> {
    let selection = node_selection(config)?;
    psnet_select::bind(NodeId(0), &selection, 0)
        .await
        .map_err(setup)
}

/// Binds the scheduler at the configured root address (port 0: any free port, see
/// [`psnet_kv::Scheduler::addr`]), as ps-lite does at `DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT`.
pub async fn bind_scheduler(config: &KvConfig) -> Result<Scheduler, KvError> {
    let ip = config.root.ip();
    let holder = interface::list_interfaces()
        .ok()
        .and_then(|ifs| ifs.into_iter().find(|i| i.addr == ip).map(|i| i.name));
    let address = NodeAddress {
        ip,
        interface: holder,
        reason: "DMLC_PS_ROOT_URI".into(),
    };
    let selection = Selection::for_address(address, config.transport).map_err(setup)?;
    selection.log();
    let t = psnet_select::bind(SCHEDULER, &selection, config.root.port())
        .await
        .map_err(setup)?;
    Ok(Scheduler::new(config, t))
}

/// Runs the scheduler until the job ends. `Err` if nodes died or never registered.
pub async fn run_scheduler(config: &KvConfig) -> Result<(), KvError> {
    bind_scheduler(config).await?.run().await
}

/// Joins the job as a server and serves until the scheduler ends the job.
pub async fn run_server(config: &KvConfig) -> Result<(), KvError> {
    psnet_kv::run_server(config, bind_node(config).await?).await
}

/// Joins the job as a worker. Needs a tokio runtime.
pub async fn join(config: &KvConfig) -> Result<Worker, KvError> {
    Worker::join(config, bind_node(config).await?).await
}

/// Whether this process was started by a launcher as one role of a job (`DMLC_ROLE` set).
/// Like ps-lite, refuses a half-described job: the job's other `DMLC_*` variables without
/// `DMLC_ROLE` is an error naming them, not a cue to start a job of one's own.
pub fn started_by_launcher() -> Result<bool, KvError> {
    use psnet_config::env::{
        DMLC_NUM_SERVER, DMLC_NUM_WORKER, DMLC_PS_ROOT_PORT, DMLC_PS_ROOT_URI, DMLC_ROLE,
    };
    if DMLC_ROLE.is_set() {
        return Ok(true);
    }
    let set: Vec<&str> = [
        DMLC_PS_ROOT_URI,
        DMLC_PS_ROOT_PORT,
        DMLC_NUM_SERVER,
        DMLC_NUM_WORKER,
    ]
    .iter()
    .filter(|v| v.is_set())
    .map(|v| v.name)
    .collect();
    if set.is_empty() {
        return Ok(false);
    }
    Err(KvError::Invalid(format!(
        "DMLC_ROLE is not set, but {} {}: set DMLC_ROLE to scheduler, server or worker, or \
         unset them to let this program launch a job of its own",
        set.join(", "),
        if set.len() == 1 { "is" } else { "are" }
    )))
}

/// Joins the job as a worker with the blocking front end (its own runtime).
pub fn join_blocking(config: &KvConfig) -> Result<KvStore, KvError> {
    let bind_config = config.clone();
    KvStore::join(config, move || async move { bind_node(&bind_config).await })
}

/// MXNet's start-up behaviour for one program launched in every role: in a scheduler or
/// server process, runs that role until the job ends and exits the process (status 0; on an
/// error, printed to stderr, [`EXIT_PEER_FAILED`](psnet_kv::EXIT_PEER_FAILED) when another
/// node of the job failed first, else 1); in a worker process, returns the configuration for
/// [`join`].
pub fn launch_from_env() -> Result<KvConfig, KvError> {
    let config = KvConfig::from_env()?;
    if config.role == Role::Worker {
        return Ok(config);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| KvError::Invalid(format!("cannot start the runtime: {e}")))?;
    let result = runtime.block_on(async {
        match config.role {
            Role::Scheduler => run_scheduler(&config).await,
            _ => run_server(&config).await,
        }
    });
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("psnet {}: error: {e}", config.role);
            std::process::exit(i32::from(e.exit_code()))
        }
    }
}

/// [`launch_from_env`] then [`join_blocking`]: the one call a program makes at start in every
/// role (scheduler and server processes never return from it).
pub fn store_from_env() -> Result<KvStore, KvError> {
    join_blocking(&launch_from_env()?)
}
