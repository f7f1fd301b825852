//! The transport conformance suite, run over TCP on 127.0.0.1: without a job secret, with
//! one, and with one and encryption (`PSNET_ENCRYPT`).

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

/// The whole suite with every node encrypting its data frames (`PSNET_ENCRYPT`), on the
/// socket only (the same-host shared-memory paths are not encrypted), so that every message
/// of every case, device segments placed on arrival included, crosses sealed.
mod with_encryption {
    use super::*;
    use psnet_transport::auth::Secret;

    struct TcpEncrypting;

    impl TransportFactory for TcpEncrypting {
        type T = TcpTransport;

        async fn create(&self, id: NodeId) -> Result<TcpTransport, TransportError> {
            let config = TcpConfig {
                connect_timeout: Duration::from_secs(2),
                secret: Some(Secret::new("conformance").expect("a secret")),
                encrypt: true,
                shm_ring: 0,
                shm_queue: 0,
                // Placed segments stream off the socket in chunks smaller than they are.
                gpu_stage_chunk: 4096,
                ..TcpConfig::default()
            };
            TcpTransport::bind(id, config).await
        }
    }

    psnet_transport::conformance_tests!(TcpEncrypting);
}
