//! Memory caps, exact. Every way a process takes device memory is charged to its slice's ledger
//! before the driver is asked (so two processes can never both squeeze past the cap), and given
//! back when the driver call fails or the memory is freed. A context is charged at creation by
//! what the driver says the process then uses (NVML), so the host and the slice agree. Over the
//! cap the call returns `CUDA_ERROR_OUT_OF_MEMORY` and nothing else is disturbed.

use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::Mutex;
use std::sync::atomic::AtomicUsize;

use crate::limits::{Kind, Limits, Slice, limits};
use crate::real::{Lib, resolve};
use gpuslice_contract::cuda::{ArrayDescriptor, ArrayDescriptor3D, Handle};

const SUCCESS: c_int = 0;
const OUT_OF_MEMORY: c_int = 2;

/// How a hook treats one call.
enum Gate {
    Pass,
    Refuse,
    Account(&'static Slice),
}

fn gate() -> Gate {
    match limits() {
        Limits::Off => Gate::Pass,
        Limits::Closed => Gate::Refuse,
        Limits::Capped(slice) => Gate::Account(slice),
    }
}

/// Charges `bytes`, makes the call, and on success remembers what it returned under `key`.
fn charged(
    bytes: u64,
    kind: Kind,
    call: impl FnOnce() -> c_int,
    key: impl FnOnce() -> u64,
) -> c_int {
    match gate() {
        Gate::Pass => call(),
        Gate::Refuse => OUT_OF_MEMORY,
        Gate::Account(slice) => {
            if !slice.try_charge(bytes) {
                return OUT_OF_MEMORY;
            }
            let rc = call();
            if rc == SUCCESS {
                slice.remember(kind, key(), bytes);
            } else {
                slice.release(bytes);
            }
            rc
        }
    }
}

/// Makes a freeing call and, when it succeeds, gives back what `key` held.
fn freed(kind: Kind, key: u64, call: impl FnOnce() -> c_int) -> c_int {
    let rc = call();
    if rc == SUCCESS
        && let Limits::Capped(slice) = limits()
        && let Some(bytes) = slice.forget(kind, key)
    {
        slice.release(bytes);
    }
    rc
}

fn read<T: Copy>(p: *const T) -> T {
    // SAFETY: only called after the driver reported success writing through this pointer.
    unsafe { p.read() }
}

type Alloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
type Free = unsafe extern "C" fn(u64) -> c_int;

pub fn alloc(real: Alloc, dptr: *mut u64, bytes: usize) -> c_int {
    // SAFETY (each real call below): the program's call, forwarded unchanged.
    charged(
        bytes as u64,
        Kind::Pointer,
        || unsafe { real(dptr, bytes) },
        || read(dptr),
    )
}

pub fn free(real: Free, dptr: u64) -> c_int {
    freed(Kind::Pointer, dptr, || unsafe { real(dptr) })
}

pub fn alloc_managed(
    real: unsafe extern "C" fn(*mut u64, usize, c_uint) -> c_int,
    dptr: *mut u64,
    bytes: usize,
    flags: c_uint,
) -> c_int {
    // Managed memory may all be resident on the device: it counts in full.
    charged(
        bytes as u64,
        Kind::Pointer,
        || unsafe { real(dptr, bytes, flags) },
        || read(dptr),
    )
}

pub fn alloc_async(
    real: unsafe extern "C" fn(*mut u64, usize, Handle) -> c_int,
    dptr: *mut u64,
    bytes: usize,
    stream: Handle,
) -> c_int {
    charged(
        bytes as u64,
        Kind::Pointer,
        || unsafe { real(dptr, bytes, stream) },
        || read(dptr),
    )
}

pub fn alloc_from_pool(
    real: unsafe extern "C" fn(*mut u64, usize, Handle, Handle) -> c_int,
    dptr: *mut u64,
    bytes: usize,
    pool: Handle,
    stream: Handle,
) -> c_int {
    charged(
        bytes as u64,
        Kind::Pointer,
        || unsafe { real(dptr, bytes, pool, stream) },
        || read(dptr),
    )
}

/// Freed when queued: the memory is the stream's until then, and no longer the program's.
pub fn free_async(
    real: unsafe extern "C" fn(u64, Handle) -> c_int,
    dptr: u64,
    stream: Handle,
) -> c_int {
    freed(Kind::Pointer, dptr, || unsafe { real(dptr, stream) })
}

/// The size of a pitched allocation is known only after the driver picks the pitch: charge it
/// then, and hand the memory back to the driver if it does not fit.
pub fn alloc_pitch(
    real: unsafe extern "C" fn(*mut u64, *mut usize, usize, usize, c_uint) -> c_int,
    dptr: *mut u64,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element: c_uint,
) -> c_int {
    let gate = gate();
    if let Gate::Refuse = gate {
        return OUT_OF_MEMORY;
    }
    // SAFETY: the program's call, forwarded unchanged.
    let rc = unsafe { real(dptr, pitch, width, height, element) };
    let Gate::Account(slice) = gate else {
        return rc;
    };
    if rc != SUCCESS {
        return rc;
    }
    let (address, bytes) = (read(dptr), read(pitch) as u64 * height as u64);
    if slice.try_charge(bytes) {
        slice.remember(Kind::Pointer, address, bytes);
        return SUCCESS;
    }
    static FREE: AtomicUsize = AtomicUsize::new(0);
    if let Some(f) = resolve(&FREE, Lib::Cuda, b"cuMemFree_v2\0") {
        // SAFETY: the real cuMemFree_v2 on the allocation the driver just made.
        unsafe { std::mem::transmute::<usize, Free>(f)(address) };
    }
    OUT_OF_MEMORY
}

pub fn create(
    real: unsafe extern "C" fn(*mut u64, usize, *const c_void, u64) -> c_int,
    handle: *mut u64,
    bytes: usize,
    prop: *const c_void,
    flags: u64,
) -> c_int {
    charged(
        bytes as u64,
        Kind::Physical,
        || unsafe { real(handle, bytes, prop, flags) },
        || read(handle),
    )
}

pub fn release(real: unsafe extern "C" fn(u64) -> c_int, handle: u64) -> c_int {
    freed(Kind::Physical, handle, || unsafe { real(handle) })
}

/// Bytes of an array; `None` for a format the shim does not know (then the driver decides).
fn array_bytes(
    width: usize,
    height: usize,
    depth: usize,
    format: c_uint,
    channels: c_uint,
) -> Option<u64> {
    let element: u64 = match format {
        0x01 | 0x08 => 1,
        0x02 | 0x09 | 0x10 => 2,
        0x03 | 0x0a | 0x20 => 4,
        _ => return None,
    };
    Some(width as u64 * height.max(1) as u64 * depth.max(1) as u64 * element * u64::from(channels))
}

pub fn array_create(
    real: unsafe extern "C" fn(*mut Handle, *const ArrayDescriptor) -> c_int,
    array: *mut Handle,
    desc: *const ArrayDescriptor,
) -> c_int {
    let bytes = (!desc.is_null())
        .then(|| read(desc))
        .and_then(|d| array_bytes(d.width, d.height, 0, d.format, d.channels));
    match bytes {
        Some(bytes) => charged(
            bytes,
            Kind::Array,
            || unsafe { real(array, desc) },
            || read(array) as u64,
        ),
        None => unsafe { real(array, desc) },
    }
}

pub fn array3d_create(
    real: unsafe extern "C" fn(*mut Handle, *const ArrayDescriptor3D) -> c_int,
    array: *mut Handle,
    desc: *const ArrayDescriptor3D,
) -> c_int {
    let bytes = (!desc.is_null())
        .then(|| read(desc))
        .and_then(|d| array_bytes(d.width, d.height, d.depth, d.format, d.channels));
    match bytes {
        Some(bytes) => charged(
            bytes,
            Kind::Array,
            || unsafe { real(array, desc) },
            || read(array) as u64,
        ),
        None => unsafe { real(array, desc) },
    }
}

pub fn array_destroy(real: unsafe extern "C" fn(Handle) -> c_int, array: Handle) -> c_int {
    freed(Kind::Array, array as u64, || unsafe { real(array) })
}

// ---- contexts ----

/// Primary contexts: device → (context, references), to give back its memory at the last release.
static PRIMARY: Mutex<Option<HashMap<c_int, (u64, u32)>>> = Mutex::new(None);

/// Charges a context just created, by what the driver now says this process holds beyond what
/// the slice already counts for it.
fn charge_context(ctx: u64) {
    let Limits::Capped(slice) = limits() else {
        return;
    };
    let on_device = crate::nvml::process_memory(std::process::id()).unwrap_or(0);
    let bytes = on_device.saturating_sub(slice.held_by_me());
    slice.charge(bytes);
    slice.remember(Kind::Context, ctx, bytes);
}

fn release_context(ctx: u64) {
    if let Limits::Capped(slice) = limits()
        && let Some(bytes) = slice.forget(Kind::Context, ctx)
    {
        slice.release(bytes);
    }
}

pub fn ctx_create(
    real: unsafe extern "C" fn(*mut Handle, c_uint, c_int) -> c_int,
    ctx: *mut Handle,
    flags: c_uint,
    device: c_int,
) -> c_int {
    if let Gate::Refuse = gate() {
        return OUT_OF_MEMORY;
    }
    // SAFETY: the program's call, forwarded unchanged.
    let rc = unsafe { real(ctx, flags, device) };
    if rc == SUCCESS {
        charge_context(read(ctx) as u64);
    }
    rc
}

/// `cuCtxCreate_v3` (execution-affinity parameters): charged as any context.
pub fn ctx_create_v3(
    real: unsafe extern "C" fn(*mut Handle, *const c_void, c_int, c_uint, c_int) -> c_int,
    ctx: *mut Handle,
    params: *const c_void,
    count: c_int,
    flags: c_uint,
    device: c_int,
) -> c_int {
    if let Gate::Refuse = gate() {
        return OUT_OF_MEMORY;
    }
    // SAFETY: the program's call, forwarded unchanged.
    let rc = unsafe { real(ctx, params, count, flags, device) };
    if rc == SUCCESS {
        charge_context(read(ctx) as u64);
    }
    rc
}

/// `cuCtxCreate_v4` (`CUctxCreateParams`): charged as any context.
pub fn ctx_create_v4(
    real: unsafe extern "C" fn(*mut Handle, *const c_void, c_uint, c_int) -> c_int,
    ctx: *mut Handle,
    params: *const c_void,
    flags: c_uint,
    device: c_int,
) -> c_int {
    if let Gate::Refuse = gate() {
        return OUT_OF_MEMORY;
    }
    // SAFETY: the program's call, forwarded unchanged.
    let rc = unsafe { real(ctx, params, flags, device) };
    if rc == SUCCESS {
        charge_context(read(ctx) as u64);
    }
    rc
}

pub fn ctx_destroy(real: unsafe extern "C" fn(Handle) -> c_int, ctx: Handle) -> c_int {
    crate::compute::forget_context(ctx);
    // SAFETY: the program's call, forwarded unchanged.
    let rc = unsafe { real(ctx) };
    if rc == SUCCESS {
        release_context(ctx as u64);
    }
    rc
}

pub fn primary_retain(
    real: unsafe extern "C" fn(*mut Handle, c_int) -> c_int,
    ctx: *mut Handle,
    device: c_int,
) -> c_int {
    if let Gate::Refuse = gate() {
        return OUT_OF_MEMORY;
    }
    // SAFETY: the program's call, forwarded unchanged.
    let rc = unsafe { real(ctx, device) };
    if rc == SUCCESS {
        let id = read(ctx) as u64;
        let mut primary = PRIMARY.lock().unwrap_or_else(|p| p.into_inner());
        let entry = primary
            .get_or_insert_with(HashMap::new)
            .entry(device)
            .or_insert((id, 0));
        entry.1 += 1;
        if entry.1 == 1 {
            drop(primary);
            charge_context(id);
        }
    }
    rc
}

pub fn primary_release(real: unsafe extern "C" fn(c_int) -> c_int, device: c_int) -> c_int {
    // SAFETY: the program's call, forwarded unchanged.
    let rc = unsafe { real(device) };
    if rc == SUCCESS {
        let mut primary = PRIMARY.lock().unwrap_or_else(|p| p.into_inner());
        let map = primary.get_or_insert_with(HashMap::new);
        if let Some((ctx, refs)) = map.get_mut(&device) {
            *refs = refs.saturating_sub(1);
            if *refs == 0 {
                let ctx = *ctx;
                map.remove(&device);
                drop(primary);
                release_context(ctx);
            }
        }
    }
    rc
}

/// `cuMemGetInfo`: the slice's cap is the total; free is what is left of it (or less, when the
/// device itself has less).
/// `cuDeviceTotalMem`: the slice's cap, not the device's memory (what `cudaGetDeviceProperties`
/// reports as `totalGlobalMem`, which frameworks size their pools from).
pub fn device_total(
    real: unsafe extern "C" fn(*mut usize, c_int) -> c_int,
    bytes: *mut usize,
    device: c_int,
) -> c_int {
    // SAFETY: the program's call, forwarded unchanged.
    let rc = unsafe { real(bytes, device) };
    if rc != SUCCESS || bytes.is_null() {
        return rc;
    }
    let total = match gate() {
        Gate::Pass => return rc,
        Gate::Refuse => 0,
        Gate::Account(slice) => slice.cap.min(read(bytes) as u64) as usize,
    };
    // SAFETY: a non-null pointer the driver just wrote through.
    unsafe { bytes.write(total) };
    rc
}

pub fn get_info(
    real: unsafe extern "C" fn(*mut usize, *mut usize) -> c_int,
    free: *mut usize,
    total: *mut usize,
) -> c_int {
    // SAFETY: the program's call, forwarded unchanged.
    let rc = unsafe { real(free, total) };
    if rc != SUCCESS || free.is_null() || total.is_null() {
        return rc;
    }
    let (f, t) = match gate() {
        Gate::Pass => return rc,
        Gate::Refuse => (0, 0),
        Gate::Account(slice) => {
            let left = slice.cap.saturating_sub(slice.used());
            ((left.min(read(free) as u64)) as usize, slice.cap as usize)
        }
    };
    // SAFETY: non-null pointers the driver just wrote through.
    unsafe {
        free.write(f);
        total.write(t);
    }
    rc
}
