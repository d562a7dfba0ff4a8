use pyo3::prelude::*; #[pymodule] mod _core {}
