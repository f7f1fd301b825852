//! The link's background tasks: the resender's timers, one sender per peer, and redialling a
//! peer that went away.

use super::*;

/// Runs the resender's timers: resends, acknowledgements, giving peers up.
pub(super) async fn pump<T: Transport>(inner: Arc<Inner<T>>) {
    let r = inner.resend();
    loop {
        let next = {
            let mut s = r.lock();
            let now = crate::clock::now();
            s.resender.handle_timeout(now);
            s.resender.take_wake();
            let mut gave_up = false;
            while let Some(GaveUp { peer, reason }) = s.resender.poll_event() {
                tracing::warn!(peer = %describe(peer), %reason, "PS_RESEND: giving the peer up");
                s.lost.push_back((peer, reason));
                gave_up = true;
            }
            for peer in s.resender.ready_peers(now) {
                if s.senders.insert(peer) {
                    s.spawn(sender(inner.clone(), peer));
                }
            }
            if gave_up {
                r.lost_ready.notify_one();
                r.gave_up.notify_waiters();
                r.window.notify_waiters();
            }
            s.resender.poll_timeout()
        };
        let woken = r.pump.notified();
        match next {
            Some(at) => {
                tokio::select! {
                    _ = woken => {}
                    _ = tokio::time::sleep_until(at.into()) => {}
                }
            }
            None => woken.await,
        }
    }
}

/// Sends what is due for `peer` (resends, acknowledgements) until nothing is.
pub(super) async fn sender<T: Transport>(inner: Arc<Inner<T>>, peer: NodeId) {
    let r = inner.resend();
    loop {
        let tx = {
            let mut s = r.lock();
            match s.resender.poll_transmit_to(peer, crate::clock::now()) {
                Some(tx) => tx,
                None => {
                    s.senders.remove(&peer);
                    return;
                }
            }
        };
        match tx.seq {
            Some(seq) => tracing::debug!(to = %describe(peer), seq, "PS_RESEND: resending"),
            None => tracing::trace!(to = %describe(peer), ack = tx.ack, "ack"),
        }
        if let Err(KvError::Transport(TransportError::Closed)) = inner.transmit(tx).await {
            r.lock().senders.remove(&peer);
            return;
        }
    }
}

/// Redials `peer` until connected, the deadline, or the transport closes.
pub(super) async fn reconnect<T: Transport>(
    inner: Arc<Inner<T>>,
    peer: NodeId,
    addr: SocketAddr,
    deadline: Instant,
) {
    let r = inner.resend();
    let mut backoff = Duration::from_millis(10);
    loop {
        {
            let mut s = r.lock();
            if !s.resender.is_down(peer) {
                // Back (it dialled us) or given up.
                s.reconnecting.remove(&peer);
                return;
            }
        }
        let attempt = tokio::time::timeout_at(deadline.into(), inner.t.redial(peer, addr)).await;
        {
            let mut s = r.lock();
            match attempt {
                Ok(Ok(())) => {
                    tracing::info!(peer = %describe(peer), "connection re-established (PS_RESEND)");
                    s.resender.handle_peer_connected(peer);
                    inner.kick(&mut s, peer, crate::clock::now());
                    s.reconnecting.remove(&peer);
                    return;
                }
                // Nobody listens at its address any more: its process is gone, and waiting
                // out PS_RESEND's give-up time would only delay every survivor's error.
                Ok(Err(TransportError::Connect { source, .. }))
                    if source.kind() == std::io::ErrorKind::ConnectionRefused =>
                {
                    let reason =
                        format!("its address {addr} refuses connections: the process is gone");
                    tracing::info!(peer = %describe(peer), %reason, "giving the peer up");
                    s.resender.fail_peer(peer, reason);
                    s.reconnecting.remove(&peer);
                    r.wake(&mut s);
                    return;
                }
                Ok(Err(e)) if !matches!(e, TransportError::Closed) => {
                    tracing::debug!(peer = %describe(peer), %addr, error = %e, "reconnect failed, retrying");
                    if crate::clock::now() + backoff >= deadline {
                        s.reconnecting.remove(&peer);
                        return;
                    }
                }
                // Closed, or out of time: the timers give the peer up.
                _ => {
                    s.reconnecting.remove(&peer);
                    return;
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}
