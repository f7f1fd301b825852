//! Where a key's values live: MXNet's key-to-server placement and big-array sharding.
//!
//! This is the pure arithmetic of MXNet's `KVStoreDist::EncodeDefaultKey` and
//! `EncodeCompressedKey` (MXNet 1.9.1 `src/kvstore/kvstore_dist.h`), without the ps-lite key
//! encoding (server key ranges) or any I/O:
//!
//! * An array with fewer than `bound` elements (`MXNET_KVSTORE_BIGARRAY_BOUND`, default
//!   [`DEFAULT_BIGARRAY_BOUND`]) lives whole on one server, [`Placement::server_for`]:
//!   `(key * 9973) % num_servers`. The comparison is `<`: an array of exactly `bound` elements
//!   is sharded.
//! * An array with `n >= bound` elements is split over all servers ([`Placement::parts`]):
//!   part `i` holds `round(n / NS * (i + 1)) - round(n / NS * i)` elements (`f64` arithmetic,
//!   round half away from zero).
//! * A compressed push of a big array is split on compressed-word boundaries
//!   ([`Placement::compressed_parts`]): with `C = ceil(n / per_word)` words, server `i < NS - 1`
//!   gets `round(C / NS * (i + 1)) - round(C / NS * i)` words and `per_word` elements per word;
//!   the last server gets the remaining words and elements. The whole array is quantized once
//!   and each server receives its slice of the compressed bytes.
//!
//! Every result lists the parts in server order and covers `[0, n)` exactly once, in order.
//!
//! ```
//! use psnet_kv::placement::{Part, Placement};
//!
//! let placement = Placement::new(2, 4)?;
//! // Small array: one server.
//! assert_eq!(placement.server_for(1), 1); // 9973 % 2
//! assert_eq!(placement.parts(1, 3).as_slice(), &[Part { server: 1, offset: 0, len: 3 }]);
//! // Big array: round(2.5) = 3 elements on server 0, 2 on server 1.
//! assert_eq!(
//!     placement.parts(1, 5).as_slice(),
//!     &[Part { server: 0, offset: 0, len: 3 }, Part { server: 1, offset: 3, len: 2 }],
//! );
//! // 2-bit compressed (16 elements per 4-byte word), 35 elements = 3 words:
//! // server 0 gets 2 words (elements 0..32), server 1 one word (elements 32..35).
//! let parts = placement.compressed_parts(1, 35, 16);
//! assert_eq!((parts[0].range(), parts[0].byte_range()), (0..32, 0..8));
//! assert_eq!((parts[1].range(), parts[1].byte_range()), (32..35, 8..12));
//! # Ok::<(), psnet_kv::placement::PlacementError>(())
//! ```
//!
//! # Deviations from MXNet
//!
//! * **No overflow in [`Placement::server_for`].** MXNet computes `(key * 9973) % num_servers`
//!   in C `int`, which overflows (undefined behaviour; in practice a negative server index) for
//!   `key >= 215_330` (`215_329 * 9973 = 2_147_476_117` is the last product that fits).
//!   psnet computes the mathematical value of `(key * 9973) mod num_servers` for every `u64`
//!   key, which is MXNet's result wherever MXNet does not overflow.
//! * **Compressed parts never overshoot.** MXNet gives every server but the last
//!   `per_word * words` elements, which can exceed what is left of the array when a non-last
//!   server holds the final, partial word (e.g. `n = 5`, 4 servers, 2-bit: server 1 would get
//!   16 elements of 5 and the last server an underflowed count). psnet clamps element
//!   boundaries to `n`, so the parts always tile `[0, n)` exactly, each non-empty part starts
//!   on a word boundary, and some parts may be empty. Where MXNet's counts are valid the
//!   result is identical.
//! * **Boundaries are clamped and monotonic.** For arrays beyond `2^53` elements, where `f64`
//!   can no longer represent `n` exactly, the rounded boundaries are clamped to `[0, n]` so the
//!   parts still cover the array (MXNet would fail its size check). Below that the results are
//!   MXNet's.

use std::ops::Range;

use smallvec::SmallVec;
use thiserror::Error;

/// MXNet's default `MXNET_KVSTORE_BIGARRAY_BOUND`: arrays of at least this many **elements**
/// (not bytes) are sharded over all servers.
pub const DEFAULT_BIGARRAY_BOUND: usize = 1_000_000;

