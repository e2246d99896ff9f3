//! Reading what ran on the GPU (the emulator's timeline, or the workers' reports) and the
//! shares it gives each slice, judged against their targets.

use gpuslice_emulator::device_key;
use gpuslice_emulator::timeline::{Interval, Timeline, timeline_path};

use super::{Bench, ComputeBenchError, Gpu, KERNEL_US, setup};

/// One slice's outcome.
#[derive(Clone, Debug)]
pub struct SliceResult {
    pub name: String,
    pub target: f64,
    pub overall: f64,
    pub windows: Vec<f64>,
    pub max_wait_ms: f64,
    /// The wait (ms) that 99 % of grants did not exceed; `None` with no grants or past 64 ms.
    pub p99_wait_ms: Option<f64>,
    pub guaranteed: bool,
    /// Percentage points a window may miss the target by.
    pub tolerance: f64,
}

impl SliceResult {
    /// Every window after the first within the tolerance.
    pub fn holds(&self) -> bool {
        self.windows
            .iter()
            .skip(1)
            .all(|w| (w - self.target).abs() <= self.tolerance)
    }
}

#[derive(Clone, Debug)]
pub struct ScenarioResult {
    pub name: String,
    pub time_slice_ms: u64,
    pub slices: Vec<SliceResult>,
    pub switches_per_s: f64,
    pub kernels_per_s: f64,
    /// When the first window began (CLOCK_MONOTONIC ns).
    pub start_ns: u64,
    /// Each worker's report, with its slice's id.
    pub reports: Vec<(String, Report)>,
}

impl ScenarioResult {
    /// Shares hold, and 99 % of a guaranteed slice's waits lasted at most one time slice (plus
    /// the kernel in flight, which a GPU cannot stop, and 1 ms for the messages). A percentile,
    /// not the maximum: on a shared host one wait stretched by the OS scheduler would decide it.
    pub fn passed(&self) -> bool {
        self.slices.iter().all(|s| {
            s.holds()
                && (!s.guaranteed
                    || s.p99_wait_ms.is_some_and(|p99| {
                        p99 <= self.time_slice_ms as f64 + KERNEL_US as f64 / 1000.0 + 1.0
                    }))
        })
    }
}

/// One worker's report of a timed run.
#[derive(Clone, Debug, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub pid: u32,
    pub kernels: u64,
    #[serde(default)]
    pub per_step: u64,
    #[serde(default)]
    pub start_ns: u64,
    #[serde(default)]
    pub end_ns: u64,
    /// When each step finished (CLOCK_MONOTONIC ns).
    #[serde(default)]
    pub done: Vec<u64>,
}

impl Report {
    /// The GPU time of its steps as intervals ending when each finished, `kernel_ns` per
    /// kernel: how a real GPU's shares are measured (it keeps no timeline of its own).
    pub fn intervals(&self, kernel_ns: u64) -> Vec<Interval> {
        let step = kernel_ns * self.per_step.max(1);
        self.done
            .iter()
            .map(|&end| Interval {
                pid: self.pid,
                start: end.saturating_sub(step),
                end,
                share: 100,
            })
            .collect()
    }
}

impl Bench {
    /// Every kernel the emulated GPU ran.
    pub fn intervals(&self) -> Result<Vec<Interval>, ComputeBenchError> {
        match &self.gpu {
            Gpu::Emulated { machine, .. } => {
                let path = timeline_path(machine, device_key(0, None));
                Ok(Timeline::open(&path)
                    .map_err(|e| setup(&path, e))?
                    .intervals())
            }
            Gpu::Real { .. } => Err(setup("GPU 0", "a real GPU keeps no timeline")),
        }
    }
}

/// The GPU time `intervals` took in % of each of `seconds` 1 s windows from `start`, and of all
/// windows after the first together.
pub fn shares(intervals: &[Interval], start: u64, seconds: u64) -> (Vec<f64>, f64) {
    const WINDOW: u64 = 1_000_000_000;
    let share_in = |from: u64, to: u64| {
        let busy: u64 = intervals
            .iter()
            .map(|i| i.end.min(to).saturating_sub(i.start.max(from)))
            .sum();
        busy as f64 / to.saturating_sub(from).max(1) as f64 * 100.0
    };
    let windows = (0..seconds)
        .map(|w| share_in(start + w * WINDOW, start + (w + 1) * WINDOW))
        .collect();
    (windows, share_in(start + WINDOW, start + seconds * WINDOW))
}
