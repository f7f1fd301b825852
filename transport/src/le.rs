//! Bounded little-endian reading and writing, for every psnet wire format: a read checks the
//! bytes left before it takes any, and fails with [`Truncated`] instead of panicking, so
//! parsers of untrusted input need no index arithmetic of their own.

/// Input ended before a field did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("truncated: {needed} bytes needed, {left} left")]
pub struct Truncated {
    /// Bytes the field needed.
    pub needed: usize,
    /// Bytes that were left.
    pub left: usize,
}

/// Reads little-endian fields from the front of a byte slice.
#[derive(Clone, Copy, Debug)]
pub struct LeReader<'a> {
    buf: &'a [u8],
}

impl<'a> LeReader<'a> {
    /// A reader over `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        LeReader { buf }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len()
    }

    /// Whether everything was read.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], Truncated> {
        if self.buf.len() < n {
            return Err(Truncated {
                needed: n,
                left: self.buf.len(),
            });
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    /// The next `N` bytes, as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], Truncated> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    /// Everything not read yet.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }

    /// A `u8`.
    pub fn u8(&mut self) -> Result<u8, Truncated> {
        Ok(self.array::<1>()?[0])
    }

    /// A little-endian `u16`.
    pub fn u16(&mut self) -> Result<u16, Truncated> {
        self.array().map(u16::from_le_bytes)
    }

    /// A little-endian `u32`.
    pub fn u32(&mut self) -> Result<u32, Truncated> {
        self.array().map(u32::from_le_bytes)
    }

    /// A little-endian `u64`.
    pub fn u64(&mut self) -> Result<u64, Truncated> {
        self.array().map(u64::from_le_bytes)
    }
}

/// Appends little-endian fields to a byte vector.
#[derive(Clone, Debug, Default)]
pub struct LeWriter {
    buf: Vec<u8>,
}

impl LeWriter {
    /// An empty writer with room for `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> Self {
        LeWriter {
            buf: Vec::with_capacity(capacity),
        }
    }

    /// Appends a `u8`.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    /// Appends a little-endian `u16`.
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    /// Appends a little-endian `u32`.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    /// Appends a little-endian `u64`.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    /// Appends raw bytes.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self
    }

    /// Bytes written so far.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether nothing was written.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The bytes written.
    pub fn into_vec(self) -> Vec<u8> {
        self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn fields_round_trip_and_any_cut_is_an_error(
            a in any::<u8>(), b in any::<u16>(), c in any::<u32>(), d in any::<u64>(),
            tail in proptest::collection::vec(any::<u8>(), 0..8),
        ) {
            let mut w = LeWriter::with_capacity(16);
            w.u8(a).u16(b).u32(c).u64(d).bytes(&tail);
            let bytes = w.into_vec();
            let mut r = LeReader::new(&bytes);
            prop_assert_eq!(r.u8().unwrap(), a);
            prop_assert_eq!(r.u16().unwrap(), b);
            prop_assert_eq!(r.u32().unwrap(), c);
            prop_assert_eq!(r.u64().unwrap(), d);
            prop_assert_eq!(r.rest(), &tail[..]);
            prop_assert!(r.is_empty());
            for cut in 0..15 {
                let mut r = LeReader::new(&bytes[..cut]);
                let all = r.u8().and_then(|_| r.u16()).and_then(|_| r.u32()).and_then(|_| r.u64());
                prop_assert!(all.is_err());
            }
        }
    }

    #[test]
    fn a_short_read_says_how_short_and_consumes_nothing() {
        let mut r = LeReader::new(&[1, 2, 3]);
        assert_eq!(r.u32(), Err(Truncated { needed: 4, left: 3 }));
        assert_eq!(r.remaining(), 3);
        assert_eq!(r.take(3).unwrap(), &[1, 2, 3]);
    }
}
