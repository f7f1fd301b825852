//! Setting up the two ends of a measurement: server, client, or both in one process.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::mpsc;
use std::thread::JoinHandle;

use psnet::config::NodeAddress;
use psnet::transport::{Event, Incoming, NodeId, OutMessage, Segment, Transport};
use psnet::{bind, AnyTransport, Selection, TransportPref};

use crate::protocol::Control;
use crate::server;

/// The server's node id.
pub const SERVER_ID: NodeId = NodeId(1);
/// The client's node id.
pub const CLIENT_ID: NodeId = NodeId(2);

/// Errors of a measurement, as text for the user.
pub(crate) type PerfResult<T> = Result<T, String>;

/// A current-thread runtime: each end of a measurement runs on one thread, like one process
/// of perftest.
pub fn runtime() -> PerfResult<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
}

/// The selection for an explicit loopback run.
pub fn loopback_selection(pref: Option<TransportPref>) -> PerfResult<Selection> {
    let address = NodeAddress {
        ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
        interface: Some("lo".into()),
        reason: "--loopback".into(),
    };
    Selection::for_address(address, pref).map_err(|e| e.to_string())
}

/// Starts a server thread on `selection` and `port`; returns its address once it listens.
pub fn spawn_server(
    selection: Selection,
    port: u16,
) -> PerfResult<(SocketAddr, JoinHandle<PerfResult<()>>)> {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::Builder::new()
        .name("psnet-perf-server".into())
        .spawn(move || -> PerfResult<()> {
            let rt = runtime()?;
            rt.block_on(async {
                let transport = match bind(SERVER_ID, &selection, port).await {
                    Ok(t) => t,
                    Err(e) => {
                        let msg = format!("server: {e}");
                        let _ = tx.send(Err(msg.clone()));
                        return Err(msg);
                    }
                };
                let _ = tx.send(Ok(transport.listen_addr()));
                server::serve_one_client(&transport).await
            })
        })
        .map_err(|e| format!("cannot start the server thread: {e}"))?;
    let addr = rx
        .recv()
        .map_err(|_| "the server thread died before listening".to_string())??;
    Ok((addr, handle))
}

/// A client connected to the server at `server`.
pub async fn connect_client(selection: &Selection, server: SocketAddr) -> PerfResult<AnyTransport> {
    let transport = bind(CLIENT_ID, selection, 0)
        .await
        .map_err(|e| format!("client: {e}"))?;
    transport
        .connect(SERVER_ID, server)
        .await
        .map_err(|e| format!("cannot reach the server: {e}"))?;
    Ok(transport)
}

/// Sends a control message with an optional payload.
pub async fn send_control<T: Transport>(
    t: &T,
    to: NodeId,
    control: Control,
    payload: &[u8],
) -> PerfResult<()> {
    let meta = control.encode();
    let segs = [Segment::new(payload)];
    let segs: &[Segment<'_>] = if payload.is_empty() { &[] } else { &segs };
    t.send(to, OutMessage::new(&meta, segs))
        .await
        .map_err(|e| e.to_string())
}

/// The next message, skipping connection events; a lost peer is an error.
pub async fn next_message<T: Transport>(t: &T) -> PerfResult<(Control, Incoming)> {
    loop {
        match t.recv().await.map_err(|e| e.to_string())? {
            Event::Message(m) => return Ok((Control::decode(&m.meta)?, m)),
            Event::PeerConnected { .. } => continue,
            Event::PeerLost { peer, reason } => return Err(format!("{peer} lost: {reason}")),
        }
    }
}

/// Waits for `Ready`.
pub async fn expect_ready<T: Transport>(t: &T) -> PerfResult<()> {
    match next_message(t).await?.0 {
        Control::Ready => Ok(()),
        other => Err(format!("expected Ready from the server, got {other:?}")),
    }
}
