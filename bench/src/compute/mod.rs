//! `gpuslice bench compute`: real processes under the shim, on the emulated GPU, arbitrated by the
//! agent's compute arbiter (served here in-process on a real socket, as the agent serves it).
//! Achieved shares come from the emulator's GPU timeline, which records which process ran each
//! kernel when, so they are exact; the table compares them with each slice's target in every
//! 1 s window after the first. With `--real-gpu` the workers run on GPU 0 through the real
//! driver and shares come from the kernels each process completed in each window.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpuslice_contract::{SliceConfig, SliceKind, StateDir, env};
use gpuslice_emulator::timeline::{Interval, Timeline, timeline_path};
use gpuslice_emulator::{Machine, Store, device_key};
use gpuslice_node::workloads::arbiter::Share;
use gpuslice_node::workloads::compute::GpuShares;
use gpuslice_node::workloads::socket;

pub mod worker;

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
/// On a real GPU, workers start their clocks this long after they are spawned (context
/// creation and the PTX's compilation take a while).
const REAL_GPU_LEAD_NS: u64 = 5_000_000_000;
/// The slices of the overhead measurement: the shim without arbitration, and with it.
const PLAIN: &str = "overhead-plain";
const ARBITRATED: &str = "overhead-arbitrated";
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

/// How a slice's processes use the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    /// Launch and wait, back to back.
    Busy,
    /// Every `busy + idle` ms, `busy` ms of kernels, then nothing.
    Bursty { busy_ms: u64, idle_ms: u64 },
    /// Like busy, ten kernels per CUDA graph launch.
    Graph,
    /// Like busy, with cooperative launches.
    Cooperative,
    /// Like busy, with `cuLaunchKernelEx`.
    LaunchEx,
}

#[derive(Clone, Debug)]
pub struct SliceSpec {
    pub name: &'static str,
    pub share: Share,
    pub processes: usize,
    pub work: Work,
    /// The share it should get (%).
    pub target: f64,
}

#[derive(Clone, Debug)]
pub struct Scenario {
    pub name: &'static str,
    pub time_slice_ms: u64,
    pub slices: Vec<SliceSpec>,
}

fn busy(name: &'static str, share: Share, target: f64) -> SliceSpec {
    SliceSpec {
        name,
        share,
        processes: 1,
        work: Work::Busy,
        target,
    }
}

fn best_effort(weight: u32) -> Share {
    Share {
        weight,
        limit: 100,
        guarantee: 0,
    }
}

/// The scenarios the issue asks for.
pub fn scenarios() -> Vec<Scenario> {
    let capped = |name, percent: u32| busy(name, Share::capped(percent), f64::from(percent));
    let mixed = [5, 5, 10, 10, 10, 15, 20, 25];
    const MIXED: [&str; 8] = ["m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8"];
    vec![
        Scenario {
            name: "10/90",
            time_slice_ms: 10,
            slices: vec![capped("a", 10), capped("b", 90)],
        },
        Scenario {
            name: "30/70",
            time_slice_ms: 10,
            slices: vec![capped("a", 30), capped("b", 70)],
        },
        Scenario {
            name: "4 x 25",
            time_slice_ms: 10,
            slices: ["a", "b", "c", "d"]
                .into_iter()
                .map(|n| capped(n, 25))
                .collect(),
        },
        Scenario {
            name: "guaranteed 50 + 2 best-effort",
            time_slice_ms: 10,
            slices: vec![
                busy(
                    "g",
                    Share {
                        weight: 34,
                        limit: 100,
                        guarantee: 50,
                    },
                    50.0,
                ),
                busy("x", best_effort(33), 25.0),
                busy("y", best_effort(33), 25.0),
            ],
        },
        Scenario {
            name: "capped 25 alone",
            time_slice_ms: 10,
            slices: vec![capped("a", 25)],
        },
        Scenario {
            name: "8 mixed caps",
            time_slice_ms: 10,
            slices: MIXED
                .into_iter()
                .zip(mixed)
                .map(|(n, p)| capped(n, p))
                .collect(),
        },
        Scenario {
            name: "bursty 30/70 + busy",
            time_slice_ms: 10,
            slices: vec![
                SliceSpec {
                    work: Work::Bursty {
                        busy_ms: 30,
                        idle_ms: 70,
                    },
                    ..busy("burst", best_effort(50), 30.0)
                },
                busy("fill", best_effort(50), 70.0),
            ],
        },
        Scenario {
            name: "2 processes, one slice",
            time_slice_ms: 10,
            slices: vec![
                SliceSpec {
                    processes: 2,
                    ..capped("a", 40)
                },
                capped("b", 60),
            ],
        },
        Scenario {
            name: "graphs 30 / kernels 70",
            time_slice_ms: 10,
            slices: vec![
                SliceSpec {
                    work: Work::Graph,
                    ..capped("g", 30)
                },
                capped("k", 70),
            ],
        },
        Scenario {
            name: "timeSlice 10ms, 50/50",
            time_slice_ms: 10,
            slices: vec![capped("a", 50), capped("b", 50)],
        },
        Scenario {
            name: "timeSlice 50ms, 50/50",
            time_slice_ms: 50,
            slices: vec![capped("a", 50), capped("b", 50)],
        },
    ]
}

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

