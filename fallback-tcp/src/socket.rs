use std::io;

use socket2::SockRef;
use tokio::net::TcpStream;

use crate::config::TcpConfig;

/// Options every psnet connection gets, on both sides.
pub(crate) fn tune(stream: &TcpStream, config: &TcpConfig) -> io::Result<()> {
    stream.set_nodelay(true)?;
    if let Some(bytes) = config.socket_buffer {
        let sock = SockRef::from(stream);
        sock.set_send_buffer_size(bytes)?;
        sock.set_recv_buffer_size(bytes)?;
    }
    Ok(())
}
