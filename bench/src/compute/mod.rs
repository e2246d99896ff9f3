//! `gpuslice bench compute`: real processes under the shim, on the emulated GPU, arbitrated by the
//! agent's compute arbiter (served here in-process on a real socket, as the agent serves it).
//! Achieved shares come from the emulator's GPU timeline, which records which process ran each
//! kernel when, so they are exact; the table compares them with each slice's target in every
//! 1 s window after the first. With `--real-gpu` the workers run on GPU 0 through the real
//! driver and shares come from the kernels each process completed in each window. Last, an
//! inference client's latency beside a training neighbour, time-sliced against MPS.

use std::path::Path;
use std::time::Instant;

mod bench;
mod jobs;
mod latency;
mod overhead;
mod render;
mod run;
mod scenarios;
mod shares;
pub mod worker;

pub use bench::{Bench, Gpu};
pub use jobs::Jobs;
pub use latency::{LATENCY_TARGET, Latency, Percentiles};
pub use overhead::Overhead;
pub use render::render;
pub use scenarios::{Scenario, SliceSpec, Work, scenarios, slice_id};
pub use shares::{Report, ScenarioResult, SliceResult, shares};

/// Tolerance on a share, in percentage points, in every window after the first; wider for long
/// time slices (see [`tolerance`]).
pub const TOLERANCE: f64 = 3.0;

/// The tolerance of a 1 s window for slices that take turns of `time_slice_ms`: a window's
/// edges cut a turn anywhere, so one turn (a tenth of a percent per ms) is its resolution; a
/// 50 ms slice's windows hold ten turns each and are measured to ±5 pp.
pub fn tolerance(time_slice_ms: u64) -> f64 {
    TOLERANCE.max(time_slice_ms as f64 / 10.0)
}
/// The kernel every worker launches (µs): short against a time slice, as real steps are.
pub const KERNEL_US: u64 = 500;
/// Launch throughput with arbitration must be at least this fraction of the shim's without.
pub const OVERHEAD_TARGET: f64 = 0.99;

/// The slices of the overhead measurement: the shim without arbitration, and with it.
const PLAIN: &str = "overhead-plain";
const ARBITRATED: &str = "overhead-arbitrated";
/// The latency run's slices: the inference client's and its training neighbour's, time-sliced
/// and then on MPS.
const INFER: &str = "latency-infer";
const TRAIN: &str = "latency-train";
const MPS_INFER: &str = "latency-mps-infer";
const MPS_TRAIN: &str = "latency-mps-train";
/// Jobs of the sharing-versus-queueing comparison.
const JOBS: usize = 4;
/// Kernels per job: one second of GPU time each.
const JOB_KERNELS: u64 = 1_000_000 / KERNEL_US;

fn job_slice(job: usize) -> String {
    format!("job-{job}")
}

#[derive(Debug, thiserror::Error)]
pub enum ComputeBenchError {
    #[error(
        "{0} is not next to {1}: build the workspace first (cargo build --release --workspace)"
    )]
    Missing(&'static str, String),
    #[error("setting up the emulated GPU in {path}: {reason}")]
    Setup { path: String, reason: String },
    #[error("worker {0}: {1}")]
    Worker(String, String),
}

fn setup(path: impl AsRef<Path>, e: impl std::fmt::Display) -> ComputeBenchError {
    ComputeBenchError::Setup {
        path: path.as_ref().display().to_string(),
        reason: e.to_string(),
    }
}

/// What a run of the bench measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parts {
    /// The scenarios' shares, the launch overhead, the four jobs and the latency comparison.
    All,
    /// The scenarios' shares only.
    Shares,
    /// The latency comparison only.
    LatencyOnly,
}

/// Runs every scenario (or those whose names contain `only`) and the other `parts`.
pub fn run_all(
    seconds: u64,
    only: &[String],
    parts: Parts,
    real_gpu: bool,
) -> Result<(String, bool), ComputeBenchError> {
    let exe = std::env::current_exe()
        .map_err(|e| ComputeBenchError::Missing("gpuslice", e.to_string()))?;
    let all = scenarios();
    let bench = if real_gpu {
        Bench::real(&exe, &all)?
    } else {
        Bench::new(&exe, &all)?
    };
    let mut results = Vec::new();
    for (i, scenario) in all.iter().enumerate() {
        if parts == Parts::LatencyOnly
            || !only.is_empty() && !only.iter().any(|o| scenario.name.contains(o.as_str()))
        {
            continue;
        }
        let started = Instant::now();
        results.push(bench.run(i, scenario, seconds)?);
        eprintln!(
            "ran {} in {:.1} s",
            scenario.name,
            started.elapsed().as_secs_f64()
        );
    }
    let (overhead, jobs) = if parts == Parts::All {
        (Some(bench.overhead(9)?), Some(bench.jobs(JOB_KERNELS)?))
    } else {
        (None, None)
    };
    let latency = if parts == Parts::Shares {
        None
    } else {
        Some(bench.latency(seconds.max(3))?)
    };
    Ok(render(&bench.describe(), &results, overhead, jobs, latency))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_is_judged_to_one_turn_of_a_long_time_slice() {
        assert_eq!(tolerance(10), TOLERANCE);
        assert_eq!(tolerance(50), 5.0);
    }

    #[test]
    fn instructions_decide_the_overhead_where_they_were_counted() {
        let noisy = Overhead {
            ratios: vec![0.93, 0.97, 1.0],
            instructions: Some((1000.0, 1005.0)),
        };
        let (line, passed) = noisy.verdict();
        assert!(passed, "{line}");
        assert!(
            line.contains("median 0.970") && line.contains("0.930–1.000"),
            "{line}"
        );
        let costly = Overhead {
            instructions: Some((1000.0, 1100.0)),
            ..noisy.clone()
        };
        assert!(!costly.verdict().1);
        let timed_only = Overhead {
            instructions: None,
            ..noisy
        };
        assert!(
            !timed_only.verdict().1,
            "the median throughput ratio is below target"
        );
    }
}
