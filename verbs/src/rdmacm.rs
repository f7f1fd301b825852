//! librdmacm's connection manager as psnet uses it: the event codes it acts on and their
//! names, the event channel ([`CmChannel`]), ids ([`CmId`]) and events ([`CmEvent`]). The FFI
//! itself is `sys::rdmacm`'s.

pub use crate::sys::rdmacm::{watch, CmChannel, CmEvent, CmId, ConnParam};

/// The event codes psnet acts on (`enum rdma_cm_event_type`).
pub mod kind {
    /// The destination address was resolved; next: resolve the route.
    pub const ADDR_RESOLVED: u32 = 0;
    /// The destination address could not be resolved.
    pub const ADDR_ERROR: u32 = 1;
    /// The route was resolved; next: connect.
    pub const ROUTE_RESOLVED: u32 = 2;
    /// No route to the destination.
    pub const ROUTE_ERROR: u32 = 3;
    /// A peer asks to connect (on a listening id; the event brings a new id).
    pub const CONNECT_REQUEST: u32 = 4;
    /// The passive side accepted (external queue pair: connect it, then establish).
    pub const CONNECT_RESPONSE: u32 = 5;
    /// The connection failed while being established.
    pub const CONNECT_ERROR: u32 = 6;
    /// The remote side did not answer.
    pub const UNREACHABLE: u32 = 7;
    /// The remote side refused.
    pub const REJECTED: u32 = 8;
    /// The connection is up (passive side: the active side's RTU arrived).
    pub const ESTABLISHED: u32 = 9;
    /// The remote side disconnected (or its process ended).
    pub const DISCONNECTED: u32 = 10;
    /// The RDMA device went away.
    pub const DEVICE_REMOVAL: u32 = 11;
    /// The address the id is bound to moved to another device.
    pub const ADDR_CHANGE: u32 = 14;
    /// The connection's time-wait ended.
    pub const TIMEWAIT_EXIT: u32 = 15;
}

/// The name of an rdma_cm event code, as rdma-core spells it.
pub fn event_name(code: u32) -> &'static str {
    const NAMES: [&str; 16] = [
        "RDMA_CM_EVENT_ADDR_RESOLVED",
        "RDMA_CM_EVENT_ADDR_ERROR",
        "RDMA_CM_EVENT_ROUTE_RESOLVED",
        "RDMA_CM_EVENT_ROUTE_ERROR",
        "RDMA_CM_EVENT_CONNECT_REQUEST",
        "RDMA_CM_EVENT_CONNECT_RESPONSE",
        "RDMA_CM_EVENT_CONNECT_ERROR",
        "RDMA_CM_EVENT_UNREACHABLE",
        "RDMA_CM_EVENT_REJECTED",
        "RDMA_CM_EVENT_ESTABLISHED",
        "RDMA_CM_EVENT_DISCONNECTED",
        "RDMA_CM_EVENT_DEVICE_REMOVAL",
        "RDMA_CM_EVENT_MULTICAST_JOIN",
        "RDMA_CM_EVENT_MULTICAST_ERROR",
        "RDMA_CM_EVENT_ADDR_CHANGE",
        "RDMA_CM_EVENT_TIMEWAIT_EXIT",
    ];
    NAMES
        .get(code as usize)
        .copied()
        .unwrap_or("unknown rdma_cm event")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_names_follow_rdma_core() {
        assert_eq!(event_name(kind::REJECTED), "RDMA_CM_EVENT_REJECTED");
        assert_eq!(event_name(kind::DISCONNECTED), "RDMA_CM_EVENT_DISCONNECTED");
        assert_eq!(
            event_name(kind::TIMEWAIT_EXIT),
            "RDMA_CM_EVENT_TIMEWAIT_EXIT"
        );
        assert_eq!(event_name(99), "unknown rdma_cm event");
    }
}
