//! The one table of hooked symbols. From it come the exported functions (what a program linked
//! to `libcuda.so.1` or `libnvidia-ml.so.1` calls), the answers to `dlsym` ([`dlsym`]) and the
//! answers to `cuGetProcAddress` ([`proc_address`], itself a hook in the table). Each export resolves its real function once, runs its hook under
//! `catch_unwind`, and on a panic makes the real call instead: an internal failure never costs
//! the program its call. (Hooks do their own work before the real call or after it without
//! panicking, so the fallback never repeats a call that happened.)

pub mod dlsym;
pub mod proc_address;

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use gpuslice_contract::cuda::{
    ArrayDescriptor, ArrayDescriptor3D, CUDA_ERROR_UNKNOWN, Handle, LaunchConfig,
};

use crate::real::{Lib, resolve};
use crate::{launch, memory, nvml};

/// One hooked symbol.
pub struct Hook {
    /// The symbol the library exports, e.g. `cuMemAlloc_v2`.
    pub export: &'static str,
    /// The name `cuGetProcAddress` is asked for, e.g. `cuMemAlloc` (empty for NVML).
    pub proc_name: &'static str,
    /// The CUDA version that introduced this variant.
    pub since: c_int,
    /// The per-thread-default-stream (`_ptsz`) variant.
    pub per_thread: bool,
    /// The shim's function.
    pub function: usize,
}

thread_local! {
    /// Whether a hook runs on this thread now.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as inside a hook until dropped (also when the hook unwinds).
struct Reentry;

impl Reentry {
    /// `None` when the thread is already inside a hook.
    fn enter() -> Option<Reentry> {
        INSIDE
            .try_with(|inside| (!inside.replace(true)).then_some(Reentry))
            .ok()
            .flatten()
    }
}

impl Drop for Reentry {
    fn drop(&mut self) {
        let _ = INSIDE.try_with(|inside| inside.set(false));
    }
}

/// What a hook returns when the real library lacks the function.
fn missing(lib: Lib) -> c_int {
    match lib {
        Lib::Cuda => CUDA_ERROR_UNKNOWN,
        Lib::Nvml => 13, // NVML_ERROR_FUNCTION_NOT_FOUND
    }
}

macro_rules! hooks {
    ($( $lib:ident $export:ident $proc:literal $since:literal $ptsz:literal
        ($($arg:ident: $ty:ty),*) => $body:path; )*) => {
        /// The real functions, resolved once each.
        #[allow(non_upper_case_globals)]
        mod real {
            use std::sync::atomic::AtomicUsize;
            $( pub static $export: AtomicUsize = AtomicUsize::new(0); )*
        }

        $(
            #[unsafe(no_mangle)]
            #[allow(clippy::too_many_arguments)] // the driver's signatures
            pub extern "C" fn $export($($arg: $ty),*) -> c_int {
                type Real = unsafe extern "C" fn($($ty),*) -> c_int;
                let name = concat!(stringify!($export), "\0").as_bytes();
                let Some(address) = resolve(&real::$export, Lib::$lib, name) else {
                    return missing(Lib::$lib);
                };
                // SAFETY: the address is the real library's function of this name and signature.
                let real = unsafe { std::mem::transmute::<usize, Real>(address) };
                // A call made while a hook of this thread runs (the driver calling its own
                // exports, or the shim's own work) is the real call: charged once, never gated twice.
                let Some(_inside) = Reentry::enter() else {
                    // SAFETY: the program's (or the driver's) own call, with its own arguments.
                    return unsafe { real($($arg),*) };
                };
                let hooked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    $body(real, $($arg),*)
                }));
                match hooked {
                    Ok(rc) => rc,
                    // SAFETY: the program's own call, with its own arguments.
                    Err(_) => unsafe { real($($arg),*) },
                }
            }
        )*

        /// Every hooked symbol.
        pub fn table() -> &'static [Hook] {
            static TABLE: OnceLock<Vec<Hook>> = OnceLock::new();
            TABLE.get_or_init(|| vec![$(
                Hook {
                    export: stringify!($export),
                    proc_name: $proc,
                    since: $since,
                    per_thread: $ptsz,
                    function: $export as *const () as usize,
                },
            )*])
        }
    };
}

