//! NumPy arrays as slices, without copying: C-contiguous arrays of the expected element type
//! are borrowed in place (numpy's borrow checking keeps Python from resizing or freeing them
//! meanwhile); anything else is a clear `TypeError` / `ValueError`.

use numpy::{
    dtype, Element, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn,
    PyReadwriteArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// Calls `$body` with `$t` the Rust element type of `$kind`.
macro_rules! with_element {
    ($kind:expr, $t:ident => $body:expr) => {
        match $kind {
            $crate::arrays::Kind::F32 => {
                type $t = f32;
                $body
            }
            $crate::arrays::Kind::F64 => {
                type $t = f64;
                $body
            }
            $crate::arrays::Kind::F16 => {
                type $t = half::f16;
                $body
            }
            $crate::arrays::Kind::I32 => {
                type $t = i32;
                $body
            }
            $crate::arrays::Kind::I64 => {
                type $t = i64;
                $body
            }
            $crate::arrays::Kind::U8 => {
                type $t = u8;
                $body
            }
        }
    };
}

pub(crate) use with_element;

/// The element types psnet's Python calls take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    F32,
    F64,
    F16,
    I32,
    I64,
    U8,
}

impl Kind {
    const ALL: [(Kind, &'static str); 6] = [
        (Kind::F32, "float32"),
        (Kind::F64, "float64"),
        (Kind::F16, "float16"),
        (Kind::I32, "int32"),
        (Kind::I64, "int64"),
        (Kind::U8, "uint8"),
    ];

    pub(crate) fn name(self) -> &'static str {
        Kind::ALL
            .iter()
            .find(|(k, _)| *k == self)
            .map_or("?", |(_, n)| n)
    }
}

fn is<T: Element>(array: &Bound<'_, PyUntypedArray>) -> bool {
    array.dtype().is_equiv_to(&dtype::<T>(array.py()))
}

/// The element type of `obj`, a NumPy array; `what` names the argument in errors.
pub(crate) fn kind_of(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Kind> {
    let array = obj.cast::<PyUntypedArray>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what}: expected a numpy.ndarray, got {}",
            type_name(obj)
        ))
    })?;
    let kind = if is::<f32>(array) {
        Kind::F32
    } else if is::<f64>(array) {
        Kind::F64
    } else if is::<half::f16>(array) {
        Kind::F16
    } else if is::<i32>(array) {
        Kind::I32
    } else if is::<i64>(array) {
        Kind::I64
    } else if is::<u8>(array) {
        Kind::U8
    } else {
        let names: Vec<&str> = Kind::ALL.iter().map(|(_, n)| *n).collect();
        return Err(PyTypeError::new_err(format!(
            "{what}: arrays of {} are not supported (use one of {})",
            array.dtype(),
            names.join(", ")
        )));
    };
    Ok(kind)
}

/// The number of elements of `obj`, a NumPy array.
pub(crate) fn len_of(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    obj.cast::<PyUntypedArray>().map(|a| a.len()).map_err(|_| {
        PyTypeError::new_err(format!(
            "{what}: expected a numpy.ndarray, got {}",
            type_name(obj)
        ))
    })
}

/// `obj` if it holds elements of `kind`, else a `TypeError` naming both.
pub(crate) fn expect_kind(obj: &Bound<'_, PyAny>, kind: Kind, what: &str) -> PyResult<()> {
    let got = kind_of(obj, what)?;
    if got != kind {
        return Err(PyTypeError::new_err(format!(
            "{what}: an array of {} where {} was expected",
            got.name(),
            kind.name()
        )));
    }
    Ok(())
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "an object".into(), |n| n.to_string())
}

/// A read-only borrow of `obj`'s elements.
pub(crate) fn read<'py, T: Element>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    let array = obj
        .cast::<PyArrayDyn<T>>()
        .map_err(|_| PyTypeError::new_err(format!("{what}: not an array of the expected type")))?;
    let borrowed = array
        .try_readonly()
        .map_err(|e| PyValueError::new_err(format!("{what}: {e}")))?;
    contiguous(&borrowed, what)?;
    Ok(borrowed)
}

/// An input's elements: borrowed in place, or copied where its memory overlaps the output's.
pub(crate) enum Input<'py, T: Element> {
    Borrowed(PyReadonlyArrayDyn<'py, T>),
    Copied(Vec<T>),
}

impl<T: Element> Input<'_, T> {
    /// The elements.
    pub(crate) fn elems(&self, what: &str) -> PyResult<&[T]> {
        match self {
            Input::Borrowed(b) => elems(b, what),
            Input::Copied(v) => Ok(v),
        }
    }
}

/// The bytes `obj`'s elements span (`obj` must be an array of `T`).
fn span<T: Element>(obj: &Bound<'_, PyAny>) -> Option<std::ops::Range<usize>> {
    let array = obj.cast::<PyArrayDyn<T>>().ok()?;
    let start = array.data() as usize;
    Some(start..start + array.len() * std::mem::size_of::<T>())
}

/// `send`'s elements for a call that writes `recv`: borrowed, unless the two share memory
/// (torch passes an in-place all-gather's input as a view of its output), in which case a
/// copy made now: a shared and a mutable slice of one memory must never exist at once.
pub(crate) fn read_apart<'py, T: Element + Copy>(
    send: &Bound<'py, PyAny>,
    recv: &Bound<'_, PyAny>,
    what: &str,
) -> PyResult<Input<'py, T>> {
    let borrowed = read::<T>(send, what)?;
    let overlap = match (span::<T>(send), span::<T>(recv)) {
        (Some(a), Some(b)) => !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end,
        _ => false,
    };
    if overlap {
        let copy = elems(&borrowed, what)?.to_vec();
        return Ok(Input::Copied(copy));
    }
    Ok(Input::Borrowed(borrowed))
}

/// A writable borrow of `obj`'s elements.
pub(crate) fn write<'py, T: Element>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<PyReadwriteArrayDyn<'py, T>> {
    let array = obj
        .cast::<PyArrayDyn<T>>()
        .map_err(|_| PyTypeError::new_err(format!("{what}: not an array of the expected type")))?;
    let borrowed = array.try_readwrite().map_err(|e| {
        PyValueError::new_err(format!(
            "{what}: cannot write into this array ({e}; is it read-only, or also an input?)"
        ))
    })?;
    contiguous(&borrowed, what)?;
    Ok(borrowed)
}

fn contiguous<T: Element>(array: &PyReadonlyArrayDyn<'_, T>, what: &str) -> PyResult<()> {
    if array.is_c_contiguous() {
        Ok(())
    } else {
        Err(not_contiguous(what))
    }
}

/// The error for an array psnet cannot use in place.
pub(crate) fn not_contiguous(what: &str) -> PyErr {
    PyValueError::new_err(format!(
        "{what}: the array is not C-contiguous (numpy.ascontiguousarray makes a copy that is)"
    ))
}

/// The elements of a read-only borrow (contiguous: [`read`] checked).
pub(crate) fn elems<'a, T: Element>(
    borrowed: &'a PyReadonlyArrayDyn<'_, T>,
    what: &str,
) -> PyResult<&'a [T]> {
    borrowed.as_slice().map_err(|_| not_contiguous(what))
}

/// The elements of a writable borrow (contiguous: [`write`] checked).
pub(crate) fn elems_mut<'a, T: Element>(
    borrowed: &'a mut PyReadwriteArrayDyn<'_, T>,
    what: &str,
) -> PyResult<&'a mut [T]> {
    borrowed.as_slice_mut().map_err(|_| not_contiguous(what))
}
