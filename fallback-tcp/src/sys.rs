//! The one `unsafe` operation of the socket paths (the same-host paths keep theirs in
//! `shm::sys`): asking the kernel how much of what was written it still holds.

use std::io;
use std::os::fd::AsFd;

use rustix::ioctl::{ioctl, Getter, Opcode};

/// `SIOCOUTQ` (the same number as `TIOCOUTQ`): bytes written to the socket that the peer has
/// not acknowledged yet, sent or not.
const OUTQ: Opcode = libc::TIOCOUTQ as Opcode;

/// Bytes written to the TCP socket `sock` and not yet acknowledged by the peer's kernel
/// (a FIN counts as one).
pub(crate) fn unacknowledged_bytes(sock: &impl AsFd) -> io::Result<usize> {
    // SAFETY: SIOCOUTQ on a TCP socket writes one `int` through the pointer it is given, and
    // `Getter<_, c_int>` provides exactly that; the descriptor is borrowed for the call.
    let n = unsafe { ioctl(sock, Getter::<OUTQ, libc::c_int>::new()) }?;
    Ok(usize::try_from(n).unwrap_or(0))
}
