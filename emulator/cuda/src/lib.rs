//! An emulated `libcuda.so.1`: the CUDA driver API that gpuslice's shim hooks and that test
//! programs call, on the shared device model. Devices come from the machine in the state file
//! named by `GPUSLICE_EMULATOR_STATE` (whole GPUs, or MIG instances, as `CUDA_VISIBLE_DEVICES`
//! selects by index, `GPU-…` or `MIG-…` UUID). Device memory is held in a ledger every process
//! shares ([`gpuslice_emulator::cuda_ledger_path`]), so allocations in one process shrink what
//! the others can take, return `CUDA_ERROR_OUT_OF_MEMORY` when the device is full, and show up in
//! the emulated NVML's process list. A context costs [`CONTEXT_BYTES`] of device memory, as a real
//! one costs hundreds of MiB. Kernels take the time their name says (`sleep_250us`), on streams
//! that events can time.
//!
//! Programs reach it as they reach the real driver: linked (`-lcuda`), through `dlopen` +
//! `dlsym`, or through `cuGetProcAddress[_v2]`, which answers from one table of entry points.
//! Every export runs under `catch_unwind`: a panic becomes `CUDA_ERROR_UNKNOWN`.

// The exports carry the driver's names and take the C caller's pointers, as its functions do.
#![allow(non_snake_case, clippy::not_unsafe_ptr_arg_deref)]

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use gpuslice_emulator::shm::{Ledger, Process, RowId, alive};
use gpuslice_emulator::timeline::{Timeline, now_ns, timeline_path};
use gpuslice_emulator::{Store, cuda_ledger_path, device_key};

pub use gpuslice_contract::cuda::{
    ArrayDescriptor, ArrayDescriptor3D, CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_DEVICE,
    CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NO_DEVICE,
    CUDA_ERROR_NOT_FOUND, CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_UNKNOWN,
    CUDA_SUCCESS, CuDevice as CUdevice, CuDevicePtr as CUdeviceptr, CuResult as CUresult, Handle,
    LaunchConfig,
};

/// Device memory a context takes when created.
pub const CONTEXT_BYTES: u64 = 300 << 20;
/// The driver version reported (12.8).
const DRIVER_VERSION: c_int = 12080;
/// Allocation granularity of the virtual-memory API.
const GRANULARITY: u64 = 2 << 20;
/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
const PER_THREAD_DEFAULT_STREAM: u64 = 1 << 1;

struct Device {
    key: u32,
    name: String,
    uuid: [u8; 16],
    total: u64,
}

#[derive(Default)]
struct Driver {
    devices: Vec<Device>,
    ledger: Option<Ledger>,
    process: Option<Process>,
    rows: HashMap<u32, RowId>,
    /// Context id → device ordinal.
    contexts: HashMap<u64, usize>,
    /// Device ordinal → (primary context, references).
    primary: HashMap<usize, (u64, u32)>,
    /// Every allocation (pointer, VMM handle or array) → (device ordinal, bytes).
    held: HashMap<u64, (usize, u64)>,
    /// Stream → when the work queued on it ends (monotonic ns).
    streams: HashMap<u64, u64>,
    events: HashMap<u64, Option<u64>>,
    modules: HashSet<u64>,
    /// Function → how long its kernel runs (ns).
    functions: HashMap<u64, u64>,
    /// Streams being captured into a graph → the kernels captured so far.
    capturing: HashMap<u64, Vec<u64>>,
    /// Graphs and their executable instances → their kernels, in order.
    graphs: HashMap<u64, Vec<u64>>,
    graph_execs: HashMap<u64, Vec<u64>>,
    /// The state file, next to which each device's timeline lives.
    state: PathBuf,
    /// Device key → its timeline, opened at the first kernel.
    timelines: HashMap<u32, Timeline>,
    next_id: u64,
    next_address: u64,
}

static DRIVER: Mutex<Option<Driver>> = Mutex::new(None);

thread_local! {
    static CURRENT: Cell<u64> = const { Cell::new(0) };
}

fn guard(body: impl FnOnce() -> Result<(), CUresult>) -> CUresult {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(rc)) => rc,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

