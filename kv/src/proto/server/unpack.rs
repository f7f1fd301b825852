//! Packed pushes ([`crate::proto::packed`]) at the server: checked against the key before
//! they wait for a later round or are unpacked, and unpacked bounded by the key.

use bytes::Bytes;

use super::{Push, ServerState};
use crate::proto::packed;
use crate::value::Dtype;

impl ServerState {
    /// What a packed push must be before it waits for a later round or is unpacked: its
    /// count, rank and type the key's, codes of a job with compression and an `f32` key, and
    /// no more bytes than the key's codes and one (the most packing makes), so that a push
    /// held packed never holds more than an unpacked one would.
    pub(super) fn check_packed(&self, p: &Push) -> Result<(), String> {
        let key = p.key;
        let k = self.check_meta(p)?;
        let c = match (p.flags.compressed, &self.compressor) {
            (false, _) => {
                return Err(format!(
                    "key {key}: packed codes in a push of uncompressed values"
                ))
            }
            (true, None) => {
                return Err(format!(
                    "key {key}: packed codes, but no compression was set on this server"
                ))
            }
            (true, Some(c)) => c,
        };
        if k.dtype != Dtype::F32 {
            return Err(format!(
                "key {key}: packed codes to a {} key: gradient compression takes float32 \
                 values only",
                k.dtype
            ));
        }
        let most = c.compressed_len(k.value.len()) + 1;
        if p.payload.len() > most {
            return Err(format!(
                "key {key}: {} bytes of packed codes, at most {most} for {} elements",
                p.payload.len(),
                k.value.len()
            ));
        }
        Ok(())
    }

    /// Unpacks the codes of `p`, checked by [`Self::check_packed`], into exactly the key's
    /// codes' size; a push that was not packed stays as is.
    pub(super) fn unpack(&self, p: &mut Push) -> Result<(), String> {
        if !p.flags.packed {
            return Ok(());
        }
        let want = match (&self.compressor, self.keys.get(&p.key)) {
            (Some(c), Some(k)) => Ok(c.compressed_len(k.value.len())),
            _ => Err("packed codes without a compressed key to unpack them for".to_string()),
        };
        let codes = want
            .and_then(|len| packed::unpack(&p.payload, len).map_err(|e| e.to_string()))
            .map_err(|e| format!("key {}: {e}", p.key))?;
        p.payload = Bytes::from(codes);
        p.flags.packed = false;
        Ok(())
    }
}
