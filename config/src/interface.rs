//! Which address this node uses: ps-lite's rules, with clearer errors.

use std::fmt;
use std::net::{IpAddr, ToSocketAddrs};

use crate::env::{self, ConfigError};

/// One address of one network interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interface {
    /// The interface's name (`eth0`, `ib0`, `lo`).
    pub name: String,
    /// One of its addresses.
    pub addr: IpAddr,
}

/// The address chosen for this node, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeAddress {
    /// The IP to listen on and to announce to peers.
    pub ip: IpAddr,
    /// The interface carrying it, when known (always, except for a `DMLC_NODE_HOST` that no
    /// local interface holds).
    pub interface: Option<String>,
    /// How it was chosen, for the start-up log.
    pub reason: String,
}

impl fmt::Display for NodeAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.interface {
            Some(name) => write!(f, "{} on {} ({})", self.ip, name, self.reason),
            None => write!(f, "{} ({})", self.ip, self.reason),
        }
    }
}

/// The interfaces of this host (of this network namespace), in the kernel's order.
pub fn list_interfaces() -> Result<Vec<Interface>, ConfigError> {
    let ifaces = if_addrs::get_if_addrs()
        .map_err(|e| ConfigError::NoAddress(format!("cannot list network interfaces: {e}")))?;
    Ok(ifaces
        .into_iter()
        .map(|i| Interface {
            addr: i.ip(),
            name: i.name,
        })
        .collect())
}

/// Chooses this node's address from the environment and the host's interfaces.
pub fn node_address_from_env() -> Result<NodeAddress, ConfigError> {
    select(
        env::DMLC_NODE_HOST.get().as_deref(),
        env::DMLC_INTERFACE.get().as_deref(),
        &list_interfaces()?,
    )
}

fn is_usable_v6(ip: &IpAddr) -> bool {
    // Link-local IPv6 needs a scope id to be dialled; skip it when choosing by default.
    matches!(ip, IpAddr::V6(v6) if !v6.is_loopback() && (v6.segments()[0] & 0xffc0) != 0xfe80)
}

/// The selection rule, without touching the system (so it can be tested):
///
/// 1. `node_host` (`DMLC_NODE_HOST`), if set, is used verbatim: an IP, or a name resolved to
///    its first address.
/// 2. `interface` (`DMLC_INTERFACE`), if set: the interface with exactly that name, else the
///    first whose name starts with it (ps-lite's prefix rule: `ib` finds `ib0`); its IPv4
///    address, else its IPv6 one. No match is an error listing the interfaces that exist.
/// 3. Otherwise the first non-loopback IPv4 interface, else the first non-loopback,
///    non-link-local IPv6 one.
pub fn select(
    node_host: Option<&str>,
    interface: Option<&str>,
    ifaces: &[Interface],
) -> Result<NodeAddress, ConfigError> {
    if let Some(host) = node_host {
        let ip = resolve(host)?;
        let holder = ifaces.iter().find(|i| i.addr == ip).map(|i| i.name.clone());
        return Ok(NodeAddress {
            ip,
            interface: holder,
            reason: "DMLC_NODE_HOST".into(),
        });
    }
    if let Some(wanted) = interface {
        let exact: Vec<&Interface> = ifaces.iter().filter(|i| i.name == wanted).collect();
        let (matches, how) = if exact.is_empty() {
            let name = ifaces
                .iter()
                .find(|i| i.name.starts_with(wanted))
                .map(|i| &i.name);
            (
                ifaces.iter().filter(|i| Some(&i.name) == name).collect(),
                "prefix match",
            )
        } else {
            (exact, "exact match")
        };
        let Some(first) = matches.first() else {
            return Err(ConfigError::NoSuchInterface {
                wanted: wanted.to_string(),
                available: describe(ifaces),
            });
        };
        let chosen = matches
            .iter()
            .find(|i| i.addr.is_ipv4())
            .or_else(|| matches.iter().find(|i| is_usable_v6(&i.addr)))
            .or(matches.first())
            .copied()
            .unwrap_or(first);
        return Ok(NodeAddress {
            ip: chosen.addr,
            interface: Some(chosen.name.clone()),
            reason: format!("DMLC_INTERFACE={wanted} ({how})"),
        });
    }
    let chosen = ifaces
        .iter()
        .find(|i| i.addr.is_ipv4() && !i.addr.is_loopback())
        .or_else(|| ifaces.iter().find(|i| is_usable_v6(&i.addr)));
    match chosen {
        Some(i) => Ok(NodeAddress {
            ip: i.addr,
            interface: Some(i.name.clone()),
            reason: "first non-loopback interface (DMLC_INTERFACE unset)".into(),
        }),
        None => Err(ConfigError::NoAddress(format!(
            "no non-loopback interface; set DMLC_INTERFACE=lo to run on this host only \
             (interfaces here: {})",
            describe(ifaces)
        ))),
    }
}

