//! What arbitration costs a launch: throughput and, under callgrind, instructions per launch.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use gpuslice_node::workloads::arbiter::Share;
use gpuslice_node::workloads::compute::GpuShares;

use super::{ARBITRATED, Bench, ComputeBenchError, Gpu, OVERHEAD_TARGET, PLAIN};

/// What arbitration costs a launch.
#[derive(Clone, Debug)]
pub struct Overhead {
    /// Launch throughput with arbitration / without, per interleaved pair, sorted.
    pub ratios: Vec<f64>,
    /// Instructions per launch without and with arbitration (emulated GPU, callgrind).
    pub instructions: Option<(f64, f64)>,
}

impl Overhead {
    /// The line of the table and whether it meets [`OVERHEAD_TARGET`]: by instructions where
    /// counted (the time of a ~160 ns emulated launch is noisier than 1 %), else by the median
    /// throughput ratio. The throughput pairs are shown with their spread either way.
    pub fn verdict(&self) -> (String, bool) {
        let median = self
            .ratios
            .get(self.ratios.len() / 2)
            .copied()
            .unwrap_or(0.0);
        let spread = format!(
            "throughput ratio median {median:.3} (pairs {:.3}–{:.3}, n={})",
            self.ratios.first().copied().unwrap_or(0.0),
            self.ratios.last().copied().unwrap_or(0.0),
            self.ratios.len()
        );
        match self.instructions {
            Some((plain, arbitrated)) => {
                let ratio = plain / arbitrated.max(1.0);
                (
                    format!(
                        "{plain:.0} vs {arbitrated:.0} instructions per launch, ratio {ratio:.4} (target ≥ {OVERHEAD_TARGET}); {spread}"
                    ),
                    ratio >= OVERHEAD_TARGET,
                )
            }
            None => (
                format!("{spread} (target ≥ {OVERHEAD_TARGET})"),
                median >= OVERHEAD_TARGET,
            ),
        }
    }
}

impl Bench {
    /// What arbitration costs one process launching empty kernels alone on a software slice
    /// (no cap), against the shim without arbitration (an exclusive slice): launches per second
    /// in `rounds` interleaved pairs (the order alternates, so drift hits both), and, on the
    /// emulated GPU, the instructions per launch under callgrind, which the machine's other
    /// load cannot move.
    pub fn overhead(&self, rounds: usize) -> Result<Overhead, ComputeBenchError> {
        self.agent.compute.set(&BTreeMap::from([(
            0,
            GpuShares {
                time_slice: Duration::from_millis(10),
                slices: BTreeMap::from([(ARBITRATED.to_string(), Share::capped(100))]),
            },
        )]));
        // A real GPU launches a few hundred thousand a second, the emulator millions.
        let (launches, iterations) = match self.gpu {
            Gpu::Emulated { .. } => (2_000_000, None),
            Gpu::Real { .. } => (200_000, Some(1)),
        };
        let args = |launches: u64| {
            let mut args = ["--kernel-us", "0", "--launches", &launches.to_string()]
                .map(String::from)
                .to_vec();
            if let Some(i) = iterations {
                args.extend(["--iterations".to_string(), i.to_string()]);
            }
            args
        };
        let rate = |slice: &str| -> Result<f64, ComputeBenchError> {
            let report: serde_json::Value = self.report(slice, &args(launches))?;
            Ok(report["launchesPerSecond"].as_f64().unwrap_or(0.0))
        };
        let mut ratios = Vec::new();
        for round in 0..rounds {
            let (plain, arbitrated) = if round % 2 == 0 {
                let plain = rate(PLAIN)?;
                (plain, rate(ARBITRATED)?)
            } else {
                let arbitrated = rate(ARBITRATED)?;
                (rate(PLAIN)?, arbitrated)
            };
            ratios.push(arbitrated / plain.max(1.0));
        }
        ratios.sort_by(f64::total_cmp);
        let instructions = match self.gpu {
            Gpu::Emulated { .. } => {
                let per_launch = |slice: &str| self.instructions_per_launch(slice, &args);
                match (per_launch(PLAIN)?, per_launch(ARBITRATED)?) {
                    (Some(plain), Some(arbitrated)) => Some((plain, arbitrated)),
                    _ => None,
                }
            }
            Gpu::Real { .. } => None,
        };
        Ok(Overhead {
            ratios,
            instructions,
        })
    }

    /// Instructions per launch of a worker on `slice` under callgrind: the difference between
    /// two run lengths, so start-up does not count. `None` without valgrind.
    fn instructions_per_launch(
        &self,
        slice: &str,
        args: &dyn Fn(u64) -> Vec<String>,
    ) -> Result<Option<f64>, ComputeBenchError> {
        const SHORT: u64 = 20_000;
        let mut counts = Vec::new();
        for launches in [SHORT, 2 * SHORT] {
            let worker = self.worker_command(slice, &args(launches));
            let out_file = self
                .state
                .root()
                .join(format!("callgrind.{slice}.{launches}"));
            let mut command = Command::new("valgrind");
            command
                .arg("--tool=callgrind")
                .arg(format!("--callgrind-out-file={}", out_file.display()))
                .arg(worker.get_program())
                .args(worker.get_args())
                .stdout(Stdio::null());
            for (key, value) in worker.get_envs() {
                match value {
                    Some(v) => command.env(key, v),
                    None => command.env_remove(key),
                };
            }
            let Ok(out) = command.output() else {
                return Ok(None);
            };
            if !out.status.success() {
                let stderr = String::from_utf8_lossy(&out.stderr);
                let tail: Vec<&str> = stderr.lines().rev().take(12).collect();
                return Err(ComputeBenchError::Worker(
                    slice.to_string(),
                    format!(
                        "under callgrind: {}:\n{}",
                        out.status,
                        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                    ),
                ));
            }
            let text = std::fs::read_to_string(&out_file)
                .map_err(|e| ComputeBenchError::Worker(slice.to_string(), e.to_string()))?;
            let total = text
                .lines()
                .find_map(|l| l.strip_prefix("summary: "))
                .and_then(|l| l.split_whitespace().next()?.parse::<u64>().ok())
                .ok_or_else(|| {
                    ComputeBenchError::Worker(slice.to_string(), "no callgrind summary".into())
                })?;
            counts.push(total);
        }
        Ok(Some(
            counts[1].saturating_sub(counts[0]) as f64 / SHORT as f64,
        ))
    }
}
