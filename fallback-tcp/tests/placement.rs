//! Received segments placed into device memory over each of TCP's paths: streamed off the
//! socket in staged chunks (shared memory off, and chunks far smaller than the segments),
//! and copied from the same-host shared-memory ring and queue (the defaults, whose large
//! messages travel there).

use std::time::Duration;

use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_transport::conformance::{self, run_case, TransportFactory};
use psnet_transport::{NodeId, TransportError};

struct Tcp {
    shm: bool,
    chunk: usize,
}

impl TransportFactory for Tcp {
    type T = TcpTransport;

    async fn create(&self, id: NodeId) -> Result<TcpTransport, TransportError> {
        let mut config = TcpConfig {
            connect_timeout: Duration::from_secs(2),
            gpu_stage_chunk: self.chunk,
            ..TcpConfig::default()
        };
        if !self.shm {
            config.shm_ring = 0;
            config.shm_queue = 0;
        }
        TcpTransport::bind(id, config).await
    }
}

const SOCKET_ONLY: Tcp = Tcp {
    shm: false,
    chunk: 4096,
};
const SHARED_MEMORY: Tcp = Tcp {
    shm: true,
    chunk: 64 << 10,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placed_off_the_socket_in_small_chunks() {
    run_case(
        "placed_segments_land_in_device_memory",
        conformance::placed_segments_land_in_device_memory(&SOCKET_ONLY),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_placement_off_the_socket_keeps_the_stream_in_step() {
    run_case(
        "a_failing_placement_loses_only_that_segment",
        conformance::a_failing_placement_loses_only_that_segment(&SOCKET_ONLY),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placed_from_shared_memory() {
    run_case(
        "placed_segments_land_in_device_memory",
        conformance::placed_segments_land_in_device_memory(&SHARED_MEMORY),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_placement_from_shared_memory() {
    run_case(
        "a_failing_placement_loses_only_that_segment",
        conformance::a_failing_placement_loses_only_that_segment(&SHARED_MEMORY),
    )
    .await;
}
