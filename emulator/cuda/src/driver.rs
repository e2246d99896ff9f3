//! The driver's state in this process (devices, the shared memory ledger, contexts, handles) and
//! the helpers every export goes through: the panic guard, the lock, out-pointers.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::Mutex;

use gpuslice_emulator::shm::{Ledger, Process, RowId, alive};
use gpuslice_emulator::timeline::Timeline;
use gpuslice_emulator::{Store, cuda_ledger_path};

use crate::visible::{Device, discover};
use crate::{
    CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NO_DEVICE, CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_UNKNOWN,
    CUDA_SUCCESS, CUdevice, CUresult,
};

/// Device memory a context takes when created.
pub const CONTEXT_BYTES: u64 = 300 << 20;

#[derive(Default)]
pub(crate) struct Driver {
    pub(crate) devices: Vec<Device>,
    ledger: Option<Ledger>,
    pub(crate) process: Option<Process>,
    rows: HashMap<u32, RowId>,
    /// Context id → device ordinal.
    pub(crate) contexts: HashMap<u64, usize>,
    /// Device ordinal → (primary context, references).
    pub(crate) primary: HashMap<usize, (u64, u32)>,
    /// Every allocation (pointer, VMM handle or array) → (device ordinal, bytes).
    pub(crate) held: HashMap<u64, (usize, u64)>,
    /// Stream → when the work queued on it ends (monotonic ns).
    pub(crate) streams: HashMap<u64, u64>,
    pub(crate) events: HashMap<u64, Option<u64>>,
    pub(crate) modules: HashSet<u64>,
    /// Function → how long its kernel runs (ns).
    pub(crate) functions: HashMap<u64, u64>,
    /// Streams being captured into a graph → the kernels captured so far.
    pub(crate) capturing: HashMap<u64, Vec<u64>>,
    /// Graphs and their executable instances → their kernels, in order.
    pub(crate) graphs: HashMap<u64, Vec<u64>>,
    pub(crate) graph_execs: HashMap<u64, Vec<u64>>,
    /// The state file, next to which each device's timeline lives.
    pub(crate) state: PathBuf,
    /// Device key → its timeline, opened at the first kernel.
    pub(crate) timelines: HashMap<u32, Timeline>,
    /// Set when an MPS control daemon answered at `cuInit`.
    pub(crate) mps: Option<crate::mps::Client>,
    next_id: u64,
    next_address: u64,
}

static DRIVER: Mutex<Option<Driver>> = Mutex::new(None);

thread_local! {
    pub(crate) static CURRENT: Cell<u64> = const { Cell::new(0) };
}

pub(crate) fn guard(body: impl FnOnce() -> Result<(), CUresult>) -> CUresult {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(rc)) => rc,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

pub(crate) fn with<T>(f: impl FnOnce(&mut Driver) -> Result<T, CUresult>) -> Result<T, CUresult> {
    let mut lock = DRIVER.lock().unwrap_or_else(|p| p.into_inner());
    let driver = lock.as_mut().ok_or(CUDA_ERROR_NOT_INITIALIZED)?;
    f(driver)
}

pub(crate) fn put<T>(out: *mut T, value: T) -> Result<(), CUresult> {
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null out-pointer to space for one T, as the driver API requires of callers.
    unsafe { out.write(value) };
    Ok(())
}

pub(crate) fn get<T: Copy>(input: *const T) -> Result<T, CUresult> {
    if input.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null pointer to one T, as the driver API requires of callers.
    Ok(unsafe { input.read() })
}

pub(crate) fn init() -> Result<(), CUresult> {
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
    let process = Process::current();
    *lock = Some(Driver {
        devices: discover(&machine),
        state: path,
        ledger: Some(ledger),
        process: Some(process),
        mps: crate::mps::connect(process.pid),
        next_id: 1,
        next_address: 0x7f00_0000_0000,
        ..Driver::default()
    });
    Ok(())
}

impl Driver {
    pub(crate) fn device(&self, ordinal: CUdevice) -> Result<&Device, CUresult> {
        usize::try_from(ordinal)
            .ok()
            .and_then(|o| self.devices.get(o))
            .ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    pub(crate) fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    pub(crate) fn current_device(&self) -> Result<usize, CUresult> {
        let ctx = CURRENT.with(Cell::get);
        self.contexts
            .get(&ctx)
            .copied()
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)
    }

    pub(crate) fn ledger(&self) -> Result<&Ledger, CUresult> {
        self.ledger.as_ref().ok_or(CUDA_ERROR_NOT_INITIALIZED)
    }

    pub(crate) fn row(&mut self, ordinal: usize) -> Result<(RowId, u64, u32), CUresult> {
        let (key, total) = {
            let d = &self.devices[ordinal];
            (d.key, d.total)
        };
        if let Some(row) = self.rows.get(&key) {
            return Ok((*row, total, key));
        }
        let process = self.process.ok_or(CUDA_ERROR_NOT_INITIALIZED)?;
        let ledger = self.ledger()?;
        let row = ledger
            .row_for(process, key)
            .map_err(|_| CUDA_ERROR_UNKNOWN)?;
        // An MPS client's context on the device: NVML lists it among the device's MPS processes.
        if self.mps.is_some() {
            ledger
                .row_for(process, gpuslice_emulator::mps_context_key(key))
                .map_err(|_| CUDA_ERROR_UNKNOWN)?;
        }
        self.rows.insert(key, row);
        Ok((row, total, key))
    }

    /// Takes device memory, or OUT_OF_MEMORY when the device (all processes together) is full.
    pub(crate) fn take(&mut self, ordinal: usize, bytes: u64) -> Result<(), CUresult> {
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
    pub(crate) fn allocate(&mut self, bytes: u64) -> Result<u64, CUresult> {
        if bytes == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let ordinal = self.current_device()?;
        if let Some(limit) = self.mps.as_ref().and_then(|m| m.pinned.get(&ordinal)) {
            let pinned: u64 = self
                .held
                .values()
                .filter(|(o, _)| *o == ordinal)
                .map(|(_, b)| b)
                .sum();
            if pinned + bytes > *limit {
                return Err(CUDA_ERROR_OUT_OF_MEMORY);
            }
        }
        self.take(ordinal, bytes)?;
        let address = self.next_address;
        self.next_address += bytes.div_ceil(512) * 512;
        self.held.insert(address, (ordinal, bytes));
        Ok(address)
    }

    /// Frees what `id` holds (a pointer, VMM handle or array).
    pub(crate) fn free(&mut self, id: u64) -> Result<(), CUresult> {
        let (ordinal, bytes) = self.held.remove(&id).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        self.give_back(ordinal, bytes)
    }

    pub(crate) fn new_context(&mut self, ordinal: usize) -> Result<u64, CUresult> {
        self.take(ordinal, CONTEXT_BYTES)?;
        let ctx = self.id();
        self.contexts.insert(ctx, ordinal);
        Ok(ctx)
    }

    pub(crate) fn drop_context(&mut self, ctx: u64) -> Result<(), CUresult> {
        let ordinal = self
            .contexts
            .remove(&ctx)
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if CURRENT.with(Cell::get) == ctx {
            CURRENT.with(|c| c.set(0));
        }
        self.give_back(ordinal, CONTEXT_BYTES)
    }
}
