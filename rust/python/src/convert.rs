//! Python arguments to plain Rust values, following docs/inputs.md (the accepted-input set and
//! the error order the reference model follows too).
//!
//! A scalar int is a Python `int` (not a `bool`) or a numpy integer scalar; a sequence of ints
//! is a `list`, `tuple`, `range` or 1-D integer `numpy.ndarray`. Values are read through the
//! base types' C layouts, never through a method the caller's object could override
//! (`__index__`, `__iter__`, `astype`): conversion runs no user code, so it cannot swallow a
//! user exception or see two different values for one input. Every buffer is reserved with
//! `try_reserve_exact` after the length is checked against `MAX_LEN`, so a huge input is an
//! `InvalidArgumentError` or a `MemoryError`, never an abort.

use crate::errors::invalid;
use crate::numpy_api::numpy_loaded;
use numpy::npyffi::{self, NpyTypes, PY_ARRAY_API};
use numpy::{PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pagedkv_core::MAX_KEY_LEN;
use pyo3::exceptions::PyMemoryError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyInt, PyList, PyRange, PyString, PyTuple, PyType};
use pyo3::{ffi, intern};

/// Most entries a sequence argument may have (and most tokens a sequence may hold).
pub const MAX_LEN: usize = i32::MAX as usize;

/// An optional argument exactly as given. Unlike `Option`, an explicit `None` stays visible,
/// so `lookahead=None` is refused like any other non-int instead of meaning the default.
pub enum Given<'py> {
    Absent,
    Value(Bound<'py, PyAny>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Given<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Given::Value(obj.to_owned()))
    }
}

static TYPE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static MASKED_ARRAY: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// An `InvalidArgumentTypeError` (an `InvalidArgumentError` and a `TypeError`): an argument
/// of the wrong kind, as opposed to a right kind with a bad value.
pub fn wrong_type(py: Python<'_>, msg: impl Into<String>) -> PyErr {
    match TYPE_ERROR.import(py, "pagedkv.errors", "InvalidArgumentTypeError") {
        Ok(ty) => PyErr::from_type(ty.clone(), msg.into()),
        Err(e) => e,
    }
}

fn no_memory(what: &str, n: usize) -> PyErr {
    PyMemoryError::new_err(format!("out of memory converting {n} entries of {what}"))
}

/// An empty vector with room for `n` values, or a `MemoryError`.
fn reserve<T>(n: usize, what: &str) -> PyResult<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(n).map_err(|_| no_memory(what, n))?;
    Ok(out)
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string())
}

/// What an argument is called in messages: `what`, or `what[i]` for an element. Formatted
/// only when a message is written, never on the hot path.
#[derive(Clone, Copy)]
struct Name<'a>(&'a str, Option<usize>);

impl std::fmt::Display for Name<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.1 {
            Some(i) => write!(f, "{}[{i}]", self.0),
            None => f.write_str(self.0),
        }
    }
}

/// A scalar int's value. Every accepted range lies within `[-2**63, 2**64)`, so a Python int
/// outside it is only ever out of range (`Huge`, with its sign).
enum Scalar {
    Int(i128),
    Huge { negative: bool },
}

/// The value of a Python int (not a bool) or of a numpy integer scalar; `None` for anything
/// else. `PyLong_AsLongLongAndOverflow` and `PyLong_AsUnsignedLongLong` read an int (or int
/// subclass) directly, and numpy scalars are copied out by numpy's C API, so no `__index__`
/// runs.
fn scalar(obj: &Bound<'_, PyAny>) -> Option<Scalar> {
    if obj.is_instance_of::<PyInt>() {
        if obj.is_instance_of::<PyBool>() {
            return None;
        }
        let mut overflow = 0;
        // SAFETY: `obj` is an int, so this cannot fail other than by overflow (reported in
        // `overflow`, no exception set).
        let v = unsafe { ffi::PyLong_AsLongLongAndOverflow(obj.as_ptr(), &mut overflow) };
        return Some(match overflow {
            0 => Scalar::Int(v.into()),
            o if o < 0 => Scalar::Huge { negative: true },
            _ => obj
                .extract::<u64>()
                .map_or(Scalar::Huge { negative: false }, |v| Scalar::Int(v.into())),
        });
    }
    numpy_int(obj).map(Scalar::Int)
}

