//! Which transport a node asks for.

use std::fmt;
use std::str::FromStr;

/// What `PSNET_TRANSPORT` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TransportPref {
    /// RDMA when a device is bound to the interface, TCP otherwise.
    #[default]
    Auto,
    /// RDMA or fail.
    Rdma,
    /// TCP even where RDMA exists.
    Tcp,
}

impl FromStr for TransportPref {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(TransportPref::Auto),
            "rdma" | "ib" | "verbs" | "ibverbs" => Ok(TransportPref::Rdma),
            "tcp" => Ok(TransportPref::Tcp),
            other => Err(format!(
                "unknown transport {other:?}: use auto, rdma or tcp"
            )),
        }
    }
}

impl fmt::Display for TransportPref {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransportPref::Auto => "auto",
            TransportPref::Rdma => "rdma",
            TransportPref::Tcp => "tcp",
        })
    }
}
