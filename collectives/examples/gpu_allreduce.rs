//! Allreduce throughput from GPU memory against the same allreduce from host memory, in one
//! run: two ranks in this process over TCP on 127.0.0.1 (sockets only), f32 sum. The GPU
//! buffers are reduced both ways: staged to the host and reduced there (`GpuStage::new`), and
//! sent from device memory and reduced on the device (`GpuStage::reducing_on_device`).
//! `cargo run --release -p psnet-collectives --features cuda --example gpu_allreduce`
//! Prints one JSON object per size: busbw of each and their ratios to the host's.

#[cfg(feature = "cuda")]
#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    use std::sync::Arc;
    use std::time::Instant;

    use futures_util::future::try_join_all;
    use psnet_collectives::{node_of, Communicator, Config, GpuStage, ReduceOp};
    use psnet_fallback_tcp::{TcpConfig, TcpTransport};
    use psnet_transport::Transport;

    if let Err(e) = psnet_compression::cuda::device_count() {
        eprintln!("gpu_allreduce: no GPU: {e}");
        std::process::exit(2);
    }
    let n = 2;
    let mut transports = Vec::new();
    for r in 0..n {
        let mut config = TcpConfig::new("127.0.0.1:0".parse().unwrap());
        config.shm_ring = 0;
        transports.push(Arc::new(
            TcpTransport::bind(node_of(r), config).await.expect("bind"),
        ));
    }
    let root = transports[0].listen_addr();
    let comms = try_join_all(
        transports
            .iter()
            .enumerate()
            .map(|(r, t)| Communicator::join(t.clone(), r, n, root, Config::default())),
    )
    .await
    .expect("join");
    let staged: Vec<GpuStage<f32>> = (0..n).map(|_| GpuStage::new(0, 8 << 20).unwrap()).collect();
    let on_device: Vec<GpuStage<f32>> = (0..n)
        .map(|_| GpuStage::reducing_on_device(0).unwrap())
        .collect();
    for bytes in [4usize << 20, 64 << 20, 256 << 20] {
        let len = bytes / 4;
        let iters = if bytes > 64 << 20 { 5 } else { 10 };
        let mut host: Vec<Vec<f32>> = (0..n).map(|_| vec![1.0f32; len]).collect();
        let mut device: Vec<_> = staged
            .iter()
            .map(|s| s.stream().clone_htod(&host[0]).unwrap())
            .collect();
        // Warm up each, then run them in turn.
        macro_rules! time {
            ($stages:expr) => {{
                let start = Instant::now();
                for _ in 0..iters {
                    if let Some(stages) = $stages {
                        let stages: &Vec<GpuStage<f32>> = stages;
                        try_join_all(comms.iter().zip(stages.iter().zip(device.iter_mut())).map(
                            |(c, (s, d))| async move {
                                c.allreduce_device(s, &mut d.as_view_mut(), ReduceOp::Sum)
                                    .await
                            },
                        ))
                        .await
                        .unwrap();
                    } else {
                        try_join_all(
                            comms
                                .iter()
                                .zip(host.iter_mut())
                                .map(|(c, b)| c.allreduce(b, ReduceOp::Sum)),
                        )
                        .await
                        .unwrap();
                    }
                }
                start.elapsed().as_secs_f64() / iters as f64
            }};
        }
        let host_only: Option<&Vec<GpuStage<f32>>> = None;
        let _warm = (
            time!(host_only),
            time!(Some(&staged)),
            time!(Some(&on_device)),
        );
        let (h, g, d) = (
            time!(host_only),
            time!(Some(&staged)),
            time!(Some(&on_device)),
        );
        let busbw = |t: f64| bytes as f64 / t / 1e9 * 2.0 * (n as f64 - 1.0) / n as f64;
        println!(
            "{{\"bytes\": {bytes}, \"ranks\": {n}, \"host_busbw_gb_s\": {:.3}, \"gpu_busbw_gb_s\": {:.3}, \"gpu_over_host\": {:.3}, \"gpu_reduced_on_device_busbw_gb_s\": {:.3}, \"gpu_reduced_on_device_over_host\": {:.3}}}",
            busbw(h),
            busbw(g),
            h / g,
            busbw(d),
            h / d
        );
    }
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("gpu_allreduce: built without the `cuda` feature");
    std::process::exit(2);
}
