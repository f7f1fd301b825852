//! Packed pushes ([`crate::proto::packed`]) unpacked at the server, bounded by the key.

use bytes::Bytes;

use super::{Push, ServerState};
use crate::proto::packed;

impl ServerState {
    /// Unpacks `p`'s packed codes ([`crate::proto::packed`]), bounded by the key's own
    /// codes' size before anything is allocated; a push that was not packed stays as is.
    pub(super) fn unpack(&self, p: &mut Push) -> Result<(), String> {
        if !p.flags.packed {
            return Ok(());
        }
        let want = match (p.flags.compressed, &self.compressor, self.keys.get(&p.key)) {
            (false, ..) => Err("packed codes in a push of uncompressed values".to_string()),
            (_, None, _) => Err("packed codes, but no compression was set on this server".into()),
            (_, _, None) => Err("pushed before it was initialized".into()),
            (true, Some(c), Some(k)) => Ok(c.compressed_len(k.value.len())),
        };
        let codes = want
            .and_then(|len| packed::unpack(&p.payload, len))
            .map_err(|e| format!("key {}: {e}", p.key))?;
        p.payload = Bytes::from(codes);
        p.flags.packed = false;
        Ok(())
    }
}
