//! Which RDMA device and port a network interface belongs to, read from sysfs.
//!
//! Two bindings exist:
//! - the device's own network interfaces, `/sys/class/infiniband/<dev>/device/net/<netdev>`
//!   (InfiniBand IPoIB interfaces and RoCE NICs);
//! - the netdev behind a RoCE GID, `/sys/class/infiniband/<dev>/ports/<port>/gid_attrs/ndevs/<i>`
//!   (software devices such as Soft-RoCE `rxe0`, whose `device` is not a PCI function).
//!
//! Only the first [`GID_SCAN_LIMIT`] GID entries of a port are read: under emulation reading
//! all 1024 takes about a minute, and the interface's GIDs sit at the start of the table.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Where sysfs lists RDMA devices on Linux.
pub const SYSFS_INFINIBAND: &str = "/sys/class/infiniband";
/// Where sysfs lists network interfaces on Linux.
pub const SYSFS_NET: &str = "/sys/class/net";
/// GID entries read per port.
pub const GID_SCAN_LIMIT: usize = 16;

/// How a device was found to serve the interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BindingSource {
    /// The interface is one of the device's own network interfaces.
    DeviceNetdev,
    /// A GID of the port is attached to the interface (RoCE).
    GidNetdev {
        /// The first GID index attached to the interface.
        gid_index: u32,
    },
    /// Named by `PSNET_IB_DEVICE` (and `PSNET_IB_PORT`).
    Configured,
    /// rdma_cm bound the interface's address to this port (see [`crate::cm`]).
    RdmaCm,
}

/// An RDMA device port serving a network interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaBinding {
    /// Device name (`mlx5_0`, `rxe0`).
    pub device: String,
    /// Port number, 1-based.
    pub port: u32,
    /// `InfiniBand` or `Ethernet` (RoCE), as sysfs reports it; empty if unreadable.
    pub link_layer: String,
    /// How the binding was found.
    pub source: BindingSource,
}

/// The RDMA device bound to `netdev` on this host, if any.
pub fn rdma_device_for_interface(netdev: &str) -> io::Result<Option<RdmaBinding>> {
    find_binding(Path::new(SYSFS_INFINIBAND), Path::new(SYSFS_NET), netdev)
}

/// The names of the RDMA devices on this host (empty when there are none or the kernel has
/// no RDMA support).
pub fn rdma_devices() -> Vec<String> {
    sorted_entries(Path::new(SYSFS_INFINIBAND))
        .into_iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect()
}

/// The binding for a device named by the user (`PSNET_IB_DEVICE`), if that device exists.
pub fn configured_binding(device: &str, port: u32) -> Option<RdmaBinding> {
    let dev = Path::new(SYSFS_INFINIBAND).join(device);
    dev.exists().then(|| RdmaBinding {
        link_layer: link_layer(&dev, port),
        device: device.to_string(),
        port,
        source: BindingSource::Configured,
    })
}

/// Reconciles sysfs's binding for an interface with rdma_cm's for its address: rdma_cm's
/// answer is the port the kernel sends from, so it wins when the two differ (with a warning)
/// and fills in when sysfs found nothing; without rdma_cm (no librdmacm, no kernel support)
/// sysfs's answer stands.
pub fn reconcile(
    sysfs: Option<RdmaBinding>,
    cm: Result<crate::cm::CmBinding, crate::VerbsError>,
    link_layer_of: impl FnOnce(&str, u32) -> String,
) -> Option<RdmaBinding> {
    let cm = match cm {
        Ok(cm) => cm,
        Err(reason) => {
            tracing::debug!(%reason, "rdma_cm gives no device for the address; using sysfs");
            return sysfs;
        }
    };
    let port = u32::from(cm.port);
    match sysfs {
        Some(b) if b.device == cm.device && b.port == port => {
            tracing::debug!(device = %b.device, port, "rdma_cm agrees with sysfs");
            Some(b)
        }
        other => {
            if let Some(b) = &other {
                tracing::warn!(sysfs = %format!("{} port {}", b.device, b.port),
                    rdma_cm = %format!("{} port {}", cm.device, cm.port),
                    "sysfs and rdma_cm disagree on the interface's RDMA port; using rdma_cm's");
            }
            Some(RdmaBinding {
                link_layer: link_layer_of(&cm.device, port),
                device: cm.device,
                port,
                source: BindingSource::RdmaCm,
            })
        }
    }
}

