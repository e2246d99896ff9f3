//! An emulated `libnvidia-ml.so.1`: the NVML C functions gpuslice's agent uses and those common
//! monitoring tools (nvidia-ml-py scripts in the style of nvidia-smi and gpustat, exporters) ask,
//! with NVML's documented semantics and return codes, backed by the shared device model in the
//! state file named by `GPUSLICE_EMULATOR_STATE`. Load it with nvml-wrapper's `lib_path` (or as
//! `libnvidia-ml.so.1` on the library path) and the agent's real NVML code runs without a GPU.
//!
//! What it emulates:
//! - discovery and identity: init/shutdown, versions (driver, NVML, CUDA), count, handles by
//!   index, UUID and PCI bus id, name, UUID, index, PCI info, serial, minor number, brand,
//!   architecture, compute capability, VBIOS version;
//! - memory from the model and the CUDA emulator's allocations (whole GPU, or a MIG device's
//!   instance), BAR1, compute processes and, among them, MPS clients (the graphics list is empty: nothing else runs);
//! - utilisation from the kernels the GPU timeline recorded in the last second
//!   ([`monitor`]), and temperature, power, energy, clocks as functions of it within the board's
//!   real ranges ([`board`]); modes (compute, persistence, ECC, display), P-state, ECC counts;
//! - MIG: mode, GPU- and compute-instance profiles, placements, creation and destruction, MIG
//!   device handles, their ids and UUIDs;
//! - event sets for XID critical errors injected into the model ([`events`]);
//! - topology: common ancestors, peer-to-peer status and NVLink state ([`topology`]: SXM boards
//!   are NVLink boards, PCIe cards are not).
//!
//! Board-level queries answer `NVML_ERROR_NOT_SUPPORTED` where the real board does (fan speed on
//! passively cooled data-centre boards; temperature, power, clocks and utilisation on MIG device
//! handles and utilisation of a GPU in MIG mode), and the queries that need board facts (power,
//! clocks, architecture, ECC, BAR1) for models outside the board table.
//!
//! Every export runs under `catch_unwind`: a panic becomes `NVML_ERROR_UNKNOWN`, never an unwind
//! across the C boundary. Handles are opaque integers cast to pointers: a device is its index + 1
//! shifted past the first page (Go clients refuse small pointer values),
//! a GPU instance is `(device index + 1) << 32 | id`, a compute instance adds its id in bits 48+,
//! and a MIG device (a GPU instance with a compute instance; one per GPU instance here) is a GPU
//! instance's bits with bit 63 set. MIG follows NVIDIA's documentation ([`mig`]).

#![allow(non_snake_case)] // the exports carry NVML's names

use std::ffi::{CStr, c_char, c_uint, c_ulonglong};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

mod board;
mod events;
mod mig;
mod monitor;
mod topology;

use gpuslice_emulator::{Machine, NvmlError, Store};
use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlGpuInstance_t, nvmlMemory_t, nvmlMemory_v2_t, nvmlProcessInfo_t, nvmlReturn_t,
};

const SUCCESS: nvmlReturn_t = 0;
const UNINITIALIZED: nvmlReturn_t = 1;
const INVALID_ARGUMENT: nvmlReturn_t = 2;
const NOT_SUPPORTED: nvmlReturn_t = 3;
const NOT_FOUND: nvmlReturn_t = 6;
const INSUFFICIENT_SIZE: nvmlReturn_t = 7;
const UNKNOWN: nvmlReturn_t = 999;

/// The state file, once `nvmlInit` has found it.
static STORE: Mutex<Option<Store>> = Mutex::new(None);

fn store() -> Result<Store, nvmlReturn_t> {
    STORE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .ok_or(UNINITIALIZED)
}

fn code(e: NvmlError) -> nvmlReturn_t {
    e.code()
}

/// Runs an export's body; panics and internal errors become NVML error codes.
fn guard(body: impl FnOnce() -> Result<(), nvmlReturn_t>) -> nvmlReturn_t {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(rc)) => rc,
        Err(_) => UNKNOWN,
    }
}

