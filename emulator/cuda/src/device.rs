//! The exports that initialise the driver and describe the devices this process sees.

use std::ffi::{c_char, c_int, c_uint};

use crate::driver::{guard, init, put, with};
use crate::{CUDA_ERROR_INVALID_VALUE, CUdevice, CUresult};

/// The driver version reported (12.8).
pub(crate) const DRIVER_VERSION: c_int = 12080;

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(_flags: c_uint) -> CUresult {
    guard(init)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    guard(|| put(version, DRIVER_VERSION))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    guard(|| put(count, with(|d| Ok(d.devices.len() as c_int))?))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    guard(|| {
        with(|d| d.device(ordinal).map(|_| ()))?;
        put(device, ordinal)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, device: CUdevice) -> CUresult {
    guard(|| {
        let text = with(|d| Ok(d.device(device)?.name.clone()))?;
        let len = usize::try_from(len).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        if name.is_null() || len == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let bytes = &text.as_bytes()[..text.len().min(len - 1)];
        // SAFETY: the caller's buffer holds `len` bytes; we write at most len - 1 plus a NUL.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), name.cast::<u8>(), bytes.len());
            name.add(bytes.len()).write(0);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: CUdevice) -> CUresult {
    guard(|| put(bytes, with(|d| Ok(d.device(device)?.total as usize))?))
}

fn device_uuid(uuid: *mut [u8; 16], device: CUdevice) -> CUresult {
    guard(|| put(uuid, with(|d| Ok(d.device(device)?.uuid))?))
}

// Exports never call each other: a preloaded shim would interpose on such calls and count twice.

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], device: CUdevice) -> CUresult {
    device_uuid(uuid, device)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], device: CUdevice) -> CUresult {
    device_uuid(uuid, device)
}

/// A few attributes programs ask for; others read 0.
#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attribute: c_int,
    device: CUdevice,
) -> CUresult {
    guard(|| {
        with(|d| d.device(device).map(|_| ()))?;
        let v = match attribute {
            1 => 1024, // MAX_THREADS_PER_BLOCK
            16 => 132, // MULTIPROCESSOR_COUNT
            75 => 9,   // COMPUTE_CAPABILITY_MAJOR
            76 => 0,   // COMPUTE_CAPABILITY_MINOR
            _ => 0,
        };
        put(value, v)
    })
}
