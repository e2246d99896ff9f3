//! Finding the real functions, and answering `dlsym` for programs that look the driver up
//! themselves (the CUDA runtime `dlopen`s `libcuda.so.1` and asks `dlsym` for its entry points).
//!
//! The shim exports `dlsym`. Lookups with `RTLD_NEXT` are jumped to (not called into) the real
//! `dlsym`, so glibc still sees the program's return address and resolves "next" from the
//! caller, not from the shim: a naive wrapper breaks every other interposer in the process.

use std::ffi::{CStr, c_char, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// glibc's `dlsym`, found once with `dlvsym` (which the shim does not export). The assembly
/// below reads it as a plain word.
static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

/// Resolves the real `dlsym` at load time, before any program code runs.
#[used]
#[unsafe(link_section = ".init_array")]
static RESOLVE_AT_LOAD: extern "C" fn() = resolve_at_load;

extern "C" fn resolve_at_load() {
    let _ = real_dlsym();
}

fn real_dlsym() -> Option<DlsymFn> {
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

/// The shim's `dlsym`: `RTLD_NEXT` goes straight to glibc with the caller's return address
/// intact; everything else goes to [`lookup`].
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub extern "C" fn dlsym(_handle: *mut c_void, _name: *const c_char) -> *mut c_void {
    std::arch::naked_asm!(
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jz 2f",
        "cmp rdi, -1",
        "jne 2f",
        "jmp rax",
        "2:",
        "jmp {lookup}",
        real = sym REAL_DLSYM,
        lookup = sym lookup,
    )
}

#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub extern "C" fn dlsym(_handle: *mut c_void, _name: *const c_char) -> *mut c_void {
    std::arch::naked_asm!(
        "adrp x16, {real}",
        "ldr x16, [x16, :lo12:{real}]",
        "cbz x16, 2f",
        "cmn x0, #1",
        "b.ne 2f",
        "br x16",
        "2:",
        "b {lookup}",
        real = sym REAL_DLSYM,
        lookup = sym lookup,
    )
}

/// A lookup through a handle (or `RTLD_DEFAULT`): where the real library has the symbol and the
/// shim hooks it, the hook is the answer.
extern "C" fn lookup(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    let Some(real) = real_dlsym() else {
        return std::ptr::null_mut();
    };
    // SAFETY: glibc's dlsym with the caller's arguments.
    let found = unsafe { real(handle, name) };
    if found.is_null() || name.is_null() || handle == libc::RTLD_NEXT {
        return found;
    }
    let hooked = std::panic::catch_unwind(|| {
        // SAFETY: a non-null symbol name is a NUL-terminated string (dlsym's contract).
        let name = unsafe { CStr::from_ptr(name) };
        crate::hooks::by_export(name.to_bytes())
    });
    match hooked {
        Ok(Some(hook)) => hook as *mut c_void,
        _ => found,
    }
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
