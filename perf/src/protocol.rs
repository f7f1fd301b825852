//! The control messages between a `psnet-perf` client and server (carried in a message's
//! metadata; data travels in segments).

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
}

impl Control {
    /// The metadata bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(17);
        match *self {
            Control::BwStart { size, iters } => {
                out.push(1);
                out.extend_from_slice(&size.to_le_bytes());
                out.extend_from_slice(&iters.to_le_bytes());
            }
            Control::BwData => out.push(2),
            Control::Ready => out.push(3),
            Control::BwDone {
                elapsed_ns,
                peak_bytes_per_s,
            } => {
                out.push(4);
                out.extend_from_slice(&elapsed_ns.to_le_bytes());
                out.extend_from_slice(&peak_bytes_per_s.to_le_bytes());
            }
            Control::LatStart { size } => {
                out.push(5);
                out.extend_from_slice(&size.to_le_bytes());
            }
            Control::Ping => out.push(6),
            Control::Bye => out.push(7),
        }
        out
    }

    /// Parses metadata; anything else is an error naming what was wrong.
    pub fn decode(meta: &[u8]) -> Result<Self, String> {
        let word = |i: usize| -> Result<[u8; 8], String> {
            meta.get(1 + 8 * i..9 + 8 * i)
                .and_then(|s| s.try_into().ok())
                .ok_or_else(|| format!("control message of {} bytes is truncated", meta.len()))
        };
        let expect_len = |n: usize| {
            if meta.len() == n {
                Ok(())
            } else {
                Err(format!(
                    "control message {} has {} bytes, expected {n}",
                    meta[0],
                    meta.len()
                ))
            }
        };
        match meta.first() {
            Some(1) => {
                expect_len(17)?;
                Ok(Control::BwStart {
                    size: u64::from_le_bytes(word(0)?),
                    iters: u64::from_le_bytes(word(1)?),
                })
            }
            Some(2) => expect_len(1).map(|_| Control::BwData),
            Some(3) => expect_len(1).map(|_| Control::Ready),
            Some(4) => {
                expect_len(17)?;
                Ok(Control::BwDone {
                    elapsed_ns: u64::from_le_bytes(word(0)?),
                    peak_bytes_per_s: f64::from_le_bytes(word(1)?),
                })
            }
            Some(5) => {
                expect_len(9)?;
                Ok(Control::LatStart {
                    size: u64::from_le_bytes(word(0)?),
                })
            }
            Some(6) => expect_len(1).map(|_| Control::Ping),
            Some(7) => expect_len(1).map(|_| Control::Bye),
            Some(op) => Err(format!("unknown control message {op}")),
            None => Err("empty control message".into()),
        }
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
