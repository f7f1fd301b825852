//! All-to-all, gather, scatter and point-to-point messages from Python, on NumPy arrays:
//! functions of a [`Comm`], as the CUDA calls are.

use numpy::Element as NpElement;
use psnet_collectives::{Element, P2pTicket};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::arrays::{self, with_element};
use crate::coll::Comm;
use crate::error;

/// The element type shared by `a` and `b`.
fn pair_kind(a: &Bound<'_, PyAny>, b: &Bound<'_, PyAny>, what: &str) -> PyResult<arrays::Kind> {
    let kind = arrays::kind_of(a, what)?;
    arrays::expect_kind(b, kind, what)?;
    Ok(kind)
}

fn alltoallv_t<E: Element + NpElement>(
    py: Python<'_>,
    comm: &Comm,
    send: &Bound<'_, PyAny>,
    send_counts: &[usize],
    recv: &Bound<'_, PyAny>,
    recv_counts: &[usize],
) -> PyResult<()> {
    let s = arrays::read_apart::<E>(send, recv, "alltoall send")?;
    let mut r = arrays::write::<E>(recv, "alltoall recv")?;
    let s = s.elems("alltoall send")?;
    let r = arrays::elems_mut(&mut r, "alltoall recv")?;
    comm.run(py, comm.comm.alltoallv(s, send_counts, r, recv_counts))
}

/// All-to-all: `send` holds `send_counts[j]` elements for rank j, in rank order; `recv` ends
/// with `recv_counts[i]` elements from rank i. Without counts, equal blocks of
/// `len(send) / size`.
#[pyfunction]
#[pyo3(signature = (comm, send, recv, send_counts=None, recv_counts=None))]
pub(crate) fn alltoall(
    py: Python<'_>,
    comm: &Comm,
    send: &Bound<'_, PyAny>,
    recv: &Bound<'_, PyAny>,
    send_counts: Option<Vec<usize>>,
    recv_counts: Option<Vec<usize>>,
) -> PyResult<()> {
    let kind = pair_kind(send, recv, "alltoall")?;
    let n = comm.comm.size();
    let equal = |what: &str, arr: &Bound<'_, PyAny>| -> PyResult<Vec<usize>> {
        let len = arrays::len_of(arr, "alltoall")?;
        if len % n != 0 {
            return Err(PyValueError::new_err(format!(
                "alltoall {what}: {len} elements do not split into {n} equal blocks; pass the \
                 split sizes"
            )));
        }
        Ok(vec![len / n; n])
    };
    let send_counts = match send_counts {
        Some(c) => c,
        None => equal("send", send)?,
    };
    let recv_counts = match recv_counts {
        Some(c) => c,
        None => equal("recv", recv)?,
    };
    with_element!(kind, E => alltoallv_t::<E>(py, comm, send, &send_counts, recv, &recv_counts))
}

/// Gather: `root`'s `recv` (size x `send`) ends with every rank's `send`, in rank order; the
/// other ranks pass `None`.
#[pyfunction]
#[pyo3(signature = (comm, send, recv, root))]
pub(crate) fn gather(
    py: Python<'_>,
    comm: &Comm,
    send: &Bound<'_, PyAny>,
    recv: Option<&Bound<'_, PyAny>>,
    root: usize,
) -> PyResult<()> {
    let kind = arrays::kind_of(send, "gather send")?;
    if let Some(r) = recv {
        arrays::expect_kind(r, kind, "gather recv")?;
    }
    with_element!(kind, E => {
        let s = match recv {
            Some(r) => arrays::read_apart::<E>(send, r, "gather send")?,
            None => arrays::Input::Borrowed(arrays::read::<E>(send, "gather send")?),
        };
        let s = s.elems("gather send")?;
        let mut r = recv.map(|r| arrays::write::<E>(r, "gather recv")).transpose()?;
        let r = match r.as_mut() {
            Some(r) => Some(arrays::elems_mut(r, "gather recv")?),
            None => None,
        };
        comm.run(py, comm.comm.gather(s, r, root))
    })
}

/// Scatter: every rank's `recv` ends with its block of `root`'s `send` (size x `recv`); the
/// other ranks pass `None`.
#[pyfunction]
#[pyo3(signature = (comm, send, recv, root))]
pub(crate) fn scatter(
    py: Python<'_>,
    comm: &Comm,
    send: Option<&Bound<'_, PyAny>>,
    recv: &Bound<'_, PyAny>,
    root: usize,
) -> PyResult<()> {
    let kind = arrays::kind_of(recv, "scatter recv")?;
    if let Some(s) = send {
        arrays::expect_kind(s, kind, "scatter send")?;
    }
    with_element!(kind, E => {
        let s = send.map(|s| arrays::read_apart::<E>(s, recv, "scatter send")).transpose()?;
        let s = match s.as_ref() {
            Some(s) => Some(s.elems("scatter send")?),
            None => None,
        };
        let mut r = arrays::write::<E>(recv, "scatter recv")?;
        let r = arrays::elems_mut(&mut r, "scatter recv")?;
        comm.run(py, comm.comm.scatter(s, r, root))
    })
}

/// A point-to-point message's place, taken when the call is made: the n-th send from a to b
/// with a tag meets the n-th receive on b from a with that tag.
#[pyclass(module = "psnet._psnet", frozen)]
pub(crate) struct Ticket(P2pTicket);

/// The next send's place to rank `peer` with `tag` (`send=True`), or receive's from it.
#[pyfunction]
pub(crate) fn p2p_ticket(comm: &Comm, peer: usize, tag: u64, send: bool) -> PyResult<Ticket> {
    let t = if send {
        comm.comm.send_ticket(peer, tag)
    } else {
        comm.comm.recv_ticket(peer, tag)
    };
    t.map(Ticket).map_err(error::coll)
}

/// Sends `array` in the place `ticket` took; returns once the transport has taken it.
#[pyfunction]
pub(crate) fn send_with(
    py: Python<'_>,
    comm: &Comm,
    ticket: &Ticket,
    array: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let t = ticket.0;
    with_element!(arrays::kind_of(array, "send")?, E => {
        let a = arrays::read::<E>(array, "send")?;
        let a = arrays::elems(&a, "send")?;
        comm.run_p2p(py, comm.comm.send_in_turn(t, a))
    })
}

/// Receives into `array` the message in the place `ticket` took.
#[pyfunction]
pub(crate) fn recv_with(
    py: Python<'_>,
    comm: &Comm,
    ticket: &Ticket,
    array: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let t = ticket.0;
    with_element!(arrays::kind_of(array, "recv")?, E => {
        let mut a = arrays::write::<E>(array, "recv")?;
        let a = arrays::elems_mut(&mut a, "recv")?;
        comm.run_p2p(py, comm.comm.recv_in_turn(t, a))
    })
}

/// Receives into `array` the next message with `tag` from whichever rank's comes first;
/// returns the sender's rank.
#[pyfunction]
pub(crate) fn recv_any(
    py: Python<'_>,
    comm: &Comm,
    array: &Bound<'_, PyAny>,
    tag: u64,
) -> PyResult<usize> {
    with_element!(arrays::kind_of(array, "recv")?, E => {
        let mut a = arrays::write::<E>(array, "recv")?;
        let a = arrays::elems_mut(&mut a, "recv")?;
        comm.run_p2p(py, comm.comm.recv_any(tag, a))
    })
}
