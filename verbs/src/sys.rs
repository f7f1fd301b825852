//! The few libibverbs calls `sideway` does not wrap, and the process limits RDMA depends on.
//! Every `unsafe` block of the data path's FFI lives here.

use std::io;
use std::sync::{Arc, OnceLock};

use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue};
use sideway::ibverbs::device_context::DeviceContext;

use crate::error::VerbsError;
use crate::events::{self, AsyncEvent, Scope};

/// Calls `ibv_fork_init` once per process, before the first registration, so that a child
/// forked by a data loader does not corrupt registered pages (on kernels that need it).
pub fn fork_init_once() {
    static DONE: OnceLock<i32> = OnceLock::new();
    let rc = *DONE.get_or_init(|| {
        // SAFETY: ibv_fork_init takes no arguments and is called before any memory of this
        // process is registered (the first transport calls it before creating its slabs).
        unsafe { rdma_mummy_sys::ibv_fork_init() }
    });
    if rc != 0 {
        tracing::warn!(
            error = %io::Error::from_raw_os_error(rc.abs()),
            "ibv_fork_init failed: children forked by this process must not touch registered memory"
        );
    }
}

/// Checks that this process may lock `need` bytes; [`VerbsError::Memlock`] says how to fix it.
pub fn check_memlock(need: u64) -> Result<(), VerbsError> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the valid pointer it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0 {
        return Ok(());
    }
    // SAFETY: geteuid has no preconditions. Root holds CAP_IPC_LOCK, which lifts the limit.
    let root = unsafe { libc::geteuid() } == 0;
    if root || lim.rlim_cur == libc::RLIM_INFINITY || lim.rlim_cur >= need {
        return Ok(());
    }
    Err(VerbsError::Memlock {
        limit: lim.rlim_cur,
        need,
    })
}

/// Makes a descriptor the caller owns non-blocking (for tokio's reactor).
pub fn set_nonblocking(fd: std::os::fd::RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns, only adding O_NONBLOCK.
    let ok = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
    };
    if ok {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Arms the completion queue: the channel becomes readable at its next completion.
pub fn req_notify(cq: &Arc<BasicCompletionQueue>) -> io::Result<()> {
    // SAFETY: the CQ pointer is valid while `cq` is alive; req_notify_cq only arms it.
    let rc = unsafe { rdma_mummy_sys::ibv_req_notify_cq(cq.cq().as_ptr(), 0) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc.abs()));
    }
    Ok(())
}

/// Takes the pending completion events from a non-blocking channel and acknowledges them;
/// returns how many there were.
pub fn drain_cq_events(channel: &Arc<CompletionChannel>) -> u32 {
    let mut n = 0;
    loop {
        let mut cq: *mut rdma_mummy_sys::ibv_cq = std::ptr::null_mut();
        let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the channel is valid while `channel` is alive and non-blocking, so this
        // returns at once; on success it stores the CQ the event belongs to in `cq`.
        let rc = unsafe {
            rdma_mummy_sys::ibv_get_cq_event(channel.comp_channel().as_ptr(), &mut cq, &mut ctx)
        };
        if rc != 0 || cq.is_null() {
            return n;
        }
        // SAFETY: `cq` was just returned by ibv_get_cq_event for one event; every event must be
        // acknowledged before the CQ is destroyed.
        unsafe { rdma_mummy_sys::ibv_ack_cq_events(cq, 1) };
        n += 1;
    }
}

/// Registers the (non-blocking) completion channel with tokio's reactor.
pub fn watch_channel(
    channel: Arc<CompletionChannel>,
) -> io::Result<tokio::io::unix::AsyncFd<Arc<CompletionChannel>>> {
    // SAFETY: the channel owns its file descriptor and closes it only when dropped; the
    // AsyncFd holds an Arc to it, so the descriptor stays open while registered.
    unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(channel, tokio::io::Interest::READABLE)
    }
    .map_err(|e| io::Error::other(e.to_string()))
}

// `rdma_mummy_sys::ibv_async_event` declares the event type as a Rust enum, which an event
// code unknown to it (a newer rdma-core) would make undefined behaviour to read: this mirror
// of the C struct reads it as a plain integer.
#[repr(C)]
union RawElement {
    ptr: *mut std::ffi::c_void,
    port_num: libc::c_int,
}

#[repr(C)]
struct RawAsyncEvent {
    element: RawElement,
    event_type: u32,
}

/// The device's asynchronous-event descriptor, kept open by the context it belongs to.
pub struct AsyncEventFd(Arc<DeviceContext>);

impl std::os::fd::AsRawFd for AsyncEventFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        // SAFETY: the context pointer is valid while `self.0` lives; async_fd is set at open.
        unsafe { (*self.0.context().as_ptr()).async_fd }
    }
}

/// Makes `ctx`'s asynchronous-event descriptor non-blocking and registers it with tokio.
pub fn watch_async_events(
    ctx: Arc<DeviceContext>,
) -> io::Result<tokio::io::unix::AsyncFd<AsyncEventFd>> {
    use std::os::fd::AsRawFd;
    let fd = AsyncEventFd(ctx);
    set_nonblocking(fd.as_raw_fd())?;
    // SAFETY: the descriptor belongs to the context, which the AsyncFd keeps open (it holds
    // the Arc) for as long as it is registered.
    unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
        .map_err(|e| io::Error::other(e.to_string()))
}

/// The next pending asynchronous event of `ctx` (acknowledged before it is returned), or
/// `None` when there is none (the descriptor must be non-blocking).
pub fn next_async_event(ctx: &DeviceContext) -> Option<AsyncEvent> {
    let mut raw = RawAsyncEvent {
        element: RawElement {
            ptr: std::ptr::null_mut(),
        },
        event_type: 0,
    };
    let event = &mut raw as *mut RawAsyncEvent as *mut rdma_mummy_sys::ibv_async_event;
    // SAFETY: the context is valid while `ctx` lives; `raw` has the C layout of
    // ibv_async_event (a pointer-sized union, then the event type), which the call fills.
    if unsafe { rdma_mummy_sys::ibv_get_async_event(ctx.context().as_ptr(), event) } != 0 {
        return None;
    }
    let code = raw.event_type;
    let (qp_num, port) = match events::scope(code) {
        // SAFETY: for queue-pair events the element is the queue pair, which stays valid until
        // the event is acknowledged (ibv_destroy_qp waits for that).
        Scope::QueuePair => (
            Some(unsafe { (*(raw.element.ptr as *const rdma_mummy_sys::ibv_qp)).qp_num }),
            None,
        ),
        // SAFETY: for port events the element is the port number.
        Scope::Port => (None, u8::try_from(unsafe { raw.element.port_num }).ok()),
        _ => (None, None),
    };
    // SAFETY: acknowledges the event just returned, once, with the layout it was read into.
    unsafe { rdma_mummy_sys::ibv_ack_async_event(event) };
    Some(AsyncEvent { code, qp_num, port })
}
