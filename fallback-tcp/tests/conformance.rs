//! The transport conformance suite, run over TCP on 127.0.0.1, without and with a job secret.

use std::time::Duration;

use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_transport::conformance::TransportFactory;
use psnet_transport::{NodeId, TransportError};

struct Tcp;

impl TransportFactory for Tcp {
    type T = TcpTransport;

    async fn create(&self, id: NodeId) -> Result<TcpTransport, TransportError> {
        let config = TcpConfig {
            connect_timeout: Duration::from_secs(2),
            ..TcpConfig::default()
        };
        TcpTransport::bind(id, config).await
    }
}

psnet_transport::conformance_tests!(Tcp);

/// The whole suite again with every node holding the job's secret: the exchange that opens
/// each connection changes nothing the contract promises.
mod with_a_secret {
    use super::*;
    use psnet_transport::auth::Secret;

    struct TcpWithSecret;

    impl TransportFactory for TcpWithSecret {
        type T = TcpTransport;

        async fn create(&self, id: NodeId) -> Result<TcpTransport, TransportError> {
            let config = TcpConfig {
                connect_timeout: Duration::from_secs(2),
                secret: Some(Secret::new("conformance").expect("a secret")),
                ..TcpConfig::default()
            };
            TcpTransport::bind(id, config).await
        }
    }

    psnet_transport::conformance_tests!(TcpWithSecret);
}
