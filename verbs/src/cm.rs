//! rdma_cm's answer to "which RDMA device and port carry this IP address": binding a
//! connection-manager id to the address makes the kernel pick the port its routing would use,
//! which also covers interfaces that sysfs does not tie to a device (VLANs, bonds, IPoIB
//! children). psnet opens that port, so every packet leaves from the interface's address
//! (ps-lite lets rdma_cm pick a source on its own, which goes wrong on multi-NIC hosts).

use std::net::{IpAddr, SocketAddr};

use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::rdmacm::communication_manager::{EventChannel, PortSpace};

use crate::error::VerbsError;

/// The device port rdma_cm binds an address to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CmBinding {
    /// Device name (`mlx5_0`, `rxe0`).
    pub device: String,
    /// Port, 1-based.
    pub port: u8,
}

/// Binds a connection-manager id to `ip` and reports the device port it landed on.
///
/// Fails (never panics) where librdmacm or the kernel's rdma_cm is missing, or no RDMA port
/// carries `ip`.
pub fn device_for_address(ip: IpAddr) -> Result<CmBinding, VerbsError> {
    if ip.is_loopback() || ip.is_unspecified() {
        return Err(VerbsError::Setup(format!("{ip} names no single RDMA port")));
    }
    bind_and_query(ip)
}

/// [`device_for_address`] without its address checks (rdma_cm maps loopback to some port).
pub(crate) fn bind_and_query(ip: IpAddr) -> Result<CmBinding, VerbsError> {
    let channel = EventChannel::new()
        .map_err(|e| VerbsError::os("rdma_create_event_channel", "rdma_cm event channel", &e))?;
    let id = channel
        .create_id(PortSpace::Tcp)
        .map_err(|e| VerbsError::os("rdma_create_id", "rdma_cm id", &e))?;
    id.bind_addr(SocketAddr::new(ip, 0))
        .map_err(|e| VerbsError::os("rdma_bind_addr", format!("rdma_cm cannot bind {ip}"), &e))?;
    let ctx = id
        .get_device_context()
        .ok_or_else(|| VerbsError::Setup(format!("rdma_cm bound {ip} to no RDMA device")))?;
    let guid = ctx
        .query_device()
        .map_err(|e| {
            VerbsError::os(
                "ibv_query_device",
                format!("query the device rdma_cm chose for {ip}"),
                &e,
            )
        })?
        .node_guid();
    let list =
        DeviceList::new().map_err(|e| VerbsError::os("ibv_get_device_list", "libibverbs", &e))?;
    let device = list
        .iter()
        .find(|d| d.guid() == guid)
        .map(|d| d.name())
        .ok_or_else(|| {
            VerbsError::Setup(format!(
                "rdma_cm chose a device for {ip} that libibverbs does not list"
            ))
        })?;
    Ok(CmBinding {
        device,
        port: id.port(),
    })
}
