//! librdmacm, wrapped once: the connection manager calls that connect psnet's own queue pairs
//! ("external QP" mode: rdma_cm resolves the route and runs the REQ / REP / RTU exchange, the
//! application creates the queue pair and moves it through the states rdma_cm computes).
//!
//! `sideway` wraps rdma_cm too, but carries no private data (psnet's handshake rides in it)
//! and panics on an event code it does not know; this wrapper reads every event into a plain
//! [`CmEvent`] and acknowledges it at once, so destroying an id never waits on an event.
//! The public face of these types is the crate's `rdmacm` module.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys as ffi;
use sideway::ibverbs::queue_pair::{QueuePairAttribute, QueuePairState};

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

/// An rdma_cm event channel: one descriptor delivering the events of every id made on it.
pub struct CmChannel {
    raw: NonNull<ffi::rdma_event_channel>,
}

// SAFETY: the channel is a descriptor plus librdmacm's bookkeeping, which librdmacm guards
// itself; psnet reads events from one task only.
unsafe impl Send for CmChannel {}
// SAFETY: as above.
unsafe impl Sync for CmChannel {}

impl CmChannel {
    /// A new channel with a non-blocking descriptor (for tokio's reactor). Fails where
    /// librdmacm or the kernel's rdma_ucm is missing.
    pub fn new() -> io::Result<Arc<CmChannel>> {
        // SAFETY: no arguments; returns null (errno set) on failure.
        let raw = unsafe { ffi::rdma_create_event_channel() };
        let raw = NonNull::new(raw).ok_or_else(io::Error::last_os_error)?;
        let channel = Arc::new(CmChannel { raw });
        super::os::set_nonblocking(channel.as_raw_fd())?;
        Ok(channel)
    }

    /// A new id in the reliable-connected (`RDMA_PS_TCP`) port space.
    pub fn create_id(self: &Arc<Self>) -> io::Result<CmId> {
        let mut id: *mut ffi::rdma_cm_id = std::ptr::null_mut();
        // SAFETY: the channel is valid while `self` lives; the call stores a new id in `id`.
        let rc = unsafe {
            ffi::rdma_create_id(
                self.raw.as_ptr(),
                &mut id,
                std::ptr::null_mut(),
                ffi::rdma_port_space::RDMA_PS_TCP,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        let raw = NonNull::new(id).ok_or_else(|| io::Error::other("rdma_create_id gave no id"))?;
        Ok(CmId {
            raw,
            _channel: self.clone(),
        })
    }

    /// The next pending event, acknowledged; `None` when none is waiting.
    pub fn next_event(self: &Arc<Self>) -> Option<io::Result<CmEvent>> {
        let mut event: *mut ffi::rdma_cm_event = std::ptr::null_mut();
        // SAFETY: the channel is valid and non-blocking; on success `event` points to an event
        // that stays valid until acknowledged below.
        if unsafe { ffi::rdma_get_cm_event(self.raw.as_ptr(), &mut event) } != 0 {
            let err = io::Error::last_os_error();
            return match err.kind() {
                io::ErrorKind::WouldBlock => None,
                _ => Some(Err(err)),
            };
        }
        // SAFETY: `event` is the valid event just returned; its fields are plain C data.
        let (code, status, id, listen_id, private_data) = unsafe {
            let e = &*event;
            // Connection events carry the peer's private data; the union's `conn` member is
            // the one rdma_cm fills for RC ids (the `ud` one starts with the same two fields).
            let conn = e.param.conn;
            let data = if conn.private_data.is_null() || conn.private_data_len == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    conn.private_data as *const u8,
                    conn.private_data_len as usize,
                )
                .to_vec()
            };
            (e.event, e.status, e.id, e.listen_id, data)
        };
        // A connect request brings a new id, which psnet owns from here on.
        let new_id = (code == kind::CONNECT_REQUEST && !listen_id.is_null())
            .then(|| NonNull::new(id))
            .flatten()
            .map(|raw| CmId {
                raw,
                _channel: self.clone(),
            });
        // SAFETY: acknowledges the event just returned, once; nothing reads it afterwards.
        unsafe { ffi::rdma_ack_cm_event(event) };
        Some(Ok(CmEvent {
            kind: code,
            status,
            id: id as usize,
            private_data,
            new_id,
        }))
    }
}

/// Registers the channel's (non-blocking) descriptor with tokio's reactor.
pub fn watch(channel: Arc<CmChannel>) -> io::Result<tokio::io::unix::AsyncFd<Arc<CmChannel>>> {
    // SAFETY: the channel owns its descriptor and closes it only when dropped; the AsyncFd
    // holds an Arc to it, so the descriptor stays open while registered.
    unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(channel, tokio::io::Interest::READABLE)
    }
    .map_err(|e| io::Error::other(e.to_string()))
}

