//! psnet-perf bw and lat: the sizes a test runs, the server, the client and the measured exchange,
//! from host memory or a GPU's.

use super::*;

pub(super) fn sizes(test: Test, args: &TestArgs) -> Vec<u64> {
    if args.all {
        size::all_sizes()
    } else {
        vec![args.size.unwrap_or(match test {
            Test::Bw => 65536,
            Test::Lat => 2,
        })]
    }
}

pub(super) fn run_test(test: Test, args: TestArgs) -> PerfResult<()> {
    if args.loopback && args.host.is_some() {
        return Err("--loopback runs both ends here: give no host".into());
    }
    if args.baseline && test == Test::Lat {
        return Err("--baseline applies to `bw`".into());
    }
    if args.gpu.is_some() && test == Test::Lat {
        return Err("--gpu applies to `bw`".into());
    }
    if let Some(ordinal) = args.gpu {
        if args.host.is_none() && !args.loopback {
            return Err("--gpu applies to the client (give a host, or --loopback)".into());
        }
        gpu_present(ordinal)?;
        if args.loopback && psnet::config::env::PSNET_SHM_RING.get().is_none() {
            // Device messages never take the same-host ring: host messages must not either,
            // or the ratio compares the ring with the socket. Set before any thread starts.
            std::env::set_var(psnet::config::env::PSNET_SHM_RING.name, "0");
        }
    }
    if args.report_gbits && test == Test::Lat {
        return Err("--report_gbits applies to `bw`".into());
    }
    if args.iters == Some(0) {
        return Err("-n must be at least 1".into());
    }
    if args.tx_depth == 0 {
        return Err("--tx-depth must be at least 1".into());
    }
    if let Some(0) = args.size {
        return Err("-s must be at least 1 byte".into());
    }
    if args.loopback {
        let selection = session::loopback_selection(args.transport)?;
        let (sink, _) = baseline::spawn_sink(SocketAddr::from(([127, 0, 0, 1], 0)))?;
        let (server_addr, server) = session::spawn_server(selection.clone(), 0)?;
        let result = run_client(test, &args, &selection, server_addr, sink);
        let served = server
            .join()
            .map_err(|_| "the server thread panicked".to_string())?;
        result.and(served)
    } else if let Some(host) = &args.host {
        let server_addr = resolve(host, args.port)?;
        let sink = SocketAddr::new(server_addr.ip(), args.port.wrapping_add(1));
        let selection = Selection::from_env(args.transport).map_err(|e| e.to_string())?;
        selection.log();
        run_client(test, &args, &selection, server_addr, sink)
    } else {
        let selection = Selection::from_env(args.transport).map_err(|e| e.to_string())?;
        selection.log();
        let listen = server_selection(&selection);
        let sink_addr = SocketAddr::new(listen.address.ip, args.port.wrapping_add(1));
        let _sink = baseline::spawn_sink(sink_addr)?;
        let rt = session::runtime()?;
        rt.block_on(async {
            let t = psnet::bind(SERVER_ID, &listen, args.port)
                .await
                .map_err(|e| e.to_string())?;
            let banner = report::banner(
                "psnet-perf server",
                &format!("{} ({})", t.capabilities().name, selection.decision.reason),
                &format!("{} ({})", t.listen_addr(), listen.address.reason),
                "waiting for a client",
            );
            // stdout carries only result rows under --json (the client prints them).
            if args.json {
                eprintln!("{banner}");
            } else {
                println!("{banner}");
            }
            server::serve_one_client(&t).await
        })
    }
}

/// What the `bw`/`lat` server listens on. With no interface chosen (neither
/// `DMLC_INTERFACE` nor `DMLC_NODE_HOST`), every address of the host (the unspecified address
/// of the selected one's family), so that a client reaches it through any of them; with one
/// chosen, that address only. RDMA keeps the selected address: the device, its GID and the
/// rdma_cm listener are those of that one address.
pub(super) fn server_selection(selection: &Selection) -> Selection {
    let chosen = psnet::config::env::DMLC_INTERFACE.get().is_some()
        || psnet::config::env::DMLC_NODE_HOST.get().is_some();
    if chosen || !matches!(selection.decision.kind, TransportKind::Tcp) {
        return selection.clone();
    }
    let mut listen = selection.clone();
    listen.address.ip = match selection.address.ip {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    listen.address.reason = format!(
        "every address: DMLC_INTERFACE and DMLC_NODE_HOST unset; this node's is {}",
        selection.address.ip
    );
    listen
}

pub(super) fn resolve(host: &str, port: u16) -> PerfResult<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host} resolves to no address"))
}

pub(super) fn run_client(
    test: Test,
    args: &TestArgs,
    selection: &Selection,
    server: SocketAddr,
    sink: SocketAddr,
) -> PerfResult<()> {
    let rt = session::runtime()?;
    let mut raw = if args.baseline {
        Some(baseline::RawClient::connect(sink)?)
    } else {
        None
    };
    rt.block_on(async {
        let t = session::connect_client(selection, server).await?;
        let outcome = measure(test, args, &t, server, raw.as_mut()).await;
        // Let the server exit even if a measurement failed.
        let _ = session::send_control(&t, SERVER_ID, protocol::Control::Bye, &[]).await;
        outcome
    })
}