/// The link layer of `device`'s `port` as sysfs reports it (empty if unreadable).
pub fn port_link_layer(device: &str, port: u32) -> String {
    link_layer(&Path::new(SYSFS_INFINIBAND).join(device), port)
}

/// [`rdma_device_for_interface`] over any sysfs-shaped tree (for tests).
pub fn find_binding(
    infiniband: &Path,
    net: &Path,
    netdev: &str,
) -> io::Result<Option<RdmaBinding>> {
    let devices = match fs::read_dir(infiniband) {
        Ok(_) => sorted_entries(infiniband),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    for dev in &devices {
        let name = dev
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if dev.join("device/net").join(netdev).exists() {
            let port = read_trimmed(&net.join(netdev).join("dev_port"))
                .and_then(|s| s.parse::<u32>().ok())
                .map_or(1, |p| p + 1);
            return Ok(Some(RdmaBinding {
                link_layer: link_layer(dev, port),
                device: name,
                port,
                source: BindingSource::DeviceNetdev,
            }));
        }
        for port_dir in sorted_entries(&dev.join("ports")) {
            let Some(port) = port_dir
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            for index in 0..GID_SCAN_LIMIT {
                let ndev = port_dir.join("gid_attrs/ndevs").join(index.to_string());
                if read_trimmed(&ndev).as_deref() == Some(netdev) {
                    return Ok(Some(RdmaBinding {
                        link_layer: link_layer(dev, port),
                        device: name,
                        port,
                        source: BindingSource::GidNetdev {
                            gid_index: index as u32,
                        },
                    }));
                }
            }
        }
    }
    Ok(None)
}

fn link_layer(dev: &Path, port: u32) -> String {
    read_trimmed(&dev.join("ports").join(port.to_string()).join("link_layer")).unwrap_or_default()
}

/// A sysfs attribute's value; unreadable attributes (EINVAL on unused GIDs) count as absent.
fn read_trimmed(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

fn sorted_entries(dir: &Path) -> Vec<PathBuf> {
    let mut entries: Vec<PathBuf> = fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    entries.sort();
    entries
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(root: &Path, rel: &str, content: &str) {
        let path = root.join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, content).unwrap();
    }

    #[test]
    fn no_infiniband_class_means_no_device() {
        let tmp = tempfile::tempdir().unwrap();
        let found = find_binding(&tmp.path().join("absent"), tmp.path(), "ib0").unwrap();
        assert_eq!(found, None);
    }

    #[test]
    fn finds_hca_by_its_netdev_and_dev_port() {
        let tmp = tempfile::tempdir().unwrap();
        let (ib, net) = (tmp.path().join("ib"), tmp.path().join("net"));
        fs::create_dir_all(ib.join("mlx5_0/device/net/ib0")).unwrap();
        write(&ib, "mlx5_0/ports/1/link_layer", "InfiniBand\n");
        write(&ib, "mlx5_1/ports/1/link_layer", "Ethernet\n");
        fs::create_dir_all(ib.join("mlx5_1/device/net/eth2")).unwrap();
        write(&ib, "mlx5_1/ports/2/link_layer", "Ethernet\n");
        write(&net, "eth2/dev_port", "1\n");
        let b = find_binding(&ib, &net, "ib0").unwrap().unwrap();
        assert_eq!((b.device.as_str(), b.port), ("mlx5_0", 1));
        assert_eq!(b.link_layer, "InfiniBand");
        let b = find_binding(&ib, &net, "eth2").unwrap().unwrap();
        assert_eq!(
            (b.device.as_str(), b.port, b.link_layer.as_str()),
            ("mlx5_1", 2, "Ethernet")
        );
        assert_eq!(find_binding(&ib, &net, "eth0").unwrap(), None);
    }

    #[test]
    fn finds_soft_roce_by_gid_netdev() {
        let tmp = tempfile::tempdir().unwrap();
        let (ib, net) = (tmp.path().join("ib"), tmp.path().join("net"));
        write(&ib, "rxe0/ports/1/link_layer", "Ethernet\n");
        fs::create_dir_all(ib.join("rxe0/ports/1/gid_attrs/ndevs")).unwrap();
        write(&ib, "rxe0/ports/1/gid_attrs/ndevs/0", "ib0\n");
        write(&ib, "rxe0/ports/1/gid_attrs/ndevs/1", "ib0\n");
        let b = find_binding(&ib, &net, "ib0").unwrap().unwrap();
        assert_eq!(b.device, "rxe0");
        assert_eq!(b.source, BindingSource::GidNetdev { gid_index: 0 });
        assert_eq!(find_binding(&ib, &net, "eth0").unwrap(), None);
    }

    #[test]
    fn gid_entries_past_the_scan_limit_are_not_read() {
        let tmp = tempfile::tempdir().unwrap();
        let (ib, net) = (tmp.path().join("ib"), tmp.path().join("net"));
        write(
            &ib,
            &format!("rxe0/ports/1/gid_attrs/ndevs/{GID_SCAN_LIMIT}"),
            "ib0",
        );
        assert_eq!(find_binding(&ib, &net, "ib0").unwrap(), None);
    }

    fn sysfs_says(device: &str, port: u32) -> Option<RdmaBinding> {
        Some(RdmaBinding {
            device: device.into(),
            port,
            link_layer: "Ethernet".into(),
            source: BindingSource::DeviceNetdev,
        })
    }

    fn cm_says(device: &str, port: u8) -> Result<crate::cm::CmBinding, crate::VerbsError> {
        Ok(crate::cm::CmBinding {
            device: device.into(),
            port,
        })
    }

    fn ll(_: &str, _: u32) -> String {
        "InfiniBand".into()
    }

    #[test]
    fn rdma_cm_confirms_fills_in_and_overrules_sysfs() {
        // Agreement keeps sysfs's record (and how it was found).
        assert_eq!(
            reconcile(sysfs_says("mlx5_0", 1), cm_says("mlx5_0", 1), ll),
            sysfs_says("mlx5_0", 1)
        );
        // sysfs found nothing (a VLAN or bond): rdma_cm's port is used.
        let filled = reconcile(None, cm_says("mlx5_1", 2), ll).expect("a binding");
        assert_eq!((filled.device.as_str(), filled.port), ("mlx5_1", 2));
        assert_eq!(filled.source, BindingSource::RdmaCm);
        assert_eq!(filled.link_layer, "InfiniBand");
        // Disagreement: the kernel's routing answer wins.
        let over = reconcile(sysfs_says("mlx5_0", 1), cm_says("mlx5_1", 1), ll).expect("binding");
        assert_eq!(
            (over.device.as_str(), over.source),
            ("mlx5_1", BindingSource::RdmaCm)
        );
        // No rdma_cm: sysfs stands, and nothing stays nothing.
        let none = || {
            Err::<crate::cm::CmBinding, _>(crate::VerbsError::errno(
                "rdma_create_event_channel",
                "rdma_cm event channel",
                libc::ENOSYS,
            ))
        };
        assert_eq!(
            reconcile(sysfs_says("rxe0", 1), none(), ll),
            sysfs_says("rxe0", 1)
        );
        assert_eq!(reconcile(None, none(), ll), None);
    }

    #[test]
    fn rdma_cm_without_hardware_is_an_error_not_a_panic() {
        // On hosts without RDMA (and for addresses that name no port) this must fail cleanly.
        let err = crate::cm::device_for_address("127.0.0.1".parse().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("127.0.0.1"), "{err}");
        if rdma_devices().is_empty() {
            // Binding sends nothing; without devices it fails in librdmacm or the kernel.
            let err = crate::cm::bind_and_query("127.0.0.1".parse().unwrap())
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("rdma_cm") || err.contains("libibverbs"),
                "{err}"
            );
        }
    }
}