/// The value of a numpy integer scalar (`np.int8` .. `np.uint64`; not `np.timedelta64`,
/// which numpy also files under `np.integer`).
fn numpy_int(obj: &Bound<'_, PyAny>) -> Option<i128> {
    let py = obj.py();
    // Without numpy no object is a numpy scalar. (numpy loaded, then made unimportable: its
    // scalars are then not read, so an argument that is one is refused by type.)
    if !numpy_loaded(py).unwrap_or(false) {
        return None;
    }
    // SAFETY: the numpy API table is initialised by `get_type_object`; the scalar check
    // comes first, and `PyArray_ScalarAsCtype` writes at most `itemsize` (<= 8 for the kinds
    // read below) bytes into the 16-byte buffer.
    unsafe {
        let ty = npyffi::get_type_object(py, NpyTypes::PyIntegerArrType_Type);
        if ffi::PyObject_TypeCheck(obj.as_ptr(), ty) == 0 {
            return None;
        }
        let descr = PY_ARRAY_API.PyArray_DescrFromScalar(py, obj.as_ptr());
        let descr = Bound::from_owned_ptr_or_opt(py, descr.cast::<ffi::PyObject>())?;
        let descr = descr.cast_into::<numpy::PyArrayDescr>().ok()?;
        let (kind, size) = (descr.kind(), descr.itemsize());
        let mut buf = [0u8; 16];
        PY_ARRAY_API.PyArray_ScalarAsCtype(py, obj.as_ptr(), buf.as_mut_ptr().cast());
        let b = &buf;
        Some(match (kind, size) {
            (b'i', 1) => i8::from_ne_bytes([b[0]]).into(),
            (b'u', 1) => b[0].into(),
            (b'i', 2) => i16::from_ne_bytes([b[0], b[1]]).into(),
            (b'u', 2) => u16::from_ne_bytes([b[0], b[1]]).into(),
            (b'i', 4) => i32::from_ne_bytes(b[..4].try_into().ok()?).into(),
            (b'u', 4) => u32::from_ne_bytes(b[..4].try_into().ok()?).into(),
            (b'i', 8) => i64::from_ne_bytes(b[..8].try_into().ok()?).into(),
            (b'u', 8) => u64::from_ne_bytes(b[..8].try_into().ok()?).into(),
            _ => return None,
        })
    }
}

/// `int.__repr__` of an int too large for any range: the base method, not an override.
fn int_repr(obj: &Bound<'_, PyAny>) -> String {
    obj.py()
        .get_type::<PyInt>()
        .call_method1(intern!(obj.py(), "__repr__"), (obj,))
        .map_or_else(|_| "a larger int".to_owned(), |r| r.to_string())
}

/// One scalar int in `lo..=hi` as `T`.
fn int_in<T: TryFrom<i128>>(
    obj: &Bound<'_, PyAny>,
    what: Name<'_>,
    lo: i128,
    hi: i128,
    range: impl std::fmt::Display,
) -> PyResult<T> {
    let py = obj.py();
    match scalar(obj) {
        Some(Scalar::Int(v)) if (lo..=hi).contains(&v) => {
            T::try_from(v).map_err(|_| invalid(py, format!("{what} = {v} is out of range {range}")))
        }
        Some(Scalar::Int(v)) => Err(invalid(py, format!("{what} = {v} is out of range {range}"))),
        Some(Scalar::Huge { .. }) => Err(invalid(
            py,
            format!("{what} = {} is out of range {range}", int_repr(obj)),
        )),
        None => Err(wrong_type(
            py,
            format!("{what} must be an int, got {}", type_name(obj)),
        )),
    }
}

