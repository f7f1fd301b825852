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
