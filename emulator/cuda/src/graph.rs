//! Graphs, captured from streams, instantiated and launched.

use std::ffi::c_int;

use crate::driver::{guard, put, with};
use crate::{CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE, CUresult, Handle};

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
