//! Packed codes: the 2-bit codes of a compressed push or pull answer, coded losslessly for
//! the wire where the link and not the CPU is what a step waits for.
//!
//! The codes are far from uniform. On `psnet-train`'s model, 2-bit gradient codes with
//! MXNet's threshold of 0.5 are about 98% zeros, and the codes of a compressed pull's change
//! about 72% (the elements below the change's mean magnitude). So a packed message is one
//! of four forms, chosen by how many 2-bit fields are nonzero (counted first, a popcount a
//! word):
//! - **sparse**, for at most one field in twelve nonzero (a push's gradients): each nonzero
//!   field as a LEB128 varint of `gap << 2 | field`, `gap` the zero fields before it since
//!   the last one. About 1.2 bytes a nonzero field, where zstd took 5 to 7 times as long
//!   and made twice the bytes;
//! - **planes** ([`psnet_compression::planes`]), for denser 2-bit codes (a pull's change),
//!   whose nonzero fields are `0b11` or `0b10`: a bit a field for which are nonzero, then a
//!   bit for each nonzero one. A pull's codes go to about 64% of their bytes. zstd took them
//!   to 59%, but with about 3 times the CPU on the server (23 against 7 us a 512 KiB
//!   piece), and unpacking on every worker, which on psnet-train's rig cost more than the
//!   bytes it saved;
//! - **zstd** (level 1, a frame), for other dense codes (a nonzero field of `0b01`, which
//!   psnet's quantizers do not make): its entropy coder;
//! - **raw**, where none would save much (1-bit codes, about half ones, are noise).
//!
//! Packing is lossless: the codes a server sums and a worker applies are exactly those that
//! were packed, so every value stays bit for bit what it is unpacked (MXNet's, for its
//! one-way 2-bit mode). The codes' meaning plays no part: any bytes come back as they went.
//!
//! Whether a job packs is the compression setting's `"pack"` (`PSNET_PACK_CODES`; by default
//! on for a job across hosts, off on one host, where packing costs CPU and saves nothing).
//! Servers take packed and plain pushes alike, and every worker reads packed answers, so a
//! worker's own `PSNET_PACK_CODES` need not agree with worker 0's. A push says whether its payload is packed
//! ([`crate::proto::msg::PushFlags::packed`]), and an answer says so in its form
//! ([`crate::proto::pulled::Form::Packed`]).

use std::cell::RefCell;

use psnet_compression::planes;

/// The first byte of a packed message: its form.
const RAW: u8 = 0;
const SPARSE: u8 = 1;
const ZSTD: u8 = 2;
const PLANES: u8 = 3;

/// zstd's level for codes: its fastest that still entropy-codes single bytes (level 1 took
/// a pull's codes to 59% of their size, negative levels left them whole).
const LEVEL: i32 = 1;

/// Sparse form while at most one 2-bit field in this many is nonzero.
const SPARSE_ONE_IN: usize = 12;

/// zstd only while at most this many fields in 16 are nonzero: past that, the codes are
/// close to noise and zstd spends its time for a few percent.
const ZSTD_AT_MOST_OF_16: usize = 9;

thread_local! {
    /// One compression context per thread: making one costs more than packing a piece.
    static PACKER: RefCell<Option<zstd::bulk::Compressor<'static>>> = const { RefCell::new(None) };
    /// One decompression context per thread.
    static UNPACKER: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
}

/// The nonzero 2-bit fields of `codes`.
fn nonzero_fields(codes: &[u8]) -> usize {
    const LOW: u64 = 0x5555_5555_5555_5555;
    let mut chunks = codes.chunks_exact(8);
    let mut n = 0usize;
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        n += ((w | (w >> 1)) & LOW).count_ones() as usize;
    }
    for &b in chunks.remainder() {
        n += ((b | (b >> 1)) & 0x55).count_ones() as usize;
    }
    n
}

