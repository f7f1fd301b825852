//! The eager path: a message that fits one buffer (header included) is copied into a send
//! buffer and lands in one of the peer's pre-posted receive buffers.

use psnet_transport::{DeviceError, OutMessage, TransportError};

use super::Link;
use crate::proto::credits::Class;
use crate::proto::wire::{self, Base, Kind};

impl Link {
    /// Sends `msg` in one eager message of `header_len` header bytes and its payload.
    pub(super) async fn send_eager(
        &self,
        msg: OutMessage<'_>,
        header_len: usize,
    ) -> Result<(), TransportError> {
        // Device segments are copied to the host before (`device_send.rs`): one that was not
        // would be written as nothing under a header announcing its length.
        if let Some(device) = msg.segments.iter().find_map(|s| s.device_bytes()) {
            return Err(TransportError::Device {
                peer: self.peer,
                source: DeviceError {
                    ordinal: device.ordinal(),
                    reason: "device memory reached the eager path without being copied".into(),
                },
            });
        }
        self.wait_for(|st| {
            let posted = self.try_post_small(st, Class::Normal, |buf, credits| {
                let base = Base {
                    kind: Kind::Eager,
                    credits,
                    seq: 0,
                };
                let lens = msg.segments.iter().map(|s| s.len() as u64);
                let mut at = wire::put_data_header(buf, base, msg.meta.len() as u32, 0, lens);
                debug_assert_eq!(at, header_len);
                let host = msg.segments.iter().map(|s| s.host().unwrap_or_default());
                for part in std::iter::once(msg.meta).chain(host) {
                    buf[at..at + part.len()].copy_from_slice(part);
                    at += part.len();
                }
                at
            });
            Ok(posted.then_some(()))
        })
        .await
    }
}
