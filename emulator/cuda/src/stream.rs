//! Streams and the events that time them.

use std::ffi::c_uint;

use gpuslice_emulator::timeline::now_ns;

use crate::driver::{guard, put, with};
use crate::timeline::wait_until;
use crate::{CUDA_ERROR_INVALID_HANDLE, CUresult, Handle};

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
