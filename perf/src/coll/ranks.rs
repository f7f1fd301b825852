//! The `#` lines above the table: the run's settings and every rank's pid, host and CPUs, as
//! nccl-tests lists its ranks.

use psnet::collectives::{CollectiveError, Communicator};
use psnet::config::env;
use psnet::AnyTransport;

use super::bind;
use super::measure::Setup;
use super::table::CollContext;
use super::Collective;

/// A rank as the banner lists it.
pub(super) struct RankInfo {
    pid: i64,
    host: String,
    /// The CPUs it may run on, as ranges.
    cpus: String,
}

/// Every rank's pid, host and CPUs, gathered (nccl-tests lists its ranks above the table).
pub(super) async fn describe_ranks(
    comm: &Communicator<AnyTransport>,
) -> Result<Vec<RankInfo>, CollectiveError> {
    let n = comm.size();
    let mut pids = vec![0i64; n];
    comm.allgather(&[i64::from(std::process::id())], &mut pids)
        .await?;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let hosts = gather_text(comm, host.trim()).await?;
    let cpus = gather_text(comm, &bind::describe_own()).await?;
    Ok(pids
        .into_iter()
        .zip(hosts)
        .zip(cpus)
        .map(|((pid, host), cpus)| RankInfo { pid, host, cpus })
        .collect())
}

/// Every rank's `text`, cut to 64 bytes.
async fn gather_text(
    comm: &Communicator<AnyTransport>,
    text: &str,
) -> Result<Vec<String>, CollectiveError> {
    const WIDTH: usize = 64;
    let mut mine = [0u8; WIDTH];
    let len = text.len().min(WIDTH);
    mine[..len].copy_from_slice(&text.as_bytes()[..len]);
    let mut all = vec![0u8; WIDTH * comm.size()];
    comm.allgather(&mine, &mut all).await?;
    Ok(all
        .chunks(WIDTH)
        .map(|t| {
            let end = t.iter().position(|&b| b == 0).unwrap_or(t.len());
            String::from_utf8_lossy(&t[..end]).into_owned()
        })
        .collect())
}

/// The `#` lines above the table.
pub(super) fn banner(s: &Setup<'_>, c: &CollContext, ranks: &[RankInfo]) -> String {
    let a = s.args;
    let step = if a.stepfactor > 1 {
        format!("{}(factor)", a.stepfactor)
    } else {
        format!("{}(bytes)", a.stepbytes)
    };
    let shm = if c.shm_ring_bytes == 0 {
        "sockets only (PSNET_SHM_RING=0)".to_string()
    } else {
        let queue = env::PSNET_SHM_QUEUE
            .parse_or_default::<u64>()
            .unwrap_or_default();
        format!(
            "same-host peers through a shared-memory queue of {queue} bytes (PSNET_SHM_QUEUE) and ring of {} bytes (PSNET_SHM_RING) per direction",
            c.shm_ring_bytes
        )
    };
    let algo = match s.coll {
        Collective::AllReduce => format!(
            "{} (PSNET_ALGO; recursive doubling up to {} bytes with auto), pieces of {} bytes",
            s.config.algo, s.config.small_bytes, s.config.piece_bytes
        ),
        Collective::ReduceScatter | Collective::AllGather => {
            format!("ring, pieces of {} bytes", s.config.piece_bytes)
        }
        Collective::Broadcast | Collective::Reduce => {
            format!("binomial tree, pieces of {} bytes", s.config.piece_bytes)
        }
        Collective::AllToAll => format!(
            "pairwise (each block straight to its rank), pieces of {} bytes; in place copies \
             the input aside first, inside the time",
            s.config.piece_bytes
        ),
        Collective::SendRecv => format!(
            "to the next rank, from the previous, at once; messages in pieces of {} bytes; in \
             place copies the input aside first, inside the time",
            s.config.piece_bytes
        ),
    };
    let mut lines = vec![
        format!(
            "# psnet-perf {} (the columns of nccl-tests' {})",
            s.coll.name(),
            s.coll.nccl_test()
        ),
        format!(
            "# nranks {} minBytes {} maxBytes {} step: {step} warmup iters: {} iters: {} validation: {}",
            c.ranks, a.minbytes, a.maxbytes, a.warmup_iters, a.iters, a.check
        ),
        format!("# transport: {}, {shm}", c.transport),
        format!("# algorithm: {algo}"),
        format!(
            "# ranks from {}, meeting at {}; time: average per iteration, the slowest rank's",
            s.world.source, s.world.root
        ),
        "#".to_string(),
        "# Using ranks".to_string(),
    ];
    for (r, RankInfo { pid, host, cpus }) in ranks.iter().enumerate() {
        lines.push(format!("#  Rank {r:>2} Pid {pid:>7} on {host} cpus {cpus}"));
    }
    lines.push("#".to_string());
    lines.join("\n")
}
