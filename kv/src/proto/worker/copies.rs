//! A worker's copies of the keys it pulls, with compressed pulls (see
//! [`crate::proto::pulled`]): one per stored key and server, at the version its last answer
//! made. A compressed answer applies to the copy, and the pull gets the whole copy.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use psnet_compression::Scheme;
use psnet_transport::NodeId;

use crate::proto::packed;
use crate::proto::pulled::{self, Form};
use crate::proto::sum;

/// One key's copy.
struct Held {
    version: u64,
    /// Shared with the answer that last carried it (no copy); written in place once that
    /// is gone.
    values: Arc<Vec<f32>>,
}

/// A copy's values as the bytes of an answer.
struct AsBytes(Arc<Vec<f32>>);

impl AsRef<[u8]> for AsBytes {
    fn as_ref(&self) -> &[u8] {
        sum::as_bytes(&self.0)
    }
}

/// Every copy this worker holds.
#[derive(Default)]
pub(crate) struct Copies {
    scheme: Option<Scheme>,
    held: HashMap<(NodeId, u64), Held>,
}

impl Copies {
    /// Compressed pulls on with `scheme`, or off; either way the copies start again.
    pub(crate) fn set_scheme(&mut self, scheme: Option<Scheme>) {
        self.scheme = scheme;
        self.held.clear();
    }

    /// The scheme of compressed pulls, if they are on.
    pub(crate) fn scheme(&self) -> Option<Scheme> {
        self.scheme
    }

    /// The version of the copy of stored key `key` from `server`, to say in a pull.
    pub(crate) fn version(&self, server: NodeId, key: u64) -> Option<u64> {
        self.scheme?;
        self.held.get(&(server, key)).map(|h| h.version)
    }

    /// A compressed pull's answer from `server` for `key`: the copy it makes, as the
    /// value's bytes; `Err` says what does not fit (the copy is then dropped, so the next
    /// pull asks for the whole value).
    pub(crate) fn handle_pulled(
        &mut self,
        server: NodeId,
        key: u64,
        version: u64,
        form: Form,
        value: Option<Bytes>,
    ) -> Result<Bytes, String> {
        let bytes = value.unwrap_or_default();
        let Some(scheme) = self.scheme else {
            // Not keeping copies: only a whole value makes sense.
            return match form {
                Form::Full => Ok(bytes),
                _ => Err(format!(
                    "key {key}: a compressed pull's answer ({form:?}) to a worker without \
                     compressed pulls"
                )),
            };
        };
        let slot = (server, key);
        let result = match (form, self.held.get_mut(&slot)) {
            (Form::Full, _) => {
                if bytes.len() % 4 != 0 {
                    Err(format!("key {key}: a whole copy of {} bytes", bytes.len()))
                } else {
                    let mut values = vec![0.0f32; bytes.len() / 4];
                    sum::copy_from_le(&mut values, &bytes);
                    let values = Arc::new(values);
                    self.held.insert(slot, Held { version, values });
                    return Ok(bytes);
                }
            }
            // An answer already applied (two pulls of the key in flight at once).
            (_, Some(h)) if h.version == version => Ok(()),
            (Form::Delta { scale } | Form::Packed { scale }, Some(h))
                if h.version.checked_add(1) == Some(version) =>
            {
                let codes = match form {
                    Form::Packed { .. } => {
                        packed::unpack(&bytes, scheme.compressed_size(h.values.len()))
                            .map(Bytes::from)
                            .map_err(|e| e.to_string())
                    }
                    _ => Ok(bytes),
                };
                codes
                    .and_then(|codes| {
                        pulled::apply(
                            scheme,
                            &codes,
                            scale,
                            Arc::make_mut(&mut h.values).as_mut_slice(),
                        )
                        .map_err(|e| e.to_string())
                    })
                    .map(|()| h.version = version)
                    .map_err(|e| format!("key {key}: {e}"))
            }
            (form, held) => Err(format!(
                "key {key}: a compressed pull's answer ({form:?}) for version {version}, this \
                 worker's copy is at {:?}",
                held.map(|h| h.version)
            )),
        };
        match result {
            Ok(()) => Ok(Bytes::from_owner(AsBytes(self.held[&slot].values.clone()))),
            Err(e) => {
                self.held.remove(&slot);
                Err(e)
            }
        }
    }
}
