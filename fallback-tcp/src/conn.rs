//! One established connection: the write half behind a fair lock, and a handle to force it shut.

use std::io::{self, IoSlice};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use psnet_transport::codec::HeaderBuf;
use psnet_transport::{NodeId, Segment};
use smallvec::SmallVec;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::task::AbortHandle;

/// Most buffers one `writev` takes (Linux's IOV_MAX).
const IOV_MAX: usize = 1024;

pub(crate) struct Conn {
    pub(crate) peer: NodeId,
    /// Whether this side dialled (the simultaneous-connect rule needs to know).
    pub(crate) dialed_by_us: bool,
    /// Tokio's mutex is FIFO, so concurrent senders are served in arrival order.
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    /// A duplicate of the socket, to shut it down from synchronous code while a send may hold
    /// the writer.
    control: std::net::TcpStream,
    broken: AtomicBool,
    reader: Mutex<Option<AbortHandle>>,
}

impl Conn {
    pub(crate) fn new(
        peer: NodeId,
        dialed_by_us: bool,
        writer: OwnedWriteHalf,
        control: std::net::TcpStream,
    ) -> Self {
        Conn {
            peer,
            dialed_by_us,
            writer: tokio::sync::Mutex::new(writer),
            control,
            broken: AtomicBool::new(false),
            reader: Mutex::new(None),
        }
    }

    pub(crate) fn set_reader(&self, handle: AbortHandle) {
        *self.reader.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
    }

    pub(crate) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Shuts the socket down both ways: pending and later writes fail, the reader sees the end.
    pub(crate) fn close(&self) {
        self.broken.store(true, Ordering::Release);
        let _ = self.control.shutdown(Shutdown::Both);
    }

    /// Stops the reader task too (transport shutdown).
    pub(crate) fn close_and_stop_reader(&self) {
        self.close();
        if let Some(h) = self.reader.lock().unwrap_or_else(|p| p.into_inner()).take() {
            h.abort();
        }
    }

    /// Writes one frame (header, metadata, segments) with vectored writes straight from the
    /// caller's buffers.
    pub(crate) async fn write_frame(
        &self,
        header: &HeaderBuf,
        meta: &[u8],
        segments: &[Segment<'_>],
    ) -> io::Result<()> {
        let mut slices: SmallVec<[IoSlice<'_>; 8]> = SmallVec::new();
        slices.push(IoSlice::new(header));
        if !meta.is_empty() {
            slices.push(IoSlice::new(meta));
        }
        slices.extend(
            segments
                .iter()
                .filter(|s| !s.is_empty())
                .map(|s| IoSlice::new(s.bytes())),
        );
        let mut writer = self.writer.lock().await;
        if self.is_broken() {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "connection closed",
            ));
        }
        let mut guard = PartialWriteGuard {
            conn: self,
            started: false,
            done: false,
        };
        let mut rest: &mut [IoSlice<'_>] = &mut slices;
        while !rest.is_empty() {
            let batch = rest.len().min(IOV_MAX);
            let n = match writer.write_vectored(&rest[..batch]).await {
                Ok(0) => Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "socket wrote 0 bytes",
                )),
                other => other,
            }
            .inspect_err(|_| self.close())?;
            guard.started = true;
            IoSlice::advance_slices(&mut rest, n);
        }
        guard.done = true;
        Ok(())
    }
}

/// If a send is dropped after writing part of a frame, the stream can no longer be parsed by
/// the peer: close the connection so both sides see a clean loss instead of garbage.
struct PartialWriteGuard<'a> {
    conn: &'a Conn,
    started: bool,
    done: bool,
}

impl Drop for PartialWriteGuard<'_> {
    fn drop(&mut self) {
        if self.started && !self.done {
            self.conn.close();
        }
    }
}
