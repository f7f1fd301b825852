//! libibverbs: the calls `sideway` does not wrap (fork support, completion events,
//! asynchronous events), completion polling, and posting work requests on a queue pair
//! ([`QueuePair`]): the only place that names memory to the NIC.

use std::io;
use std::sync::{Arc, OnceLock};

use rdma_mummy_sys::ibv_sge;
use sideway::ibverbs::completion::{
    BasicCompletionQueue, CompletionChannel, CompletionQueue, PollCompletionQueueError,
};
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::queue_pair::{
    GenericQueuePair, ModifyQueuePairError, PostRecvError, PostSendError, PostSendGuard,
    QueuePair as _, QueuePairAttribute, SetInlineData, SetScatterGatherEntry, WorkRequestFlags,
};
use smallvec::SmallVec;

use super::memory::{Region, Slab, Slot};
use super::os::set_nonblocking;
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

/// Work-request indices (and the link's rendezvous sequence numbers) fill 28 bits of an id.
pub(crate) const INDEX_MASK: u32 = 0x0FFF_FFFF;

/// What a work request was, encoded in its id with the link and an index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WrKind {
    Recv = 1,
    Send = 2,
    Write = 3,
}

impl WrKind {
    /// The kind's name, as errors print it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            WrKind::Recv => "Recv",
            WrKind::Send => "Send",
            WrKind::Write => "Write",
        }
    }
}

/// Builds a work-request id.
pub(crate) fn wr_id(link: u32, kind: WrKind, index: u32) -> u64 {
    ((link as u64) << 32) | ((kind as u64) << 28) | (index & INDEX_MASK) as u64
}

/// Splits a work-request id into link, kind and index.
pub(crate) fn split_wr_id(id: u64) -> (u32, Option<WrKind>, u32) {
    let kind = match (id >> 28) & 0xF {
        1 => Some(WrKind::Recv),
        2 => Some(WrKind::Send),
        3 => Some(WrKind::Write),
        _ => None,
    };
    ((id >> 32) as u32, kind, id as u32 & INDEX_MASK)
}

/// One work completion as the completion queue reported it. Only [`poll`] makes them, so one
/// is proof that the NIC is done with the work request it names ([`Slab::completed`] relies
/// on that).
#[derive(Debug)]
pub(crate) struct WorkCompletion {
    wr_id: u64,
    status: u32,
    opcode: u32,
    byte_len: u32,
    imm: u32,
}

impl WorkCompletion {
    /// The work request's id.
    pub(crate) fn wr_id(&self) -> u64 {
        self.wr_id
    }

    /// The `ibv_wc_status` (0: success).
    pub(crate) fn status(&self) -> u32 {
        self.status
    }

    /// The `ibv_wc_opcode`.
    pub(crate) fn opcode(&self) -> u32 {
        self.opcode
    }

    /// Bytes received.
    pub(crate) fn byte_len(&self) -> u32 {
        self.byte_len
    }

    /// The immediate data, as it arrived (network byte order).
    pub(crate) fn imm(&self) -> u32 {
        self.imm
    }
}

/// Hands every completion waiting in `cq` to `each`, until the queue is empty; returns how
/// many there were.
pub(crate) fn poll(cq: &BasicCompletionQueue, mut each: impl FnMut(WorkCompletion)) -> usize {
    let mut handled = 0;
    loop {
        let poller = match cq.start_poll() {
            Ok(p) => p,
            Err(PollCompletionQueueError::CompletionQueueEmpty) => break,
            Err(e) => {
                tracing::error!(error = %e, "polling the completion queue failed");
                break;
            }
        };
        for wc in poller {
            handled += 1;
            each(WorkCompletion {
                wr_id: wc.wr_id(),
                status: wc.status(),
                opcode: wc.opcode(),
                byte_len: wc.byte_len(),
                imm: wc.imm_data(),
            });
        }
    }
    handled
}

/// One RDMA write: gather entries `first..end` (`bytes` in all), into the peer's memory at
/// `remote` under `rkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WriteGroup {
    pub first: usize,
    pub end: usize,
    pub bytes: u64,
    pub rkey: u32,
    pub remote: u64,
}

/// The local memory a chain of RDMA writes reads: (address, length, key) entries, in order.
#[derive(Clone, Default)]
pub(crate) struct Gather {
    sges: SmallVec<[ibv_sge; 4]>,
}

impl Gather {
    /// Appends `bytes` (at most 4 GiB - 1), registered under `lkey`.
    pub(crate) fn push(&mut self, bytes: &[u8], lkey: u32) {
        let length = u32::try_from(bytes.len()).expect("one gather entry is below 4 GiB");
        self.sges.push(ibv_sge {
            addr: bytes.as_ptr() as u64,
            length,
            lkey,
        });
    }

    /// Appends `len` bytes (at most 4 GiB - 1) at `addr` in a registration's address space
    /// (device memory registered with the NIC), under `lkey`.
    pub(crate) fn push_device(&mut self, addr: u64, len: usize, lkey: u32) {
        let length = u32::try_from(len).expect("one gather entry is below 4 GiB");
        self.sges.push(ibv_sge { addr, length, lkey });
    }

    /// Entries in the list.
    pub(crate) fn len(&self) -> usize {
        self.sges.len()
    }

    /// The entries' lengths, in order.
    pub(crate) fn lens(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.sges.iter().map(|s| s.length as u64)
    }

    /// Bytes in all entries.
    pub(crate) fn total(&self) -> u64 {
        self.lens().sum()
    }
}

