//! NVML as the slice sees it: `nvidia-smi` and NVML users inside the slice get the cap as the
//! device's total memory and the slice's use as used. Also how the shim learns what the driver
//! holds for this process (a context's memory).

use std::ffi::{c_int, c_uint};
use std::sync::atomic::AtomicUsize;

use crate::limits::{Limits, limits};
use crate::real::{Lib, resolve};
use gpuslice_contract::cuda::Handle;

const SUCCESS: c_int = 0;

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Memory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MemoryV2 {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// (total, free, used) as the slice sees them, given the device's free memory.
fn slice_view(device_free: u64) -> Option<(u64, u64, u64)> {
    match limits() {
        Limits::Off => None,
        Limits::Closed => Some((0, 0, 0)),
        Limits::Capped(slice) => {
            let used = slice.used().min(slice.cap);
            Some((slice.cap, (slice.cap - used).min(device_free), used))
        }
    }
}

pub fn memory_info(
    real: unsafe extern "C" fn(Handle, *mut Memory) -> c_int,
    device: Handle,
    memory: *mut Memory,
) -> c_int {
    // SAFETY: the program's call, forwarded unchanged.
    let rc = unsafe { real(device, memory) };
    if rc == SUCCESS && !memory.is_null() {
        // SAFETY: NVML just filled it.
        let m = unsafe { &mut *memory };
        if let Some((total, free, used)) = slice_view(m.free) {
            *m = Memory { total, free, used };
        }
    }
    rc
}

pub fn memory_info_v2(
    real: unsafe extern "C" fn(Handle, *mut MemoryV2) -> c_int,
    device: Handle,
    memory: *mut MemoryV2,
) -> c_int {
    // SAFETY: the program's call, forwarded unchanged.
    let rc = unsafe { real(device, memory) };
    if rc == SUCCESS && !memory.is_null() {
        // SAFETY: NVML just filled it.
        let m = unsafe { &mut *memory };
        if let Some((total, free, used)) = slice_view(m.free) {
            m.total = total;
            m.free = free;
            m.used = used;
            m.reserved = 0;
        }
    }
    rc
}

/// `nvmlProcessInfo_t` (v3 layout).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ProcessInfo {
    pid: c_uint,
    used: u64,
    gpu_instance: c_uint,
    compute_instance: c_uint,
}

/// Device memory the driver reports for `pid`, over every GPU; `None` when NVML cannot say.
pub fn process_memory(pid: u32) -> Option<u64> {
    type Init = unsafe extern "C" fn() -> c_int;
    type Count = unsafe extern "C" fn(*mut c_uint) -> c_int;
    type ByIndex = unsafe extern "C" fn(c_uint, *mut Handle) -> c_int;
    type Procs = unsafe extern "C" fn(Handle, *mut c_uint, *mut ProcessInfo) -> c_int;
    static INIT: AtomicUsize = AtomicUsize::new(0);
    static COUNT: AtomicUsize = AtomicUsize::new(0);
    static BY_INDEX: AtomicUsize = AtomicUsize::new(0);
    static PROCS: AtomicUsize = AtomicUsize::new(0);
    // SAFETY (transmutes): each address is the real NVML function of that name and signature.
    let init: Init = unsafe { std::mem::transmute(resolve(&INIT, Lib::Nvml, b"nvmlInit_v2\0")?) };
    let count: Count =
        unsafe { std::mem::transmute(resolve(&COUNT, Lib::Nvml, b"nvmlDeviceGetCount_v2\0")?) };
    let by_index: ByIndex = unsafe {
        std::mem::transmute(resolve(
            &BY_INDEX,
            Lib::Nvml,
            b"nvmlDeviceGetHandleByIndex_v2\0",
        )?)
    };
    let procs: Procs = unsafe {
        std::mem::transmute(resolve(
            &PROCS,
            Lib::Nvml,
            b"nvmlDeviceGetComputeRunningProcesses_v3\0",
        )?)
    };
    // SAFETY (calls): NVML's functions with valid out-pointers and buffer sizes.
    if unsafe { init() } != SUCCESS {
        return None;
    }
    let mut n: c_uint = 0;
    if unsafe { count(&mut n) } != SUCCESS {
        return None;
    }
    let mut total = 0;
    for i in 0..n {
        let mut device: Handle = std::ptr::null_mut();
        if unsafe { by_index(i, &mut device) } != SUCCESS {
            continue;
        }
        let mut list = [ProcessInfo::default(); 256];
        let mut len = list.len() as c_uint;
        if unsafe { procs(device, &mut len, list.as_mut_ptr()) } != SUCCESS {
            continue;
        }
        total += list[..len as usize]
            .iter()
            .filter(|p| p.pid == pid)
            .map(|p| p.used)
            .sum::<u64>();
    }
    Some(total)
}
