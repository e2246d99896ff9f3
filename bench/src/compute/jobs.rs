//! Four jobs of fixed work, run one after another and then sharing the GPU.

use std::collections::BTreeMap;
use std::time::Duration;

use gpuslice_node::workloads::compute::GpuShares;

use super::bench::finish;
use super::scenarios::best_effort;
use super::{Bench, ComputeBenchError, JOBS, KERNEL_US, Report, job_slice};

/// Four jobs of fixed work, queued or sharing the GPU.
#[derive(Clone, Copy, Debug)]
pub struct Jobs {
    pub kernels: u64,
    /// Seconds for the four, one after another.
    pub one_after_another: f64,
    /// Seconds for the four at once, sharing the GPU.
    pub together: f64,
}

impl Bench {
    /// Four jobs of `kernels` kernels each, run one after another and then all at once on four
    /// slices of the GPU (equal weights, no caps): the seconds each way took.
    pub fn jobs(&self, kernels: u64) -> Result<Jobs, ComputeBenchError> {
        self.agent.compute.set(&BTreeMap::from([(
            0,
            GpuShares {
                time_slice: Duration::from_millis(10),
                slices: (0..JOBS).map(|j| (job_slice(j), best_effort(25))).collect(),
            },
        )]));
        let args = |start: u64| {
            [
                "--kernel-us",
                &KERNEL_US.to_string(),
                "--seconds",
                "3600",
                "--kernels",
                &kernels.to_string(),
                "--start-at",
                &start.to_string(),
            ]
            .map(String::from)
        };
        let mut one_after_another = 0.0;
        for _ in 0..JOBS {
            let start = self.start_time();
            let report: Report = self.report(&job_slice(0), &args(start))?;
            one_after_another += report.end_ns.saturating_sub(start) as f64 / 1e9;
        }
        let start = self.start_time();
        let children = (0..JOBS)
            .map(|j| Ok((job_slice(j), self.worker(&job_slice(j), &args(start))?)))
            .collect::<Result<Vec<_>, ComputeBenchError>>()?;
        let mut end = start;
        for (slice, child) in children {
            end = end.max(finish::<Report>(&slice, child)?.end_ns);
        }
        Ok(Jobs {
            kernels,
            one_after_another,
            together: end.saturating_sub(start) as f64 / 1e9,
        })
    }
}