fn with<T>(f: impl FnOnce(&mut Driver) -> Result<T, CUresult>) -> Result<T, CUresult> {
    let mut lock = DRIVER.lock().unwrap_or_else(|p| p.into_inner());
    let driver = lock.as_mut().ok_or(CUDA_ERROR_NOT_INITIALIZED)?;
    f(driver)
}

fn put<T>(out: *mut T, value: T) -> Result<(), CUresult> {
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null out-pointer to space for one T, as the driver API requires of callers.
    unsafe { out.write(value) };
    Ok(())
}

fn get<T: Copy>(input: *const T) -> Result<T, CUresult> {
    if input.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null pointer to one T, as the driver API requires of callers.
    Ok(unsafe { input.read() })
}

fn uuid_bytes(text: &str) -> [u8; 16] {
    let hex: String = text
        .trim_start_matches("GPU-")
        .trim_start_matches("MIG-")
        .chars()
        .filter(char::is_ascii_hexdigit)
        .collect();
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = hex
            .get(i * 2..i * 2 + 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .unwrap_or(0);
    }
    out
}

/// The devices this process sees: `CUDA_VISIBLE_DEVICES` entries (indices, `GPU-`/`MIG-` UUIDs)
/// in order, or every GPU (each MIG instance of a GPU in MIG mode) when unset.
fn discover(machine: &gpuslice_emulator::Machine) -> Vec<Device> {
    let whole = |g: &gpuslice_emulator::Gpu| Device {
        key: device_key(g.index, None),
        name: g.model.clone(),
        uuid: uuid_bytes(&g.uuid),
        total: g.memory_total,
    };
    let instance = |g: &gpuslice_emulator::Gpu, i: &gpuslice_emulator::GpuInstance| {
        let model = gpuslice_planning::catalog::model(&g.model).ok();
        let profile = model
            .and_then(|m| m.mig.as_ref())
            .and_then(|mig| mig.profile_by_id(i.profile_id));
        Device {
            key: device_key(g.index, Some(i.id)),
            name: format!(
                "{} MIG {}",
                g.model,
                profile.map_or("?", |p| p.name.as_str())
            ),
            uuid: uuid_bytes(&i.uuid),
            total: profile.map_or(0, |p| p.memory_bytes()),
        }
    };
    let all = || -> Vec<Device> {
        machine
            .gpus
            .iter()
            .flat_map(|g| {
                if g.mig_enabled {
                    g.instances.iter().map(|i| instance(g, i)).collect()
                } else {
                    vec![whole(g)]
                }
            })
            .collect()
    };
    let Ok(visible) = std::env::var("CUDA_VISIBLE_DEVICES") else {
        return all();
    };
    let mut out = Vec::new();
    for entry in visible.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        // As the driver does, stop at the first entry that names nothing.
        let found = if let Ok(n) = entry.parse::<usize>() {
            machine.gpus.get(n).filter(|g| !g.mig_enabled).map(whole)
        } else if entry.starts_with("MIG-") {
            machine.gpus.iter().find_map(|g| {
                g.instances
                    .iter()
                    .find(|i| i.uuid == entry)
                    .map(|i| instance(g, i))
            })
        } else {
            machine
                .gpus
                .iter()
                .find(|g| g.uuid == entry && !g.mig_enabled)
                .map(whole)
        };
        match found {
            Some(d) => out.push(d),
            None => break,
        }
    }
    out
}

fn init() -> Result<(), CUresult> {
    let mut lock = DRIVER.lock().unwrap_or_else(|p| p.into_inner());
    if lock.is_some() {
        return Ok(());
    }
    let path = std::env::var_os(gpuslice_contract::env::EMULATOR_STATE)
        .map(PathBuf::from)
        .ok_or(CUDA_ERROR_NO_DEVICE)?;
    let machine = Store::open(&path).and_then(|s| s.snapshot()).map_err(|e| {
        eprintln!("gpuslice CUDA emulator: {e}");
        CUDA_ERROR_NO_DEVICE
    })?;
    let ledger = Ledger::open(&cuda_ledger_path(&path)).map_err(|e| {
        eprintln!("gpuslice CUDA emulator: {e}");
        CUDA_ERROR_UNKNOWN
    })?;
    ledger.reclaim(alive);
    *lock = Some(Driver {
        devices: discover(&machine),
        state: path,
        ledger: Some(ledger),
        process: Some(Process::current()),
        next_id: 1,
        next_address: 0x7f00_0000_0000,
        ..Driver::default()
    });
    Ok(())
}

