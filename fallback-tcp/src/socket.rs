use std::io;
use std::net::SocketAddr;

use socket2::SockRef;
use tokio::net::TcpStream;

use crate::config::TcpConfig;

/// Options every psnet connection gets, on both sides.
pub(crate) fn tune(stream: &TcpStream, config: &TcpConfig) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let sock = SockRef::from(stream);
    if let Some(bytes) = config.socket_buffer {
        sock.set_send_buffer_size(bytes)?;
        sock.set_recv_buffer_size(bytes)?;
    }
    let same_host = same_host(stream.local_addr()?, stream.peer_addr()?);
    let (choices, required) = config.congestion.choices(same_host);
    let mut refusals = Vec::new();
    for name in &choices {
        match sock.set_tcp_congestion(name.as_bytes()) {
            Ok(()) => return Ok(()),
            Err(e) => refusals.push(format!("{name}: {e}")),
        }
    }
    if !refusals.is_empty() {
        let refusals = refusals.join("; ");
        if required {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("PSNET_TCP_CONGESTION: the kernel refuses the algorithm ({refusals})"),
            ));
        }
        tracing::debug!(%refusals, "same-host connection keeps the system's congestion control");
    }
    Ok(())
}

/// Whether a connection joins two processes of one host: over loopback, or to this host's
/// own address.
pub(crate) fn same_host(local: SocketAddr, peer: SocketAddr) -> bool {
    peer.ip().is_loopback() || peer.ip() == local.ip()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Congestion;

    fn congestion_of(stream: &TcpStream) -> String {
        let name = SockRef::from(stream).tcp_congestion().unwrap();
        String::from_utf8_lossy(&name)
            .trim_end_matches('\0')
            .to_string()
    }

    async fn pair(config: &TcpConfig) -> (TcpStream, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (dialled, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (dialled, accepted) = (dialled.unwrap(), accepted.unwrap().0);
        tune(&dialled, config).unwrap();
        tune(&accepted, config).unwrap();
        (dialled, accepted)
    }

    #[test]
    fn same_host_is_loopback_or_own_address() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(same_host(a("10.0.0.1:5"), a("127.0.0.1:6")));
        assert!(same_host(a("10.0.0.1:5"), a("10.0.0.1:6")));
        assert!(same_host(a("[::1]:5"), a("[::1]:6")));
        assert!(!same_host(a("10.0.0.1:5"), a("10.0.0.2:6")));
    }

    #[tokio::test]
    async fn same_host_connections_leave_pacing_algorithms() {
        let (dialled, accepted) = pair(&TcpConfig::default()).await;
        for s in [&dialled, &accepted] {
            let name = congestion_of(s);
            assert!(
                name == "cubic" || name == "reno",
                "a loopback connection uses {name}"
            );
        }
    }

    #[tokio::test]
    async fn a_named_algorithm_is_set_or_refused_clearly() {
        let mut config = TcpConfig {
            congestion: Congestion::Named("reno".into()),
            ..TcpConfig::default()
        };
        let (dialled, _accepted) = pair(&config).await;
        assert_eq!(congestion_of(&dialled), "reno");

        config.congestion = Congestion::Named("nosuchalgo".into());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let err = tune(&stream, &config).unwrap_err();
        assert!(err.to_string().contains("nosuchalgo"), "{err}");
        assert!(err.to_string().contains("PSNET_TCP_CONGESTION"), "{err}");
    }
}