fn read<T>(f: impl FnOnce(&Machine) -> Result<T, NvmlError>) -> Result<T, nvmlReturn_t> {
    let store = store()?;
    let mut machine = store.snapshot().map_err(|_| UNKNOWN)?;
    add_cuda_processes(&mut machine, store.path());
    f(&machine).map_err(code)
}

/// Processes holding memory through the CUDA emulator are on the GPU too, as NVML shows them.
fn add_cuda_processes(machine: &mut Machine, state: &std::path::Path) {
    let path = gpuslice_emulator::cuda_ledger_path(state);
    if !path.exists() {
        return;
    }
    let Ok(ledger) = gpuslice_emulator::shm::Ledger::open(&path) else {
        return;
    };
    let rows = ledger.rows();
    // A process in a container recorded its pid there; the driver reports the caller's view of
    // it (the host's, for the node agent), as NVIDIA's does.
    let host = rows
        .iter()
        .any(|(p, _, _)| p.pidns != 0)
        .then(gpuslice_emulator::shm::HostProcesses::read)
        .unwrap_or_default();
    let mut mps_clients = Vec::new();
    for (process, key, bytes) in rows {
        let Some(pid) = host.local_pid(process) else {
            continue;
        };
        let (gpu, gpu_instance) = gpuslice_emulator::device_of_key(key);
        if gpuslice_emulator::is_mps_context(key) {
            mps_clients.push((gpu, pid, gpu_instance));
        } else {
            let _ = machine.attach_real_process(gpu, pid, bytes, gpu_instance);
        }
    }
    for (gpu, pid, gpu_instance) in mps_clients {
        machine.mark_mps_client(gpu, pid, gpu_instance);
    }
}

fn mutate<T>(f: impl FnOnce(&mut Machine) -> Result<T, NvmlError>) -> Result<T, nvmlReturn_t> {
    store()?.mutate(f).map_err(|_| UNKNOWN)?.map_err(code)
}

/// A whole GPU's handle is `(index + 1) << 16`: never below 4096, which Go's runtime takes for a
/// corrupt pointer when it finds one in a pointer field (go-nvml keeps handles in such fields).
const DEVICE_HANDLE_SHIFT: u32 = 16;

fn device_index(device: nvmlDevice_t) -> Result<u32, nvmlReturn_t> {
    let raw = device as usize;
    let low = (1usize << DEVICE_HANDLE_SHIFT) - 1;
    if raw == 0 || raw > u32::MAX as usize || raw & low != 0 {
        return Err(INVALID_ARGUMENT);
    }
    Ok(((raw >> DEVICE_HANDLE_SHIFT) - 1) as u32)
}

fn device_handle(index: u32) -> nvmlDevice_t {
    ((index as usize + 1) << DEVICE_HANDLE_SHIFT) as nvmlDevice_t
}

fn gpu_instance_handle(index: u32, id: u32) -> nvmlGpuInstance_t {
    (((index as usize + 1) << 32) | id as usize) as nvmlGpuInstance_t
}

fn gpu_instance_parts(handle: nvmlGpuInstance_t) -> Result<(u32, u32), nvmlReturn_t> {
    let raw = handle as usize & ((1 << 48) - 1);
    let device = raw >> 32;
    if device == 0 {
        return Err(INVALID_ARGUMENT);
    }
    Ok(((device - 1) as u32, (raw & 0xffff_ffff) as u32))
}

/// Writes `value` through an out-pointer, or INVALID_ARGUMENT when it is null.
fn put<T>(out: *mut T, value: T) -> Result<(), nvmlReturn_t> {
    if out.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: the caller passed a non-null pointer to space for one T, as NVML's API requires.
    unsafe { out.write(value) };
    Ok(())
}

/// Reads a value through an in-pointer, or INVALID_ARGUMENT when it is null.
fn get<T: Copy>(input: *const T) -> Result<T, nvmlReturn_t> {
    if input.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: the caller passed a non-null pointer to one T, as NVML's API requires.
    Ok(unsafe { input.read() })
}

