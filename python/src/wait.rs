//! Waiting on the network with the GIL released and Ctrl-C honoured.

use std::future::Future;
use std::time::Duration;

use pyo3::prelude::*;

/// How often a waiting call takes the GIL back to run Python's signal handlers.
pub(crate) const SIGNAL_CHECK: Duration = Duration::from_millis(50);

/// Runs `op` to completion on `runtime` with the GIL released, so other Python threads run
/// meanwhile. Every [`SIGNAL_CHECK`] it runs Python's signal handlers; if one raises (Ctrl-C's
/// `KeyboardInterrupt`), `op` is dropped before this returns that exception, so nothing it
/// borrowed (the caller's arrays) is touched afterwards.
pub(crate) fn wait<F, R>(py: Python<'_>, runtime: &tokio::runtime::Runtime, op: F) -> PyResult<R>
where
    F: Future<Output = PyResult<R>> + Send,
    R: Send,
{
    py.detach(|| {
        runtime.block_on(async {
            tokio::pin!(op);
            loop {
                tokio::select! {
                    result = &mut op => return result,
                    () = tokio::time::sleep(SIGNAL_CHECK) => {
                        Python::attach(|py| py.check_signals())?;
                    }
                }
            }
        })
    })
}

/// A runtime whose one thread carries a communicator's or worker's traffic while Python's
/// thread computes (the blocking front ends' shape).
pub(crate) fn runtime(what: &str) -> PyResult<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(format!("psnet-{what}"))
        .enable_all()
        .build()
        .map_err(|e| {
            crate::error::PsnetError::new_err(format!("cannot start psnet's {what} runtime: {e}"))
        })
}
