//! Device memory: allocations, pools, the virtual-memory API and arrays, charged to the shared
//! ledger.

use std::ffi::{c_int, c_uint, c_void};

use crate::driver::{get, guard, put, with};
use crate::{
    ArrayDescriptor, ArrayDescriptor3D, CUDA_ERROR_INVALID_VALUE, CUdevice, CUdeviceptr, CUresult,
    Handle,
};

/// Allocation granularity of the virtual-memory API.
const GRANULARITY: u64 = 2 << 20;

#[unsafe(no_mangle)]
pub extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    guard(|| {
        let (f, t) = with(|d| {
            let ordinal = d.current_device()?;
            let (_, total, key) = d.row(ordinal)?;
            let used = d.ledger()?.used(key);
            Ok((total.saturating_sub(used), total))
        })?;
        put(free, f as usize)?;
        put(total, t as usize)
    })
}

fn mem_alloc(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    guard(|| put(dptr, with(|d| d.allocate(bytes as u64))?))
}

fn mem_free(dptr: CUdeviceptr) -> CUresult {
    guard(|| with(|d| d.free(dptr)))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    mem_alloc(dptr, bytes)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    mem_free(dptr)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element: c_uint,
) -> CUresult {
    guard(|| {
        if !matches!(element, 4 | 8 | 16) || width == 0 || height == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let row = width.div_ceil(512) * 512;
        let address = with(|d| d.allocate((row * height) as u64))?;
        put(pitch, row)?;
        put(dptr, address)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    _flags: c_uint,
) -> CUresult {
    mem_alloc(dptr, bytes)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    _stream: Handle,
) -> CUresult {
    mem_alloc(dptr, bytes)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    stream: Handle,
) -> CUresult {
    let _ = stream;
    mem_alloc(dptr, bytes)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, _stream: Handle) -> CUresult {
    mem_free(dptr)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: Handle) -> CUresult {
    let _ = stream;
    mem_free(dptr)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    pool: Handle,
    _stream: Handle,
) -> CUresult {
    if pool.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    mem_alloc(dptr, bytes)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    pool: Handle,
    stream: Handle,
) -> CUresult {
    let _ = stream;
    if pool.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    mem_alloc(dptr, bytes)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetDefaultMemPool(pool: *mut Handle, device: CUdevice) -> CUresult {
    guard(|| {
        with(|d| d.device(device).map(|_| ()))?;
        put(pool, (0x9000 + device as usize) as Handle)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    _prop: *const c_void,
    _option: c_int,
) -> CUresult {
    guard(|| put(granularity, GRANULARITY as usize))
}

/// `cuMemCreate`: physical memory for the virtual-memory API. The property struct's location id
/// names the device (offset 8: type, then id).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemCreate(
    handle: *mut u64,
    bytes: usize,
    prop: *const [c_int; 4],
    _flags: u64,
) -> CUresult {
    guard(|| {
        let prop = get(prop)?;
        let bytes = bytes as u64;
        if bytes == 0 || !bytes.is_multiple_of(GRANULARITY) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = with(|d| {
            let ordinal = prop[3];
            d.device(ordinal)?;
            d.take(ordinal as usize, bytes)?;
            let id = d.id();
            d.held.insert(id, (ordinal as usize, bytes));
            Ok(id)
        })?;
        put(handle, id)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemRelease(handle: u64) -> CUresult {
    guard(|| with(|d| d.free(handle)))
}

/// Bytes per element of a `CUarray_format`.
pub fn format_bytes(format: c_uint) -> Option<u64> {
    match format {
        0x01 | 0x08 => Some(1),
        0x02 | 0x09 | 0x10 => Some(2),
        0x03 | 0x0a | 0x20 => Some(4),
        _ => None,
    }
}

fn create_array(
    array: *mut Handle,
    width: usize,
    height: usize,
    depth: usize,
    format: c_uint,
    channels: c_uint,
) -> Result<(), CUresult> {
    let element = format_bytes(format).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if width == 0 || !matches!(channels, 1 | 2 | 4) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let bytes =
        width as u64 * height.max(1) as u64 * depth.max(1) as u64 * element * u64::from(channels);
    let id = with(|d| d.allocate(bytes))?;
    put(array, id as Handle)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuArrayCreate_v2(array: *mut Handle, desc: *const ArrayDescriptor) -> CUresult {
    guard(|| {
        let d = get(desc)?;
        create_array(array, d.width, d.height, 0, d.format, d.channels)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuArray3DCreate_v2(
    array: *mut Handle,
    desc: *const ArrayDescriptor3D,
) -> CUresult {
    guard(|| {
        let d = get(desc)?;
        create_array(array, d.width, d.height, d.depth, d.format, d.channels)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuArrayDestroy(array: Handle) -> CUresult {
    guard(|| with(|d| d.free(array as u64)))
}