/// The multiplier of MXNet's "simple heuristic for load balance".
const KEY_MULTIPLIER: u128 = 9973;

/// Bytes per compressed word (MXNet stores compressed data in `float32` words).
const WORD_BYTES: usize = 4;

/// Invalid arguments to [`Placement::new`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PlacementError {
    /// `num_servers` was 0.
    #[error("the number of servers must be at least 1, got 0 (DMLC_NUM_SERVER)")]
    NoServers,
    /// `bigarray_bound` was 0.
    #[error(
        "the big-array bound must be at least 1 element, got 0 (MXNET_KVSTORE_BIGARRAY_BOUND)"
    )]
    ZeroBound,
}

/// One server's share of an uncompressed array, in **elements** of the flattened array.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Part {
    /// The server's rank, `0..num_servers`.
    pub server: usize,
    /// The first element of the share.
    pub offset: usize,
    /// The number of elements (may be 0 when the array has fewer elements than servers).
    pub len: usize,
}

impl Part {
    /// The element range `offset..offset + len`.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// One server's share of a compressed push: its elements and the compressed bytes that encode
/// them.
///
/// The compressed bytes are a slice of the quantization of the **whole** array, which starts
/// at element `per_word * byte_offset / 4`; that is `offset` whenever the part is non-empty
/// (an empty part's `offset` is clamped to `n`). The bytes `byte_offset..byte_offset +
/// byte_len` therefore hold exactly the codes of elements `offset..offset + len` (the final
/// word padded), and `byte_len == 4 * ceil(len / per_word)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CompressedPart {
    /// The server's rank, `0..num_servers`.
    pub server: usize,
    /// The first element of the share.
    pub offset: usize,
    /// The number of elements (may be 0).
    pub len: usize,
    /// The first byte of the share in the compressed buffer (a multiple of 4).
    pub byte_offset: usize,
    /// The number of compressed bytes, `4 * words` (may be 0).
    pub byte_len: usize,
}

impl CompressedPart {
    /// The element range `offset..offset + len`.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }

    /// The compressed byte range `byte_offset..byte_offset + byte_len`.
    pub fn byte_range(&self) -> Range<usize> {
        self.byte_offset..self.byte_offset + self.byte_len
    }

    /// The number of 4-byte compressed words, `byte_len / 4`.
    pub fn words(&self) -> usize {
        self.byte_len / WORD_BYTES
    }
}

/// MXNet's placement of keys on servers, for a fixed number of servers and big-array bound.
///
/// Cheap to copy; all methods are pure functions of their arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Placement {
    num_servers: usize,
    bigarray_bound: usize,
}

impl Placement {
    /// A placement over `num_servers` servers, sharding arrays of `bigarray_bound` or more
    /// elements (MXNet's `MXNET_KVSTORE_BIGARRAY_BOUND`, default [`DEFAULT_BIGARRAY_BOUND`]).
    ///
    /// Both must be at least 1.
    pub fn new(num_servers: usize, bigarray_bound: usize) -> Result<Self, PlacementError> {
        if num_servers == 0 {
            return Err(PlacementError::NoServers);
        }
        if bigarray_bound == 0 {
            return Err(PlacementError::ZeroBound);
        }
        Ok(Placement {
            num_servers,
            bigarray_bound,
        })
    }

    /// The number of servers.
    pub fn num_servers(&self) -> usize {
        self.num_servers
    }

    /// The big-array bound, in elements.
    pub fn bigarray_bound(&self) -> usize {
        self.bigarray_bound
    }

    /// Whether an array of `n_elems` elements is split over all servers (`n_elems >= bound`)
    /// rather than stored whole on [`server_for(key)`](Self::server_for).
    pub fn is_sharded(&self, n_elems: usize) -> bool {
        n_elems >= self.bigarray_bound
    }

    /// The server holding a small (unsharded) array: `(key * 9973) % num_servers`, computed
    /// without overflow for every key (see the module's notes on MXNet's `int` overflow).
    pub fn server_for(&self, key: u64) -> usize {
        let server = u128::from(key) * KEY_MULTIPLIER % self.num_servers as u128;
        // The remainder is below `num_servers`, which is a usize.
        server as usize
    }