/// The GPU the workers run on.
#[derive(Clone, Debug)]
pub enum Gpu {
    /// The CUDA emulator: its library folder and machine state. Shares come from its timeline.
    Emulated { lib: PathBuf, machine: PathBuf },
    /// GPU 0 of this machine, through the real driver: the busy loop's iterations per kernel
    /// and the time one takes alone. Shares come from each process's completed kernels.
    Real { iterations: u64, kernel_ns: u64 },
}

/// The GPU, the slices' directories and the agent's socket, for every scenario.
pub struct Bench {
    _dir: tempfile::TempDir,
    gpu: Gpu,
    state: StateDir,
    shim: PathBuf,
    exe: PathBuf,
    agent: socket::Node,
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
            })
            .collect()
    }
}

fn next_to(exe: &Path, names: &[&str], what: &'static str) -> Result<PathBuf, ComputeBenchError> {
    let dir = exe.parent().unwrap_or(Path::new(".")).to_path_buf();
    // Cargo leaves a copy in both places; the newer is the one just built.
    names
        .iter()
        .flat_map(|n| [dir.join(n), dir.join("deps").join(n)])
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
        .ok_or_else(|| ComputeBenchError::Missing(what, exe.display().to_string()))
}

impl Bench {
    /// The bench for these scenarios, run by the `gpuslice` binary `exe` (whose workers it
    /// spawns; the shim and the CUDA emulator are found next to it).
    pub fn new(exe: &Path, scenarios: &[Scenario]) -> Result<Bench, ComputeBenchError> {
        let cuda = next_to(
            exe,
            &["libcuda.so"],
            "the CUDA driver emulator (libcuda.so)",
        )?;
        let dir = tempfile::tempdir().map_err(|e| setup("a temporary folder", e))?;
        let root = dir.path().to_path_buf();
        let lib = root.join("lib");
        std::fs::create_dir_all(&lib).map_err(|e| setup(&lib, e))?;
        std::os::unix::fs::symlink(&cuda, lib.join("libcuda.so.1")).map_err(|e| setup(&lib, e))?;
        let node: gpuslice_api::NodeInventory =
            serde_yaml::from_str("name: bench\ngpus:\n- {index: 0, model: NVIDIA H200}\n")
                .map_err(|e| setup("the node", e))?;
        let machine = root.join("machine.json");
        let seeded = Machine::from_inventory(&node).map_err(|e| setup(&machine, e))?;
        Store::create(&machine, &seeded).map_err(|e| setup(&machine, e))?;
        Bench::serve(dir, Gpu::Emulated { lib, machine }, exe, scenarios)
    }

    /// The bench on this machine's GPU 0 through the real CUDA driver: finds the busy loop's
    /// iterations for a kernel of `KERNEL_US` first. Nothing on the GPU is reconfigured.
    pub fn real(exe: &Path, scenarios: &[Scenario]) -> Result<Bench, ComputeBenchError> {
        let dir = tempfile::tempdir().map_err(|e| setup("a temporary folder", e))?;
        let gpu = Gpu::Real {
            iterations: 0,
            kernel_ns: 0,
        };
        let mut bench = Bench::serve(dir, gpu, exe, scenarios)?;
        let args = ["--kernel-us", &KERNEL_US.to_string(), "--calibrate"].map(String::from);
        let calibrated: serde_json::Value = bench.report(PLAIN, &args)?;
        let field = |name: &str| calibrated[name].as_u64().filter(|v| *v > 0);
        match (field("iterations"), field("kernelNs")) {
            (Some(iterations), Some(kernel_ns)) => {
                bench.gpu = Gpu::Real {
                    iterations,
                    kernel_ns,
                };
                Ok(bench)
            }
            _ => Err(ComputeBenchError::Worker(
                PLAIN.to_string(),
                format!("calibration reported {calibrated}"),
            )),
        }
    }

