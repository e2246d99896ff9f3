//! The names and descriptions of the driver's error codes.

use std::ffi::{CStr, c_char};

use crate::driver::{guard, put};
use crate::{
    CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_HANDLE,
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NO_DEVICE, CUDA_ERROR_NOT_FOUND,
    CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_UNKNOWN, CUDA_SUCCESS,
    CUresult,
};

fn error_text(rc: CUresult) -> Option<(&'static CStr, &'static CStr)> {
    Some(match rc {
        CUDA_SUCCESS => (c"CUDA_SUCCESS", c"no error"),
        CUDA_ERROR_INVALID_VALUE => (c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
        CUDA_ERROR_OUT_OF_MEMORY => (c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
        CUDA_ERROR_NOT_INITIALIZED => (c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
        CUDA_ERROR_NO_DEVICE => (
            c"CUDA_ERROR_NO_DEVICE",
            c"no CUDA-capable device is detected",
        ),
        CUDA_ERROR_INVALID_DEVICE => (c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
        CUDA_ERROR_INVALID_CONTEXT => (c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
        CUDA_ERROR_INVALID_HANDLE => (c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
        CUDA_ERROR_NOT_FOUND => (c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
        CUDA_ERROR_UNKNOWN => (c"CUDA_ERROR_UNKNOWN", c"unknown error"),
        _ => return None,
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGetErrorString(rc: CUresult, text: *mut *const c_char) -> CUresult {
    guard(|| {
        let (_, s) = error_text(rc).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        put(text, s.as_ptr())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGetErrorName(rc: CUresult, text: *mut *const c_char) -> CUresult {
    guard(|| {
        let (n, _) = error_text(rc).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        put(text, n.as_ptr())
    })
}
