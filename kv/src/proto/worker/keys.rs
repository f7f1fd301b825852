//! Keys laid out over the servers, and pushes prepared from them: MXNet's shares, compressed
//! shares, pieces, declared rows.

use super::*;

impl WorkerState {
    /// Lays `key` out over the servers for `len` elements of type `dtype` ([`Layout`]:
    /// MXNet's shares, compressed ones when compression is on, or pieces).
    pub fn define_key(&mut self, key: u64, len: usize, dtype: Dtype) -> Result<(), KvError> {
        if self.partition_bytes > 0 && key_of_slot(key) != key {
            return Err(KvError::Invalid(format!(
                "key {key}: keys from 2^{PIECE_SHIFT} up are where the pieces of partitioned \
                 keys are stored (PSNET_PARTITION_BYTES={}); use smaller keys or set \
                 PSNET_PARTITION_BYTES=0",
                self.partition_bytes
            )));
        }
        let whole = |server, offset, len| Part {
            server,
            offset,
            len,
            slot: key,
        };
        let piece_bytes = self.piece_bytes(dtype);
        let parts = if piece_bytes > 0 && len.saturating_mul(dtype.size()) > piece_bytes {
            pieces(
                key,
                len,
                dtype.size(),
                piece_bytes,
                self.placement.server_for(key),
                self.placement.num_servers(),
            )
        } else {
            match self.compressor.as_ref().filter(|_| dtype == Dtype::F32) {
                Some(c) => self
                    .placement
                    .compressed_parts(key, len, c.scheme().factor())
                    .iter()
                    .map(|p| whole(p.server, p.offset, p.len))
                    .collect(),
                None => self
                    .placement
                    .parts(key, len)
                    .iter()
                    .map(|p| whole(p.server, p.offset, p.len))
                    .collect(),
            }
        };
        self.keys.insert(
            key,
            Layout {
                len,
                dtype,
                parts,
                rows: None,
            },
        );
        self.priorities.declare(key);
        // An init starts the key's updates again on every server.
        self.acknowledged.retain(|(_, k), _| key_of_slot(*k) != key);
        Ok(())
    }

    /// How many servers a key of `len` elements is spread over (1 below
    /// `MXNET_KVSTORE_BIGARRAY_BOUND`, every server from it).
    pub fn servers_for(&self, key: u64, len: usize) -> usize {
        self.placement.parts(key, len).len()
    }

    /// Declares `key` (defined) row-sparse, with rows of `width` elements: from now on this
    /// worker pushes it by rows only ([`crate::Worker::push_rows`]) and refuses a dense push.
    pub fn declare_rows(&mut self, key: u64, width: usize) -> Result<(), KvError> {
        let layout = self.keys.get_mut(&key).ok_or(KvError::UnknownKey(key))?;
        if width == 0 || layout.len % width != 0 {
            return Err(KvError::Invalid(format!(
                "key {key}: rows of {width} elements do not divide its {} elements",
                layout.len
            )));
        }
        layout.rows = Some(width);
        Ok(())
    }

    /// A dense push of a row-sparse key is refused, naming the call to use.
    pub(crate) fn dense_push(&self, key: u64) -> Result<(), KvError> {
        match self.keys.get(&key).and_then(|l| l.rows) {
            Some(width) => Err(KvError::Invalid(format!(
                "key {key} is row-sparse (rows of {width} elements): push its rows with \
                 push_rows, not a dense push"
            ))),
            None => Ok(()),
        }
    }

    /// `key`'s layout, if it is defined.
    pub fn defined_layout(&self, key: u64) -> Option<&Layout> {
        self.keys.get(&key)
    }

    /// The layout of `key`, checked against `len` elements of type `dtype`.
    pub fn layout(&self, key: u64, len: usize, dtype: Dtype) -> Result<&Layout, KvError> {
        let layout = self.keys.get(&key).ok_or(KvError::UnknownKey(key))?;
        if layout.dtype != dtype {
            return Err(KvError::Invalid(format!(
                "key {key} was initialized with {} values, given {dtype}",
                layout.dtype
            )));
        }
        if layout.len != len {
            return Err(KvError::SizeMismatch {
                key,
                expected: layout.len,
                got: len,
            });
        }
        Ok(layout)
    }

    /// The parts of a push of `values` to `key`: each part's range, flags and, when
    /// compression is on, its compressed bytes (the residual updated as MXNet does).
    pub fn prepare_push<V: Value>(
        &mut self,
        key: u64,
        values: &[V],
        pull_back: bool,
    ) -> Result<Vec<PreparedPart>, KvError> {
        self.dense_push(key)?;
        let layout = self.layout(key, values.len(), V::DTYPE)?.clone();
        let floats: Option<&[f32]> = match (&self.compressor, V::DTYPE) {
            (None, _) => None,
            (Some(_), Dtype::F32) => Some(bytemuck::cast_slice(values)),
            (Some(_), dtype) => {
                return Err(KvError::Invalid(format!(
                    "key {key}: gradient compression takes float32 values, given {dtype}"
                )))
            }
        };
        let mut parts = Vec::with_capacity(layout.parts.len());
        for p in &layout.parts {
            let compressed = match (&self.compressor, floats) {
                (Some(c), Some(floats)) => {
                    let slice = &floats[p.offset..p.offset + p.len];
                    let mut out = vec![0u8; c.compressed_len(p.len)];
                    let residual = self
                        .residuals
                        .entry(key)
                        .or_insert_with(|| vec![0.0; layout.len]);
                    c.quantize(slice, &mut residual[p.offset..p.offset + p.len], &mut out)
                        .map_err(|e| KvError::Invalid(e.to_string()))?;
                    if self.pack {
                        out = packed::pack(&out).map_err(|e| KvError::Invalid(e.to_string()))?;
                    }
                    Some(out)
                }
                _ => None,
            };
            parts.push(PreparedPart {
                key,
                part: *p,
                flags: PushFlags {
                    init: false,
                    compressed: compressed.is_some(),
                    packed: compressed.is_some() && self.pack,
                    pull_back,
                    retry: None,
                    dtype: V::DTYPE,
                    have: None,
                },
                compressed,
            });
        }
        Ok(parts)
    }

    /// The parts of a push of `n_elems` values of `dtype` sent straight from device memory:
    /// None when gradient compression is on (the values must be quantized where they are read).
    pub fn prepare_device_push(
        &mut self,
        key: u64,
        n_elems: usize,
        dtype: Dtype,
        pull_back: bool,
    ) -> Result<Option<Vec<PreparedPart>>, KvError> {
        self.dense_push(key)?;
        let layout = self.layout(key, n_elems, dtype)?;
        if self.compressor.is_some() {
            return Ok(None);
        }
        let parts = layout
            .parts
            .iter()
            .map(|p| PreparedPart {
                key,
                part: *p,
                flags: PushFlags {
                    init: false,
                    compressed: false,
                    pull_back,
                    retry: None,
                    dtype,
                    have: None,
                    packed: false,
                },
                compressed: None,
            })
            .collect();
        Ok(Some(parts))
    }
}
