//! The `dlsym` the shim exports, for programs that look the driver up themselves (the CUDA
//! runtime `dlopen`s `libcuda.so.1` and asks `dlsym` for its entry points): where the real library
//! has the symbol and the hook table has a hook for it, the hook is the answer.
//!
//! Lookups with `RTLD_NEXT` are jumped to (not called into) the real `dlsym`, so glibc still sees
//! the program's return address and resolves "next" from the caller, not from the shim: a naive
//! wrapper breaks every other interposer in the process.

use std::ffi::{CStr, c_char, c_void};

use crate::real::{REAL_DLSYM, real_dlsym};

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
        super::by_export(name.to_bytes())
    });
    match hooked {
        Ok(Some(hook)) => hook as *mut c_void,
        _ => found,
    }
}