/// A queue pair, and the registered memory its work requests name: every [`Slab`] it posted
/// from stays registered and allocated until the queue pair is destroyed (dropped first).
pub(crate) struct QueuePair {
    qp: GenericQueuePair,
    keep: SmallVec<[Arc<Region>; 2]>,
}

impl QueuePair {
    /// Wraps a queue pair just created.
    pub(crate) fn new(qp: GenericQueuePair) -> QueuePair {
        QueuePair {
            qp,
            keep: SmallVec::new(),
        }
    }

    /// The queue pair's number.
    pub(crate) fn qp_number(&self) -> u32 {
        self.qp.qp_number()
    }

    /// Moves the queue pair to another state (`ibv_modify_qp`).
    pub(crate) fn modify(&mut self, attr: &QueuePairAttribute) -> Result<(), ModifyQueuePairError> {
        self.qp.modify(attr)
    }

    fn keep(&mut self, slab: &Slab) {
        let region = slab.region();
        if !self.keep.iter().any(|r| Arc::ptr_eq(r, region)) {
            self.keep.push(region.clone());
        }
    }

    /// Posts a receive into receive buffer `slot`, which belongs to the NIC until its
    /// completion gives it back ([`Slab::completed`]); on failure the slot comes back.
    pub(crate) fn post_recv(
        &mut self,
        slab: &Slab,
        slot: Slot,
    ) -> Result<(), (Slot, PostRecvError)> {
        assert_eq!(
            slab.kind(),
            WrKind::Recv,
            "receives are posted from a receive slab"
        );
        self.keep(slab);
        let (addr, lkey, index) = slab.lend(slot);
        let mut guard = self.qp.start_post_recv();
        let wr = guard.construct_wr(wr_id(slab.link(), WrKind::Recv, index));
        // SAFETY: the buffer lies in `slab`'s registered region, which this queue pair keeps
        // (`keep`) until it is destroyed; the slot was lent, so no CPU access reaches it until
        // the receive's completion returns it.
        unsafe { wr.setup_sge(lkey, addr, slab.slot_size() as u32) };
        guard.post().map_err(|e| (slab.unlend(index), e))
    }

    /// Sends the first `len` bytes of send buffer `slot` (signalled), which belongs to the NIC
    /// until the send's completion gives it back ([`Slab::completed`]).
    pub(crate) fn post_send(
        &mut self,
        slab: &Slab,
        slot: Slot,
        len: usize,
    ) -> Result<(), PostSendError> {
        assert_eq!(
            slab.kind(),
            WrKind::Send,
            "sends are posted from a send slab"
        );
        assert!(len <= slab.slot_size(), "a send fits its buffer");
        self.keep(slab);
        let (addr, lkey, index) = slab.lend(slot);
        let mut guard = self.qp.start_post_send();
        let wr = guard
            .construct_wr(
                wr_id(slab.link(), WrKind::Send, index),
                WorkRequestFlags::Signaled,
            )
            .setup_send();
        // SAFETY: as in `post_recv`: the bytes lie in a region this queue pair keeps, and the
        // lent slot is not written until the completion returns it.
        unsafe { wr.setup_sge(lkey, addr, len as u32) };
        // Not posted: the buffer is idle again. Its slot is not handed back; the link fails.
        guard.post().inspect_err(|_| {
            let _idle = slab.unlend(index);
        })
    }

    /// Sends `bytes` inline (signalled): they are copied into the work request at once.
    pub(crate) fn post_send_inline(
        &mut self,
        wr_id: u64,
        bytes: &[u8],
    ) -> Result<(), PostSendError> {
        let mut guard = self.qp.start_post_send();
        guard
            .construct_wr(wr_id, WorkRequestFlags::Signaled)
            .setup_send()
            .setup_inline_data(bytes);
        guard.post()
    }

    /// Posts one RDMA write per group of `gather`'s entries ([`WriteGroup`]: its entries, into
    /// the peer's memory at its address under its key); the last is signalled and carries
    /// `imm` (WRITE WITH IMMEDIATE) if given. All carry `wr_id`.
    ///
    /// The gather names memory by address, so this is where sys trusts its caller: the link
    /// keeps every entry's memory valid until the last write completes or the link fails.
    /// Registrations are held by the send (`OutRndv`) until then; bytes borrowed from the
    /// application by the send's future, whose abandonment fails the link (moving the queue
    /// pair to ERROR) before the borrow ends. A send future that is leaked rather than
    /// dropped ends the borrow without that; the transport contract's zero-copy send cannot
    /// rule it out.
    pub(crate) fn post_writes(
        &mut self,
        wr_id: u64,
        gather: &Gather,
        groups: &[WriteGroup],
        imm: Option<u32>,
    ) -> Result<(), PostSendError> {
        let mut guard = self.qp.start_post_send();
        for (n, g) in groups.iter().enumerate() {
            let last = n + 1 == groups.len();
            let flags = if last {
                WorkRequestFlags::Signaled
            } else {
                WorkRequestFlags::none()
            };
            let wr = guard.construct_wr(wr_id, flags);
            let wr = match imm {
                Some(imm) if last => wr.setup_write_imm(g.rkey, g.remote, imm.to_be()),
                _ => wr.setup_write(g.rkey, g.remote),
            };
            // SAFETY: the entries point into memory the caller keeps valid until the writes
            // complete (see above); the NIC only reads it, and checks each key against its
            // registration.
            unsafe { wr.setup_sge_list(&gather.sges[g.first..g.end]) };
        }
        guard.post()
    }
}
