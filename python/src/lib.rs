//! `psnet._psnet`, the native half of psnet's Python package.
//!
//! The Python package (`python/psnet/`) gives MXNet's kvstore API and Horovod-style
//! collectives; this module is what it stands on:
//!
//! - [`kv::Worker`]: a kv worker joined from the `DMLC_*` environment, pushing and pulling
//!   NumPy arrays in place (float32, float16);
//! - [`kv::run_role`]: runs a scheduler or server process's role until the job ends, as
//!   `import mxnet` does when `DMLC_ROLE` says so;
//! - [`kv::Updater`]: psnet's server optimizers (MXNet 1.9.1's arithmetic), for the `local`
//!   kvstore;
//! - [`coll::Comm`]: a collectives communicator joined from psnet's, torchrun's, mpirun's or
//!   Slurm's variables, reducing NumPy arrays in place;
//! - [`cuda`]: CUDA tensors by device pointer, an allreduce on their GPU and the kv worker's
//!   calls on GPU buffers (the crate's only `unsafe`, in that module).
//!
//! Every call that waits on the network releases the GIL, and checks for signals every
//! [`wait::SIGNAL_CHECK`]: Ctrl-C raises `KeyboardInterrupt` and abandons the call (the
//! operation is dropped, so nothing touches the caller's array afterwards). Errors are
//! Python exceptions carrying psnet's message ([`error`]).
#![deny(unsafe_code)]

use pyo3::prelude::*;

mod arrays;
mod coll;
mod cuda;
mod error;
mod exchange;
mod kv;
mod wait;

#[pymodule]
fn _psnet(m: &Bound<'_, PyModule>) -> PyResult<()> {
    psnet::logging::init();
    let py = m.py();
    m.add("PsnetError", py.get_type::<error::PsnetError>())?;
    m.add("KvError", py.get_type::<error::KvError>())?;
    m.add("CollectiveError", py.get_type::<error::CollectiveError>())?;
    m.add("PeerLostError", py.get_type::<error::PeerLostError>())?;
    m.add_class::<kv::Worker>()?;
    m.add_class::<kv::Updater>()?;
    m.add_class::<coll::Comm>()?;
    m.add_class::<exchange::Ticket>()?;
    m.add_function(wrap_pyfunction!(exchange::alltoall, m)?)?;
    m.add_function(wrap_pyfunction!(exchange::gather, m)?)?;
    m.add_function(wrap_pyfunction!(exchange::scatter, m)?)?;
    m.add_function(wrap_pyfunction!(exchange::p2p_ticket, m)?)?;
    m.add_function(wrap_pyfunction!(exchange::send_with, m)?)?;
    m.add_function(wrap_pyfunction!(exchange::recv_with, m)?)?;
    m.add_function(wrap_pyfunction!(exchange::recv_any, m)?)?;
    m.add_function(wrap_pyfunction!(kv::run_role, m)?)?;
    m.add_function(wrap_pyfunction!(kv::role, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::allreduce_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::broadcast_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::allgather_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::reduce_scatter_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::reduce_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::kv_push_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::kv_pull_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::kv_pushpull_cuda, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Benchmarks refuse a debug build: it made the kv store look 20% slower on the rig.
    m.add(
        "BUILD_PROFILE",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
    )?;
    Ok(())
}