/// What went wrong packing or unpacking codes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PackedError {
    /// zstd could not make its context (memory).
    #[error("{what} codes: zstd context: {reason}")]
    Context {
        /// `"packing"` or `"unpacking"`.
        what: &'static str,
        /// zstd's words.
        reason: String,
    },
    /// zstd could not compress.
    #[error("packing {len} bytes of codes: {reason}")]
    Compress {
        /// The codes' length.
        len: usize,
        /// zstd's words.
        reason: String,
    },
    /// Nothing at all, not even the form byte.
    #[error("packed codes of 0 bytes")]
    Empty,
    /// Raw codes of the wrong length.
    #[error("raw packed codes of {got} bytes, expected {expected}")]
    RawLength {
        /// Their length.
        got: usize,
        /// The codes' length.
        expected: usize,
    },
    /// Planes that do not join.
    #[error("packed codes: {0}")]
    Planes(String),
    /// A form byte no packer writes.
    #[error("packed codes of unknown form {0}")]
    UnknownForm(u8),
    /// A malformed sparse list.
    #[error("{0}")]
    Sparse(&'static str),
    /// A sparse list naming a field past the codes.
    #[error("sparse packed codes run past {len} bytes of codes")]
    SparsePastEnd {
        /// The codes' length.
        len: usize,
    },
    /// A zstd frame that does not decompress to the codes' length.
    #[error("packed codes ({frame} bytes) do not unpack to {len} bytes: {reason}")]
    Frame {
        /// The frame's length.
        frame: usize,
        /// The codes' length.
        len: usize,
        /// zstd's words.
        reason: String,
    },
    /// A zstd frame that decompresses to another length.
    #[error("packed codes ({frame} bytes) unpack to {got} bytes, expected {expected}")]
    FrameLength {
        /// The frame's length.
        frame: usize,
        /// What it unpacked to.
        got: usize,
        /// The codes' length.
        expected: usize,
    },
}

/// `codes` packed. Fails only where zstd cannot make a context, and says so.
pub fn pack(codes: &[u8]) -> Result<Vec<u8>, PackedError> {
    let fields = codes.len() * 4;
    let nonzero = nonzero_fields(codes);
    if nonzero * SPARSE_ONE_IN <= fields {
        return Ok(pack_sparse(codes, nonzero));
    }
    if nonzero < fields {
        let mut out = Vec::with_capacity(codes.len() + 1);
        out.push(PLANES);
        // Never longer than raw: an odd byte's mask half-byte can tip nearly full codes over.
        if planes::split(codes, &mut out) && out.len() <= codes.len() {
            return Ok(out);
        }
    }
    if nonzero * 16 <= fields * ZSTD_AT_MOST_OF_16 {
        let packed = pack_zstd(codes)?;
        if packed.len() < codes.len() {
            return Ok(packed);
        }
    }
    let mut out = Vec::with_capacity(codes.len() + 1);
    out.push(RAW);
    out.extend_from_slice(codes);
    Ok(out)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Field `k` of the codes is bits `2 (k mod 4)` of byte `k / 4`, so that a little-endian
/// word's field `f` is bits `2f` of it.
fn pack_sparse(codes: &[u8], nonzero: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + nonzero * 2);
    out.push(SPARSE);
    let mut gap = 0u64;
    let mut word = |w: u64, width: u32, out: &mut Vec<u8>| {
        let (mut w, mut next) = (w, 0u32);
        while w != 0 {
            let f = w.trailing_zeros() / 2;
            let field = (w >> (2 * f)) & 3;
            put_varint(out, ((gap + u64::from(f - next)) << 2) | field);
            gap = 0;
            next = f + 1;
            w &= !(3u64 << (2 * f));
        }
        gap += u64::from(width - next);
    };
    let mut chunks = codes.chunks_exact(8);
    for c in &mut chunks {
        word(
            u64::from_le_bytes(c.try_into().expect("8 bytes")),
            32,
            &mut out,
        );
    }
    for &b in chunks.remainder() {
        word(u64::from(b), 4, &mut out);
    }
    out
}

