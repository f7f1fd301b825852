//! Allreduce of GPU buffers (feature `cuda`): three ranks on the in-memory network (or TCP),
//! each reducing a buffer on the GPU through `GpuStage` in small chunks; the results must be
//! the bits the same chunks reduced from host buffers give; and reducing on the device (with
//! received pieces placed in device memory by the transport, or not), the bits a host
//! allreduce of the whole buffers gives, for several types and operations. Without a GPU the
//! tests say why they skipped.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use futures_util::future::try_join_all;
use psnet_collectives::{bf16, f16, node_of, Communicator, Config, GpuStage, ReduceOp};
use psnet_compression::cuda::device_count;
use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_memnet::{MemNet, MemNetConfig, MemTransport};
use psnet_transport::Transport;

async fn world(net: &MemNet, n: usize) -> Vec<Communicator<MemTransport>> {
    world_on((0..n).map(|r| Arc::new(net.bind(node_of(r)))).collect()).await
}

/// Elements per chunk of the GPU stage.
const CHUNK: usize = 64 << 10;

/// Stages reducing on the device for ranks 0 and 1, and their `values` in GPU memory.
#[allow(clippy::type_complexity)]
fn two_device_ranks(
    len: usize,
) -> (
    Vec<GpuStage<f32>>,
    Vec<psnet_compression::cuda::cudarc::driver::CudaSlice<f32>>,
) {
    let stages: Vec<GpuStage<f32>> = (0..2)
        .map(|_| GpuStage::reducing_on_device(0).expect("a stage"))
        .collect();
    let device = stages
        .iter()
        .enumerate()
        .map(|(r, s)| s.stream().clone_htod(&values(r, len)).expect("upload"))
        .collect();
    (stages, device)
}

fn values(rank: usize, len: usize) -> Vec<f32> {
    let mut rng = fastrand::Rng::with_seed(rank as u64 + 7);
    (0..len).map(|_| rng.f32() * 2.0 - 1.0).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gpu_buffers_reduce_to_the_bits_of_host_buffers() {
    if let Err(e) = device_count() {
        eprintln!("gpu_buffers_reduce_to_the_bits_of_host_buffers: skipped: {e}");
        return;
    }
    let n = 3;
    // Not a multiple of the chunk, and chunks smaller than the ring's pieces.
    let len = 1_000_003;
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
        let net = MemNet::reliable();
        let comms = world(&net, n).await;
        // The GPU path reduces chunk by chunk: the reference is the same chunks reduced from
        // host memory (a float sum's bits depend on how the ring splits the buffer).
        let mut host: Vec<Vec<f32>> = (0..n).map(|r| values(r, len)).collect();
        for start in (0..len).step_by(CHUNK) {
            let end = (start + CHUNK).min(len);
            try_join_all(
                comms
                    .iter()
                    .zip(host.iter_mut())
                    .map(|(c, b)| c.allreduce(&mut b[start..end], op)),
            )
            .await
            .expect("host allreduce");
        }

        let net = MemNet::reliable();
        let comms = world(&net, n).await;
        let stages: Vec<GpuStage<f32>> = (0..n)
            .map(|_| GpuStage::new(0, CHUNK * 4).expect("a stage"))
            .collect();
        let mut device: Vec<_> = stages
            .iter()
            .enumerate()
            .map(|(r, s)| s.stream().clone_htod(&values(r, len)).expect("upload"))
            .collect();
        try_join_all(comms.iter().zip(stages.iter().zip(device.iter_mut())).map(
            |(c, (s, d))| async move { c.allreduce_device(s, &mut d.as_view_mut(), op).await },
        ))
        .await
        .expect("GPU allreduce");
        for (r, (d, s)) in device.iter().zip(&stages).enumerate() {
            let back = s.stream().clone_dtoh(d).expect("download");
            let same = back
                .iter()
                .zip(&host[r])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{op}: rank {r} differs from the host allreduce");
        }
    }
}

/// Where a test's ranks meet.
#[derive(Clone, Copy, Debug)]
enum Wire {
    /// The in-memory network; `places`: received pieces are placed in device memory.
    Mem { places: bool },
    /// TCP on 127.0.0.1, sockets only: placed pieces are read off the socket chunk by chunk,
    /// each chunk copied to the device while the next is read.
    Tcp,
}

/// A communicator of every one of `transports`.
async fn world_on<T: Transport>(transports: Vec<Arc<T>>) -> Vec<Communicator<T>> {
    let n = transports.len();
    let root = transports[0].listen_addr();
    try_join_all(
        transports
            .iter()
            .enumerate()
            .map(|(r, t)| Communicator::join(t.clone(), r, n, root, Config::default())),
    )
    .await
    .expect("every rank joins")
}

