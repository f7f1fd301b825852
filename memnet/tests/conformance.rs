//! The transport conformance suite on the in-memory network (real time, as the other
//! transports run it).

use psnet_memnet::{MemNet, MemTransport};
use psnet_transport::conformance::TransportFactory;
use psnet_transport::{NodeId, TransportError};

struct Mem(MemNet);

impl TransportFactory for Mem {
    type T = MemTransport;
    async fn create(&self, id: NodeId) -> Result<MemTransport, TransportError> {
        Ok(self.0.bind(id))
    }
}

psnet_transport::conformance_tests!(Mem(MemNet::reliable()));

/// The whole suite again on a network whose endpoints cannot place received segments in
/// device memory: they say so, and deliver host bytes.
mod without_placing {
    use super::*;
    use psnet_memnet::MemNetConfig;

    psnet_transport::conformance_tests!(Mem(MemNet::new(MemNetConfig {
        places: false,
        ..MemNetConfig::default()
    })));
}

/// The whole suite again with the link model on: four hosts whose links carry a terabyte a
/// second (so real-time tests take no longer), endpoints on them in turn.
mod with_links {
    use super::*;
    use psnet_memnet::{HostLinks, Link, MemNetConfig};
    use std::time::Duration;

    fn links() -> MemNet {
        let link = Link::new(1e12, Duration::ZERO).expect("a link");
        MemNet::new(MemNetConfig {
            hosts: vec![HostLinks::symmetric(link, link); 4],
            ..MemNetConfig::default()
        })
    }

    psnet_transport::conformance_tests!(Mem(links()));
}
