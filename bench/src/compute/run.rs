//! Running one scenario: the arbiter given its shares, its workers spawned and waited for, and
//! what each slice got.

use std::collections::BTreeMap;
use std::process::Child;
use std::time::Duration;

use gpuslice_emulator::timeline::Interval;
use gpuslice_node::workloads::arbiter::Share;
use gpuslice_node::workloads::compute::GpuShares;

use super::bench::finish;
use super::{
    Bench, ComputeBenchError, Gpu, KERNEL_US, Report, Scenario, ScenarioResult, SliceResult,
    SliceSpec, Work, shares, slice_id, tolerance,
};

impl Bench {
    /// Gives the arbiter the scenario's slices and shares.
    pub fn activate(&self, index: usize, scenario: &Scenario) {
        let slices: BTreeMap<String, Share> = scenario
            .slices
            .iter()
            .map(|s| (slice_id(index, s.name), s.share))
            .collect();
        self.agent.compute.set(&BTreeMap::from([(
            0,
            GpuShares {
                time_slice: Duration::from_millis(scenario.time_slice_ms),
                slices,
            },
        )]));
    }

    /// Runs one scenario for `seconds` (the first second is the warm-up window).
    pub fn run(
        &self,
        index: usize,
        scenario: &Scenario,
        seconds: u64,
    ) -> Result<ScenarioResult, ComputeBenchError> {
        self.activate(index, scenario);
        let switches_before = self
            .agent
            .compute
            .usage()
            .get(&0)
            .map_or(0, |(_, switches)| *switches);
        let start = self.start_time();
        let run_for = seconds as f64 + 0.3;
        let children = self.spawn_workers(index, scenario, start, run_for)?;
        let mut pids: BTreeMap<u32, String> = BTreeMap::new();
        let mut reports = Vec::new();
        for (id, child) in children {
            let report: Report = finish(&id, child)?;
            pids.insert(report.pid, id);
            reports.push(report);
        }
        let kernels: u64 = reports.iter().map(|r| r.kernels).sum();
        let intervals = self.ran(&reports)?;
        let usage = self.agent.compute.usage();
        let (usage, switches) = usage.get(&0).cloned().unwrap_or_default();
        let slices = scenario
            .slices
            .iter()
            .map(|spec| {
                let id = slice_id(index, spec.name);
                let mine: Vec<Interval> = intervals
                    .iter()
                    .filter(|i| pids.get(&i.pid) == Some(&id))
                    .copied()
                    .collect();
                let (windows, overall) = shares(&mine, start, seconds);
                SliceResult {
                    name: spec.name.to_string(),
                    target: spec.target,
                    overall,
                    windows,
                    max_wait_ms: usage.get(&id).map_or(0.0, |u| u.max_wait as f64 / 1e6),
                    p99_wait_ms: usage
                        .get(&id)
                        .and_then(|u| u.waits.percentile(99.0))
                        .map(|ns| ns as f64 / 1e6),
                    guaranteed: spec.share.guarantee > 0,
                    tolerance: tolerance(scenario.time_slice_ms),
                }
            })
            .collect();
        Ok(ScenarioResult {
            name: scenario.name.to_string(),
            time_slice_ms: scenario.time_slice_ms,
            slices,
            switches_per_s: switches.saturating_sub(switches_before) as f64 / run_for,
            kernels_per_s: kernels as f64 / run_for,
            start_ns: start,
            reports: reports
                .into_iter()
                .map(|r| (pids[&r.pid].clone(), r))
                .collect(),
        })
    }

    /// Spawns each slice's processes, every one working for `run_for` seconds from `start`.
    fn spawn_workers(
        &self,
        index: usize,
        scenario: &Scenario,
        start: u64,
        run_for: f64,
    ) -> Result<Vec<(String, Child)>, ComputeBenchError> {
        let mut children: Vec<(String, Child)> = Vec::new();
        for slice in &scenario.slices {
            let id = slice_id(index, slice.name);
            let args = worker_args(slice, start, run_for);
            for _ in 0..slice.processes {
                children.push((id.clone(), self.worker(&id, &args)?));
            }
        }
        Ok(children)
    }

    /// Every kernel the workers ran: the emulator's timeline, or a real GPU's reported steps.
    fn ran(&self, reports: &[Report]) -> Result<Vec<Interval>, ComputeBenchError> {
        Ok(match self.gpu {
            Gpu::Emulated { .. } => self.intervals()?,
            Gpu::Real { kernel_ns, .. } => reports
                .iter()
                .flat_map(|r| r.intervals(kernel_ns))
                .collect(),
        })
    }
}

/// A worker's arguments for a slice's kind of work, from `start` for `run_for` seconds.
fn worker_args(slice: &SliceSpec, start: u64, run_for: f64) -> Vec<String> {
    let mut args = vec![
        "--kernel-us".to_string(),
        KERNEL_US.to_string(),
        "--seconds".to_string(),
        run_for.to_string(),
        "--start-at".to_string(),
        start.to_string(),
    ];
    match slice.work {
        Work::Busy => {}
        Work::Bursty { busy_ms, idle_ms } => args.extend([
            "--busy-ms".to_string(),
            busy_ms.to_string(),
            "--idle-ms".to_string(),
            idle_ms.to_string(),
        ]),
        Work::Graph => args.extend(["--graph".to_string(), "10".to_string()]),
        Work::Cooperative => args.push("--cooperative".to_string()),
        Work::LaunchEx => args.push("--ex".to_string()),
    }
    args
}
