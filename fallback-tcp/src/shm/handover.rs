//! Handing shared memory to a peer on this host: by descriptor, never by name.
//!
//! The offering side makes anonymous memory files (and, for the queue, an eventfd), listens on
//! a one-shot Unix socket in the abstract namespace and sends the descriptors (`SCM_RIGHTS`)
//! to the first connection from the same user that presents the offer's random token. The
//! offer itself (size, cookie, token, socket name) crosses the TCP connection. Nothing is
//! left in any file system, so a `kill -9` leaves nothing behind; a peer on another host or
//! in another network namespace cannot reach the socket and declines.

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::time::Duration;

use psnet_transport::le::{LeReader, LeWriter};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use tokio::io::AsyncReadExt;
use tokio::task::AbortHandle;

/// Bytes of the token that fetches the descriptors.
pub(crate) const TOKEN: usize = 16;
/// Longest abstract socket name an offer may carry.
const MAX_NAME: usize = 64;
/// How long the handover of descriptors may take, on either side.
const HANDOVER: Duration = Duration::from_secs(5);
/// The seals a memory file must carry before it is mapped: its size is fixed for good.
pub(crate) const REQUIRED_SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW);
/// Most descriptors one offer hands over.
const MAX_FDS: usize = 2;

/// `N` random bytes from the system.
pub(crate) fn random<const N: usize>() -> io::Result<[u8; N]> {
    let mut b = [0u8; N];
    let mut filled = 0;
    while filled < N {
        filled += rustix::rand::getrandom(&mut b[filled..], rustix::rand::GetRandomFlags::empty())?;
    }
    Ok(b)
}

/// A new memory file of `size` bytes, its pages allocated now (so that a lack of memory is an
/// error here, not a fault later), sealed against shrinking and growing.
pub(crate) fn sealed_memfd(name: &str, size: usize) -> io::Result<File> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    rustix::fs::fallocate(&fd, rustix::fs::FallocateFlags::empty(), 0, size as u64)?;
    rustix::fs::fcntl_add_seals(&fd, REQUIRED_SEALS | SealFlags::SEAL)?;
    Ok(File::from(fd))
}

/// Checks that a handed-over descriptor is a memory file sealed against resizing, of `size`
/// bytes: only such a file can be mapped without a truncation turning reads into SIGBUS.
pub(crate) fn check_sealed(fd: OwnedFd, size: u64, what: &str) -> io::Result<File> {
    let bad = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
    // Anything but a memory file (a regular file, a device) has no seals at all.
    let seals = rustix::fs::fcntl_get_seals(&fd)
        .map_err(|_| bad(format!("the {what} is not a sealed memory file")))?;
    if !seals.contains(REQUIRED_SEALS) {
        return Err(bad(format!(
            "the {what} is not sealed against shrinking and growing"
        )));
    }
    if rustix::fs::fstat(&fd)?.st_size as u64 != size {
        return Err(bad(format!("the {what} has the wrong size")));
    }
    Ok(File::from(fd))
}

/// What an offer says: the memory's size and cookie, and where and how to fetch it.
pub(crate) struct Offer {
    pub(crate) size: u64,
    pub(crate) cookie: u64,
    pub(crate) token: [u8; TOKEN],
    pub(crate) name: Vec<u8>,
}

impl Offer {
    /// The offer's body: size, cookie, token, then the abstract socket's name.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = LeWriter::with_capacity(16 + TOKEN + self.name.len());
        w.u64(self.size)
            .u64(self.cookie)
            .bytes(&self.token)
            .bytes(&self.name);
        w.into_vec()
    }

    /// Parses an offer's body.
    pub(crate) fn parse(body: &[u8]) -> io::Result<Offer> {
        let bad = || io::Error::new(io::ErrorKind::InvalidData, "malformed shared-memory offer");
        if body.len() < 16 + TOKEN + 1 || body.len() > 16 + TOKEN + MAX_NAME {
            return Err(bad());
        }
        let mut r = LeReader::new(body);
        let size = r.u64().map_err(|_| bad())?;
        let cookie = r.u64().map_err(|_| bad())?;
        let token = r.array().map_err(|_| bad())?;
        Ok(Offer {
            size,
            cookie,
            token,
            name: r.rest().to_vec(),
        })
    }

    /// Connects to the offering peer's socket, presents the token and receives `count`
    /// descriptors, within a bounded time.
    pub(crate) async fn fetch(&self, count: usize) -> io::Result<Vec<OwnedFd>> {
        let (name, token) = (self.name.clone(), self.token);
        let fetch = tokio::task::spawn_blocking(move || fetch_descriptors(&name, &token));
        let fds = match tokio::time::timeout(HANDOVER, fetch).await {
            Ok(Ok(fds)) => fds?,
            Ok(Err(e)) => return Err(io::Error::other(e)),
            Err(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the peer did not hand over its shared memory in time",
                ))
            }
        };
        if fds.len() != count {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} descriptors handed over, {count} expected", fds.len()),
            ));
        }
        Ok(fds)
    }
}

