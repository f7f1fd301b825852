//! The operating system's side: the memory-lock limit RDMA registrations count against,
//! non-blocking descriptors, the page size.

use std::io;
use std::os::fd::RawFd;

use crate::error::VerbsError;

/// Checks that this process may lock `need` bytes; [`VerbsError::Memlock`] says how to fix it.
pub(crate) fn check_memlock(need: u64) -> Result<(), VerbsError> {
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
pub(crate) fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns, only adding O_NONBLOCK; an invalid
    // descriptor makes it fail with EBADF, nothing worse.
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

/// The host page size.
#[cfg(feature = "cuda")]
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(page)
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}
