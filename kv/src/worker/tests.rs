use super::*;
use crate::proto::msg::NodeInfo;

fn node(role: Role, rank: u32, addr: &str) -> NodeInfo {
    NodeInfo {
        id: NodeId(0),
        role,
        rank,
        addr: addr.parse().unwrap(),
        identity: psnet_transport::PublicIdentity([0; 32]),
    }
}

#[test]
fn keys_go_in_pieces_by_default_only_across_hosts() {
    let root = "127.0.0.1:9000".parse().unwrap();
    let config = KvConfig::local(Role::Worker, root, 1, 1);
    // The scheduler's host does not count: it carries no values.
    let one_host = [
        node(Role::Scheduler, 0, "10.0.0.9:9000"),
        node(Role::Server, 0, "10.0.0.1:9001"),
        node(Role::Worker, 0, "10.0.0.1:9002"),
    ];
    assert_eq!(partition_bytes(&config, &one_host), 0);
    let two_hosts = [
        node(Role::Server, 0, "10.0.0.1:9001"),
        node(Role::Worker, 0, "10.0.0.2:9002"),
    ];
    assert_eq!(
        partition_bytes(&config, &two_hosts),
        crate::config::DEFAULT_PARTITION_BYTES
    );
    let set = config.partition_bytes(4096);
    assert_eq!(partition_bytes(&set, &one_host), 4096);
    assert_eq!(partition_bytes(&set.partition_bytes(0), &two_hosts), 0);
}