/// Copies a string into a caller buffer of `len` bytes, NUL-terminated.
fn put_str(out: *mut c_char, len: c_uint, s: &str) -> Result<(), nvmlReturn_t> {
    if out.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    let bytes = s.as_bytes();
    if bytes.len() + 1 > len as usize {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: the buffer holds `len` bytes (caller contract) and we write at most bytes.len() + 1 ≤ len.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.cast::<u8>(), bytes.len());
        out.add(bytes.len()).write(0);
    }
    Ok(())
}

/// Fills a caller array of `*count` entries, or reports the size needed.
fn put_list<T: Copy>(out: *mut T, count: *mut c_uint, items: &[T]) -> Result<(), nvmlReturn_t> {
    if count.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: count is non-null and points to the caller's capacity.
    let capacity = unsafe { count.read() } as usize;
    // SAFETY: as above.
    unsafe { count.write(items.len() as c_uint) };
    if items.len() > capacity || (out.is_null() && !items.is_empty()) {
        return Err(INSUFFICIENT_SIZE);
    }
    for (i, item) in items.iter().enumerate() {
        // SAFETY: i < items.len() ≤ capacity, the caller's array length.
        unsafe { out.add(i).write(*item) };
    }
    Ok(())
}

fn init() -> Result<(), nvmlReturn_t> {
    let path = std::env::var_os(gpuslice_contract::env::EMULATOR_STATE)
        .map(PathBuf::from)
        .ok_or(nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_ERROR_LIBRARY_NOT_FOUND)?;
    let store = Store::open(&path).map_err(|e| {
        eprintln!("gpuslice NVML emulator: {e}");
        UNKNOWN
    })?;
    *STORE.lock().unwrap_or_else(|p| p.into_inner()) = Some(store);
    Ok(())
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    guard(init)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    guard(init)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    guard(|| {
        STORE
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .map(|_| ())
            .ok_or(UNINITIALIZED)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    let text: &'static CStr = match result {
        SUCCESS => c"Success",
        UNINITIALIZED => c"Uninitialized",
        INVALID_ARGUMENT => c"Invalid Argument",
        NOT_SUPPORTED => c"Not Supported",
        NOT_FOUND => c"Not Found",
        INSUFFICIENT_SIZE => c"Insufficient Size",
        19 => c"In use by another client",
        23 => c"Insufficient Resources",
        mig::VERSION_MISMATCH => c"Argument version mismatch",
        _ => c"Unknown Error",
    };
    text.as_ptr()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    guard(|| {
        let driver = read(|m| Ok(m.driver().version))?;
        put_str(version, length, &driver)
    })
}

/// How often this process enumerated the GPUs: each read of the whole node starts with it, so
/// tests can assert how many times a pass reads the node.
static NODE_READS: AtomicU64 = AtomicU64::new(0);

/// Not NVML: the emulator's count of `nvmlDeviceGetCount` calls in this process.
#[unsafe(no_mangle)]
pub extern "C" fn gpusliceEmulatorNodeReads() -> c_ulonglong {
    NODE_READS.load(Ordering::SeqCst)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    NODE_READS.fetch_add(1, Ordering::SeqCst);
    guard(|| put(count, read(|m| Ok(m.gpus.len() as c_uint))?))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    guard(|| {
        read(|m| m.gpu(index).map(|_| ()))?;
        put(device, device_handle(index))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) -> nvmlReturn_t {
    guard(|| put(index, device_index(device)?))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let text = match mig_device_parts(device) {
            // As NVML names a MIG device: the GPU's name, "MIG" and the profile.
            Some((i, gi)) => read(|m| {
                let gpu = m.gpu(i)?;
                let instance = gpu.instances.iter().find(|x| x.id == gi);
                let p = mig::profile(m, i, instance.ok_or(NvmlError::NotFound)?.profile_id)?;
                Ok(format!("{} MIG {}", gpu.model, p.name))
            })?,
            None => {
                let i = device_index(device)?;
                read(|m| Ok(m.gpu(i)?.model.clone()))?
            }
        };
        put_str(name, length, &text)
    })
}

const MIG_DEVICE_BIT: usize = 1 << 63;

fn mig_device_parts(device: nvmlDevice_t) -> Option<(u32, u32)> {
    let raw = device as usize;
    (raw & MIG_DEVICE_BIT != 0)
        .then(|| gpu_instance_parts((raw & !MIG_DEVICE_BIT) as nvmlGpuInstance_t).ok())
        .flatten()
}

/// The GPU a handle is on, and the GPU instance when it is a MIG device.
fn gpu_and_instance(device: nvmlDevice_t) -> Result<(u32, Option<u32>), nvmlReturn_t> {
    match mig_device_parts(device) {
        Some((i, gi)) => Ok((i, Some(gi))),
        None => Ok((device_index(device)?, None)),
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let text = match mig_device_parts(device) {
            Some((i, gi)) => read(|m| {
                let gpu = m.gpu(i)?;
                let instance = gpu.instances.iter().find(|x| x.id == gi);
                Ok(instance.ok_or(NvmlError::NotFound)?.uuid.clone())
            })?,
            None => {
                let i = device_index(device)?;
                read(|m| Ok(m.gpu(i)?.uuid.clone()))?
            }
        };
        put_str(uuid, length, &text)
    })
}

