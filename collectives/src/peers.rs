//! Connections made when a call first needs them. Forming a communicator connects each rank
//! to rank 0 (and its last step, gathering every rank's CPUs, to that allgather's partners);
//! a call then dials the ranks it sends to or receives from that are not connected yet: a
//! ring's two neighbours, a tree's parent and children, every rank for an all-to-all or a
//! receive from any rank, the peer of a send or a receive. So a rank holds connections to
//! the ranks it talks to, not to all n - 1, and a communicator of n ranks makes O(n)
//! connections for a ring rather than n(n - 1) / 2, as NCCL connects at run time.
//!
//! A rank dials the ranks it receives from too, though they would dial it to send: a rank
//! that died before dialling is then seen lost (its address refuses the dial) instead of
//! waited for until the call timeout.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use psnet_transport::{NodeId, Transport, TransportError};

use crate::admission::NOT_FORMED;

/// Where each member listens, and whether this rank has a connection to it.
#[derive(Default)]
pub(crate) struct Peers {
    known: HashMap<NodeId, Peer>,
}

struct Peer {
    addr: SocketAddr,
    /// Connected when the communicator formed, or dialled by this rank since (a rank that
    /// dialled this one is dialled back, which returns at once while the connection lasts).
    reached: AtomicBool,
}

/// A member that could not be reached.
#[derive(Debug)]
pub(crate) struct Unreachable {
    pub(crate) node: NodeId,
    pub(crate) reason: String,
}

impl Peers {
    /// The members `nodes` at `addrs` (in the same order); those in `connected` are reached.
    pub(crate) fn new(nodes: &[NodeId], addrs: &[SocketAddr], connected: &[NodeId]) -> Peers {
        let known = nodes
            .iter()
            .zip(addrs)
            .map(|(&node, &addr)| {
                let peer = Peer {
                    addr,
                    reached: AtomicBool::new(connected.contains(&node)),
                };
                (node, peer)
            })
            .collect();
        Peers { known }
    }

    /// The members among `nodes` that have not been reached yet.
    pub(crate) fn unreached(&self, nodes: impl IntoIterator<Item = NodeId>) -> Vec<NodeId> {
        nodes
            .into_iter()
            .filter(|n| {
                self.known
                    .get(n)
                    .is_some_and(|p| !p.reached.load(Ordering::Acquire))
            })
            .collect()
    }

    /// Connects to every member among `nodes` not reached yet, all at once, each within
    /// `within`. Nodes that are not members are left alone. The first that cannot be reached
    /// is the error; the others still count as reached.
    pub(crate) async fn reach<T: Transport>(
        &self,
        transport: &T,
        nodes: impl IntoIterator<Item = NodeId>,
        within: Duration,
    ) -> Result<(), Unreachable> {
        let mut dials: FuturesUnordered<_> = self
            .unreached(nodes)
            .into_iter()
            .map(|node| {
                let peer = &self.known[&node];
                async move {
                    let dialled = tokio::time::timeout(within, dial(transport, node, peer.addr));
                    let result = match dialled.await {
                        Ok(Ok(())) => {
                            peer.reached.store(true, Ordering::Release);
                            Ok(())
                        }
                        Ok(Err(e)) => Err(format!("cannot connect to it at {}: {e}", peer.addr)),
                        Err(_) => Err(format!(
                            "it did not answer at {} within {within:?}",
                            peer.addr
                        )),
                    };
                    result.map_err(|reason| Unreachable { node, reason })
                }
            })
            .collect();
        let mut first = None;
        while let Some(result) = dials.next().await {
            if let (Err(e), None) = (result, &first) {
                first = Some(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// Connects to `node`, again while it says it has not got the table yet: a rank may start
/// a call, and dial, before rank 0's table has reached every other rank. The caller bounds
/// the time.
async fn dial<T: Transport>(
    transport: &T,
    node: NodeId,
    addr: SocketAddr,
) -> Result<(), TransportError> {
    let mut pause = Duration::from_micros(200);
    loop {
        // A refused connection is no one listening: every member listens from before its
        // hello, so the rank is gone, and is named at once rather than after the connect
        // timeout.
        match transport.redial(node, addr).await {
            Err(TransportError::Handshake { reason, .. }) if reason.contains(NOT_FORMED) => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            done => return done,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_members_not_reached_are_dialled() {
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let nodes = [NodeId(1), NodeId(2), NodeId(3)];
        let peers = Peers::new(&nodes, &[addr; 3], &[NodeId(1)]);
        assert_eq!(
            peers.unreached([NodeId(1), NodeId(2), NodeId(3), NodeId(9)]),
            vec![NodeId(2), NodeId(3)],
            "a member connected already and a node of no member are left alone"
        );
        assert!(Peers::default().unreached(nodes).is_empty());
    }

    /// Lets everyone in, as a rank does once it has the table and the dialler its secret.
    struct Open;

    impl psnet_transport::Admission for Open {
        fn proof(&self, _: NodeId, _: &psnet_transport::Binding) -> Option<psnet_transport::Proof> {
            None
        }

        fn admit(
            &self,
            _: NodeId,
            _: Option<&psnet_transport::Proof>,
            _: &psnet_transport::Binding,
        ) -> Result<(), psnet_transport::Refusal> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_rank_without_the_table_is_dialled_again_until_it_has_it() {
        use std::sync::Arc;

        use crate::admission::Joining;
        use psnet_memnet::MemNet;

        let net = MemNet::reliable();
        let a = net.bind(NodeId(1));
        let b = net.bind(NodeId(2));
        let root = NodeId(9);
        b.set_admission(Arc::new(Joining { root }));
        let peers = Peers::new(&[NodeId(2)], &[b.listen_addr()], &[]);
        let reach = peers.reach(&a, [NodeId(2)], Duration::from_secs(10));
        let table_comes = async {
            tokio::time::sleep(Duration::from_millis(30)).await;
            b.set_admission(Arc::new(Open));
        };
        let (reached, ()) = tokio::join!(reach, table_comes);
        reached.unwrap();
        assert_eq!(a.connected_peers(), vec![NodeId(2)]);
        assert_eq!(b.connected_peers(), vec![NodeId(1)]);
        assert!(peers.unreached([NodeId(2)]).is_empty());

        // One that never gets it is unreachable once the time given is up, and says so.
        let c = net.bind(NodeId(3));
        c.set_admission(Arc::new(Joining { root }));
        let peers = Peers::new(&[NodeId(3)], &[c.listen_addr()], &[]);
        let e = peers
            .reach(&a, [NodeId(3)], Duration::from_millis(50))
            .await
            .unwrap_err();
        assert_eq!(e.node, NodeId(3));
        assert!(e.reason.contains("did not answer"), "{}", e.reason);
        assert_eq!(peers.unreached([NodeId(3)]), vec![NodeId(3)]);
    }
}