    /// Writes every slice's config and serves the agent's socket.
    fn serve(
        dir: tempfile::TempDir,
        gpu: Gpu,
        exe: &Path,
        scenarios: &[Scenario],
    ) -> Result<Bench, ComputeBenchError> {
        let shim = next_to(exe, &["libgpuslice.so"], "the shim (libgpuslice.so)")?;
        let state = StateDir::new(dir.path().join("state"));
        let mut configs: Vec<SliceConfig> = scenarios
            .iter()
            .enumerate()
            .flat_map(|(i, s)| {
                s.slices
                    .iter()
                    .map(move |slice| software(&slice_id(i, slice.name), slice.share.weight))
            })
            .collect();
        configs.push(SliceConfig {
            kind: SliceKind::Exclusive,
            ..software(PLAIN, 100)
        });
        configs.push(software(ARBITRATED, 100));
        configs.extend((0..JOBS).map(|j| software(&job_slice(j), 100)));
        gpuslice_node::gpu::slices::sync_dirs(&state, &configs)
            .map_err(|e| setup(state.root(), e))?;
        let agent = socket::Node::default();
        agent.serve(&state).map_err(|e| setup(state.root(), e))?;
        Ok(Bench {
            _dir: dir,
            gpu,
            state,
            shim,
            exe: exe.to_path_buf(),
            agent,
        })
    }

    /// Starts a worker process on `slice` under the shim.
    pub fn worker(&self, slice: &str, args: &[String]) -> Result<Child, ComputeBenchError> {
        self.worker_command(slice, args)
            .spawn()
            .map_err(|e| ComputeBenchError::Worker(slice.to_string(), e.to_string()))
    }

    /// The command that runs a worker on `slice` under the shim.
    fn worker_command(&self, slice: &str, args: &[String]) -> Command {
        let mut command = Command::new(&self.exe);
        command
            .args(["bench", "compute-worker"])
            .args(args)
            .env("LD_PRELOAD", &self.shim)
            .env(env::SLICE_CONFIG, self.state.slice_config(slice))
            .stdout(Stdio::piped());
        match &self.gpu {
            Gpu::Emulated { lib, machine } => {
                command
                    .env("LD_LIBRARY_PATH", lib)
                    .env(env::EMULATOR_STATE, machine)
                    .env_remove("CUDA_VISIBLE_DEVICES");
            }
            Gpu::Real { iterations, .. } => {
                if !args.iter().any(|a| a == "--iterations") {
                    command.args(["--iterations".to_string(), iterations.to_string()]);
                }
            }
        }
        command
    }

    /// Runs a worker on `slice` to the end and returns its JSON report.
    fn report<T: serde::de::DeserializeOwned>(
        &self,
        slice: &str,
        args: &[String],
    ) -> Result<T, ComputeBenchError> {
        finish(slice, self.worker(slice, args)?)
    }

    /// When workers spawned now should start their clocks: a real GPU's contexts take a while
    /// to create, so every worker starts at the same moment, after that.
    fn start_time(&self) -> u64 {
        let lead = match self.gpu {
            Gpu::Emulated { .. } => 0,
            Gpu::Real { .. } => REAL_GPU_LEAD_NS,
        };
        gpuslice_emulator::timeline::now_ns() + lead
    }

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
        let mut children: Vec<(String, Child)> = Vec::new();
        for slice in &scenario.slices {
            let id = slice_id(index, slice.name);
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
            for _ in 0..slice.processes {
                children.push((id.clone(), self.worker(&id, &args)?));
            }
        }
        let mut pids: BTreeMap<u32, String> = BTreeMap::new();
        let mut reports = Vec::new();
        for (id, child) in children {
            let report: Report = finish(&id, child)?;
            pids.insert(report.pid, id);
            reports.push(report);
        }
        let kernels: u64 = reports.iter().map(|r| r.kernels).sum();
        let intervals = match self.gpu {
            Gpu::Emulated { .. } => self.intervals()?,
            Gpu::Real { kernel_ns, .. } => reports
                .iter()
                .flat_map(|r| r.intervals(kernel_ns))
                .collect(),
        };
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

