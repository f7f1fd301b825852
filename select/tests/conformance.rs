//! The conformance suite through `AnyTransport`, as the kv store and collectives will use it.

use std::net::{IpAddr, Ipv4Addr};

use psnet_config::NodeAddress;
use psnet_select::{bind, AnyTransport, Selection, TransportPref};
use psnet_transport::conformance::TransportFactory;
use psnet_transport::{NodeId, TransportError};

struct Any;

impl TransportFactory for Any {
    type T = AnyTransport;

    async fn create(&self, id: NodeId) -> Result<AnyTransport, TransportError> {
        std::env::set_var("PSNET_CONNECT_TIMEOUT", "2");
        let address = NodeAddress {
            ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            interface: Some("lo".into()),
            reason: "test".into(),
        };
        let selection = Selection::for_address(address, Some(TransportPref::Auto)).unwrap();
        bind(id, &selection, 0).await.map_err(|e| match e {
            psnet_select::SelectError::Transport(t) => t,
            other => TransportError::Unavailable(other.to_string()),
        })
    }
}

psnet_transport::conformance_tests!(Any);
