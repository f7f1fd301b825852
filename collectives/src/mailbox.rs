//! Everything the transport delivers, sorted for the calls that will take it: the one task
//! that reads the transport files each message under its communicator and call number, and
//! notes lost peers, aborts and malformed messages. A rank may run ahead of another by a call
//! or so; its messages wait here until this rank makes that call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use psnet_transport::{Event, NodeId, Transport};
use tokio::sync::Notify;

use crate::wire::{Header, Kind};

/// A message as it arrived.
#[derive(Debug)]
pub(crate) struct Arrival {
    pub from: NodeId,
    pub header: Header,
    pub data: Bytes,
}

/// What the reading task found, behind one lock.
#[derive(Debug, Default)]
pub(crate) struct Mail {
    /// Data messages per communicator and call number.
    pub calls: HashMap<(u32, u64), Vec<Arrival>>,
    /// Joining messages (hello, table), in arrival order.
    pub joining: Vec<Arrival>,
    /// Peers whose connection was lost, and why.
    pub lost: HashMap<NodeId, String>,
    /// Communicators a peer aborted: who, and why.
    pub aborted: HashMap<u32, (NodeId, String)>,
    /// Peers that sent something unreadable, and what.
    pub malformed: HashMap<NodeId, String>,
    /// The transport closed, and why.
    pub closed: Option<String>,
}

/// The mail, and a signal for every change to it.
#[derive(Debug, Default)]
pub(crate) struct Mailbox {
    mail: Mutex<Mail>,
    /// Signalled whenever the mail changes.
    pub changed: Notify,
}

impl Mailbox {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Mail> {
        self.mail.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Reads `transport` until it closes, filing what arrives in `mailbox`.
pub(crate) async fn read_all<T: Transport>(transport: Arc<T>, mailbox: Arc<Mailbox>) {
    loop {
        let event = transport.recv().await;
        let mut mail = mailbox.lock();
        match event {
            Ok(Event::Message(m)) => match Header::decode(&m.meta) {
                Ok(header) if m.segments.len() <= 1 => {
                    let data = m.segments.into_iter().next().unwrap_or_default();
                    let arrival = Arrival {
                        from: m.peer,
                        header,
                        data,
                    };
                    match header.kind {
                        Kind::Data => mail
                            .calls
                            .entry((header.comm, header.seq))
                            .or_default()
                            .push(arrival),
                        Kind::Abort => {
                            let why = String::from_utf8_lossy(&arrival.data).into_owned();
                            mail.aborted.entry(header.comm).or_insert((m.peer, why));
                        }
                        Kind::Hello | Kind::Table => mail.joining.push(arrival),
                    }
                }
                Ok(_) => {
                    mail.malformed.entry(m.peer).or_insert_with(|| {
                        format!("a message of {} segments (one at most)", m.segments.len())
                    });
                }
                Err(e) => {
                    mail.malformed.entry(m.peer).or_insert(e);
                }
            },
            Ok(Event::PeerLost { peer, reason }) => {
                mail.lost.insert(peer, reason);
            }
            // A collective's messages lost with a connection are not sent again: a peer lost
            // once stays lost for every call, even if it connects again.
            Ok(Event::PeerConnected { .. }) => continue,
            Err(e) => {
                mail.closed = Some(e.to_string());
                drop(mail);
                mailbox.changed.notify_waiters();
                return;
            }
        }
        drop(mail);
        mailbox.changed.notify_waiters();
    }
}
