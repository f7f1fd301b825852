//! How a key is laid out over the servers: MXNet's shares, or pieces ([`Layout`]).

use crate::value::Dtype;

/// One server's share of a key, or one piece of a partitioned key ([`Layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    /// The server's rank.
    pub server: usize,
    /// The part's first element.
    pub offset: usize,
    /// Its element count.
    pub len: usize,
    /// The key the server stores this part under: the key itself for a share and for a
    /// key's first piece, [`piece_key`] for its other pieces.
    pub slot: u64,
}

/// How a key is laid out over the servers.
///
/// Without partitioning (`PSNET_PARTITION_BYTES=0`), or for a key of at most that many
/// bytes: MXNet's placement and sharding, one part per server's share. A larger key is cut
/// into pieces of about `PSNET_PARTITION_BYTES` (multiples of [`PIECE_ALIGN`] elements), as
/// BytePS partitions its tensors, and piece `g` goes to server `(server_for(key) + g) mod
/// servers`. A server stores, sums, updates and answers each piece on its own, under a key of
/// its own ([`piece_key`]), so the answers to a key's first pieces go down while its later
/// pieces still go up, and every server carries an equal share of the bytes. Every update
/// psnet's servers run is element-wise and every piece starts on a compressed word, so the
/// values are bit for bit those of MXNet's layout.
#[derive(Clone, Debug)]
pub struct Layout {
    /// Elements in the key.
    pub len: usize,
    /// Their type.
    pub dtype: Dtype,
    /// The parts, in element order.
    pub parts: Vec<Part>,
    /// A row-sparse key's row width: its rows are pushed with row pushes only.
    pub rows: Option<usize>,
}

/// Pieces start at multiples of this many elements: whole compressed words for 2-bit (16 a
/// word) and 1-bit (32), and whole cache lines.
pub const PIECE_ALIGN: usize = 128;

/// Piece `g` of key `k` is stored under `k + g * 2^PIECE_SHIFT`; a partitioned job's keys
/// stay below `2^PIECE_SHIFT`.
pub const PIECE_SHIFT: u32 = 48;

/// The most pieces one key is cut into (larger keys get larger pieces).
const MAX_PIECES: usize = 1 << 16;

/// The key piece `piece` of `key` is stored under (`key` itself for piece 0).
pub fn piece_key(key: u64, piece: usize) -> u64 {
    key | ((piece as u64) << PIECE_SHIFT)
}

/// The key whose piece is stored under `slot`.
pub fn key_of_slot(slot: u64) -> u64 {
    slot & ((1u64 << PIECE_SHIFT) - 1)
}

/// The pieces of a key of `len` elements of `elem_bytes` bytes, cut at about `piece_bytes`
/// (at least [`PIECE_ALIGN`] elements), spread over `servers` servers from `first`.
pub(super) fn pieces(
    key: u64,
    len: usize,
    elem_bytes: usize,
    piece_bytes: usize,
    first: usize,
    servers: usize,
) -> Vec<Part> {
    let mut piece = (piece_bytes / elem_bytes.max(1) / PIECE_ALIGN * PIECE_ALIGN).max(PIECE_ALIGN);
    if len.div_ceil(piece) > MAX_PIECES {
        piece = len.div_ceil(MAX_PIECES).next_multiple_of(PIECE_ALIGN);
    }
    (0..len.div_ceil(piece))
        .map(|g| Part {
            server: (first + g) % servers.max(1),
            offset: g * piece,
            len: piece.min(len - g * piece),
            slot: piece_key(key, g),
        })
        .collect()
}