fn pack_zstd(codes: &[u8]) -> Result<Vec<u8>, PackedError> {
    PACKER.with_borrow_mut(|slot| {
        if slot.is_none() {
            *slot = Some(
                zstd::bulk::Compressor::new(LEVEL).map_err(|e| PackedError::Context {
                    what: "packing",
                    reason: e.to_string(),
                })?,
            );
        }
        let packer = slot.as_mut().expect("made above");
        let mut out = Vec::with_capacity(zstd::zstd_safe::compress_bound(codes.len()) + 1);
        out.push(ZSTD);
        let frame = packer.compress(codes).map_err(|e| PackedError::Compress {
            len: codes.len(),
            reason: e.to_string(),
        })?;
        out.extend_from_slice(&frame);
        Ok(out)
    })
}

/// The codes in `packed`, which must be exactly `len` bytes of them: at most `len` bytes are
/// ever allocated, whatever `packed` says, and anything else (an unknown form, a malformed
/// frame or varint, a field past the end, more or fewer bytes) is an error naming it.
pub fn unpack(packed: &[u8], len: usize) -> Result<Vec<u8>, PackedError> {
    let Some((&form, body)) = packed.split_first() else {
        return Err(PackedError::Empty);
    };
    match form {
        RAW if body.len() == len => Ok(body.to_vec()),
        RAW => Err(PackedError::RawLength {
            got: body.len(),
            expected: len,
        }),
        SPARSE => unpack_sparse(body, len),
        ZSTD => unpack_zstd(body, len),
        PLANES => planes::join(body, len).map_err(|e| PackedError::Planes(e.to_string())),
        other => Err(PackedError::UnknownForm(other)),
    }
}

fn unpack_sparse(mut body: &[u8], len: usize) -> Result<Vec<u8>, PackedError> {
    let fields = len as u64 * 4;
    let mut out = vec![0u8; len];
    let mut at = 0u64;
    while !body.is_empty() {
        let mut v = 0u64;
        let mut shift = 0u32;
        loop {
            let (&b, rest) = body.split_first().ok_or(PackedError::Sparse(
                "sparse packed codes end inside a number",
            ))?;
            body = rest;
            if shift > 63 || (shift == 63 && b > 1) {
                return Err(PackedError::Sparse(
                    "sparse packed codes: a number past 64 bits",
                ));
            }
            v |= u64::from(b & 0x7f) << shift;
            shift += 7;
            if b & 0x80 == 0 {
                break;
            }
        }
        let (gap, field) = (v >> 2, (v & 3) as u8);
        if field == 0 {
            return Err(PackedError::Sparse("sparse packed codes list a zero field"));
        }
        at = at
            .checked_add(gap)
            .filter(|&k| k < fields)
            .ok_or(PackedError::SparsePastEnd { len })?;
        out[(at / 4) as usize] |= field << (2 * (at % 4));
        at += 1;
    }
    Ok(out)
}

fn unpack_zstd(frame: &[u8], len: usize) -> Result<Vec<u8>, PackedError> {
    UNPACKER.with_borrow_mut(|slot| {
        if slot.is_none() {
            *slot = Some(
                zstd::bulk::Decompressor::new().map_err(|e| PackedError::Context {
                    what: "unpacking",
                    reason: e.to_string(),
                })?,
            );
        }
        let unpacker = slot.as_mut().expect("made above");
        let codes = unpacker
            .decompress(frame, len)
            .map_err(|e| PackedError::Frame {
                frame: frame.len(),
                len,
                reason: e.to_string(),
            })?;
        if codes.len() != len {
            return Err(PackedError::FrameLength {
                frame: frame.len(),
                got: codes.len(),
                expected: len,
            });
        }
        Ok(codes)
    })
}

#[cfg(test)]
mod tests;
