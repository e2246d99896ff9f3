//! `cuGetProcAddress[_v2]`: CUDA ≥ 11.3 runtimes fetch every driver entry point through it, so a
//! symbol override alone misses them. The real lookup runs first (its status is the program's);
//! where it found a function the shim hooks, the hook is handed out instead.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;
use std::sync::atomic::AtomicUsize;

use crate::real::{Lib, resolve};

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
    // The driver hands out the newest variant both the caller and the driver know; the hook
    // must be of that variant, whose arguments the caller will pass.
    let version = driver_version().map_or(version, |driver| version.min(driver));
    if let Some(hook) = super::by_proc(name.to_bytes(), version, flags) {
        // SAFETY: as above.
        unsafe { pfn.write(hook as *mut c_void) };
    }
}

/// The real driver's CUDA version (`cuDriverGetVersion`), asked once; `None` when it cannot say.
fn driver_version() -> Option<c_int> {
    static VERSION: OnceLock<Option<c_int>> = OnceLock::new();
    *VERSION.get_or_init(|| {
        static REAL: AtomicUsize = AtomicUsize::new(0);
        let address = resolve(&REAL, Lib::Cuda, b"cuDriverGetVersion\0")?;
        // SAFETY: the real library's cuDriverGetVersion, of this signature.
        let real = unsafe { std::mem::transmute::<usize, DriverGetVersion>(address) };
        let mut version = 0;
        // SAFETY: a valid out-pointer.
        (unsafe { real(&mut version) } == 0).then_some(version)
    })
}

type DriverGetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;

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
