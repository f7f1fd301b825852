//! Endpoints on the RDMA device the environment names, for the tests.

use psnet_config::env::harness_var;
use std::net::{IpAddr, SocketAddr};

use psnet_transport::conformance::TransportFactory;
use psnet_transport::{Event, Incoming, NodeId, Transport, TransportError};
use psnet_verbs::{DeviceSpec, VerbsConfig, VerbsTransport};

/// Builds verbs endpoints on `RXE_DEV` (port 1) at `RXE_ADDR`.
pub struct VerbsFactory {
    spec: Result<DeviceSpec, String>,
}

impl VerbsFactory {
    /// From `RXE_DEV` / `RXE_ADDR` (set by the Soft-RoCE guest), or the reason there is none.
    pub fn from_env() -> Self {
        // RUST_LOG=psnet_verbs=debug shows the handshake when a case fails in the guest.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
        let spec = match (harness_var("RXE_DEV"), harness_var("RXE_ADDR")) {
            (Some(device), Some(addr)) => addr
                .parse::<IpAddr>()
                .map(|ip| DeviceSpec {
                    device,
                    port: 1,
                    gid_index: harness_var("RXE_GID_INDEX").and_then(|g| g.parse().ok()),
                    ip,
                })
                .map_err(|e| format!("RXE_ADDR={addr}: {e}")),
            _ => Err(match psnet_verbs::devices::verbs_devices() {
                Err(e) => format!("{e} (RXE_DEV/RXE_ADDR unset: run inside scripts/rxe-vm)"),
                Ok(d) => format!(
                    "RXE_DEV/RXE_ADDR unset (devices here: {:?}); set them to run over RDMA",
                    d.iter().map(|d| d.name.clone()).collect::<Vec<_>>()
                ),
            }),
        };
        VerbsFactory { spec }
    }

    /// The device spec, if tests can run.
    #[allow(dead_code)]
    pub fn spec(&self) -> Option<&DeviceSpec> {
        self.spec.as_ref().ok()
    }

    /// A config on the device, listening on any port.
    pub fn config(&self) -> VerbsConfig {
        let spec = self.spec.clone().expect("checked by skip_reason");
        let mut config = VerbsConfig::new(SocketAddr::new(spec.ip, 0), spec);
        // The guest runs the suite once per way of connecting queue pairs.
        if let Some(handshake) = psnet_config::env::PSNET_RDMA_CONNECT
            .get()
            .and_then(|v| v.parse().ok())
        {
            config.handshake = handshake;
        }
        config
    }
}

impl TransportFactory for VerbsFactory {
    type T = VerbsTransport;

    async fn create(&self, id: NodeId) -> Result<VerbsTransport, TransportError> {
        VerbsTransport::bind(id, self.config()).await
    }

    fn skip_reason(&self) -> Option<String> {
        self.spec.as_ref().err().cloned()
    }
}

/// Two connected endpoints on the device with `offer_bytes` of offers each; `None` (after
/// printing SKIPPED and why) where no device exists.
#[allow(dead_code)]
pub async fn pair(offer_bytes: u64) -> Option<(VerbsTransport, VerbsTransport)> {
    let factory = VerbsFactory::from_env();
    if let Some(why) = factory.skip_reason() {
        eprintln!("SKIPPED: {why}");
        return None;
    }
    let mut config = factory.config();
    config.offer_bytes = offer_bytes;
    let a = VerbsTransport::bind(NodeId(1), config.clone())
        .await
        .expect("endpoint 1");
    let b = VerbsTransport::bind(NodeId(2), config)
        .await
        .expect("endpoint 2");
    a.connect(b.local_id(), b.listen_addr())
        .await
        .expect("connect");
    Some((a, b))
}

/// The next message `t` receives, skipping connection events; a lost peer fails the test.
#[allow(dead_code)]
pub async fn next_message(t: &VerbsTransport) -> Incoming {
    loop {
        match t.recv().await.expect("recv") {
            Event::Message(m) => return m,
            Event::PeerConnected { .. } => continue,
            Event::PeerLost { peer, reason } => panic!("lost {peer}: {reason}"),
        }
    }
}
