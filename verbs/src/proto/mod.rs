//! The verbs protocol as plain types, free of I/O (quinn-proto's lesson): the message header
//! codec, credit accounting, where a large message's bytes go in the receiver, standing offers, in-order delivery and connection set-up (the
//! handshakes' state machines). The transport only moves bytes between these types and the
//! queue pairs, so all of this is tested without an RDMA device.

pub mod credits;
pub mod destination;
pub mod handshake;
pub mod offers;
pub mod order;
pub mod wire;