impl AsRawFd for CmChannel {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the channel is valid while `self` lives; `fd` is set at creation.
        unsafe { self.raw.as_ref().fd }
    }
}

impl Drop for CmChannel {
    fn drop(&mut self) {
        // SAFETY: every id holds an Arc to its channel, so none is left when this runs.
        unsafe { ffi::rdma_destroy_event_channel(self.raw.as_ptr()) };
    }
}

/// One rdma_cm event, copied out and already acknowledged.
#[derive(Debug)]
pub struct CmEvent {
    /// The event code (see [`kind`]).
    pub kind: u32,
    /// Its status: an errno for errors, the reject reason for `REJECTED`.
    pub status: i32,
    /// The id it belongs to, as a key ([`CmId::key`]); for a connect request, the new id's.
    pub id: usize,
    /// The peer's private data (connect request, response, reject, established).
    pub private_data: Vec<u8>,
    /// For a connect request: the new id, to accept or reject.
    pub new_id: Option<CmId>,
}

/// What [`CmId::connect`] and [`CmId::accept`] send.
#[derive(Clone, Debug)]
pub struct ConnParam {
    /// The application's queue pair.
    pub qp_num: u32,
    /// Private data for the peer (at most 56 bytes in a request, 196 in a reply).
    pub private_data: Vec<u8>,
    /// Transport retries before an error completion.
    pub retry_count: u8,
    /// Receiver-not-ready retries (7 would be infinite).
    pub rnr_retry_count: u8,
}

/// An rdma_cm id (the connection manager's socket), destroyed when dropped.
pub struct CmId {
    raw: NonNull<ffi::rdma_cm_id>,
    _channel: Arc<CmChannel>,
}

// SAFETY: librdmacm serialises the calls on an id itself; psnet keeps each id in one owner.
unsafe impl Send for CmId {}
// SAFETY: as above.
unsafe impl Sync for CmId {}

impl std::fmt::Debug for CmId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CmId({:#x})", self.key())
    }
}

fn check(rc: i32) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn sockaddr_of(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: an all-zero sockaddr_storage is a valid (empty) value.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in, sin) };
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in6, sin6) };
        }
    }
    storage
}

impl CmId {
    /// This id as a key: the address events name it by.
    pub fn key(&self) -> usize {
        self.raw.as_ptr() as usize
    }

    /// Binds the id to `addr` (its IP picks the RDMA device and port).
    pub fn bind(&self, addr: SocketAddr) -> io::Result<()> {
        let mut sa = sockaddr_of(addr);
        // SAFETY: the id is valid; `sa` is a valid socket address for the call's duration.
        check(unsafe { ffi::rdma_bind_addr(self.raw.as_ptr(), &mut sa as *mut _ as *mut _) })
    }

    /// Listens for connect requests on the bound address.
    pub fn listen(&self, backlog: i32) -> io::Result<()> {
        // SAFETY: the id is valid.
        check(unsafe { ffi::rdma_listen(self.raw.as_ptr(), backlog) })
    }

    /// Starts resolving `dst` from the source address `src` (`ADDR_RESOLVED` follows).
    pub fn resolve_addr(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout_ms: i32,
    ) -> io::Result<()> {
        let mut src = src.map(sockaddr_of);
        let mut dst = sockaddr_of(dst);
        let src_ptr = match &mut src {
            Some(s) => s as *mut _ as *mut libc::sockaddr,
            None => std::ptr::null_mut(),
        };
        // SAFETY: the id is valid; both addresses live for the call (librdmacm copies them).
        check(unsafe {
            ffi::rdma_resolve_addr(
                self.raw.as_ptr(),
                src_ptr,
                &mut dst as *mut _ as *mut libc::sockaddr,
                timeout_ms,
            )
        })
    }

    /// Starts resolving the route to the resolved address (`ROUTE_RESOLVED` follows).
    pub fn resolve_route(&self, timeout_ms: i32) -> io::Result<()> {
        // SAFETY: the id is valid.
        check(unsafe { ffi::rdma_resolve_route(self.raw.as_ptr(), timeout_ms) })
    }