/// Serves `fds` once to whoever presents the token of the returned offer (size and cookie
/// as given); the task stops when aborted through the handle. Needs a tokio runtime.
pub(crate) fn serve(
    fds: Vec<OwnedFd>,
    size: u64,
    cookie: u64,
    prefix: &str,
) -> io::Result<(Offer, AbortHandle)> {
    let token = random::<TOKEN>()?;
    let name = format!("{prefix}-{:032x}", u128::from_le_bytes(random::<16>()?)).into_bytes();
    let listener = UnixListener::bind_addr(&UnixAddr::from_abstract_name(&name)?)?;
    listener.set_nonblocking(true)?;
    let listener = tokio::net::UnixListener::from_std(listener)?;
    let task = tokio::spawn(hand_over(listener, fds, token));
    let offer = Offer {
        size,
        cookie,
        token,
        name,
    };
    Ok((offer, task.abort_handle()))
}

/// Serves the descriptors once: to the first connection from this user that presents the
/// token. Anyone else is refused and logged; the task ends after the handover, when aborted,
/// or when nobody asked in time.
async fn hand_over(listener: tokio::net::UnixListener, fds: Vec<OwnedFd>, token: [u8; TOKEN]) {
    let me = rustix::process::getuid();
    let deadline = tokio::time::Instant::now() + HANDOVER * 2;
    loop {
        let Ok(Ok((mut stream, _))) = tokio::time::timeout_at(deadline, listener.accept()).await
        else {
            return;
        };
        let same_user = stream.peer_cred().is_ok_and(|c| c.uid() == me.as_raw());
        if !same_user {
            tracing::warn!("refused a shared-memory request from another user");
            continue;
        }
        let mut got = [0u8; TOKEN];
        let read = tokio::time::timeout(HANDOVER, stream.read_exact(&mut got)).await;
        let valid = matches!(read, Ok(Ok(_)))
            && got.iter().zip(&token).fold(0u8, |a, (x, y)| a | (x ^ y)) == 0;
        if !valid {
            tracing::warn!("refused a shared-memory request without the offer's token");
            continue;
        }
        let sent = tokio::time::timeout(
            HANDOVER,
            stream.async_io(tokio::io::Interest::WRITABLE, || {
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
                let mut control = SendAncillaryBuffer::new(&mut space);
                let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
                control.push(SendAncillaryMessage::ScmRights(&borrowed));
                rustix::net::sendmsg(
                    &stream,
                    &[IoSlice::new(&[1])],
                    &mut control,
                    SendFlags::empty(),
                )
                .map_err(io::Error::from)
            }),
        )
        .await;
        if !matches!(sent, Ok(Ok(1))) {
            tracing::debug!(?sent, "shared-memory descriptors not handed over");
        }
        return;
    }
}

/// Connects to the peer's abstract socket `name`, presents `token` and receives the
/// descriptors. Blocking, with timeouts: runs on the blocking pool.
pub(crate) fn fetch_descriptors(name: &[u8], token: &[u8; TOKEN]) -> io::Result<Vec<OwnedFd>> {
    let mut stream = UnixStream::connect_addr(&UnixAddr::from_abstract_name(name)?)?;
    stream.set_read_timeout(Some(HANDOVER))?;
    stream.set_write_timeout(Some(HANDOVER))?;
    let peer = rustix::net::sockopt::socket_peercred(&stream)?;
    if peer.uid != rustix::process::getuid() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "the shared memory's socket belongs to another user",
        ));
    }
    stream.write_all(token)?;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    rustix::net::recvmsg(
        &stream,
        &mut [IoSliceMut::new(&mut byte)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    // Descriptors beyond MAX_FDS were cut off by the kernel (MSG_CTRUNC) and never opened.
    let fds: Vec<OwnedFd> = control
        .drain()
        .filter_map(|m| match m {
            RecvAncillaryMessage::ScmRights(fds) => Some(fds),
            _ => None,
        })
        .flatten()
        .collect();
    if fds.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "no descriptor handed over",
        ));
    }
    Ok(fds)
}