hooks! {
    Cuda cuGetProcAddress "cuGetProcAddress" 11030 false
        (symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64)
        => proc_address::v1;
    Cuda cuGetProcAddress_v2 "cuGetProcAddress" 12000 false
        (symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64, status: *mut c_int)
        => proc_address::v2;
    Cuda cuCtxCreate_v2 "cuCtxCreate" 3020 false
        (ctx: *mut Handle, flags: c_uint, device: c_int) => memory::ctx_create;
    Cuda cuCtxCreate_v3 "cuCtxCreate" 11040 false
        (ctx: *mut Handle, params: *const c_void, count: c_int, flags: c_uint, device: c_int)
        => memory::ctx_create_v3;
    Cuda cuCtxCreate_v4 "cuCtxCreate" 12050 false
        (ctx: *mut Handle, params: *const c_void, flags: c_uint, device: c_int)
        => memory::ctx_create_v4;
    Cuda cuCtxDestroy_v2 "cuCtxDestroy" 4000 false (ctx: Handle) => memory::ctx_destroy;
    Cuda cuDevicePrimaryCtxRetain "cuDevicePrimaryCtxRetain" 7000 false
        (ctx: *mut Handle, device: c_int) => memory::primary_retain;
    Cuda cuDevicePrimaryCtxRelease_v2 "cuDevicePrimaryCtxRelease" 11000 false
        (device: c_int) => memory::primary_release;
    Cuda cuDeviceTotalMem_v2 "cuDeviceTotalMem" 3020 false
        (bytes: *mut usize, device: c_int) => memory::device_total;
    Cuda cuMemGetInfo_v2 "cuMemGetInfo" 3020 false
        (free: *mut usize, total: *mut usize) => memory::get_info;
    Cuda cuMemAlloc_v2 "cuMemAlloc" 3020 false (dptr: *mut u64, bytes: usize) => memory::alloc;
    Cuda cuMemFree_v2 "cuMemFree" 3020 false (dptr: u64) => memory::free;
    Cuda cuMemAllocPitch_v2 "cuMemAllocPitch" 3020 false
        (dptr: *mut u64, pitch: *mut usize, width: usize, height: usize, element: c_uint)
        => memory::alloc_pitch;
    Cuda cuMemAllocManaged "cuMemAllocManaged" 6000 false
        (dptr: *mut u64, bytes: usize, flags: c_uint) => memory::alloc_managed;
    Cuda cuMemAllocAsync "cuMemAllocAsync" 11020 false
        (dptr: *mut u64, bytes: usize, stream: Handle) => memory::alloc_async;
    Cuda cuMemAllocAsync_ptsz "cuMemAllocAsync" 11020 true
        (dptr: *mut u64, bytes: usize, stream: Handle) => memory::alloc_async;
    Cuda cuMemFreeAsync "cuMemFreeAsync" 11020 false
        (dptr: u64, stream: Handle) => memory::free_async;
    Cuda cuMemFreeAsync_ptsz "cuMemFreeAsync" 11020 true
        (dptr: u64, stream: Handle) => memory::free_async;
    Cuda cuMemAllocFromPoolAsync "cuMemAllocFromPoolAsync" 11020 false
        (dptr: *mut u64, bytes: usize, pool: Handle, stream: Handle) => memory::alloc_from_pool;
    Cuda cuMemAllocFromPoolAsync_ptsz "cuMemAllocFromPoolAsync" 11020 true
        (dptr: *mut u64, bytes: usize, pool: Handle, stream: Handle) => memory::alloc_from_pool;
    Cuda cuMemCreate "cuMemCreate" 10020 false
        (handle: *mut u64, bytes: usize, prop: *const c_void, flags: u64) => memory::create;
    Cuda cuMemRelease "cuMemRelease" 10020 false (handle: u64) => memory::release;
    Cuda cuArrayCreate_v2 "cuArrayCreate" 3020 false
        (array: *mut Handle, desc: *const ArrayDescriptor) => memory::array_create;
    Cuda cuArray3DCreate_v2 "cuArray3DCreate" 3020 false
        (array: *mut Handle, desc: *const ArrayDescriptor3D) => memory::array3d_create;
    Cuda cuArrayDestroy "cuArrayDestroy" 2000 false (array: Handle) => memory::array_destroy;
    Cuda cuLaunchKernel "cuLaunchKernel" 4000 false
        (f: Handle, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint,
         shared: c_uint, stream: Handle, params: *mut *mut c_void, extra: *mut *mut c_void)
        => launch::launch;
    Cuda cuLaunchKernel_ptsz "cuLaunchKernel" 7000 true
        (f: Handle, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint,
         shared: c_uint, stream: Handle, params: *mut *mut c_void, extra: *mut *mut c_void)
        => launch::launch;
    Cuda cuLaunchCooperativeKernel "cuLaunchCooperativeKernel" 9000 false
        (f: Handle, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint,
         shared: c_uint, stream: Handle, params: *mut *mut c_void) => launch::cooperative;
    Cuda cuLaunchCooperativeKernel_ptsz "cuLaunchCooperativeKernel" 9000 true
        (f: Handle, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint,
         shared: c_uint, stream: Handle, params: *mut *mut c_void) => launch::cooperative;
    Cuda cuLaunchKernelEx "cuLaunchKernelEx" 11060 false
        (config: *const LaunchConfig, f: Handle, params: *mut *mut c_void,
         extra: *mut *mut c_void) => launch::launch_ex;
    Cuda cuLaunchKernelEx_ptsz "cuLaunchKernelEx" 11060 true
        (config: *const LaunchConfig, f: Handle, params: *mut *mut c_void,
         extra: *mut *mut c_void) => launch::launch_ex;
    Cuda cuGraphLaunch "cuGraphLaunch" 10000 false (exec: Handle, stream: Handle) => launch::graph;
    Cuda cuGraphLaunch_ptsz "cuGraphLaunch" 10000 true
        (exec: Handle, stream: Handle) => launch::graph;
    Cuda cuStreamBeginCapture_v2 "cuStreamBeginCapture" 10010 false
        (stream: Handle, mode: c_int) => launch::begin_capture;
    Cuda cuStreamBeginCapture_v2_ptsz "cuStreamBeginCapture" 10010 true
        (stream: Handle, mode: c_int) => launch::begin_capture;
    Cuda cuStreamEndCapture "cuStreamEndCapture" 10000 false
        (stream: Handle, graph: *mut Handle) => launch::end_capture;
    Cuda cuStreamEndCapture_ptsz "cuStreamEndCapture" 10000 true
        (stream: Handle, graph: *mut Handle) => launch::end_capture;
    Nvml nvmlDeviceGetMemoryInfo "" 0 false
        (device: Handle, memory: *mut nvml::Memory) => nvml::memory_info;
    Nvml nvmlDeviceGetMemoryInfo_v2 "" 0 false
        (device: Handle, memory: *mut nvml::MemoryV2) => nvml::memory_info_v2;
}

/// The hook for an exported symbol name.
pub fn by_export(name: &[u8]) -> Option<usize> {
    table()
        .iter()
        .find(|h| h.export.as_bytes() == name)
        .map(|h| h.function)
}

/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
const PER_THREAD_DEFAULT_STREAM: u64 = 1 << 1;

/// The hook `cuGetProcAddress(name, version, flags)` should answer: the newest hooked variant the
/// version knows, the per-thread one when asked for and hooked.
pub fn by_proc(name: &[u8], version: c_int, flags: u64) -> Option<usize> {
    let pick = |per_thread: bool| {
        table()
            .iter()
            .filter(|h| {
                !h.proc_name.is_empty()
                    && h.proc_name.as_bytes() == name
                    && h.since <= version
                    && h.per_thread == per_thread
            })
            .max_by_key(|h| h.since)
            .map(|h| h.function)
    };
    if flags & PER_THREAD_DEFAULT_STREAM != 0 {
        pick(true).or_else(|| pick(false))
    } else {
        pick(false)
    }
}
