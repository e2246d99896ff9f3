//! Contexts: created, primary (retained and released), current per thread, synchronised.

use std::cell::Cell;
use std::ffi::{c_int, c_uint, c_void};

use crate::driver::{CURRENT, guard, put, with};
use crate::timeline::wait_until;
use crate::{CUDA_ERROR_INVALID_CONTEXT, CUdevice, CUresult, Handle};

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