async fn tcp_transports(n: usize) -> Vec<Arc<TcpTransport>> {
    let mut out = Vec::new();
    for r in 0..n {
        let mut config = TcpConfig::new(([127, 0, 0, 1], 0).into());
        config.shm_ring = 0;
        config.shm_queue = 0;
        config.gpu_stage_chunk = 64 << 10;
        out.push(Arc::new(
            TcpTransport::bind(node_of(r), config).await.expect("bind"),
        ));
    }
    out
}

fn mem_transports(n: usize, places: bool) -> Vec<Arc<MemTransport>> {
    let net = MemNet::new(MemNetConfig {
        places,
        ..MemNetConfig::default()
    });
    (0..n).map(|r| Arc::new(net.bind(node_of(r)))).collect()
}

/// Runs `op` over `values` (one buffer per rank) on the host and, from GPU buffers reduced
/// on the device, on a fresh world on `wire`; every rank's bits must be the host's.
async fn device_matches_host<E>(op: ReduceOp, values: Vec<Vec<E>>, wire: Wire)
where
    E: psnet_collectives::Element
        + psnet_compression::cuda::cudarc::driver::DeviceRepr
        + psnet_compression::cuda::cudarc::driver::ValidAsZeroBits,
{
    let n = values.len();
    let net = MemNet::reliable();
    let comms = world(&net, n).await;
    let mut host = values.clone();
    try_join_all(
        comms
            .iter()
            .zip(host.iter_mut())
            .map(|(c, b)| c.allreduce(b, op)),
    )
    .await
    .expect("host allreduce");
    let device = match wire {
        Wire::Mem { places } => {
            on_device(&world_on(mem_transports(n, places)).await, op, &values).await
        }
        Wire::Tcp => on_device(&world_on(tcp_transports(n).await).await, op, &values).await,
    };
    let len = values[0].len();
    for (r, back) in device.iter().enumerate() {
        let same = bytemuck::cast_slice::<E, u8>(back) == bytemuck::cast_slice::<E, u8>(&host[r]);
        assert!(
            same,
            "{op} of {len} {} over {wire:?}: rank {r} differs from the host allreduce",
            E::DTYPE
        );
    }
}

/// Every rank's `values` allreduced with `op` on the device by `comms`; the results, back on
/// the host.
async fn on_device<T: Transport, E>(
    comms: &[Communicator<T>],
    op: ReduceOp,
    values: &[Vec<E>],
) -> Vec<Vec<E>>
where
    E: psnet_collectives::Element
        + psnet_compression::cuda::cudarc::driver::DeviceRepr
        + psnet_compression::cuda::cudarc::driver::ValidAsZeroBits,
{
    let stages: Vec<GpuStage<E>> = (0..comms.len())
        .map(|_| GpuStage::reducing_on_device(0).expect("a stage"))
        .collect();
    assert!(stages.iter().all(GpuStage::reduces_on_device));
    let mut device: Vec<_> = stages
        .iter()
        .zip(values)
        .map(|(s, v)| s.stream().clone_htod(v).expect("upload"))
        .collect();
    try_join_all(
        comms
            .iter()
            .zip(stages.iter().zip(device.iter_mut()))
            .map(
                |(c, (s, d))| async move { c.allreduce_device(s, &mut d.as_view_mut(), op).await },
            ),
    )
    .await
    .expect("GPU allreduce");
    device
        .iter()
        .zip(&stages)
        .map(|(d, s)| s.stream().clone_dtoh(d).expect("download"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gpu_buffers_reduced_on_the_device_have_the_bits_of_host_buffers() {
    if let Err(e) = device_count() {
        eprintln!("gpu_buffers_reduced_on_the_device_have_the_bits_of_host_buffers: skipped: {e}");
        return;
    }
    // Recursive doubling (small) and the pipelined ring (large, several pieces per block).
    for len in [1_000, 1_000_003] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Prod] {
            device_matches_host(op, (0..3).map(|r| values(r, len)).collect(), PLACED).await;
        }
        let halves = (0..3)
            .map(|r| values(r, len).into_iter().map(f16::from_f32).collect())
            .collect();
        device_matches_host::<f16>(ReduceOp::Sum, halves, PLACED).await;
        let halves = (0..3)
            .map(|r| values(r, len).into_iter().map(bf16::from_f32).collect())
            .collect();
        device_matches_host::<bf16>(ReduceOp::Avg, halves, PLACED).await;
        let ints = (0..3)
            .map(|r| {
                values(r, len)
                    .into_iter()
                    .map(|v| (v * 1e9) as i32)
                    .collect()
            })
            .collect();
        device_matches_host::<i32>(ReduceOp::Sum, ints, PLACED).await;
    }
}

/// The in-memory network, placing received pieces in device memory.
const PLACED: Wire = Wire::Mem { places: true };

/// Pieces placed in device memory as they are read off a TCP socket, and pieces left in host
/// memory (a transport that cannot place) and copied in by the reducer, give the same bits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pieces_placed_off_tcp_or_left_on_the_host_reduce_to_the_same_bits() {
    if let Err(e) = device_count() {
        eprintln!(
            "pieces_placed_off_tcp_or_left_on_the_host_reduce_to_the_same_bits: skipped: {e}"
        );
        return;
    }
    for wire in [Wire::Tcp, Wire::Mem { places: false }] {
        for len in [1_000, 1_000_003] {
            device_matches_host(
                ReduceOp::Sum,
                (0..3).map(|r| values(r, len)).collect(),
                wire,
            )
            .await;
            let halves = (0..3)
                .map(|r| values(r, len).into_iter().map(bf16::from_f32).collect())
                .collect();
            device_matches_host::<bf16>(ReduceOp::Avg, halves, wire).await;
        }
    }
}

