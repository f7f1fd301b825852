//! Shared pieces of psnet's fuzz targets: a cursor over the fuzzer's bytes, the transport
//! limits a target decodes under, an allocator that records the largest allocation (so a
//! target can assert that a decoder stays within the limits it was given), and the seed
//! inputs the corpus is made of ([`seeds`], written by `examples/gen_corpus.rs` with the
//! real encoders).
//!
//! Every target reads its input the same way its seeds in `seeds` are laid out: the first
//! bytes choose settings (limits, mode), the rest is the wire bytes.
#![deny(missing_docs)]
#![deny(unsafe_code)]

pub mod seeds;
#[allow(unsafe_code)]
mod sys;

pub use sys::{largest_allocation, TrackingAlloc};

use psnet_transport::Limits;

/// Reads settings off the front of the fuzzer's bytes; past the end every read is zero, so
/// any input is usable.
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    /// A cursor over `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }

    /// The next byte (0 past the end).
    pub fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    /// The next two bytes, little endian.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    /// The next four bytes, little endian.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    /// Everything not read yet.
    pub fn rest(self) -> &'a [u8] {
        self.data
    }
}

/// The limits a target decodes under, chosen by one input byte: the defaults, or small ones
/// that the fuzzer can actually reach the edges of.
pub fn limits(choice: u8) -> Limits {
    match choice % 4 {
        0 => Limits::default(),
        1 => Limits {
            max_meta: 64,
            max_segments: 4,
            max_message: 256,
        },
        2 => Limits {
            max_meta: 0,
            max_segments: 0,
            max_message: 0,
        },
        _ => Limits {
            max_meta: u32::MAX,
            max_segments: u16::MAX,
            max_message: u64::MAX,
        },
    }
}