pub(super) async fn measure(
    test: Test,
    args: &TestArgs,
    t: &AnyTransport,
    server: SocketAddr,
    mut raw: Option<&mut baseline::RawClient>,
) -> PerfResult<()> {
    // The transport that carries the messages (`auto` may have fallen back to TCP).
    let name = t.capabilities().name;
    // Sizes are checked before anything is printed: a table that stops half-way misleads.
    let max = t.capabilities().max_message;
    if let Some(size) = sizes(test, args).into_iter().find(|&s| s + 64 > max) {
        return Err(format!(
            "a {size}-byte message does not fit the transport's largest message \
             (PSNET_MAX_MESSAGE={max} bytes, headers included)"
        ));
    }
    let unit = if args.report_gbits {
        BwUnit::GbitPerSec
    } else {
        BwUnit::MibPerSec
    };
    let context = RunContext {
        test: match test {
            Test::Bw => "bw",
            Test::Lat => "lat",
        },
        transport: name,
        local: t.listen_addr().to_string(),
        remote: server.to_string(),
    };
    if !args.json {
        let title = match test {
            Test::Bw => "psnet bandwidth test (perftest ib_write_bw layout)",
            Test::Lat => "psnet latency test (perftest ib_send_lat layout, one-way)",
        };
        println!(
            "{}",
            report::banner(title, name, &context.local, &context.remote)
        );
        println!(
            "{}",
            match test {
                Test::Bw => report::bw_header(unit, raw.is_some()),
                Test::Lat => report::lat_header(),
            }
        );
    }
    let gpu = match args.gpu {
        None => None,
        Some(ordinal) => {
            let largest = sizes(test, args).into_iter().max().unwrap_or(0);
            Some((ordinal, gpu_source(ordinal, largest)?))
        }
    };
    let mut gpu_rows = Vec::new();
    // Each row is printed as soon as it is measured, as a table line or one JSON line.
    for size in sizes(test, args) {
        let line = match test {
            Test::Bw => {
                let iters = args.iters.unwrap_or_else(|| bw::default_iters(size));
                let mut row = bw::run(t, size, iters, args.tx_depth).await?;
                if let Some(raw) = raw.as_deref_mut() {
                    let elapsed = raw.stream(size * iters)?;
                    row = row.with_baseline(elapsed.as_secs_f64());
                }
                if let Some((ordinal, source)) = &gpu {
                    let from_gpu = gpu_run(source, t, size, iters, args.tx_depth).await?;
                    let to_gpu = bw::run_to_gpu(t, size, iters, args.tx_depth, *ordinal).await?;
                    gpu_rows.push(report::GpuBwRow::new(*ordinal, &row, &from_gpu, &to_gpu));
                }
                if args.json {
                    report::json_line(&context, &row)
                } else {
                    report::bw_line(&row, unit)
                }
            }
            Test::Lat => {
                let iters = args.iters.unwrap_or_else(|| lat::default_iters(size));
                let row = lat::run(t, size, iters).await?;
                if args.json {
                    report::json_line(&context, &row)
                } else {
                    report::lat_line(&row)
                }
            }
        };
        println!("{line}");
    }
    if !args.json {
        println!("{}", report::rule());
    }
    for row in &gpu_rows {
        if args.json {
            println!("{}", report::json_line(&context, row));
        }
    }
    if !args.json && !gpu_rows.is_empty() {
        let ring = psnet::config::env::PSNET_SHM_RING
            .get()
            .unwrap_or_else(|| psnet::config::env::PSNET_SHM_RING.default.to_string());
        print!("{}", report::gpu_bw_table(&gpu_rows, unit, &ring));
    }
    Ok(())
}

#[cfg(feature = "cuda")]
pub(super) type GpuSource = bw_gpu::GpuSource;
#[cfg(not(feature = "cuda"))]
pub(super) type GpuSource = std::convert::Infallible;

#[cfg(feature = "cuda")]
pub(super) fn gpu_source(ordinal: usize, largest: u64) -> PerfResult<GpuSource> {
    let len = usize::try_from(largest).map_err(|_| format!("size {largest} does not fit"))?;
    bw_gpu::GpuSource::new(ordinal, len)
}

#[cfg(not(feature = "cuda"))]
pub(super) fn gpu_source(_ordinal: usize, _largest: u64) -> PerfResult<GpuSource> {
    Err(kv::GPU_FEATURE.into())
}

#[cfg(feature = "cuda")]
pub(super) async fn gpu_run(
    source: &GpuSource,
    t: &AnyTransport,
    size: u64,
    iters: u64,
    depth: usize,
) -> PerfResult<report::BwRow> {
    source.run(t, size, iters, depth).await
}

#[cfg(not(feature = "cuda"))]
pub(super) async fn gpu_run(
    source: &GpuSource,
    _t: &AnyTransport,
    _size: u64,
    _iters: u64,
    _depth: usize,
) -> PerfResult<report::BwRow> {
    match *source {}
}
