//! Kernels on the device's shared timeline: launches queued on streams, and the host's wait
//! for the work to end.

use std::time::Duration;

use gpuslice_emulator::timeline::{Timeline, now_ns, timeline_path};

use crate::driver::Driver;
use crate::{CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_UNKNOWN, CUresult, Handle};

impl Driver {
    pub(crate) fn launch(&mut self, function: Handle, stream: Handle) -> Result<(), CUresult> {
        self.current_device()?;
        let run = *self
            .functions
            .get(&(function as u64))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        self.enqueue(stream, &[run])
    }

    /// Queues kernels of these lengths on a stream: captured into its graph while it is being
    /// captured, else run on the device's timeline, after the stream's earlier work.
    pub(crate) fn enqueue(&mut self, stream: Handle, kernels: &[u64]) -> Result<(), CUresult> {
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
        let timeline = &self.timelines[&key];
        for &run in kernels {
            end = match &self.mps {
                Some(client) => timeline.run_beside(pid, end.max(now), run, client.share),
                None => timeline.run(pid, end.max(now), run),
            };
        }
        self.streams.insert(stream as u64, end);
        Ok(())
    }

    pub(crate) fn stream_end(&self, stream: Handle) -> Result<u64, CUresult> {
        match self.streams.get(&(stream as u64)) {
            Some(end) => Ok(*end),
            None if stream.is_null() => Ok(now_ns()),
            None => Err(CUDA_ERROR_INVALID_HANDLE),
        }
    }
}

/// Waits for the device to reach `end`: sleeps most of the way, then yields the last stretch,
/// so a synchronising host wakes when the work ends, as with a real GPU, not a timer slack later.
pub(crate) fn wait_until(end: u64) {
    const SPIN: u64 = 100_000;
    let now = now_ns();
    if end > now + SPIN {
        std::thread::sleep(Duration::from_nanos(end - now - SPIN));
    }
    while now_ns() < end {
        std::thread::yield_now();
    }
}