/// A rank reducing on the device and ranks reducing host buffers take part in one allreduce
/// (the same plan and messages), and all end with the host allreduce's bits: a process that
/// cannot reduce on its GPU may stage instead without the others noticing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn device_and_host_ranks_reduce_together() {
    if let Err(e) = device_count() {
        eprintln!("device_and_host_ranks_reduce_together: skipped: {e}");
        return;
    }
    let (n, len) = (3, 1_000_003);
    let net = MemNet::reliable();
    let comms = world(&net, n).await;
    let mut reference: Vec<Vec<f32>> = (0..n).map(|r| values(r, len)).collect();
    try_join_all(
        comms
            .iter()
            .zip(reference.iter_mut())
            .map(|(c, b)| c.allreduce(b, ReduceOp::Avg)),
    )
    .await
    .expect("host allreduce");

    let net = MemNet::reliable();
    let comms = world(&net, n).await;
    let stage = GpuStage::<f32>::reducing_on_device(0).expect("a stage");
    let mut device = stage.stream().clone_htod(&values(0, len)).expect("upload");
    let mut host: Vec<Vec<f32>> = (1..n).map(|r| values(r, len)).collect();
    {
        let mut view = device.as_view_mut();
        let on_device = comms[0].allreduce_device(&stage, &mut view, ReduceOp::Avg);
        let on_host = try_join_all(
            comms[1..]
                .iter()
                .zip(host.iter_mut())
                .map(|(c, b)| c.allreduce(b, ReduceOp::Avg)),
        );
        let (a, b) = tokio::join!(on_device, on_host);
        a.expect("the device rank");
        b.expect("the host ranks");
    }
    let back = stage.stream().clone_dtoh(&device).expect("download");
    for (r, got) in std::iter::once(&back).chain(&host).enumerate() {
        let same = got
            .iter()
            .zip(&reference[r])
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "rank {r} differs from the all-host allreduce");
    }
}

/// A broadcast from GPU memory into GPU memory, with a rank broadcasting a host buffer taking
/// part: every rank ends with the root's bits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gpu_broadcast_lands_the_roots_bits_on_every_rank() {
    if let Err(e) = device_count() {
        eprintln!("a_gpu_broadcast_lands_the_roots_bits_on_every_rank: skipped: {e}");
        return;
    }
    let (n, len, root) = (3, 1_000_003, 1);
    let net = MemNet::reliable();
    let comms = world(&net, n).await;
    let (stages, mut device) = two_device_ranks(len);
    let mut host = values(2, len);
    {
        let on_device =
            comms[..2]
                .iter()
                .zip(stages.iter().zip(device.iter_mut()))
                .map(|(c, (s, d))| async move {
                    c.broadcast_device(s, &mut d.as_view_mut(), root).await
                });
        let (a, b) = tokio::join!(try_join_all(on_device), comms[2].broadcast(&mut host, root));
        a.expect("the device ranks");
        b.expect("the host rank");
    }
    let want: Vec<u32> = values(root, len).iter().map(|v| v.to_bits()).collect();
    for (r, (d, s)) in device.iter().zip(&stages).enumerate() {
        let back = s.stream().clone_dtoh(d).expect("download");
        let got: Vec<u32> = back.iter().map(|v| v.to_bits()).collect();
        assert!(got == want, "rank {r} does not hold the root's values");
    }
    let got: Vec<u32> = host.iter().map(|v| v.to_bits()).collect();
    assert!(got == want, "the host rank does not hold the root's values");
}

