//! One opened RDMA device port: context, protection domain, the completion queue every queue
//! pair shares, its completion channel, and the port's addressing (GID, LID, MTU).

use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;

use sideway::ibverbs::address::{Gid, GidType};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu};
use sideway::ibverbs::protection_domain::ProtectionDomain;

use crate::discovery::GID_SCAN_LIMIT;
use crate::error::VerbsError;

/// Which device port to open, and the IP address whose GID to use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSpec {
    /// Device name (`mlx5_0`, `rxe0`).
    pub device: String,
    /// Port, 1-based.
    pub port: u8,
    /// GID index (`PSNET_GID_INDEX`); found from `ip` when `None`.
    pub gid_index: Option<u32>,
    /// The node's address: on RoCE, the GID carrying it is the source of every packet.
    pub ip: IpAddr,
}

/// An opened device port and the resources shared by all queue pairs on it.
pub struct Device {
    /// Device name.
    pub name: String,
    /// Port, 1-based.
    pub port: u8,
    /// Local GID used as the source of packets.
    pub gid: Gid,
    /// Its index.
    pub gid_index: u8,
    /// Local LID (InfiniBand).
    pub lid: u16,
    /// RoCE (Ethernet link layer) rather than InfiniBand.
    pub ethernet: bool,
    /// Active path MTU.
    pub mtu: Mtu,
    /// Largest scatter-gather list of one work request.
    pub max_sge: u32,
    /// Completion queue entries.
    pub cq_depth: u32,
    // Drop order: the CQ before its channel, both before the PD and the context.
    /// The completion queue shared by every queue pair.
    pub cq: Arc<BasicCompletionQueue>,
    /// Its completion channel (non-blocking).
    pub channel: Arc<CompletionChannel>,
    /// Protection domain of every registration and queue pair.
    pub pd: Arc<ProtectionDomain>,
    /// The opened device.
    pub ctx: Arc<DeviceContext>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name)
            .field("port", &self.port)
            .field("gid", &self.gid.to_string())
            .field("gid_index", &self.gid_index)
            .field("lid", &self.lid)
            .field("ethernet", &self.ethernet)
            .finish()
    }
}

impl Device {
    /// Opens `spec`'s device port with a completion queue of about `cq_depth` entries.
    pub fn open(spec: &DeviceSpec, cq_depth: u32) -> Result<Device, VerbsError> {
        let name = &spec.device;
        let list = DeviceList::new()
            .map_err(|e| VerbsError::os("ibv_get_device_list", "libibverbs", &e))?;
        let names: Vec<String> = list.iter().map(|d| d.name()).collect();
        let dev = list.iter().find(|d| d.name() == *name).ok_or_else(|| {
            VerbsError::Setup(format!(
                "RDMA device {name} not found (libibverbs lists {names:?})"
            ))
        })?;
        let ctx = dev
            .open()
            .map_err(|e| VerbsError::os("ibv_open_device", format!("cannot open {name}"), &e))?;
        let port = ctx.query_port(spec.port).map_err(|e| {
            VerbsError::os("ibv_query_port", format!("{name} port {}", spec.port), &e)
        })?;
        let ethernet = matches!(port.link_layer(), LinkLayer::Ethernet);
        let attr = ctx
            .query_device()
            .map_err(|e| VerbsError::os("ibv_query_device", format!("{name}: query_device"), &e))?;
        let gid_index = match spec.gid_index {
            Some(i) => i,
            None => find_gid_index(&ctx, spec.port, spec.ip, ethernet),
        };
        let gid = ctx.query_gid(spec.port, gid_index).map_err(|e| {
            VerbsError::os(
                "ibv_query_gid",
                format!("{name} port {} GID {gid_index}", spec.port),
                &e,
            )
        })?;
        let cq_depth = cq_depth.min(attr.max_cqe().max(1) as u32);
        let channel = CompletionChannel::new(&ctx).map_err(|e| {
            VerbsError::os(
                "ibv_create_comp_channel",
                format!("{name}: completion channel"),
                &e,
            )
        })?;
        channel
            .set_nonblocking(true)
            .map_err(|e| VerbsError::os("fcntl(O_NONBLOCK)", "completion channel", &e))?;
        let cq = ctx
            .create_cq_builder()
            .setup_cqe(cq_depth)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(|e| {
                VerbsError::os(
                    "ibv_create_cq",
                    format!("{name}: completion queue of {cq_depth}"),
                    &e,
                )
            })?;
        let pd = ctx.alloc_pd().map_err(|e| {
            VerbsError::os("ibv_alloc_pd", format!("{name}: protection domain"), &e)
        })?;
        Ok(Device {
            name: spec.device.clone(),
            port: spec.port,
            gid,
            gid_index: gid_index as u8,
            lid: port.lid(),
            ethernet,
            mtu: port.active_mtu(),
            max_sge: (attr.max_sge().max(1) as u32).min(16),
            cq_depth,
            cq,
            channel,
            pd,
            ctx,
        })
    }
}

/// The GID index carrying `ip` on `port` (RoCE v2 preferred); 0 when none does (InfiniBand,
/// or an address not bound to this port).
fn find_gid_index(ctx: &Arc<DeviceContext>, port: u8, ip: IpAddr, ethernet: bool) -> u32 {
    if !ethernet {
        return 0;
    }
    let want: Ipv6Addr = match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    let mut fallback = None;
    for index in 0..GID_SCAN_LIMIT as u32 {
        let Ok(entry) = ctx.query_gid_ex(port, index) else {
            continue;
        };
        if Ipv6Addr::from(entry.gid()) != want {
            continue;
        }
        if matches!(entry.gid_type(), GidType::RoceV2) {
            return index;
        }
        fallback.get_or_insert(index);
    }
    fallback.unwrap_or_else(|| {
        tracing::warn!(%ip, "no GID of the RDMA port carries this address; using GID 0");
        0
    })
}