impl Driver {
    fn device(&self, ordinal: CUdevice) -> Result<&Device, CUresult> {
        usize::try_from(ordinal)
            .ok()
            .and_then(|o| self.devices.get(o))
            .ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn current_device(&self) -> Result<usize, CUresult> {
        let ctx = CURRENT.with(Cell::get);
        self.contexts
            .get(&ctx)
            .copied()
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)
    }

    fn ledger(&self) -> Result<&Ledger, CUresult> {
        self.ledger.as_ref().ok_or(CUDA_ERROR_NOT_INITIALIZED)
    }

    fn row(&mut self, ordinal: usize) -> Result<(RowId, u64, u32), CUresult> {
        let (key, total) = {
            let d = &self.devices[ordinal];
            (d.key, d.total)
        };
        if let Some(row) = self.rows.get(&key) {
            return Ok((*row, total, key));
        }
        let process = self.process.ok_or(CUDA_ERROR_NOT_INITIALIZED)?;
        let row = self
            .ledger()?
            .row_for(process, key)
            .map_err(|_| CUDA_ERROR_UNKNOWN)?;
        self.rows.insert(key, row);
        Ok((row, total, key))
    }

    /// Takes device memory, or OUT_OF_MEMORY when the device (all processes together) is full.
    fn take(&mut self, ordinal: usize, bytes: u64) -> Result<(), CUresult> {
        let (row, total, _) = self.row(ordinal)?;
        let ledger = self.ledger()?;
        if ledger.try_charge(row, bytes, total) {
            return Ok(());
        }
        // Memory of processes that died comes back, as the driver frees it.
        if ledger.reclaim(alive) > 0 && ledger.try_charge(row, bytes, total) {
            return Ok(());
        }
        Err(CUDA_ERROR_OUT_OF_MEMORY)
    }

    fn give_back(&mut self, ordinal: usize, bytes: u64) -> Result<(), CUresult> {
        let (row, _, _) = self.row(ordinal)?;
        self.ledger()?.release(row, bytes);
        Ok(())
    }

    /// Takes `bytes` on the current device and records the allocation under a new address.
    fn allocate(&mut self, bytes: u64) -> Result<u64, CUresult> {
        if bytes == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let ordinal = self.current_device()?;
        self.take(ordinal, bytes)?;
        let address = self.next_address;
        self.next_address += bytes.div_ceil(512) * 512;
        self.held.insert(address, (ordinal, bytes));
        Ok(address)
    }

    /// Frees what `id` holds (a pointer, VMM handle or array).
    fn free(&mut self, id: u64) -> Result<(), CUresult> {
        let (ordinal, bytes) = self.held.remove(&id).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        self.give_back(ordinal, bytes)
    }

    fn new_context(&mut self, ordinal: usize) -> Result<u64, CUresult> {
        self.take(ordinal, CONTEXT_BYTES)?;
        let ctx = self.id();
        self.contexts.insert(ctx, ordinal);
        Ok(ctx)
    }

    fn drop_context(&mut self, ctx: u64) -> Result<(), CUresult> {
        let ordinal = self
            .contexts
            .remove(&ctx)
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if CURRENT.with(Cell::get) == ctx {
            CURRENT.with(|c| c.set(0));
        }
        self.give_back(ordinal, CONTEXT_BYTES)
    }

    fn launch(&mut self, function: Handle, stream: Handle) -> Result<(), CUresult> {
        self.current_device()?;
        let run = *self
            .functions
            .get(&(function as u64))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        self.enqueue(stream, &[run])
    }

    /// Queues kernels of these lengths on a stream: captured into its graph while it is being
    /// captured, else run on the device's timeline, after the stream's earlier work.
    fn enqueue(&mut self, stream: Handle, kernels: &[u64]) -> Result<(), CUresult> {
        let ordinal = self.current_device()?;
        if let Some(graph) = self.capturing.get_mut(&(stream as u64)) {
            graph.extend_from_slice(kernels);
            return Ok(());
        }
        let key = self.devices[ordinal].key;
        if !self.timelines.contains_key(&key) {
            let timeline = Timeline::open(&timeline_path(&self.state, key)).map_err(|e| {
                eprintln!("gpuslice CUDA emulator: {e}");
                CUDA_ERROR_UNKNOWN
            })?;
            self.timelines.insert(key, timeline);
        }
        let pid = self.process.map_or(0, |p| p.pid);
        let now = now_ns();
        let mut end = self.streams.get(&(stream as u64)).copied().unwrap_or(now);
        for &run in kernels {
            end = self.timelines[&key].run(pid, end.max(now), run);
        }
        self.streams.insert(stream as u64, end);
        Ok(())
    }