    fn with_param<R>(param: &ConnParam, f: impl FnOnce(&mut ffi::rdma_conn_param) -> R) -> R {
        let mut raw = ffi::rdma_conn_param {
            private_data: param.private_data.as_ptr() as *const _,
            private_data_len: param.private_data.len().min(u8::MAX as usize) as u8,
            responder_resources: 1,
            initiator_depth: 1,
            flow_control: 0,
            retry_count: param.retry_count,
            rnr_retry_count: param.rnr_retry_count,
            srq: 0,
            qp_num: param.qp_num,
        };
        f(&mut raw)
    }

    /// Sends the connect request for the application's queue pair.
    pub fn connect(&self, param: &ConnParam) -> io::Result<()> {
        Self::with_param(param, |raw| {
            // SAFETY: the id is valid; the parameters and the private data they point to live
            // for the call (librdmacm copies them into the request).
            check(unsafe { ffi::rdma_connect(self.raw.as_ptr(), raw) })
        })
    }

    /// Accepts a connect request with the application's queue pair.
    pub fn accept(&self, param: &ConnParam) -> io::Result<()> {
        Self::with_param(param, |raw| {
            // SAFETY: as in `connect`.
            check(unsafe { ffi::rdma_accept(self.raw.as_ptr(), raw) })
        })
    }

    /// Refuses a connect request, telling the peer why in `private_data`.
    pub fn reject(&self, private_data: &[u8]) -> io::Result<()> {
        let len = private_data.len().min(u8::MAX as usize) as u8;
        // SAFETY: the id is valid; the data lives for the call.
        check(unsafe {
            ffi::rdma_reject(self.raw.as_ptr(), private_data.as_ptr() as *const _, len)
        })
    }

    /// Active side, after connecting its queue pair: sends the RTU that completes the
    /// connection.
    pub fn establish(&self) -> io::Result<()> {
        // SAFETY: the id is valid.
        check(unsafe { ffi::rdma_establish(self.raw.as_ptr()) })
    }

    /// Tells the peer the connection is over (it sees `DISCONNECTED`).
    pub fn disconnect(&self) -> io::Result<()> {
        // SAFETY: the id is valid.
        check(unsafe { ffi::rdma_disconnect(self.raw.as_ptr()) })
    }

    /// The attributes rdma_cm computed for moving the application's queue pair to `state`
    /// (route, path MTU, remote queue pair, packet sequence numbers).
    pub fn qp_attr(&self, state: QueuePairState) -> io::Result<QueuePairAttribute> {
        // SAFETY: an all-zero ibv_qp_attr is a valid value.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = state as _;
        let mut mask = 0;
        // SAFETY: the id is valid; the call fills `attr` and `mask`.
        check(unsafe { ffi::rdma_init_qp_attr(self.raw.as_ptr(), &mut attr, &mut mask) })?;
        Ok(QueuePairAttribute::from(&attr, mask))
    }

    /// The RDMA device and port the id is bound to, once bound or resolved.
    pub fn device_port(&self) -> Option<(String, u8)> {
        // SAFETY: the id is valid; `verbs` is null until bound, then a context whose device
        // pointer and name stay valid while the id lives.
        unsafe {
            let id = self.raw.as_ref();
            if id.verbs.is_null() || (*id.verbs).device.is_null() {
                return None;
            }
            let name = ffi::ibv_get_device_name((*id.verbs).device);
            if name.is_null() {
                return None;
            }
            let name = std::ffi::CStr::from_ptr(name)
                .to_string_lossy()
                .into_owned();
            Some((name, id.port_num))
        }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: the id is valid and owned here; its events are acknowledged as soon as they
        // are read, so destroying it does not wait on one.
        unsafe { ffi::rdma_destroy_id(self.raw.as_ptr()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_addresses_convert_to_c() {
        let sa = sockaddr_of("10.1.2.3:4567".parse().unwrap());
        // SAFETY: sockaddr_of wrote a sockaddr_in for an IPv4 address.
        let sin = unsafe { *(&sa as *const _ as *const libc::sockaddr_in) };
        assert_eq!(sin.sin_family as i32, libc::AF_INET);
        assert_eq!(u16::from_be(sin.sin_port), 4567);
        assert_eq!(sin.sin_addr.s_addr.to_ne_bytes(), [10, 1, 2, 3]);
        let sa = sockaddr_of("[fe80::1]:9".parse().unwrap());
        // SAFETY: sockaddr_of wrote a sockaddr_in6 for an IPv6 address.
        let sin6 = unsafe { *(&sa as *const _ as *const libc::sockaddr_in6) };
        assert_eq!(sin6.sin6_family as i32, libc::AF_INET6);
        assert_eq!(u16::from_be(sin6.sin6_port), 9);
        assert_eq!(sin6.sin6_addr.s6_addr[0], 0xfe);
    }

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
