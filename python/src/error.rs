//! psnet's errors as Python exceptions.
//!
//! `PsnetError` (a `RuntimeError`) is the base; `KvError` and `CollectiveError` say which part
//! failed; `PeerLostError` (from `PsnetError`) is a node or rank of the job that died or left. The
//! message is psnet's own. Wrong arguments (an unknown key, a wrong size, a bad setting) are
//! `ValueError`, a wrong array type `TypeError`.

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::PyErr;

create_exception!(
    _psnet,
    PsnetError,
    PyRuntimeError,
    "A psnet operation failed; the message is psnet's."
);
create_exception!(
    _psnet,
    KvError,
    PsnetError,
    "A kvstore operation failed (a server refused it, the job ended, ...)."
);
create_exception!(
    _psnet,
    CollectiveError,
    PsnetError,
    "A collective failed (a rank disagreed, timed out, ...); the communicator is then unusable."
);
create_exception!(
    _psnet,
    PeerLostError,
    PsnetError,
    "A node or rank of the job died or left; the message names it."
);

/// A kv error as the Python exception that fits it.
pub(crate) fn kv(e: psnet_kv::KvError) -> PyErr {
    use psnet_kv::KvError as E;
    let text = e.to_string();
    match e {
        E::Invalid(_) | E::UnknownKey(_) | E::SizeMismatch { .. } | E::Config(_) => {
            PyValueError::new_err(text)
        }
        E::NodeLost { .. } => PeerLostError::new_err(text),
        _ => KvError::new_err(text),
    }
}

/// A collectives error as the Python exception that fits it.
pub(crate) fn coll(e: psnet_collectives::CollectiveError) -> PyErr {
    use psnet_collectives::CollectiveError as E;
    let text = e.to_string();
    match e {
        E::Invalid(_) => PyValueError::new_err(text),
        E::RankLost { .. } | E::Aborted { .. } => PeerLostError::new_err(text),
        _ => CollectiveError::new_err(text),
    }
}
