//! The RDMA devices libibverbs reports, through `sideway` (libibverbs is loaded at run time).
//!
//! On a host without RDMA, `ibv_get_device_list` fails (with ENOSYS here, where the kernel has
//! no InfiniBand support; EOPNOTSUPP without rdma-core) instead of returning an empty list:
//! both mean "no RDMA device" and come back as [`Unavailable`] with the reason.

use sideway::ibverbs::device::{DeviceInfo, DeviceList};

/// Why this host offers no RDMA devices.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no RDMA devices here: {0}")]
pub struct Unavailable(pub String);

/// One device as libibverbs lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsDevice {
    /// Device name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Node GUID, as libibverbs prints it.
    pub guid: String,
}

/// The devices libibverbs reports, or why there are none.
pub fn verbs_devices() -> Result<Vec<VerbsDevice>, Unavailable> {
    let list = DeviceList::new().map_err(|e| {
        let cause = std::error::Error::source(&e)
            .map(|c| c.to_string())
            .unwrap_or_default();
        Unavailable(format!("libibverbs: {e} ({cause})"))
    })?;
    let devices: Vec<VerbsDevice> = list
        .iter()
        .map(|d| VerbsDevice {
            name: d.name(),
            guid: d.guid().to_string(),
        })
        .collect();
    if devices.is_empty() {
        return Err(Unavailable("libibverbs lists no device".into()));
    }
    Ok(devices)
}
