//! What the collectives' test files share: a paused-clock runtime, a world of ranks on the
//! in-memory network, and a network with seeded delays.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::try_join_all;
use psnet_collectives::{node_of, Communicator, Config};
use psnet_memnet::{Faults, MemNet, MemTransport};
use psnet_transport::Transport;

pub type Comm = Communicator<MemTransport>;

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime")
}

pub async fn world(net: &MemNet, n: usize, config: Config) -> Vec<Comm> {
    let transports: Vec<Arc<MemTransport>> =
        (0..n).map(|r| Arc::new(net.bind(node_of(r)))).collect();
    let root = transports[0].listen_addr();
    try_join_all(
        transports
            .iter()
            .enumerate()
            .map(|(r, t)| Communicator::join(t.clone(), r, n, root, config.clone())),
    )
    .await
    .expect("every rank joins")
}

pub fn delayed(seed: u64) -> MemNet {
    let mut faults = Faults::none();
    faults.seed = seed;
    faults.delay = (Duration::ZERO, Duration::from_micros(300));
    MemNet::with_faults(faults)
}