fn resolve(host: &str) -> Result<IpAddr, ConfigError> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(ip);
    }
    let invalid = |reason: String| ConfigError::Invalid {
        name: env::DMLC_NODE_HOST.name,
        value: host.to_string(),
        reason,
    };
    let mut addrs = (host, 0u16)
        .to_socket_addrs()
        .map_err(|e| invalid(format!("not an IP address and cannot be resolved: {e}")))?;
    addrs
        .next()
        .map(|a| a.ip())
        .ok_or_else(|| invalid("resolves to no address".into()))
}

fn describe(ifaces: &[Interface]) -> String {
    if ifaces.is_empty() {
        return "none".into();
    }
    ifaces
        .iter()
        .map(|i| format!("{} ({})", i.name, i.addr))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iface(name: &str, addr: &str) -> Interface {
        Interface {
            name: name.into(),
            addr: addr.parse().unwrap(),
        }
    }

    fn host() -> Vec<Interface> {
        vec![
            iface("lo", "127.0.0.1"),
            iface("eth0", "fe80::1"),
            iface("eth0", "192.0.2.10"),
            iface("ib0", "198.51.100.7"),
            iface("ib1", "198.51.100.8"),
            iface("eth10", "203.0.113.5"),
        ]
    }

    #[test]
    fn node_host_beats_interface() {
        let a = select(Some("198.51.100.8"), Some("eth0"), &host()).unwrap();
        assert_eq!(a.ip, "198.51.100.8".parse::<IpAddr>().unwrap());
        assert_eq!(a.interface.as_deref(), Some("ib1"));
    }

    #[test]
    fn exact_name_before_prefix() {
        // `eth1` is not a name, but `eth10` starts with it.
        let a = select(None, Some("eth1"), &host()).unwrap();
        assert_eq!(a.interface.as_deref(), Some("eth10"));
        // `eth0` exists exactly, though `eth0` is also a prefix of nothing else.
        let a = select(None, Some("eth0"), &host()).unwrap();
        assert_eq!(
            a.ip,
            "192.0.2.10".parse::<IpAddr>().unwrap(),
            "IPv4 preferred"
        );
    }

    #[test]
    fn prefix_finds_first_match() {
        let a = select(None, Some("ib"), &host()).unwrap();
        assert_eq!(a.interface.as_deref(), Some("ib0"));
        assert!(a.reason.contains("prefix"));
    }

    #[test]
    fn unknown_interface_lists_what_exists() {
        let err = select(None, Some("mlx"), &host()).unwrap_err().to_string();
        assert!(
            err.contains("mlx") && err.contains("ib0 (198.51.100.7)"),
            "{err}"
        );
    }

    #[test]
    fn default_is_first_non_loopback_ipv4_then_ipv6() {
        let a = select(None, None, &host()).unwrap();
        assert_eq!(a.interface.as_deref(), Some("eth0"));
        assert!(a.ip.is_ipv4());
        let v6_only = vec![
            iface("lo", "127.0.0.1"),
            iface("lo", "::1"),
            iface("eth0", "fe80::2"),
            iface("eth0", "2001:db8::2"),
        ];
        let a = select(None, None, &v6_only).unwrap();
        assert_eq!(a.ip, "2001:db8::2".parse::<IpAddr>().unwrap());
        let err = select(None, None, &[iface("lo", "127.0.0.1")]).unwrap_err();
        assert!(err.to_string().contains("DMLC_INTERFACE=lo"), "{err}");
    }

    #[test]
    fn lo_can_be_chosen_explicitly() {
        let a = select(None, Some("lo"), &host()).unwrap();
        assert_eq!(a.ip, "127.0.0.1".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn unresolvable_node_host_is_a_clear_error() {
        let err = select(Some("no such host.invalid"), None, &host()).unwrap_err();
        assert!(err.to_string().contains("DMLC_NODE_HOST"), "{err}");
    }
}
