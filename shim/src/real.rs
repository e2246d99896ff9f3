//! Finding the real functions: the driver libraries opened once (locally), each real function
//! resolved once through glibc's own `dlsym`, which the shim's exported `dlsym`
//! ([`crate::hooks::dlsym`]) also forwards to.

use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

pub(crate) type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// glibc's `dlsym`, found once with `dlvsym` (which the shim does not export). The assembly
/// below reads it as a plain word.
pub(crate) static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

/// Resolves the real `dlsym` at load time, before any program code runs.
#[used]
#[unsafe(link_section = ".init_array")]
static RESOLVE_AT_LOAD: extern "C" fn() = resolve_at_load;

extern "C" fn resolve_at_load() {
    let _ = real_dlsym();
}

pub(crate) fn real_dlsym() -> Option<DlsymFn> {
    let known = REAL_DLSYM.load(Ordering::Acquire);
    if known != 0 {
        // SAFETY: the address came from dlvsym for "dlsym", whose type is DlsymFn.
        return Some(unsafe { std::mem::transmute::<usize, DlsymFn>(known) });
    }
    for version in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
        // SAFETY: dlvsym with constant NUL-terminated strings.
        let found = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
        if !found.is_null() {
            REAL_DLSYM.store(found as usize, Ordering::Release);
            // SAFETY: this is glibc's dlsym.
            return Some(unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(found) });
        }
    }
    None
}

/// The libraries the shim forwards to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lib {
    Cuda,
    Nvml,
}

static HANDLES: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];

fn handle(lib: Lib) -> Option<*mut c_void> {
    let slot = &HANDLES[lib as usize];
    let known = slot.load(Ordering::Acquire);
    if known != 0 {
        return Some(known as *mut c_void);
    }
    let name = match lib {
        Lib::Cuda => c"libcuda.so.1",
        Lib::Nvml => c"libnvidia-ml.so.1",
    };
    // Local: the shim's lookup must not add the driver's symbols to the program's global scope
    // (a program that links the driver has them there already; one that dlopens it decides).
    // SAFETY: dlopen of a library by name; the program would load it to call it anyway.
    let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        return None;
    }
    slot.store(h as usize, Ordering::Release);
    Some(h)
}

/// The real function `name` (NUL-terminated) of `lib`, resolved once into `slot`.
pub fn resolve(slot: &AtomicUsize, lib: Lib, name: &'static [u8]) -> Option<usize> {
    let known = slot.load(Ordering::Acquire);
    if known != 0 {
        return Some(known);
    }
    let real = real_dlsym()?;
    let h = handle(lib)?;
    // SAFETY: glibc's dlsym on a live handle with a NUL-terminated name.
    let found = unsafe { real(h, name.as_ptr().cast()) };
    if found.is_null() {
        return None;
    }
    slot.store(found as usize, Ordering::Release);
    Some(found as usize)
}