/// A required int argument in `lo..=hi`.
pub fn int_arg(obj: &Bound<'_, PyAny>, what: &str, lo: i64, hi: i64) -> PyResult<i64> {
    int_in(obj, Name(what, None), lo.into(), hi.into(), Bounds(lo, hi))
}

/// An accepted range `[lo, hi]` in messages, formatted only when a message is written (an
/// eager `format!` cost every int argument an allocation on the per-step calls).
#[derive(Clone, Copy)]
struct Bounds(i64, i64);

impl std::fmt::Display for Bounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}, {}]", self.0, self.1)
    }
}

/// An optional int argument in `lo..=hi`; left out, it is `default` (`None` is refused).
pub fn opt_int_arg(obj: &Given<'_>, default: i64, what: &str, lo: i64, hi: i64) -> PyResult<i64> {
    match obj {
        Given::Absent => Ok(default),
        Given::Value(o) => int_arg(o, what, lo, hi),
    }
}

/// An unsigned 64-bit argument (seeds, adapter ids).
pub fn u64_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    int_in(obj, Name(what, None), 0, u64::MAX.into(), "[0, 2**64)")
}

/// An optional unsigned 64-bit argument; left out, it is `default` (`None` is refused).
pub fn opt_u64_arg(obj: &Given<'_>, default: u64, what: &str) -> PyResult<u64> {
    match obj {
        Given::Absent => Ok(default),
        Given::Value(o) => u64_arg(o, what),
    }
}

/// `lora_id`: `None` (no adapter) or an id in `[0, 2**64)`.
pub fn lora_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    obj.map(|o| u64_arg(o, "lora_id")).transpose()
}

/// A flag: a Python `bool`, nothing else (a truthy string is a mistake, not `True`).
pub fn flag(obj: &Given<'_>, default: bool, what: &str) -> PyResult<bool> {
    match obj {
        Given::Absent => Ok(default),
        Given::Value(o) => match o.cast::<PyBool>() {
            Ok(b) => Ok(b.is_true()),
            Err(_) => Err(wrong_type(
                o.py(),
                format!("{what} must be a bool, got {}", type_name(o)),
            )),
        },
    }
}

/// A text argument (`hash_algo`): a `str`.
pub fn text<'py>(obj: &Given<'py>, default: &'static str, what: &str) -> PyResult<String> {
    match obj {
        Given::Absent => Ok(default.to_owned()),
        Given::Value(o) => match o.cast::<PyString>() {
            Ok(s) => Ok(s.to_string_lossy().into_owned()),
            Err(_) => Err(wrong_type(
                o.py(),
                format!("{what} must be a str, got {}", type_name(o)),
            )),
        },
    }
}

/// A float argument (docs/inputs.md): a Python `float` (subclasses such as `np.float64`
/// included) or `int` (not a `bool`; one too large for an `f64` reads as infinite, out of
/// every range). Anything else (`np.float32`, 0-d arrays, strings) is refused by type.
pub fn float_arg(o: &Bound<'_, PyAny>, what: &str) -> PyResult<f64> {
    if let Ok(f) = o.cast::<PyFloat>() {
        return Ok(f.value());
    }
    match scalar(o) {
        Some(Scalar::Int(v)) if o.is_instance_of::<PyInt>() => Ok(v as f64),
        Some(Scalar::Huge { .. }) => Ok(f64::INFINITY), // out of range, whatever its sign
        _ => Err(wrong_type(
            o.py(),
            format!("{what} must be a float, got {}", type_name(o)),
        )),
    }
}

/// `watermark`: a float or int (not a bool), finite, in `[0, 1)`.
pub fn watermark(obj: &Given<'_>) -> PyResult<f64> {
    let Given::Value(o) = obj else {
        return Ok(0.01);
    };
    let w = float_arg(o, "watermark")?;
    if (0.0..1.0).contains(&w) {
        Ok(w)
    } else {
        Err(invalid(
            o.py(),
            format!("watermark = {w} is out of range [0, 1)"),
        ))
    }
}

