//! The verbs wire format's version and [`WireError`], why a message header was refused.
//!
//! They sit here, below `proto::wire` (which re-exports both), because [`VerbsError`]
//! carries a [`WireError`] and `VerbsError` is used by the FFI layer, which must not depend
//! on the protocol.
//!
//! [`VerbsError`]: super::VerbsError

/// Wire version of the verbs protocol.
pub const VERSION: u8 = 3;

/// A header that breaks the format or this side's limits.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than the header needs.
    #[error("truncated verbs message: {got} bytes, need {need}")]
    Truncated {
        /// Bytes received.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// Unknown kind byte.
    #[error("unknown verbs message kind {0}")]
    UnknownKind(u8),
    /// Another protocol version.
    #[error("verbs protocol version {0}, this build speaks {VERSION}")]
    Version(u8),
    /// A size above the limits.
    #[error("verbs message exceeds a limit: {0}")]
    Limit(String),
}
