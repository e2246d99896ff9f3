//! An inference client's latency beside a training neighbour: the two on time-sliced software
//! slices (taking turns under the arbiter) against the two on MPS slices (side by side, each on
//! half the SMs, through an MPS control daemon as the agent runs it: the emulated one, or on a
//! real GPU the driver's).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use gpuslice_node::workloads::compute::GpuShares;

use gpuslice_node::gpu::mps::MpsControl;

use super::bench::{Gpu, finish};
use super::scenarios::best_effort;
use super::{Bench, ComputeBenchError, INFER, MPS_INFER, MPS_TRAIN, Report, TRAIN, setup};

/// The inference client's request: one kernel of this long on the whole GPU (ms), every
/// [`PERIOD_MS`].
pub const REQUEST_MS: u64 = 2;
pub const PERIOD_MS: u64 = 20;
/// The training neighbour's kernels, back to back (ms).
pub const TRAINING_KERNEL_MS: u64 = 10;
/// MPS passes when its p99 latency is at most this fraction of time slicing's.
pub const LATENCY_TARGET: f64 = 0.5;
/// The SM share of each MPS slice (%).
const MPS_SHARE: u32 = 50;

/// Latency percentiles of one way of sharing (ms).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Percentiles {
    pub requests: usize,
    pub p50: f64,
    pub p99: f64,
}

/// The client's latency, time-sliced and with MPS.
#[derive(Clone, Copy, Debug)]
pub struct Latency {
    pub time_sliced: Percentiles,
    pub mps: Percentiles,
}

impl Latency {
    /// MPS's p99 against time slicing's, and whether it meets [`LATENCY_TARGET`].
    pub fn verdict(&self) -> (f64, bool) {
        let ratio = self.mps.p99 / self.time_sliced.p99.max(1e-9);
        (ratio, self.mps.requests > 0 && ratio <= LATENCY_TARGET)
    }
}

/// Percentiles of the client's latencies: request `i` is due at `start + i × period` and
/// answered when its step ended (its report's `done[i]`), waiting in line included.
pub fn percentiles(report: &Report) -> Percentiles {
    let period = PERIOD_MS * 1_000_000;
    let mut ms: Vec<f64> = report
        .done
        .iter()
        .enumerate()
        .map(|(i, &done)| done.saturating_sub(report.start_ns + i as u64 * period) as f64 / 1e6)
        .collect();
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() as f64 * q).ceil() as usize).clamp(1, ms.len()) - 1];
    if ms.is_empty() {
        return Percentiles::default();
    }
    Percentiles {
        requests: ms.len(),
        p50: at(0.5),
        p99: at(0.99),
    }
}

/// The bench's own MPS control daemon, quit when dropped.
struct Daemon(MpsControl);

impl Drop for Daemon {
    fn drop(&mut self) {
        self.0.quit();
    }
}

impl Bench {
    /// The inference client (a [`REQUEST_MS`] request every [`PERIOD_MS`]) beside a training
    /// neighbour for `seconds`: on two time-sliced slices of equal weight, then on two MPS
    /// slices of half the SMs each.
    pub fn latency(&self, seconds: u64) -> Result<Latency, ComputeBenchError> {
        self.agent.compute.set(&BTreeMap::from([(
            0,
            GpuShares {
                time_slice: Duration::from_millis(10),
                slices: [INFER, TRAIN]
                    .into_iter()
                    .map(|s| (s.to_string(), best_effort(50)))
                    .collect(),
            },
        )]));
        let time_sliced = self.pair(INFER, TRAIN, seconds, &[])?;
        // The emulated daemon next to us, or the driver's; either way one of the bench's own,
        // on pipes of its own.
        let tool = match &self.gpu {
            Gpu::Emulated { .. } => super::bench::next_to(
                &self.exe,
                &[gpuslice_node::gpu::mps::DEFAULT_CONTROL],
                "the emulated MPS control daemon (nvidia-cuda-mps-control)",
            )?,
            Gpu::Real { .. } => PathBuf::from(gpuslice_node::gpu::mps::DEFAULT_CONTROL),
        };
        let pipe = self.state.root().with_file_name("mps-pipe");
        let daemon = Daemon(MpsControl {
            tool,
            log: pipe.with_file_name("mps-log"),
            pipe,
        });
        // The workers' GPU, as the agent gives a daemon its GPU.
        daemon.0.start("0").map_err(|e| setup(&daemon.0.tool, e))?;
        daemon
            .0
            .set_defaults(MPS_SHARE, None)
            .map_err(|e| setup(&daemon.0.tool, e))?;
        let pipe = daemon.0.pipe.display().to_string();
        let mps = self.pair(
            MPS_INFER,
            MPS_TRAIN,
            seconds,
            &[(gpuslice_contract::env::MPS_PIPE_DIRECTORY, pipe.as_str())],
        )?;
        Ok(Latency { time_sliced, mps })
    }

    /// The client on `infer` and the neighbour on `train`, started together; the client's
    /// latency percentiles.
    fn pair(
        &self,
        infer: &str,
        train: &str,
        seconds: u64,
        env: &[(&str, &str)],
    ) -> Result<Percentiles, ComputeBenchError> {
        let start = self.start_time() + 200_000_000;
        let common = |kernel_ms: u64| {
            let mut args = vec![
                "--kernel-us".to_string(),
                (kernel_ms * 1000).to_string(),
                "--seconds".to_string(),
                seconds.to_string(),
                "--start-at".to_string(),
                start.to_string(),
            ];
            // On a real GPU the busy loop was calibrated for KERNEL_US: scale it.
            if let Gpu::Real { iterations, .. } = self.gpu {
                args.push("--iterations".to_string());
                args.push((iterations * kernel_ms * 1000 / super::KERNEL_US).to_string());
            }
            args
        };
        let spawn = |slice: &str, args: Vec<String>| {
            self.worker_command(slice, &args)
                .envs(env.iter().copied())
                .spawn()
                .map_err(|e| ComputeBenchError::Worker(slice.to_string(), e.to_string()))
        };
        let neighbour = spawn(train, common(TRAINING_KERNEL_MS))?;
        let mut client_args = common(REQUEST_MS);
        client_args.extend(
            [
                "--busy-ms",
                &REQUEST_MS.to_string(),
                "--idle-ms",
                &(PERIOD_MS - REQUEST_MS).to_string(),
            ]
            .map(String::from),
        );
        let client = spawn(infer, client_args)?;
        let report: Report = finish(infer, client)?;
        finish::<Report>(train, neighbour)?;
        Ok(percentiles(&report))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_late_in_line_counts_its_wait() {
        let ms = 1_000_000;
        let report = Report {
            start_ns: 1_000 * ms,
            // Due at 0, 20 and 40 ms after the start; the second waited 10 ms behind a kernel.
            done: vec![1_002 * ms, 1_032 * ms, 1_042 * ms],
            ..Report::default()
        };
        let p = percentiles(&report);
        assert_eq!(p.requests, 3);
        assert_eq!(p.p50, 2.0);
        assert_eq!(p.p99, 12.0);
    }
}