/// A sequence of ints in `lo..=hi`, as `T`s: the entries of a `list` or `tuple` (exact types:
/// a subclass could override what iterating means), of a `range`, or of a 1-D integer ndarray.
fn ints<T: TryFrom<i128>>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    lo: i128,
    hi: i128,
    range: &str,
) -> PyResult<Vec<T>> {
    let py = obj.py();
    if let Some(arr) = as_array(obj)? {
        return from_array(&arr, what, lo, hi, range);
    }
    let too_long = |n: &dyn std::fmt::Display| {
        invalid(
            py,
            format!("{what} has {n} entries, more than the maximum {MAX_LEN}"),
        )
    };
    if let Ok(list) = obj.cast_exact::<PyList>() {
        if list.len() > MAX_LEN {
            return Err(too_long(&list.len()));
        }
        let mut out = reserve(list.len(), what)?;
        for (i, item) in list.iter().enumerate() {
            out.push(int_in(&item, Name(what, Some(i)), lo, hi, range)?);
        }
        return Ok(out);
    }
    if let Ok(tuple) = obj.cast_exact::<PyTuple>() {
        if tuple.len() > MAX_LEN {
            return Err(too_long(&tuple.len()));
        }
        let mut out = reserve(tuple.len(), what)?;
        for (i, item) in tuple.iter().enumerate() {
            out.push(int_in(&item, Name(what, Some(i)), lo, hi, range)?);
        }
        return Ok(out);
    }
    if let Ok(r) = obj.cast::<PyRange>() {
        // A range's length overflows `len()` beyond 2**63 - 1: then it is too long anyway.
        let n = r.len().map_err(|_| too_long(&"more than 2**63"))?;
        if n > MAX_LEN {
            return Err(too_long(&n));
        }
        let mut out = reserve(n, what)?;
        if n == 0 {
            return Ok(out);
        }
        // Range attributes are plain ints. One beyond every range (`Huge`) makes entry 0
        // (start) or entry 1 on (step) out of range, as its value would be.
        let exact = |name| -> PyResult<Option<i128>> {
            Ok(match scalar(&r.getattr(name)?) {
                Some(Scalar::Int(v)) => Some(v),
                _ => None,
            })
        };
        let (start, step) = (exact(intern!(py, "start"))?, exact(intern!(py, "step"))?);
        for i in 0..n {
            let d = if i == 0 {
                Some(0)
            } else {
                step.and_then(|s| s.checked_mul(i as i128))
            };
            let v = d
                .and_then(|d| start?.checked_add(d))
                .filter(|v| (lo..=hi).contains(v))
                .and_then(|v| T::try_from(v).ok());
            let v = v.ok_or_else(|| {
                invalid(
                    py,
                    format!("{} is out of range {range}", Name(what, Some(i))),
                )
            })?;
            out.push(v);
        }
        return Ok(out);
    }
    Err(wrong_type(
        py,
        format!(
            "{what} must be a list, tuple, range or 1-D integer numpy array, got {}",
            type_name(obj)
        ),
    ))
}

/// The common token input, a plain (exact `ndarray`), contiguous, native-order `uint32`
/// array, copied whole: every `uint32` is a token id, so there is nothing to check per entry.
/// `None` for any other input (read by `ints`).
fn plain_u32(obj: &Bound<'_, PyAny>, what: &str) -> Option<PyResult<Vec<u32>>> {
    match numpy_loaded(obj.py()) {
        Ok(true) => {}
        Ok(false) => return None,
        Err(e) => return Some(Err(e)),
    }
    if !obj.get_type().is(obj.py().get_type::<PyUntypedArray>()) {
        return None;
    }
    let arr = obj.cast::<PyArray1<u32>>().ok()?;
    let view = arr.try_readonly().ok()?;
    let src = view.as_slice().ok()?;
    if src.len() > MAX_LEN {
        return None;
    }
    Some(reserve(src.len(), what).map(|mut out| {
        out.extend_from_slice(src);
        out
    }))
}

