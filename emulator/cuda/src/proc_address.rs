//! `cuGetProcAddress[_v2]`: one table of entry points, by name, version and stream flavour.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;

use crate::context::*;
use crate::device::*;
use crate::driver::{guard, put};
use crate::error::*;
use crate::graph::*;
use crate::launch::*;
use crate::memory::*;
use crate::stream::*;
use crate::{CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_FOUND, CUresult};

/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
const PER_THREAD_DEFAULT_STREAM: u64 = 1 << 1;

/// An entry point as `cuGetProcAddress` names it: base name, the CUDA version that introduced
/// this variant, whether it is the per-thread-default-stream variant, and the function.
struct Entry {
    name: &'static str,
    since: c_int,
    per_thread: bool,
    function: usize,
}

fn entries() -> &'static [Entry] {
    static TABLE: OnceLock<Vec<Entry>> = OnceLock::new();
    TABLE.get_or_init(|| {
        macro_rules! e {
            ($name:literal, $since:literal, $f:ident) => {
                Entry {
                    name: $name,
                    since: $since,
                    per_thread: false,
                    function: $f as *const () as usize,
                }
            };
            ($name:literal, $since:literal, ptsz $f:ident) => {
                Entry {
                    name: $name,
                    since: $since,
                    per_thread: true,
                    function: $f as *const () as usize,
                }
            };
        }
        vec![
            e!("cuInit", 2000, cuInit),
            e!("cuDriverGetVersion", 2020, cuDriverGetVersion),
            e!("cuDeviceGetCount", 2000, cuDeviceGetCount),
            e!("cuDeviceGet", 2000, cuDeviceGet),
            e!("cuDeviceGetName", 2000, cuDeviceGetName),
            e!("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2),
            e!("cuDeviceGetUuid", 9020, cuDeviceGetUuid),
            e!("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2),
            e!("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute),
            e!("cuCtxCreate", 3020, cuCtxCreate_v2),
            e!("cuCtxCreate", 11040, cuCtxCreate_v3),
            e!("cuCtxCreate", 12050, cuCtxCreate_v4),
            e!("cuCtxDestroy", 4000, cuCtxDestroy_v2),
            e!("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain),
            e!(
                "cuDevicePrimaryCtxRelease",
                11000,
                cuDevicePrimaryCtxRelease_v2
            ),
            e!("cuCtxSetCurrent", 4000, cuCtxSetCurrent),
            e!("cuCtxGetCurrent", 4000, cuCtxGetCurrent),
            e!("cuCtxGetDevice", 2000, cuCtxGetDevice),
            e!("cuCtxSynchronize", 2000, cuCtxSynchronize),
            e!("cuMemGetInfo", 3020, cuMemGetInfo_v2),
            e!("cuMemAlloc", 3020, cuMemAlloc_v2),
            e!("cuMemFree", 3020, cuMemFree_v2),
            e!("cuMemAllocPitch", 3020, cuMemAllocPitch_v2),
            e!("cuMemAllocManaged", 6000, cuMemAllocManaged),
            e!("cuMemAllocAsync", 11020, cuMemAllocAsync),
            e!("cuMemAllocAsync", 11020, ptsz cuMemAllocAsync_ptsz),
            e!("cuMemFreeAsync", 11020, cuMemFreeAsync),
            e!("cuMemFreeAsync", 11020, ptsz cuMemFreeAsync_ptsz),
            e!("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync),
            e!("cuMemAllocFromPoolAsync", 11020, ptsz cuMemAllocFromPoolAsync_ptsz),
            e!(
                "cuDeviceGetDefaultMemPool",
                11020,
                cuDeviceGetDefaultMemPool
            ),
            e!(
                "cuMemGetAllocationGranularity",
                10020,
                cuMemGetAllocationGranularity
            ),
            e!("cuMemCreate", 10020, cuMemCreate),
            e!("cuMemRelease", 10020, cuMemRelease),
            e!("cuArrayCreate", 3020, cuArrayCreate_v2),
            e!("cuArray3DCreate", 3020, cuArray3DCreate_v2),
            e!("cuArrayDestroy", 2000, cuArrayDestroy),
            e!("cuStreamCreate", 2000, cuStreamCreate),
            e!("cuStreamDestroy", 4000, cuStreamDestroy_v2),
            e!("cuStreamSynchronize", 2000, cuStreamSynchronize),
            e!("cuStreamSynchronize", 7000, ptsz cuStreamSynchronize_ptsz),
            e!("cuEventCreate", 2000, cuEventCreate),
            e!("cuEventRecord", 2000, cuEventRecord),
            e!("cuEventRecord", 7000, ptsz cuEventRecord_ptsz),
            e!("cuEventSynchronize", 2000, cuEventSynchronize),
            e!("cuEventElapsedTime", 2000, cuEventElapsedTime),
            e!("cuEventDestroy", 4000, cuEventDestroy_v2),
            e!("cuModuleLoadData", 2000, cuModuleLoadData),
            e!("cuModuleGetFunction", 2000, cuModuleGetFunction),
            e!("cuModuleUnload", 2000, cuModuleUnload),
            e!("cuLaunchKernel", 4000, cuLaunchKernel),
            e!("cuLaunchKernel", 7000, ptsz cuLaunchKernel_ptsz),
            e!("cuLaunchCooperativeKernel", 9000, cuLaunchCooperativeKernel),
            e!("cuLaunchCooperativeKernel", 9000, ptsz cuLaunchCooperativeKernel_ptsz),
            e!("cuLaunchKernelEx", 11060, cuLaunchKernelEx),
            e!("cuLaunchKernelEx", 11060, ptsz cuLaunchKernelEx_ptsz),
            e!("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2),
            e!("cuStreamBeginCapture", 10010, ptsz cuStreamBeginCapture_v2_ptsz),
            e!("cuStreamEndCapture", 10000, cuStreamEndCapture),
            e!("cuStreamEndCapture", 10000, ptsz cuStreamEndCapture_ptsz),
            e!("cuStreamIsCapturing", 10000, cuStreamIsCapturing),
            e!("cuGraphInstantiate", 11040, cuGraphInstantiateWithFlags),
            e!(
                "cuGraphInstantiateWithFlags",
                11040,
                cuGraphInstantiateWithFlags
            ),
            e!("cuGraphLaunch", 10000, cuGraphLaunch),
            e!("cuGraphLaunch", 10000, ptsz cuGraphLaunch_ptsz),
            e!("cuGraphExecDestroy", 10000, cuGraphExecDestroy),
            e!("cuGraphDestroy", 10000, cuGraphDestroy),
            e!("cuGetErrorString", 6000, cuGetErrorString),
            e!("cuGetErrorName", 6000, cuGetErrorName),
            e!("cuGetProcAddress", 11030, cuGetProcAddress),
            e!("cuGetProcAddress", 12000, cuGetProcAddress_v2),
        ]
    })
}

/// The newest variant of `name` that both `version` and this driver know, per-thread when asked
/// and one exists (what the driver's `cuGetProcAddress` hands out).
fn lookup(name: &str, version: c_int, flags: u64) -> Option<usize> {
    let version = version.min(DRIVER_VERSION);
    let wanted = flags & PER_THREAD_DEFAULT_STREAM != 0;
    let pick = |per_thread: bool| {
        entries()
            .iter()
            .filter(|e| e.name == name && e.since <= version && e.per_thread == per_thread)
            .max_by_key(|e| e.since)
            .map(|e| e.function)
    };
    if wanted {
        pick(true).or_else(|| pick(false))
    } else {
        pick(false)
    }
}

fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> Result<(), CUresult> {
    if symbol.is_null() || pfn.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null NUL-terminated string, as the API requires.
    let name = unsafe { CStr::from_ptr(symbol) }
        .to_str()
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    match lookup(name, version, flags) {
        Some(f) => put(pfn, f as *mut c_void),
        None => {
            put(pfn, std::ptr::null_mut())?;
            Err(CUDA_ERROR_NOT_FOUND)
        }
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CUresult {
    guard(|| get_proc_address(symbol, pfn, version, flags))
}

/// `CU_GET_PROC_ADDRESS_SUCCESS` = 0, `..._SYMBOL_NOT_FOUND` = 1.
#[unsafe(no_mangle)]
pub extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CUresult {
    guard(|| {
        let found = get_proc_address(symbol, pfn, version, flags);
        if !status.is_null() {
            put(status, c_int::from(found.is_err()))?;
        }
        found
    })
}