    fn stream_end(&self, stream: Handle) -> Result<u64, CUresult> {
        match self.streams.get(&(stream as u64)) {
            Some(end) => Ok(*end),
            None if stream.is_null() => Ok(now_ns()),
            None => Err(CUDA_ERROR_INVALID_HANDLE),
        }
    }
}

/// Waits for the device to reach `end`: sleeps most of the way, then yields the last stretch,
/// so a synchronising host wakes when the work ends, as with a real GPU, not a timer slack later.
fn wait_until(end: u64) {
    const SPIN: u64 = 100_000;
    let now = now_ns();
    if end > now + SPIN {
        std::thread::sleep(Duration::from_nanos(end - now - SPIN));
    }
    while now_ns() < end {
        std::thread::yield_now();
    }
}

// ---- initialisation, devices ----

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

// ---- contexts ----

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxCreate_v2(ctx: *mut Handle, _flags: c_uint, device: CUdevice) -> CUresult {
    guard(|| {
        let id = with(|d| {
            d.device(device)?;
            d.new_context(device as usize)
        })?;
        CURRENT.with(|c| c.set(id));
        put(ctx, id as Handle)
    })
}

/// CUDA 11.4's variant, with execution-affinity parameters (the emulator has no SM affinity to
/// give, so it takes the context whole, as a driver without the feature does).
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxCreate_v3(
    ctx: *mut Handle,
    _params: *const c_void,
    _count: c_int,
    flags: c_uint,
    device: CUdevice,
) -> CUresult {
    cuCtxCreate_v2(ctx, flags, device)
}