/// Entries of an ndarray, read from its buffer with its own strides and byte order.
fn from_array<T: TryFrom<i128>>(
    arr: &Bound<'_, PyUntypedArray>,
    what: &str,
    lo: i128,
    hi: i128,
    range: &str,
) -> PyResult<Vec<T>> {
    let py = arr.py();
    if !arr.get_type().is(py.get_type::<PyUntypedArray>()) {
        // Masked entries have no value to read: refusing is safer than reading the data
        // under the mask. Other subclasses are read as the plain arrays they are.
        let masked = MASKED_ARRAY.import(py, "numpy.ma", "MaskedArray")?;
        if arr.is_instance(masked)? {
            return Err(wrong_type(
                py,
                format!("{what} must not be a masked array (fill it or compress it first)"),
            ));
        }
    }
    if arr.ndim() != 1 {
        return Err(wrong_type(
            py,
            format!("{what} must be a 1-D array, got {} dimensions", arr.ndim()),
        ));
    }
    let dtype = arr.dtype();
    let (kind, size) = (dtype.kind(), dtype.itemsize());
    if !matches!(kind, b'i' | b'u') {
        return Err(wrong_type(
            py,
            format!("{what} must have an integer dtype, got {dtype}"),
        ));
    }
    let n = arr.len();
    if n > MAX_LEN {
        return Err(invalid(
            py,
            format!("{what} has {n} entries, more than the maximum {MAX_LEN}"),
        ));
    }
    let swap = dtype.is_native_byteorder() == Some(false);
    // SAFETY: numpy guarantees `data + i * stride` (i < len) addresses one element of
    // `itemsize` bytes; reads are unaligned-safe. The GIL is held throughout and no Python
    // code runs during the loop, so nothing can resize or free the buffer meanwhile.
    let (data, stride) = unsafe { ((*arr.as_array_ptr()).data as *const u8, arr.strides()[0]) };
    let read = Read {
        data,
        stride,
        n,
        swap,
        what,
        lo,
        hi,
        range,
    };
    match (kind, size) {
        (b'i', 1) => read.all::<i8, T>(py),
        (b'u', 1) => read.all::<u8, T>(py),
        (b'i', 2) => read.all::<i16, T>(py),
        (b'u', 2) => read.all::<u16, T>(py),
        (b'i', 4) => read.all::<i32, T>(py),
        (b'u', 4) => read.all::<u32, T>(py),
        (b'i', 8) => read.all::<i64, T>(py),
        (b'u', 8) => read.all::<u64, T>(py),
        _ => Err(wrong_type(
            py,
            format!("{what} must have an integer dtype, got {dtype}"),
        )),
    }
}

/// A numpy integer element type: read raw, byte-swapped when the array is not native.
trait Raw: Copy + Into<i128> {
    fn swapped(self) -> Self;
}

macro_rules! raw {
    ($($t:ty),*) => {$(
        impl Raw for $t {
            fn swapped(self) -> Self {
                self.swap_bytes()
            }
        }
    )*};
}
raw!(i8, u8, i16, u16, i32, u32, i64, u64);

struct Read<'a> {
    data: *const u8,
    stride: isize,
    n: usize,
    swap: bool,
    what: &'a str,
    lo: i128,
    hi: i128,
    range: &'a str,
}

impl Read<'_> {
    fn all<S: Raw, T: TryFrom<i128>>(&self, py: Python<'_>) -> PyResult<Vec<T>> {
        let mut out = reserve(self.n, self.what)?;
        for i in 0..self.n {
            // SAFETY: see `from_array`; `i < len`.
            let raw = unsafe {
                self.data
                    .offset(i as isize * self.stride)
                    .cast::<S>()
                    .read_unaligned()
            };
            let v: i128 = if self.swap { raw.swapped() } else { raw }.into();
            match T::try_from(v) {
                Ok(t) if (self.lo..=self.hi).contains(&v) => out.push(t),
                _ => {
                    return Err(invalid(
                        py,
                        format!("{}[{i}] = {v} is out of range {}", self.what, self.range),
                    ))
                }
            }
        }
        Ok(out)
    }
}