/// Allgather and reduce-scatter in place of GPU buffers, on the device, end with the bits the
/// same calls on host buffers give (reduce-scatter: this rank's block), with a rank working
/// on a host buffer taking part in each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gathers_and_reduce_scatters_on_the_device_have_the_host_bits() {
    if let Err(e) = device_count() {
        eprintln!("gathers_and_reduce_scatters_on_the_device_have_the_host_bits: skipped: {e}");
        return;
    }
    let (n, block) = (3, 333_335);
    let len = n * block;
    for op in [None, Some(ReduceOp::Sum), Some(ReduceOp::Avg)] {
        // The reference: every rank on host buffers.
        let net = MemNet::reliable();
        let comms = world(&net, n).await;
        let mut host: Vec<Vec<f32>> = (0..n).map(|r| values(r, len)).collect();
        try_join_all(comms.iter().zip(host.iter_mut()).map(|(c, b)| async move {
            match op {
                None => c.allgather_in_place(b).await,
                Some(op) => c.reduce_scatter_in_place(b, op).await,
            }
        }))
        .await
        .expect("host calls");

        // Ranks 0 and 1 on the device, rank 2 on the host.
        let net = MemNet::reliable();
        let comms = world(&net, n).await;
        let (stages, mut device) = two_device_ranks(len);
        let mut mixed = values(2, len);
        {
            let on_device = comms[..2]
                .iter()
                .zip(stages.iter().zip(device.iter_mut()))
                .map(|(c, (s, d))| async move {
                    let mut view = d.as_view_mut();
                    match op {
                        None => c.allgather_in_place_device(s, &mut view).await,
                        Some(op) => c.reduce_scatter_in_place_device(s, &mut view, op).await,
                    }
                });
            let on_host = async {
                match op {
                    None => comms[2].allgather_in_place(&mut mixed).await,
                    Some(op) => comms[2].reduce_scatter_in_place(&mut mixed, op).await,
                }
            };
            let (a, b) = tokio::join!(try_join_all(on_device), on_host);
            a.expect("the device ranks");
            b.expect("the host rank");
        }
        let mut got: Vec<Vec<f32>> = device
            .iter()
            .zip(&stages)
            .map(|(d, s)| s.stream().clone_dtoh(d).expect("download"))
            .collect();
        got.push(mixed);
        for (r, got) in got.iter().enumerate() {
            // Allgather: the whole buffer; reduce-scatter: this rank's block.
            let range = match op {
                None => 0..len,
                Some(_) => r * block..(r + 1) * block,
            };
            let same = got[range.clone()]
                .iter()
                .zip(&host[r][range])
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{op:?}: rank {r} differs from the host call");
        }
    }
}

/// A reduce of GPU buffers on the device ends with the bits the host reduce gives on the
/// root, whether the root reduces a GPU buffer or a host one, with a rank working on a host
/// buffer taking part.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reduces_on_the_device_have_the_host_bits() {
    if let Err(e) = device_count() {
        eprintln!("reduces_on_the_device_have_the_host_bits: skipped: {e}");
        return;
    }
    let (n, len) = (3, 700_001);
    for (op, root) in [(ReduceOp::Sum, 1), (ReduceOp::Avg, 0), (ReduceOp::Sum, 2)] {
        // The reference: every rank on host buffers.
        let net = MemNet::reliable();
        let comms = world(&net, n).await;
        let mut host: Vec<Vec<f32>> = (0..n).map(|r| values(r, len)).collect();
        try_join_all(
            comms
                .iter()
                .zip(host.iter_mut())
                .map(|(c, b)| c.reduce(b, op, root)),
        )
        .await
        .expect("host calls");

        // Ranks 0 and 1 on the device, rank 2 on the host.
        let net = MemNet::reliable();
        let comms = world(&net, n).await;
        let (stages, mut device) = two_device_ranks(len);
        let mut mixed = values(2, len);
        {
            let on_device = comms[..2]
                .iter()
                .zip(stages.iter().zip(device.iter_mut()))
                .map(|(c, (s, d))| async move {
                    c.reduce_device(s, &mut d.as_view_mut(), op, root).await
                });
            let on_host = comms[2].reduce(&mut mixed, op, root);
            let (a, b) = tokio::join!(try_join_all(on_device), on_host);
            a.expect("the device ranks");
            b.expect("the host rank");
        }
        let got = match root {
            2 => mixed,
            r => stages[r].stream().clone_dtoh(&device[r]).expect("download"),
        };
        let same = got
            .iter()
            .zip(&host[root])
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same,
            "{op:?} to {root}: the root differs from the host reduce"
        );
    }
}