    /// Each server's share of an uncompressed array of `n_elems` elements, in server order.
    ///
    /// A small array (`n_elems < bound`) gives one part, `[0, n_elems)` on
    /// [`server_for(key)`](Self::server_for). A big array gives `num_servers` parts, part `i`
    /// on server `i` with `round(n/NS*(i+1)) - round(n/NS*i)` elements; parts can be empty
    /// when there are more servers than elements.
    pub fn parts(&self, key: u64, n_elems: usize) -> SmallVec<[Part; 4]> {
        if !self.is_sharded(n_elems) {
            let mut parts = SmallVec::new();
            parts.push(Part {
                server: self.server_for(key),
                offset: 0,
                len: n_elems,
            });
            return parts;
        }
        (0..self.num_servers)
            .map(|i| {
                let start = self.boundary(n_elems, i);
                let end = self.boundary(n_elems, i + 1);
                Part {
                    server: i,
                    offset: start,
                    len: end - start,
                }
            })
            .collect()
    }

    /// Each server's share of a compressed push of `n_elems` elements, in server order, for a
    /// scheme packing `elems_per_word` elements into each 4-byte word (2-bit: 16, 1-bit: 32;
    /// `psnet_compression::Scheme::factor`).
    ///
    /// The compressed buffer of the whole array has `C = ceil(n_elems / elems_per_word)` words.
    /// A small array (`n_elems < bound`) gives one part on
    /// [`server_for(key)`](Self::server_for) with all elements and all `4 * C` bytes. A big
    /// array gives `num_servers` parts: server `i < NS - 1` gets
    /// `round(C/NS*(i+1)) - round(C/NS*i)` words, the last server the remaining words; each
    /// part's elements are the ones its words encode, clamped to `n_elems` (see the module's
    /// notes). The byte ranges tile `[0, 4 * C)` and the element ranges tile `[0, n_elems)`.
    ///
    /// # Panics
    ///
    /// If `elems_per_word` is 0.
    pub fn compressed_parts(
        &self,
        key: u64,
        n_elems: usize,
        elems_per_word: usize,
    ) -> SmallVec<[CompressedPart; 4]> {
        assert!(elems_per_word > 0, "elems_per_word must be at least 1");
        let words = n_elems.div_ceil(elems_per_word);
        if !self.is_sharded(n_elems) {
            let mut parts = SmallVec::new();
            parts.push(CompressedPart {
                server: self.server_for(key),
                offset: 0,
                len: n_elems,
                byte_offset: 0,
                byte_len: WORD_BYTES * words,
            });
            return parts;
        }
        // Word boundaries: MXNet's running sum of per-server word counts telescopes to
        // round(C/NS*i) for i < NS; the last server takes the rest (boundary NS = C).
        let word_boundary = |i: usize| self.boundary(words, i);
        // Element boundaries: `per_word` elements per word before it (MXNet's `po_i`),
        // clamped to the array; the last server takes the rest.
        let elem_boundary = |i: usize| {
            if i >= self.num_servers {
                n_elems
            } else {
                word_boundary(i).saturating_mul(elems_per_word).min(n_elems)
            }
        };
        (0..self.num_servers)
            .map(|i| {
                let (w0, w1) = (word_boundary(i), word_boundary(i + 1));
                let (e0, e1) = (elem_boundary(i), elem_boundary(i + 1));
                CompressedPart {
                    server: i,
                    offset: e0,
                    len: e1 - e0,
                    byte_offset: WORD_BYTES * w0,
                    byte_len: WORD_BYTES * (w1 - w0),
                }
            })
            .collect()
    }

    /// The start of part `i` of `total` units: `round(total / NS * i)` as MXNet computes it
    /// (`f64`, half away from zero), clamped to `total`; `total` for `i >= NS`.
    ///
    /// Non-decreasing in `i` (a product with a growing factor and `round` are both monotonic),
    /// 0 at `i = 0`. MXNet's own end, `round(total / NS * NS)`, equals `total` for every
    /// total below `2^51`; the clamp only matters beyond.
    fn boundary(&self, total: usize, i: usize) -> usize {
        if i >= self.num_servers {
            return total;
        }
        let x = (total as f64 / self.num_servers as f64 * i as f64).round();
        // `as` saturates; the value is non-negative.
        (x as usize).min(total)
    }
}
