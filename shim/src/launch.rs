//! Kernel launches. Passed through for now; the compute-share arbiter (#9) hooks in here.

use std::ffi::{c_int, c_uint, c_void};

use crate::hooks::Handle;

type Launch = unsafe extern "C" fn(
    Handle,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    Handle,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;

#[allow(clippy::too_many_arguments)] // the driver's signature
pub fn launch(
    real: Launch,
    f: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> c_int {
    // SAFETY: the program's call, forwarded unchanged.
    unsafe { real(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra) }
}