const TOKEN_MAX: i128 = u32::MAX as i128;
const ID_MAX: i128 = u64::MAX as i128;

/// Token ids: non-empty, each in `[0, 2**32)`.
pub fn tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let out = batch_tokens(obj)?;
    if out.is_empty() {
        return Err(invalid(obj.py(), "token_ids must not be empty"));
    }
    Ok(out)
}

/// Token ids that may be empty (one per sequence of a batch; `hash_blocks`).
pub fn batch_tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Some(out) = plain_u32(obj, "token_ids") {
        return out;
    }
    ints(obj, "token_ids", 0, TOKEN_MAX, "[0, 2**32)")
}

/// Sequence ids of a batch: each in `[0, 2**64)`.
pub fn seq_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    ints(obj, "seq_ids", 0, ID_MAX, "[0, 2**64)")
}

/// 64-bit values (the router's integer block hashes): each in `[0, 2**64)`.
pub fn u64s(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    ints(obj, what, 0, ID_MAX, "[0, 2**64)")
}

/// GPU block ids (`evict_blocks`): each in `[0, 2**31)` (whether it names a block of the
/// pool is the core's check).
pub fn block_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    ints(obj, "block_ids", 0, i32::MAX.into(), "[0, 2**31)")
}

/// One sequence id (the argument `seq_id`).
pub fn seq_id(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    id_arg(obj, "seq_id")
}

/// One sequence id, for an argument called `what`.
pub fn id_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    int_in(obj, Name(what, None), 0, ID_MAX, "[0, 2**64)")
}

/// A sequence id if `obj` is one, else `None` (for `in`, which never raises).
pub fn maybe_seq_id(obj: &Bound<'_, PyAny>) -> Option<u64> {
    match scalar(obj)? {
        Scalar::Int(v) => u64::try_from(v).ok(),
        Scalar::Huge { .. } => None,
    }
}

/// Whether `can_allocate`'s first argument is a count (an int, or anything that is not a
/// sized collection: its error then names `num_tokens`) rather than the prompt's token ids.
pub fn is_count(obj: &Bound<'_, PyAny>) -> bool {
    scalar(obj).is_some() || !obj.hasattr("__len__").unwrap_or(false)
}

/// `can_allocate`'s token count: an int >= 1 of any size. Counts beyond `i64::MAX` need more
/// blocks than any pool has (NEVER either way), so they are capped there: no overflow below.
pub fn token_count(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    let cap = i64::MAX as usize;
    match scalar(obj) {
        Some(Scalar::Huge { negative: false }) => Ok(cap),
        Some(Scalar::Int(v)) if v >= 1 => Ok(usize::try_from(v).map_or(cap, |v| v.min(cap))),
        _ => int_arg(obj, "num_tokens", 1, i64::MAX).map(|v| v as usize),
    }
}

/// Per-sequence counts (`num_new_tokens`): one int for all, or one per sequence, each in
/// `[1, 2**63)`. (Whether a count fits its sequence is a state check, in the core.)
pub fn counts(obj: &Bound<'_, PyAny>, n: usize, what: &str) -> PyResult<Vec<usize>> {
    const MAX: i128 = i64::MAX as i128;
    if scalar(obj).is_some() {
        let v: usize = int_in(obj, Name(what, None), 1, MAX, "[1, 2**63)")?;
        let mut out = reserve(n, what)?;
        out.resize(n, v);
        return Ok(out);
    }
    ints(obj, what, 1, MAX, "[1, 2**63)")
}

