//! The reference: the plainest possible TCP stream, blocking `write`/`read` of 1 MiB chunks on
//! one socket with `TCP_NODELAY`. psnet's bandwidth is quoted as a ratio to this, measured in
//! the same run.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::session::PerfResult;

/// The chunk the reference reads and writes.
pub const CHUNK: usize = 1 << 20;

/// Starts the reference sink: per test, reads an 8-byte total, then that many bytes in 1 MiB
/// reads, then answers one byte. Serves one connection, until it closes.
pub fn spawn_sink(addr: SocketAddr) -> PerfResult<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(addr)
        .map_err(|e| format!("baseline sink cannot listen on {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let handle = std::thread::Builder::new()
        .name("raw-tcp-sink".into())
        .spawn(move || {
            if let Ok((mut s, _)) = listener.accept() {
                let _ = s.set_nodelay(true);
                let mut buf = vec![0u8; CHUNK];
                let mut total = [0u8; 8];
                while s.read_exact(&mut total).is_ok() {
                    let mut left = u64::from_le_bytes(total);
                    while left > 0 {
                        let want = left.min(CHUNK as u64) as usize;
                        match s.read(&mut buf[..want]) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => left -= n as u64,
                        }
                    }
                    if s.write_all(&[1]).is_err() {
                        return;
                    }
                }
            }
        })
        .map_err(|e| e.to_string())?;
    Ok((local, handle))
}

/// A connection to the sink.
pub struct RawClient {
    stream: TcpStream,
    chunk: Vec<u8>,
}

impl RawClient {
    /// Connects (retrying briefly while the sink starts).
    pub fn connect(addr: SocketAddr) -> PerfResult<Self> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let stream = loop {
            match TcpStream::connect(addr) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => {
                    return Err(format!("baseline: cannot reach the sink at {addr}: {e}"))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        Ok(RawClient {
            stream,
            chunk: vec![0x5a; CHUNK],
        })
    }

    /// Streams `total` bytes and waits for the sink's answer; returns the elapsed time.
    pub fn stream(&mut self, total: u64) -> PerfResult<Duration> {
        let io = |e: std::io::Error| format!("baseline stream: {e}");
        let start = Instant::now();
        self.stream.write_all(&total.to_le_bytes()).map_err(io)?;
        let mut left = total;
        while left > 0 {
            let n = left.min(CHUNK as u64) as usize;
            self.stream.write_all(&self.chunk[..n]).map_err(io)?;
            left -= n as u64;
        }
        let mut ack = [0u8; 1];
        self.stream.read_exact(&mut ack).map_err(io)?;
        Ok(start.elapsed())
    }
}
