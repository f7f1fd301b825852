//! Interface and transport selection for real, in network namespaces of the test's own with
//! veth pairs named `ib0` and `eth0`. Needs root and iproute2; skips with a message otherwise.

use std::process::{Command, Output, Stdio};

mod common;

use common::Server;

/// Two namespaces joined by two veth pairs, `ib0`<->`ib0` and `eth0`<->`eth0`, removed on drop.
struct Hosts {
    a: String,
    b: String,
}

const A_IB0: &str = "10.231.1.1";
const B_IB0: &str = "10.231.1.2";
const A_ETH0: &str = "10.231.2.1";
const B_ETH0: &str = "10.231.2.2";

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run `ip`: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Hosts {
    fn new(tag: &str) -> Result<Self, String> {
        let pid = std::process::id();
        let hosts = Hosts {
            a: format!("psnet-{tag}-{pid}-a"),
            b: format!("psnet-{tag}-{pid}-b"),
        };
        ip(&["netns", "add", &hosts.a])?;
        ip(&["netns", "add", &hosts.b])?;
        for (name, a_addr, b_addr) in [("ib0", A_IB0, B_IB0), ("eth0", A_ETH0, B_ETH0)] {
            ip(&[
                "link", "add", name, "netns", &hosts.a, "type", "veth", "peer", "name", name,
                "netns", &hosts.b,
            ])?;
            ip(&[
                "-n",
                &hosts.a,
                "addr",
                "add",
                &format!("{a_addr}/24"),
                "dev",
                name,
            ])?;
            ip(&[
                "-n",
                &hosts.b,
                "addr",
                "add",
                &format!("{b_addr}/24"),
                "dev",
                name,
            ])?;
            ip(&["-n", &hosts.a, "link", "set", name, "up"])?;
            ip(&["-n", &hosts.b, "link", "set", name, "up"])?;
        }
        ip(&["-n", &hosts.a, "link", "set", "lo", "up"])?;
        ip(&["-n", &hosts.b, "link", "set", "lo", "up"])?;
        Ok(hosts)
    }

    /// `psnet-perf` inside namespace `ns`, with a clean psnet environment plus `env`.
    fn perf(ns: &str, env: &[(&str, &str)], args: &[&str]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_psnet-perf")])
            .args(args);
        for var in [
            "DMLC_INTERFACE",
            "DMLC_NODE_HOST",
            "PSNET_TRANSPORT",
            "PS_VERBOSE",
            "RUST_LOG",
        ] {
            cmd.env_remove(var);
        }
        cmd.envs(env.iter().copied());
        cmd.stdin(Stdio::null());
        cmd
    }

    fn rx_bytes(ns: &str, dev: &str) -> u64 {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                ns,
                "cat",
                &format!("/sys/class/net/{dev}/statistics/rx_bytes"),
            ])
            .output()
            .expect("read counters");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(0)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth ends inside it.
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}

/// The namespaces, or None (with the reason printed) where this test cannot create them.
fn hosts(tag: &str) -> Option<Hosts> {
    match Hosts::new(tag) {
        Ok(h) => Some(h),
        Err(e) => {
            eprintln!("SKIPPED: network namespaces unavailable (needs root and iproute2): {e}");
            None
        }
    }
}

fn select(ns: &str, env: &[(&str, &str)]) -> Output {
    Hosts::perf(ns, env, &["select", "--json"])
        .output()
        .expect("run psnet-perf select")
}