/// `block_hashes`: None, or an exact list or tuple of `bytes` objects (the caller's block
/// keys), each of 1..=`MAX_KEY_LEN` bytes. Read through the objects' C layouts, as ints are.
pub fn keys_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<Vec<u8>>>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    let py = obj.py();
    let items: Vec<Bound<'_, PyAny>> = if let Ok(l) = obj.cast_exact::<PyList>() {
        l.iter().collect()
    } else if let Ok(t) = obj.cast_exact::<PyTuple>() {
        t.iter().collect()
    } else {
        return Err(wrong_type(
            py,
            format!(
                "block_hashes must be a list or tuple of bytes, or None, got {}",
                type_name(obj)
            ),
        ));
    };
    let mut out = reserve(items.len(), "block_hashes")?;
    for (i, item) in items.iter().enumerate() {
        let b = item.cast::<PyBytes>().map_err(|_| {
            wrong_type(
                py,
                format!("block_hashes[{i}] must be bytes, got {}", type_name(item)),
            )
        })?;
        let key = b.as_bytes();
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(invalid(
                py,
                format!(
                    "block_hashes[{i}] has {} bytes: a key has 1..={MAX_KEY_LEN}",
                    key.len()
                ),
            ));
        }
        out.push(key.to_vec());
    }
    Ok(Some(out))
}

/// `max_hit_tokens`: None (no cap) or an int `>= 0`.
pub fn max_hit_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    obj.filter(|o| !o.is_none())
        .map(|o| int_arg(o, "max_hit_tokens", 0, i64::MAX).map(|v| v as usize))
        .transpose()
}

/// Token positions (`reachable_tokens`): a sequence of ints in `[0, 2**31)`.
pub fn positions(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<usize>> {
    ints(obj, what, 0, i128::from(i32::MAX), "[0, 2**31)")
}

/// `loaded_tokens`: None (0) or an int `>= 0`.
pub fn loaded_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
    obj.filter(|o| !o.is_none()).map_or(Ok(0), |o| {
        int_arg(o, "loaded_tokens", 0, i64::MAX).map(|v| v as usize)
    })
}

/// A batch query's `lookahead` as given: one count for every sequence, or one per sequence.
pub enum Lookaheads {
    All(usize),
    Each(Vec<usize>),
}

impl Lookaheads {
    /// The core's view (whether a per-sequence list matches the batch is the core's check).
    pub fn as_core(&self) -> pagedkv_core::Lookahead<'_> {
        match self {
            Lookaheads::All(k) => pagedkv_core::Lookahead::All(*k),
            Lookaheads::Each(ks) => pagedkv_core::Lookahead::Each(ks),
        }
    }
}

/// `lookahead` of `slot_mapping` and `flashinfer_page_table`: left out, 0; one int for all,
/// or one int per sequence (a prefill beside decodes with drafts has 0), each in
/// `[0, 2**63)`. `None` is refused like any other non-int.
pub fn lookaheads(obj: &Given<'_>) -> PyResult<Lookaheads> {
    const MAX: i128 = i64::MAX as i128;
    match obj {
        Given::Absent => Ok(Lookaheads::All(0)),
        Given::Value(v) if scalar(v).is_some() => {
            int_in(v, Name("lookahead", None), 0, MAX, "[0, 2**63)").map(Lookaheads::All)
        }
        Given::Value(v) if is_int_sequence(v)? => {
            ints(v, "lookahead", 0, MAX, "[0, 2**63)").map(Lookaheads::Each)
        }
        Given::Value(v) => Err(wrong_type(
            v.py(),
            format!(
                "lookahead must be an int, or a list, tuple, range or 1-D integer numpy array \
                 of ints, got {}",
                type_name(v)
            ),
        )),
    }
}

/// Whether `ints` reads `obj` as a sequence (the kinds it accepts; its entries and, for an
/// array, its shape and dtype are still to check).
fn is_int_sequence(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(obj.cast_exact::<PyList>().is_ok()
        || obj.cast_exact::<PyTuple>().is_ok()
        || obj.cast::<PyRange>().is_ok()
        || as_array(obj)?.is_some())
}

/// `obj` as an ndarray (subclasses included), if it is one. Without numpy (`numpy_loaded`)
/// nothing is.
fn as_array<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyUntypedArray>>> {
    if !numpy_loaded(obj.py())? {
        return Ok(None);
    }
    Ok(obj.cast::<PyUntypedArray>().ok().cloned())
}
