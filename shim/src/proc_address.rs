//! `cuGetProcAddress[_v2]`: CUDA ≥ 11.3 runtimes fetch every driver entry point through it, so a
//! symbol override alone misses them. The real lookup runs first (its status is the program's);
//! where it found a function the shim hooks, the hook is handed out instead.

use std::ffi::{CStr, c_char, c_int, c_void};

type V1 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> c_int;
type V2 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> c_int;

fn substitute(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) {
    if symbol.is_null() || pfn.is_null() {
        return;
    }
    // SAFETY: the real call succeeded with these pointers, so pfn points to a written pointer.
    if unsafe { pfn.read() }.is_null() {
        return;
    }
    // SAFETY: a non-null symbol is a NUL-terminated string (the API's contract).
    let name = unsafe { CStr::from_ptr(symbol) };
    if let Some(hook) = crate::hooks::by_proc(name.to_bytes(), version, flags) {
        // SAFETY: as above.
        unsafe { pfn.write(hook as *mut c_void) };
    }
}

pub fn v1(
    real: V1,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> c_int {
    // SAFETY: the program's call, forwarded unchanged.
    let rc = unsafe { real(symbol, pfn, version, flags) };
    if rc == 0 {
        substitute(symbol, pfn, version, flags);
    }
    rc
}

pub fn v2(
    real: V2,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> c_int {
    // SAFETY: the program's call, forwarded unchanged.
    let rc = unsafe { real(symbol, pfn, version, flags, status) };
    if rc == 0 {
        substitute(symbol, pfn, version, flags);
    }
    rc
}