    /// What the table says the GPU is.
    pub fn describe(&self) -> String {
        match self.gpu {
            Gpu::Emulated { .. } => format!("one emulated H200 (kernels of {KERNEL_US} µs)"),
            Gpu::Real { kernel_ns, .. } => format!(
                "GPU 0 through the real driver (busy-loop kernels of {:.0} µs; shares from completed kernels)",
                kernel_ns as f64 / 1e3
            ),
        }
    }

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

/// Waits for a worker on `slice` and reads its JSON report.
fn finish<T: serde::de::DeserializeOwned>(
    slice: &str,
    child: Child,
) -> Result<T, ComputeBenchError> {
    let failed = |why: String| ComputeBenchError::Worker(slice.to_string(), why);
    let out = child
        .wait_with_output()
        .map_err(|e| failed(e.to_string()))?;
    if !out.status.success() {
        return Err(failed(out.status.to_string()));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| failed(format!("its report: {e}")))
}

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

/// Four jobs of fixed work, queued or sharing the GPU.
#[derive(Clone, Copy, Debug)]
pub struct Jobs {
    pub kernels: u64,
    /// Seconds for the four, one after another.
    pub one_after_another: f64,
    /// Seconds for the four at once, sharing the GPU.
    pub together: f64,
}

fn setup(path: impl AsRef<Path>, e: impl std::fmt::Display) -> ComputeBenchError {
    ComputeBenchError::Setup {
        path: path.as_ref().display().to_string(),
        reason: e.to_string(),
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

/// The id of a scenario's slice.
pub fn slice_id(scenario: usize, name: &str) -> String {
    format!("c{scenario}-{name}")
}

fn software(id: &str, compute: u32) -> SliceConfig {
    SliceConfig {
        id: id.to_string(),
        kind: SliceKind::Software,
        gpu: 0,
        device_minor: None,
        device_uuid: String::new(),
        memory_bytes: 16 << 30,
        compute_percent: compute,
    }
}

/// The table: per slice, target and achieved share per window and overall; per scenario,
/// switches and throughput; then the overhead line. Returns it and whether all passed.
pub fn render(
    gpu: &str,
    results: &[ScenarioResult],
    overhead: Option<Overhead>,
    jobs: Option<Jobs>,
) -> (String, bool) {
    use std::fmt::Write as _;
    let mut out = String::new();
    let mut ok = true;
    let _ = writeln!(
        out,
        "compute shares on {gpu}; share % per 1 s window, the first is warm-up; ±{TOLERANCE} pp, or one time slice where that is more"
    );
    let _ = writeln!(
        out,
        "{:<32} {:>5} {:<6} {:>6} {:>8}  {:<28} {:>13} {:>10} {:>9}  result",
        "scenario",
        "slice",
        "",
        "target",
        "overall",
        "windows",
        "wait ms p99/max",
        "switches/s",
        "kernels/s"
    );
    for r in results {
        let passed = r.passed();
        ok &= passed;
        for (i, s) in r.slices.iter().enumerate() {
            let windows: Vec<String> = s.windows.iter().map(|w| format!("{w:.1}")).collect();
            let first = i == 0;
            let _ = writeln!(
                out,
                "{:<32} {:>5} {:<6} {:>6.1} {:>8.2}  {:<28} {:>13} {:>10} {:>9}  {}",
                if first { r.name.as_str() } else { "" },
                s.name,
                if s.guaranteed { "(g)" } else { "" },
                s.target,
                s.overall,
                windows.join(" "),
                format!(
                    "{}/{:.1}",
                    s.p99_wait_ms
                        .map_or_else(|| "-".to_string(), |p| format!("{p:.0}")),
                    s.max_wait_ms
                ),
                if first {
                    format!("{:.0}", r.switches_per_s)
                } else {
                    String::new()
                },
                if first {
                    format!("{:.0}", r.kernels_per_s)
                } else {
                    String::new()
                },
                if s.holds() && (!s.guaranteed || passed) {
                    "PASS"
                } else {
                    "FAIL"
                }
            );
        }
    }
    if let Some(o) = overhead {
        let (verdict, passed) = o.verdict();
        ok &= passed;
        let _ = writeln!(
            out,
            "\nlaunch cost, one process, no cap, shim with arbitration against without: {verdict}  {}",
            if passed { "PASS" } else { "FAIL" }
        );
    }
    if let Some(j) = jobs {
        let _ = writeln!(
            out,
            "{JOBS} jobs of {} kernels: one after another {:.2} s, sharing the GPU (equal weights) {:.2} s; aggregate throughput sharing / one after another {:.3}",
            j.kernels,
            j.one_after_another,
            j.together,
            j.one_after_another / j.together.max(1e-9)
        );
    }
    (out, ok)
}

/// Runs every scenario (or those whose names contain `only`) and the overhead measurement.
pub fn run_all(
    seconds: u64,
    only: &[String],
    overhead: bool,
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
        if !only.is_empty() && !only.iter().any(|o| scenario.name.contains(o.as_str())) {
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
    let (overhead, jobs) = if overhead {
        (Some(bench.overhead(9)?), Some(bench.jobs(JOB_KERNELS)?))
    } else {
        (None, None)
    };
    Ok(render(&bench.describe(), &results, overhead, jobs))
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
