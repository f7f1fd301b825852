//! The job's shared secret on the in-memory network: the same exchange and refusals as on a
//! wire, so simulations can run jobs with a secret and intruders without it.

use psnet_memnet::MemNet;
use psnet_transport::auth::{Secret, REFUSE_NO_PROOF, REFUSE_UNEXPECTED_PROOF};
use psnet_transport::{NodeId, Transport, TransportError};

fn secret(s: &str) -> Option<Secret> {
    Some(Secret::new(s).unwrap())
}

fn reason(r: Result<(), TransportError>) -> String {
    match r {
        Err(TransportError::Handshake { reason, .. }) => reason,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn only_nodes_with_the_same_secret_connect() {
    let net = MemNet::reliable();
    let a = net.bind_with_secret(NodeId(1), secret("job"));
    let b = net.bind_with_secret(NodeId(2), secret("job"));
    let wrong = net.bind_with_secret(NodeId(3), secret("other job"));
    let open = net.bind(NodeId(4));

    a.connect(NodeId(2), b.listen_addr())
        .await
        .expect("same secret");
    let r = reason(wrong.connect(NodeId(1), a.listen_addr()).await);
    assert!(r.contains("does not know this job's secret"), "{r}");
    assert_eq!(
        reason(open.connect(NodeId(1), a.listen_addr()).await),
        REFUSE_NO_PROOF
    );
    assert_eq!(
        reason(a.connect(NodeId(4), open.listen_addr()).await),
        REFUSE_UNEXPECTED_PROOF
    );
    assert_eq!(a.connected_peers(), vec![NodeId(2)]);
    assert!(wrong.connected_peers().is_empty() && open.connected_peers().is_empty());
}
