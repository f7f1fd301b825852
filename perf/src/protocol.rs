//! The control messages between a `psnet-perf` client and server (carried in a message's
//! metadata; data travels in segments).

use psnet::transport::le::{LeReader, LeWriter};

/// One control message.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Control {
    /// Client: a bandwidth test of `iters` messages of `size` bytes follows.
    BwStart { size: u64, iters: u64 },
    /// Client: one bandwidth message (payload in the segment).
    BwData,
    /// Server: ready for the announced test.
    Ready,
    /// Server: all bandwidth messages arrived; its own view of the rate.
    BwDone {
        elapsed_ns: u64,
        peak_bytes_per_s: f64,
    },
    /// Client: a latency test of `size`-byte pings follows.
    LatStart { size: u64 },
    /// Either side: one ping or its echo (payload in the segment).
    Ping,
    /// Client: finished, the server may exit.
    Bye,
    /// Client: a bandwidth test as [`Control::BwStart`], each message received into GPU
    /// `gpu`'s memory on the server (placed there as it arrives).
    BwStartToGpu { size: u64, iters: u64, gpu: u64 },
}

impl Control {
    /// The metadata bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = LeWriter::with_capacity(25);
        match *self {
            Control::BwStart { size, iters } => w.u8(1).u64(size).u64(iters),
            Control::BwData => w.u8(2),
            Control::Ready => w.u8(3),
            Control::BwDone {
                elapsed_ns,
                peak_bytes_per_s,
            } => w.u8(4).u64(elapsed_ns).u64(peak_bytes_per_s.to_bits()),
            Control::LatStart { size } => w.u8(5).u64(size),
            Control::Ping => w.u8(6),
            Control::Bye => w.u8(7),
            Control::BwStartToGpu { size, iters, gpu } => w.u8(8).u64(size).u64(iters).u64(gpu),
        };
        w.into_vec()
    }

    /// Parses metadata; anything else is an error naming what was wrong.
    pub(crate) fn decode(meta: &[u8]) -> Result<Self, String> {
        let mut r = LeReader::new(meta);
        let op = r.u8().map_err(|_| "empty control message".to_string())?;
        let expected = match op {
            1 | 4 => 16,
            5 => 8,
            8 => 24,
            2 | 3 | 6 | 7 => 0,
            _ => return Err(format!("unknown control message {op}")),
        };
        if r.remaining() != expected {
            return Err(format!(
                "control message {op} has {} bytes, expected {}",
                meta.len(),
                expected + 1
            ));
        }
        let word = |r: &mut LeReader<'_>| r.u64().map_err(|e| format!("control message: {e}"));
        Ok(match op {
            1 => Control::BwStart {
                size: word(&mut r)?,
                iters: word(&mut r)?,
            },
            2 => Control::BwData,
            3 => Control::Ready,
            4 => Control::BwDone {
                elapsed_ns: word(&mut r)?,
                peak_bytes_per_s: f64::from_bits(word(&mut r)?),
            },
            5 => Control::LatStart {
                size: word(&mut r)?,
            },
            6 => Control::Ping,
            7 => Control::Bye,
            _ => Control::BwStartToGpu {
                size: word(&mut r)?,
                iters: word(&mut r)?,
                gpu: word(&mut r)?,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trips() {
        for c in [
            Control::BwStart {
                size: 1 << 24,
                iters: 7,
            },
            Control::BwData,
            Control::Ready,
            Control::BwDone {
                elapsed_ns: 5,
                peak_bytes_per_s: 1.5e9,
            },
            Control::LatStart { size: 64 },
            Control::Ping,
            Control::Bye,
            Control::BwStartToGpu {
                size: 1 << 20,
                iters: 3,
                gpu: 1,
            },
        ] {
            assert_eq!(Control::decode(&c.encode()), Ok(c));
        }
    }

    proptest! {
        #[test]
        fn arbitrary_metadata_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            let _ = Control::decode(&bytes);
        }
    }
}
