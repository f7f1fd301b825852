//! The transport decision, as a plain function of what was found.

pub use psnet_config::TransportPref;
use psnet_verbs::discovery::RdmaBinding;

/// The transport a node runs on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// TCP.
    Tcp,
    /// RDMA over the given device port.
    Rdma(RdmaBinding),
}

impl TransportKind {
    /// `"tcp"` or `"rdma"`.
    pub fn name(&self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Rdma(_) => "rdma",
        }
    }
}

/// The choice and the reason for it, logged once at start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// What was chosen.
    pub kind: TransportKind,
    /// Why, in words a user can act on.
    pub reason: String,
}

/// Why `PSNET_TRANSPORT=rdma` cannot be had.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("PSNET_TRANSPORT=rdma, but {why}")]
pub struct RdmaUnavailable {
    /// What stands in the way, in words a user can act on.
    pub why: String,
}

/// Decides the transport.
///
/// - `interface`: the interface this node's address is on (None if unknown);
/// - `binding`: the RDMA device bound to it, if discovery found one;
/// - `rdma_data_path`: whether this build can move data over RDMA.
///
/// `Err` only for `PSNET_TRANSPORT=rdma` when RDMA cannot be used, with the reason.
pub fn decide(
    pref: TransportPref,
    interface: Option<&str>,
    binding: Option<RdmaBinding>,
    rdma_data_path: bool,
) -> Result<Decision, RdmaUnavailable> {
    let iface = interface.unwrap_or("(no local interface holds DMLC_NODE_HOST)");
    let rdma_blocker = match (&binding, rdma_data_path) {
        (None, _) => Some(format!("no RDMA device is bound to {iface}")),
        (Some(b), false) => Some(format!(
            "RDMA device {} port {} is bound to {iface}, but this build's verbs transport has \
             no data path yet",
            b.device, b.port
        )),
        (Some(_), true) => None,
    };
    match (pref, rdma_blocker, binding) {
        (TransportPref::Tcp, _, _) => Ok(Decision {
            kind: TransportKind::Tcp,
            reason: "PSNET_TRANSPORT=tcp".into(),
        }),
        (TransportPref::Rdma, Some(why), _) => Err(RdmaUnavailable { why }),
        (TransportPref::Auto, Some(why), _) => Ok(Decision {
            kind: TransportKind::Tcp,
            reason: why,
        }),
        (pref, None, Some(b)) => Ok(Decision {
            reason: format!(
                "RDMA device {} port {} ({}) is bound to {iface}{}",
                b.device,
                b.port,
                if b.link_layer.is_empty() {
                    "link layer unknown"
                } else {
                    &b.link_layer
                },
                if pref == TransportPref::Rdma {
                    ", PSNET_TRANSPORT=rdma"
                } else {
                    ""
                }
            ),
            kind: TransportKind::Rdma(b),
        }),
        (_, None, None) => unreachable!("no blocker implies a binding"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use psnet_verbs::discovery::BindingSource;

    fn rxe() -> RdmaBinding {
        RdmaBinding {
            device: "rxe0".into(),
            port: 1,
            link_layer: "Ethernet".into(),
            source: BindingSource::GidNetdev { gid_index: 1 },
        }
    }

    #[test]
    fn parses_preferences() {
        assert_eq!("AUTO".parse(), Ok(TransportPref::Auto));
        assert_eq!("rdma".parse(), Ok(TransportPref::Rdma));
        assert_eq!("tcp".parse(), Ok(TransportPref::Tcp));
        assert!("udp"
            .parse::<TransportPref>()
            .unwrap_err()
            .contains("auto, rdma or tcp"));
    }

    #[test]
    fn auto_uses_rdma_only_where_a_device_is_bound() {
        let d = decide(TransportPref::Auto, Some("ib0"), Some(rxe()), true).unwrap();
        assert_eq!(d.kind, TransportKind::Rdma(rxe()));
        assert!(
            d.reason.contains("rxe0") && d.reason.contains("ib0"),
            "{}",
            d.reason
        );
        let d = decide(TransportPref::Auto, Some("eth0"), None, true).unwrap();
        assert_eq!(d.kind, TransportKind::Tcp);
        assert!(
            d.reason.contains("no RDMA device is bound to eth0"),
            "{}",
            d.reason
        );
    }

    #[test]
    fn auto_falls_back_when_the_data_path_is_missing() {
        let d = decide(TransportPref::Auto, Some("ib0"), Some(rxe()), false).unwrap();
        assert_eq!(d.kind, TransportKind::Tcp);
        assert!(d.reason.contains("no data path"), "{}", d.reason);
    }

    #[test]
    fn forced_rdma_without_device_is_an_error_and_tcp_always_works() {
        let err = decide(TransportPref::Rdma, Some("eth0"), None, true)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("PSNET_TRANSPORT=rdma") && err.contains("eth0"),
            "{err}"
        );
        let d = decide(TransportPref::Tcp, Some("ib0"), Some(rxe()), true).unwrap();
        assert_eq!(d.kind, TransportKind::Tcp);
    }
}