/// (total, used) memory of a whole GPU, or of a MIG device: its instance's memory and what the
/// processes in it hold.
fn memory_of(device: nvmlDevice_t) -> Result<(u64, u64), nvmlReturn_t> {
    let (i, mig) = gpu_and_instance(device)?;
    read(|m| {
        let gpu = m.gpu(i)?;
        let total = match mig {
            Some(gi) => {
                let instance = gpu.instances.iter().find(|x| x.id == gi);
                mig::profile(m, i, instance.ok_or(NvmlError::NotFound)?.profile_id)?.memory_mib
                    << 20
            }
            None => gpu.memory_total,
        };
        let used: u64 = gpu
            .processes
            .iter()
            .filter(|p| mig.is_none_or(|gi| p.gpu_instance == Some(gi)))
            .map(|p| p.memory)
            .sum();
        Ok((total, used.min(total)))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    guard(|| {
        let (total, used) = memory_of(device)?;
        put(
            memory,
            nvmlMemory_t {
                total,
                used,
                free: total - used,
            },
        )
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    guard(|| {
        let (total, used) = memory_of(device)?;
        let version = (std::mem::size_of::<nvmlMemory_v2_t>() | (2 << 24)) as c_uint;
        put(
            memory,
            nvmlMemory_v2_t {
                version,
                total,
                reserved: 0,
                used,
                free: total - used,
            },
        )
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    guard(|| {
        let procs = process_infos(device, |_| true)?;
        put_list(infos, count, &procs)
    })
}

/// The processes on `device` that `which` keeps, as NVML lists them: a MIG device's are those in
/// its instance, a whole GPU's all of them.
pub(crate) fn process_infos(
    device: nvmlDevice_t,
    which: impl Fn(&gpuslice_emulator::model::Process) -> bool,
) -> Result<Vec<nvmlProcessInfo_t>, nvmlReturn_t> {
    let (i, mig) = gpu_and_instance(device)?;
    read(|m| {
        Ok(m.gpu(i)?
            .processes
            .iter()
            .filter(|p| mig.is_none_or(|gi| p.gpu_instance == Some(gi)) && which(p))
            .map(|p| nvmlProcessInfo_t {
                pid: p.pid,
                usedGpuMemory: p.memory as c_ulonglong,
                gpuInstanceId: p.gpu_instance.unwrap_or(u32::MAX),
                computeInstanceId: if p.gpu_instance.is_some() {
                    0
                } else {
                    u32::MAX
                },
            })
            .collect::<Vec<_>>())
    })
}