fn select_json(ns: &str, env: &[(&str, &str)]) -> serde_json::Value {
    let out = select(ns, env);
    assert!(
        out.status.success(),
        "select failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

#[test]
fn interface_and_transport_selection_in_namespaces() {
    let Some(h) = hosts("sel") else { return };

    let d = select_json(&h.a, &[("DMLC_INTERFACE", "ib0")]);
    assert_eq!(
        (d["interface"].as_str(), d["address"].as_str()),
        (Some("ib0"), Some(A_IB0))
    );
    assert_eq!(d["transport"], "tcp");
    assert!(
        d["transport_reason"]
            .as_str()
            .unwrap()
            .contains("no RDMA device is bound to ib0"),
        "{d}"
    );

    // ps-lite's prefix rule: `ib` finds `ib0`, `eth` finds `eth0`.
    let d = select_json(&h.a, &[("DMLC_INTERFACE", "ib")]);
    assert_eq!(d["interface"], "ib0");
    let d = select_json(&h.b, &[("DMLC_INTERFACE", "eth")]);
    assert_eq!(
        (d["interface"].as_str(), d["address"].as_str()),
        (Some("eth0"), Some(B_ETH0))
    );

    // Unset: the first non-loopback IPv4 interface (ib0 was created first).
    let d = select_json(&h.a, &[]);
    assert_eq!(
        (d["interface"].as_str(), d["address"].as_str()),
        (Some("ib0"), Some(A_IB0))
    );

    // DMLC_NODE_HOST beats DMLC_INTERFACE.
    let d = select_json(
        &h.a,
        &[("DMLC_INTERFACE", "ib0"), ("DMLC_NODE_HOST", A_ETH0)],
    );
    assert_eq!(
        (d["interface"].as_str(), d["address"].as_str()),
        (Some("eth0"), Some(A_ETH0))
    );

    // A name that matches nothing lists what exists.
    let out = select(&h.a, &[("DMLC_INTERFACE", "mlx")]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("mlx")
            && err.contains("ib0 (10.231.1.1)")
            && err.contains("eth0 (10.231.2.1)"),
        "{err}"
    );

    // RDMA required where there is no device: a clear error, not a silent TCP.
    let out = select(
        &h.a,
        &[("DMLC_INTERFACE", "ib0"), ("PSNET_TRANSPORT", "rdma")],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("PSNET_TRANSPORT=rdma") && err.contains("ib0"),
        "{err}"
    );
}

#[test]
fn traffic_crosses_the_chosen_interface() {
    let Some(h) = hosts("bw") else { return };
    let before_ib = Hosts::rx_bytes(&h.a, "ib0");
    let before_eth = Hosts::rx_bytes(&h.a, "eth0");
    let mut server = Hosts::perf(&h.a, &[("DMLC_INTERFACE", "ib0")], &["bw", "-p", "18515"])
        .stdout(Stdio::null())
        .spawn()
        .expect("start server");
    let out = Hosts::perf(
        &h.b,
        &[("DMLC_INTERFACE", "ib0")],
        &[
            "bw", A_IB0, "-p", "18515", "-s", "64K", "-n", "100", "--json",
        ],
    )
    .output()
    .expect("run client");
    let server_status = server.wait().expect("server exits");
    assert!(
        out.status.success(),
        "client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(server_status.success());
    let row: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(row["test"], "bw");
    assert_eq!(row["iterations"], 100);
    assert_eq!(row["remote"], format!("{A_IB0}:18515"));
    let ib = Hosts::rx_bytes(&h.a, "ib0") - before_ib;
    let eth = Hosts::rx_bytes(&h.a, "eth0") - before_eth;
    assert!(ib >= 100 * 65536, "ib0 received only {ib} bytes");
    assert!(
        eth < 65536,
        "eth0 carried {eth} bytes of a test bound to ib0"
    );
}

/// A `lat` client in `b` against a server in `a` at `addr`; whether it got its row.
fn lat_client(h: &Hosts, addr: &str) -> bool {
    let out = Hosts::perf(
        &h.b,
        &[("DMLC_INTERFACE", "eth0"), ("PSNET_CONNECT_TIMEOUT", "1")],
        &["lat", addr, "-p", "18515", "-s", "64", "-n", "20", "--json"],
    )
    .output()
    .expect("run client");
    out.status.success()
        && serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .is_ok_and(|row| row["iterations"] == 20)
}

/// Without DMLC_INTERFACE / DMLC_NODE_HOST the server listens on every address: a client
/// reaches it through either of the host's interfaces. With DMLC_INTERFACE=ib0, only through
/// ib0's address.
#[test]
fn server_without_an_interface_listens_on_every_address() {
    let Some(h) = hosts("any") else { return };
    for addr in [A_IB0, A_ETH0] {
        let server =
            Server::start(Hosts::perf(&h.a, &[], &["lat", "-p", "18515"]).stdout(Stdio::piped()));
        let reached = lat_client(&h, addr);
        let server = server.finish();
        let banner = String::from_utf8_lossy(&server.stdout);
        assert!(reached, "no answer through {addr}: {banner}");
        assert!(server.status.success());
        assert!(banner.contains("0.0.0.0:18515"), "{banner}");
    }
    let server = Server::start(
        Hosts::perf(&h.a, &[("DMLC_INTERFACE", "ib0")], &["lat", "-p", "18515"])
            .stdout(Stdio::null()),
    );
    let through_eth0 = lat_client(&h, A_ETH0);
    let through_ib0 = lat_client(&h, A_IB0);
    let status = server.finish().status;
    assert!(!through_eth0, "a server bound to ib0 answered on eth0");
    assert!(through_ib0 && status.success());
}