/// CUDA 12.5's variant, with `CUctxCreateParams` (affinity and a CIG context; neither applies).
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxCreate_v4(
    ctx: *mut Handle,
    _params: *const c_void,
    flags: c_uint,
    device: CUdevice,
) -> CUresult {
    cuCtxCreate_v2(ctx, flags, device)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxDestroy_v2(ctx: Handle) -> CUresult {
    guard(|| with(|d| d.drop_context(ctx as u64)))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut Handle, device: CUdevice) -> CUresult {
    guard(|| {
        let id = with(|d| {
            d.device(device)?;
            let ordinal = device as usize;
            if let Some((ctx, refs)) = d.primary.get_mut(&ordinal) {
                *refs += 1;
                return Ok(*ctx);
            }
            let ctx = d.new_context(ordinal)?;
            d.primary.insert(ordinal, (ctx, 1));
            Ok(ctx)
        })?;
        put(ctx, id as Handle)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(device: CUdevice) -> CUresult {
    guard(|| {
        with(|d| {
            d.device(device)?;
            let ordinal = device as usize;
            let (ctx, refs) = d
                .primary
                .get_mut(&ordinal)
                .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
            *refs -= 1;
            if *refs == 0 {
                let ctx = *ctx;
                d.primary.remove(&ordinal);
                d.drop_context(ctx)?;
            }
            Ok(())
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: Handle) -> CUresult {
    guard(|| {
        if !ctx.is_null() {
            with(|d| {
                d.contexts
                    .contains_key(&(ctx as u64))
                    .then_some(())
                    .ok_or(CUDA_ERROR_INVALID_CONTEXT)
            })?;
        }
        CURRENT.with(|c| c.set(ctx as u64));
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxGetCurrent(ctx: *mut Handle) -> CUresult {
    guard(|| put(ctx, CURRENT.with(Cell::get) as Handle))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    guard(|| put(device, with(|d| d.current_device())? as CUdevice))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    guard(|| {
        let end = with(|d| {
            d.current_device()?;
            Ok(d.streams.values().max().copied())
        })?;
        if let Some(end) = end {
            wait_until(end);
        }
        Ok(())
    })
}

// ---- memory ----

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

// ---- streams, events, modules, launches ----

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamCreate(stream: *mut Handle, _flags: c_uint) -> CUresult {
    guard(|| {
        let id = with(|d| {
            d.current_device()?;
            let id = d.id();
            d.streams.insert(id, now_ns());
            Ok(id)
        })?;
        put(stream, id as Handle)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(stream: Handle) -> CUresult {
    guard(|| {
        with(|d| {
            d.streams
                .remove(&(stream as u64))
                .map(|_| ())
                .ok_or(CUDA_ERROR_INVALID_HANDLE)
        })
    })
}

fn stream_synchronize(stream: Handle) -> CUresult {
    guard(|| {
        wait_until(with(|d| d.stream_end(stream))?);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(stream: Handle) -> CUresult {
    stream_synchronize(stream)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize_ptsz(stream: Handle) -> CUresult {
    stream_synchronize(stream)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventCreate(event: *mut Handle, _flags: c_uint) -> CUresult {
    guard(|| {
        let id = with(|d| {
            let id = d.id();
            d.events.insert(id, None);
            Ok(id)
        })?;
        put(event, id as Handle)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord(event: Handle, stream: Handle) -> CUresult {
    event_record(event, stream)
}

fn event_record(event: Handle, stream: Handle) -> CUresult {
    guard(|| {
        with(|d| {
            let at = d.stream_end(stream)?.max(now_ns());
            let slot = d
                .events
                .get_mut(&(event as u64))
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            *slot = Some(at);
            Ok(())
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord_ptsz(event: Handle, stream: Handle) -> CUresult {
    event_record(event, stream)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventSynchronize(event: Handle) -> CUresult {
    guard(|| {
        let at = with(|d| {
            d.events
                .get(&(event as u64))
                .copied()
                .ok_or(CUDA_ERROR_INVALID_HANDLE)
        })?;
        if let Some(at) = at {
            wait_until(at);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventElapsedTime(ms: *mut f32, start: Handle, end: Handle) -> CUresult {
    guard(|| {
        let (a, b) = with(|d| {
            let at = |e: Handle| {
                d.events
                    .get(&(e as u64))
                    .copied()
                    .ok_or(CUDA_ERROR_INVALID_HANDLE)?
                    .ok_or(CUDA_ERROR_INVALID_HANDLE)
            };
            Ok((at(start)?, at(end)?))
        })?;
        put(ms, b.saturating_sub(a) as f32 / 1e6)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventDestroy_v2(event: Handle) -> CUresult {
    guard(|| {
        with(|d| {
            d.events
                .remove(&(event as u64))
                .map(|_| ())
                .ok_or(CUDA_ERROR_INVALID_HANDLE)
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> CUresult {
    guard(|| {
        if image.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = with(|d| {
            d.current_device()?;
            let id = d.id();
            d.modules.insert(id);
            Ok(id)
        })?;
        put(module, id as Handle)
    })
}

/// Any function name resolves; `sleep_<N>us` runs for N microseconds, anything else instantly.
#[unsafe(no_mangle)]
pub extern "C" fn cuModuleGetFunction(
    function: *mut Handle,
    module: Handle,
    name: *const c_char,
) -> CUresult {
    guard(|| {
        if name.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null NUL-terminated string, as the API requires.
        let name = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        let run = name
            .strip_prefix("sleep_")
            .and_then(|n| n.strip_suffix("us"))
            .and_then(|n| n.parse().ok())
            .map_or(0, |us: u64| us * 1_000);
        let id = with(|d| {
            if !d.modules.contains(&(module as u64)) {
                return Err(CUDA_ERROR_INVALID_HANDLE);
            }
            let id = d.id();
            d.functions.insert(id, run);
            Ok(id)
        })?;
        put(function, id as Handle)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(module: Handle) -> CUresult {
    guard(|| {
        with(|d| {
            d.modules
                .remove(&(module as u64))
                .then_some(())
                .ok_or(CUDA_ERROR_INVALID_HANDLE)
        })
    })
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)] // the driver's signature
pub extern "C" fn cuLaunchKernel(
    function: Handle,
    _gx: c_uint,
    _gy: c_uint,
    _gz: c_uint,
    _bx: c_uint,
    _by: c_uint,
    _bz: c_uint,
    _shared: c_uint,
    stream: Handle,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    guard(|| with(|d| d.launch(function, stream)))
}

fn launch(function: Handle, stream: Handle) -> CUresult {
    guard(|| with(|d| d.launch(function, stream)))
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)] // the driver's signature
pub extern "C" fn cuLaunchKernel_ptsz(
    function: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let _ = (gx, gy, gz, bx, by, bz, shared, params, extra);
    launch(function, stream)
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)] // the driver's signature
pub extern "C" fn cuLaunchCooperativeKernel(
    function: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
) -> CUresult {
    let _ = (gx, gy, gz, bx, by, bz, shared, params);
    launch(function, stream)
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)] // the driver's signature
pub extern "C" fn cuLaunchCooperativeKernel_ptsz(
    function: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
) -> CUresult {
    let _ = (gx, gy, gz, bx, by, bz, shared, params);
    launch(function, stream)
}

fn launch_ex(config: *const LaunchConfig, function: Handle) -> CUresult {
    guard(|| {
        if config.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null, pointing at the caller's CUlaunchConfig as the API requires.
        let stream = unsafe { (*config).stream };
        with(|d| d.launch(function, stream))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchKernelEx(
    config: *const LaunchConfig,
    function: Handle,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    launch_ex(config, function)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchKernelEx_ptsz(
    config: *const LaunchConfig,
    function: Handle,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    launch_ex(config, function)
}

// ---- graphs, captured from streams ----

fn begin_capture(stream: Handle) -> CUresult {
    guard(|| {
        with(|d| {
            d.current_device()?;
            d.capturing.insert(stream as u64, Vec::new());
            Ok(())
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamBeginCapture_v2(stream: Handle, _mode: c_int) -> CUresult {
    begin_capture(stream)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamBeginCapture_v2_ptsz(stream: Handle, _mode: c_int) -> CUresult {
    begin_capture(stream)
}

fn end_capture(stream: Handle, graph: *mut Handle) -> CUresult {
    guard(|| {
        let id = with(|d| {
            let kernels = d
                .capturing
                .remove(&(stream as u64))
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
            let id = d.id();
            d.graphs.insert(id, kernels);
            Ok(id)
        })?;
        put(graph, id as Handle)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamEndCapture(stream: Handle, graph: *mut Handle) -> CUresult {
    end_capture(stream, graph)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamEndCapture_ptsz(stream: Handle, graph: *mut Handle) -> CUresult {
    end_capture(stream, graph)
}

/// `CUstreamCaptureStatus`: 0 none, 1 active.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamIsCapturing(stream: Handle, status: *mut c_int) -> CUresult {
    guard(|| {
        let active = with(|d| Ok(d.capturing.contains_key(&(stream as u64))))?;
        put(status, c_int::from(active))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphInstantiateWithFlags(
    exec: *mut Handle,
    graph: Handle,
    _flags: u64,
) -> CUresult {
    guard(|| {
        let id = with(|d| {
            let kernels = d
                .graphs
                .get(&(graph as u64))
                .cloned()
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            let id = d.id();
            d.graph_execs.insert(id, kernels);
            Ok(id)
        })?;
        put(exec, id as Handle)
    })
}

fn graph_launch(exec: Handle, stream: Handle) -> CUresult {
    guard(|| {
        with(|d| {
            let kernels = d
                .graph_execs
                .get(&(exec as u64))
                .cloned()
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            d.enqueue(stream, &kernels)
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphLaunch(exec: Handle, stream: Handle) -> CUresult {
    graph_launch(exec, stream)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphLaunch_ptsz(exec: Handle, stream: Handle) -> CUresult {
    graph_launch(exec, stream)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphExecDestroy(exec: Handle) -> CUresult {
    guard(|| {
        with(|d| {
            d.graph_execs
                .remove(&(exec as u64))
                .map(|_| ())
                .ok_or(CUDA_ERROR_INVALID_HANDLE)
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphDestroy(graph: Handle) -> CUresult {
    guard(|| {
        with(|d| {
            d.graphs
                .remove(&(graph as u64))
                .map(|_| ())
                .ok_or(CUDA_ERROR_INVALID_HANDLE)
        })
    })
}

// ---- errors ----

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

// ---- cuGetProcAddress: one table of entry points ----

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
