//! The transport conformance suite over real verbs. It runs where an RDMA device exists (the
//! Soft-RoCE guest of `scripts/rxe-vm`, which sets `RXE_DEV` and `RXE_ADDR`) and prints
//! SKIPPED with the reason elsewhere.

mod common;

psnet_transport::conformance_tests!(common::VerbsFactory::from_env());

/// The whole suite again with every node holding the job's secret: the control connections
/// are authenticated and tagged, and every message of every queue pair carries a tag under
/// keys derived from them (`Link::protect`). Nothing the contract promises changes.
mod with_a_secret {
    use psnet_transport::auth::Secret;
    use psnet_transport::conformance::TransportFactory;
    use psnet_transport::{NodeId, TransportError};
    use psnet_verbs::VerbsTransport;

    struct WithSecret(super::common::VerbsFactory);

    impl TransportFactory for WithSecret {
        type T = VerbsTransport;

        async fn create(&self, id: NodeId) -> Result<VerbsTransport, TransportError> {
            let mut config = self.0.config();
            config.tcp.secret = Some(Secret::new("conformance").expect("a secret"));
            VerbsTransport::bind(id, config).await
        }

        fn skip_reason(&self) -> Option<String> {
            self.0.skip_reason()
        }
    }

    psnet_transport::conformance_tests!(WithSecret(super::common::VerbsFactory::from_env()));
}
