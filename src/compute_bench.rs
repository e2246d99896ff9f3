//! `gpuslice bench compute`: real processes under the shim, on the emulated GPU, arbitrated by the
//! agent's compute arbiter (served here in-process on a real socket, as the agent serves it).
//! Achieved shares come from the emulator's GPU timeline, which records which process ran each
//! kernel when, so they are exact; the table compares them with each slice's target in every
//! 1 s window after the first.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuslice_emulator::timeline::{Interval, Timeline, timeline_path};
use gpuslice_emulator::{Machine, Store, device_key};
use gpuslice_node::arbiter::Share;
use gpuslice_node::slices::{SliceConfig, SliceKind};

use crate::claims::Claims;
use crate::compute::GpuShares;

/// Tolerance on a share, in percentage points, in every window after the first.
pub const TOLERANCE: f64 = 3.0;
/// The kernel every worker launches (µs): short against a time slice, as real steps are.
pub const KERNEL_US: u64 = 500;
/// Launch throughput with arbitration must be at least this fraction of the shim's without.
pub const OVERHEAD_TARGET: f64 = 0.99;

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
    pub guaranteed: bool,
}

impl SliceResult {
    /// Every window after the first within the tolerance.
    pub fn holds(&self) -> bool {
        self.windows
            .iter()
            .skip(1)
            .all(|w| (w - self.target).abs() <= TOLERANCE)
    }
}

#[derive(Clone, Debug)]
pub struct ScenarioResult {
    pub name: String,
    pub time_slice_ms: u64,
    pub slices: Vec<SliceResult>,
    pub switches_per_s: f64,
    pub kernels_per_s: f64,
}

impl ScenarioResult {
    /// Shares hold, and a guaranteed slice waited at most one time slice (plus the kernel in
    /// flight, which a GPU cannot stop, and 1 ms for the messages).
    pub fn passed(&self) -> bool {
        self.slices.iter().all(|s| {
            s.holds()
                && (!s.guaranteed
                    || s.max_wait_ms <= self.time_slice_ms as f64 + KERNEL_US as f64 / 1000.0 + 1.0)
        })
    }
}

/// The emulated machine, the slices' directories and the agent's socket, for every scenario.
pub struct Bench {
    _dir: tempfile::TempDir,
    root: PathBuf,
    machine: PathBuf,
    state: PathBuf,
    shim: PathBuf,
    exe: PathBuf,
    claims: Arc<Claims>,
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
        let shim = next_to(exe, &["libgpuslice.so"], "the shim (libgpuslice.so)")?;
        let exe = exe.to_path_buf();
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
        let state = root.join("state");
        let mut configs: Vec<SliceConfig> = scenarios
            .iter()
            .enumerate()
            .flat_map(|(i, s)| {
                s.slices
                    .iter()
                    .map(move |slice| software(&slice_id(i, slice.name), slice.share.weight))
            })
            .collect();
        for (id, kind) in [
            ("overhead-plain", SliceKind::Exclusive),
            ("overhead-arbitrated", SliceKind::Software),
        ] {
            configs.push(SliceConfig {
                kind,
                ..software(id, 100)
            });
        }
        gpuslice_node::slices::sync_dirs(&state, &configs).map_err(|e| setup(&state, e))?;
        let socket = state.join("agent.sock");
        let listener =
            std::os::unix::net::UnixListener::bind(&socket).map_err(|e| setup(&socket, e))?;
        let claims = Arc::new(Claims::default());
        let serving = Arc::clone(&claims);
        let served = state.clone();
        std::thread::spawn(move || serving.serve(listener, served));
        Ok(Bench {
            _dir: dir,
            root,
            machine,
            state,
            shim,
            exe,
            claims,
        })
    }

    /// Starts a worker process on `slice` under the shim.
    pub fn worker(&self, slice: &str, args: &[String]) -> Result<Child, ComputeBenchError> {
        Command::new(&self.exe)
            .args(["bench", "compute-worker"])
            .args(args)
            .env("LD_PRELOAD", &self.shim)
            .env("LD_LIBRARY_PATH", self.root.join("lib"))
            .env("GPUSLICE_EMULATOR_STATE", &self.machine)
            .env(
                "GPUSLICE_SLICE_CONFIG",
                self.state.join("slices").join(slice).join("config"),
            )
            .env_remove("CUDA_VISIBLE_DEVICES")
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| ComputeBenchError::Worker(slice.to_string(), e.to_string()))
    }

    /// Gives the arbiter the scenario's slices and shares.
    pub fn activate(&self, index: usize, scenario: &Scenario) {
        let slices: BTreeMap<String, Share> = scenario
            .slices
            .iter()
            .map(|s| (slice_id(index, s.name), s.share))
            .collect();
        self.claims.compute().set(&BTreeMap::from([(
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
            .claims
            .compute()
            .usage()
            .get(&0)
            .map_or(0, |(_, switches)| *switches);
        let start = gpuslice_emulator::timeline::now_ns();
        let run_for = seconds as f64 + 0.3;
        let mut children: Vec<(String, Child)> = Vec::new();
        for slice in &scenario.slices {
            let id = slice_id(index, slice.name);
            let mut args = vec![
                "--kernel-us".to_string(),
                KERNEL_US.to_string(),
                "--seconds".to_string(),
                run_for.to_string(),
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
        let mut kernels = 0u64;
        for (id, child) in children {
            let pid = child.id();
            let out = child
                .wait_with_output()
                .map_err(|e| ComputeBenchError::Worker(id.clone(), e.to_string()))?;
            if !out.status.success() {
                return Err(ComputeBenchError::Worker(id, format!("{}", out.status)));
            }
            let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            kernels += report["kernels"].as_u64().unwrap_or(0);
            pids.insert(pid, id);
        }
        let intervals = self.intervals()?;
        let usage = self.claims.compute().usage();
        let (usage, switches) = usage.get(&0).cloned().unwrap_or_default();
        let window = 1_000_000_000u64;
        let slices = scenario
            .slices
            .iter()
            .map(|spec| {
                let id = slice_id(index, spec.name);
                let mine: Vec<&Interval> = intervals
                    .iter()
                    .filter(|i| pids.get(&i.pid) == Some(&id))
                    .collect();
                let share_in = |from: u64, to: u64| {
                    let busy: u64 = mine
                        .iter()
                        .map(|i| i.end.min(to).saturating_sub(i.start.max(from)))
                        .sum();
                    busy as f64 / (to - from) as f64 * 100.0
                };
                let windows: Vec<f64> = (0..seconds)
                    .map(|w| share_in(start + w * window, start + (w + 1) * window))
                    .collect();
                SliceResult {
                    name: spec.name.to_string(),
                    target: spec.target,
                    overall: share_in(start + window, start + seconds * window),
                    windows,
                    max_wait_ms: usage.get(&id).map_or(0.0, |u| u.max_wait as f64 / 1e6),
                    guaranteed: spec.share.guarantee > 0,
                }
            })
            .collect();
        Ok(ScenarioResult {
            name: scenario.name.to_string(),
            time_slice_ms: scenario.time_slice_ms,
            slices,
            switches_per_s: switches.saturating_sub(switches_before) as f64 / run_for,
            kernels_per_s: kernels as f64 / run_for,
        })
    }

    /// Every kernel the emulated GPU ran.
    pub fn intervals(&self) -> Result<Vec<Interval>, ComputeBenchError> {
        let path = timeline_path(&self.machine, device_key(0, None));
        Ok(Timeline::open(&path)
            .map_err(|e| setup(&path, e))?
            .intervals())
    }

    /// Launches per second of one process launching empty kernels, with the shim but without
    /// arbitration (an exclusive slice) and with it (a software slice alone, no cap); best of
    /// `rounds` alternating runs of each.
    pub fn overhead(&self, rounds: usize) -> Result<(f64, f64), ComputeBenchError> {
        self.claims.compute().set(&BTreeMap::from([(
            0,
            GpuShares {
                time_slice: Duration::from_millis(10),
                slices: BTreeMap::from([("overhead-arbitrated".to_string(), Share::capped(100))]),
            },
        )]));
        let mut best = (0.0f64, 0.0f64);
        for _ in 0..rounds {
            for (slot, slice) in ["overhead-plain", "overhead-arbitrated"].iter().enumerate() {
                let args = ["--kernel-us", "0", "--launches", "1000000"].map(String::from);
                let out = self
                    .worker(slice, &args)?
                    .wait_with_output()
                    .map_err(|e| ComputeBenchError::Worker(slice.to_string(), e.to_string()))?;
                let report: serde_json::Value =
                    serde_json::from_slice(&out.stdout).unwrap_or_default();
                let rate = report["launchesPerSecond"].as_f64().unwrap_or(0.0);
                if slot == 0 {
                    best.0 = best.0.max(rate);
                } else {
                    best.1 = best.1.max(rate);
                }
            }
        }
        Ok(best)
    }
}

fn setup(path: impl AsRef<Path>, e: impl std::fmt::Display) -> ComputeBenchError {
    ComputeBenchError::Setup {
        path: path.as_ref().display().to_string(),
        reason: e.to_string(),
    }
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
        device_uuid: String::new(),
        memory_bytes: 16 << 30,
        compute_percent: compute,
    }
}

/// The table: per slice, target and achieved share per window and overall; per scenario,
/// switches and throughput; then the overhead line. Returns it and whether all passed.
pub fn render(results: &[ScenarioResult], overhead: Option<(f64, f64)>) -> (String, bool) {
    use std::fmt::Write as _;
    let mut out = String::new();
    let mut ok = true;
    let _ = writeln!(
        out,
        "compute shares on one emulated H200 (kernels of {KERNEL_US} µs; share % per 1 s window, the first is warm-up; ±{TOLERANCE} pp)"
    );
    let _ = writeln!(
        out,
        "{:<32} {:>5} {:<6} {:>6} {:>8}  {:<28} {:>9} {:>10} {:>9}  result",
        "scenario",
        "slice",
        "",
        "target",
        "overall",
        "windows",
        "wait ms",
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
                "{:<32} {:>5} {:<6} {:>6.1} {:>8.2}  {:<28} {:>9.1} {:>10} {:>9}  {}",
                if first { r.name.as_str() } else { "" },
                s.name,
                if s.guaranteed { "(g)" } else { "" },
                s.target,
                s.overall,
                windows.join(" "),
                s.max_wait_ms,
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
    if let Some((plain, arbitrated)) = overhead {
        let ratio = arbitrated / plain.max(1.0);
        let passed = ratio >= OVERHEAD_TARGET;
        ok &= passed;
        let _ = writeln!(
            out,
            "\nlaunch throughput, one process, no cap: shim without arbitration {:.0}/s, with {:.0}/s, ratio {:.3} (target ≥ {OVERHEAD_TARGET})  {}",
            plain,
            arbitrated,
            ratio,
            if passed { "PASS" } else { "FAIL" }
        );
    }
    (out, ok)
}

/// The worker the benchmark runs under the shim: it reaches the (emulated) driver as CUDA
/// programs do, through `libcuda.so.1`, and prints what it did as JSON.
pub mod worker {
    use std::ffi::{CString, c_int, c_uint, c_void};
    use std::time::{Duration, Instant};

    type Handle = *mut c_void;

    #[derive(Clone, Copy, Debug, Default)]
    pub struct Plan {
        pub kernel_us: u64,
        pub seconds: f64,
        pub busy_ms: Option<u64>,
        pub idle_ms: u64,
        pub graph: Option<u32>,
        pub cooperative: bool,
        pub ex: bool,
        pub launches: Option<u64>,
    }

    #[repr(C)]
    struct LaunchConfig {
        grid: [c_uint; 3],
        block: [c_uint; 3],
        shared_mem_bytes: c_uint,
        stream: Handle,
        attrs: *mut c_void,
        num_attrs: c_uint,
    }

    struct Driver {
        _lib: libloading::Library,
        launch: unsafe extern "C" fn(
            Handle,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            Handle,
            *mut *mut c_void,
            *mut *mut c_void,
        ) -> c_int,
        cooperative: unsafe extern "C" fn(
            Handle,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            Handle,
            *mut *mut c_void,
        ) -> c_int,
        launch_ex: unsafe extern "C" fn(
            *const LaunchConfig,
            Handle,
            *mut *mut c_void,
            *mut *mut c_void,
        ) -> c_int,
        sync: unsafe extern "C" fn(Handle) -> c_int,
        event_record: unsafe extern "C" fn(Handle, Handle) -> c_int,
        event_sync: unsafe extern "C" fn(Handle) -> c_int,
        begin_capture: unsafe extern "C" fn(Handle, c_int) -> c_int,
        end_capture: unsafe extern "C" fn(Handle, *mut Handle) -> c_int,
        instantiate: unsafe extern "C" fn(*mut Handle, Handle, u64) -> c_int,
        graph_launch: unsafe extern "C" fn(Handle, Handle) -> c_int,
    }

    impl Driver {
        /// One single-thread-block launch of `function` on `stream`.
        ///
        /// # Safety
        /// `function` and `stream` are this process's, from the driver.
        unsafe fn launch_one(&self, function: Handle, stream: Handle) -> c_int {
            let none = std::ptr::null_mut();
            // SAFETY: the caller's function and stream; no parameters.
            unsafe { (self.launch)(function, 1, 1, 1, 1, 1, 1, 0, stream, none, none) }
        }
    }

    fn check(what: &str, rc: c_int) -> Result<(), String> {
        if rc == 0 {
            Ok(())
        } else {
            Err(format!("{what} returned CUDA error {rc}"))
        }
    }

    /// Runs the plan; returns the JSON report.
    pub fn run(plan: Plan) -> Result<serde_json::Value, String> {
        // SAFETY: loading the CUDA driver (here the emulator, or the real one) as programs do.
        let lib = unsafe { libloading::Library::new("libcuda.so.1") }.map_err(|e| e.to_string())?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the driver's exported function of this name, with its C signature.
                *unsafe { lib.get($name) }.map_err(|e| format!("{}", e))?
            };
        }
        let init: unsafe extern "C" fn(c_uint) -> c_int = sym!(b"cuInit\0");
        let device_get: unsafe extern "C" fn(*mut c_int, c_int) -> c_int = sym!(b"cuDeviceGet\0");
        let ctx_create: unsafe extern "C" fn(*mut Handle, c_uint, c_int) -> c_int =
            sym!(b"cuCtxCreate_v2\0");
        let module_load: unsafe extern "C" fn(*mut Handle, *const c_void) -> c_int =
            sym!(b"cuModuleLoadData\0");
        let get_function: unsafe extern "C" fn(*mut Handle, Handle, *const i8) -> c_int =
            sym!(b"cuModuleGetFunction\0");
        let stream_create: unsafe extern "C" fn(*mut Handle, c_uint) -> c_int =
            sym!(b"cuStreamCreate\0");
        let event_create: unsafe extern "C" fn(*mut Handle, c_uint) -> c_int =
            sym!(b"cuEventCreate\0");
        let driver = Driver {
            launch: sym!(b"cuLaunchKernel\0"),
            cooperative: sym!(b"cuLaunchCooperativeKernel\0"),
            launch_ex: sym!(b"cuLaunchKernelEx\0"),
            sync: sym!(b"cuStreamSynchronize\0"),
            event_record: sym!(b"cuEventRecord\0"),
            event_sync: sym!(b"cuEventSynchronize\0"),
            begin_capture: sym!(b"cuStreamBeginCapture_v2\0"),
            end_capture: sym!(b"cuStreamEndCapture\0"),
            instantiate: sym!(b"cuGraphInstantiateWithFlags\0"),
            graph_launch: sym!(b"cuGraphLaunch\0"),
            _lib: lib,
        };
        let mut device = 0;
        let mut ctx: Handle = std::ptr::null_mut();
        let mut module: Handle = std::ptr::null_mut();
        let mut function: Handle = std::ptr::null_mut();
        let mut stream: Handle = std::ptr::null_mut();
        // Two steps in flight, as a training loop keeps the GPU fed: wait for the step before
        // the one just queued.
        let mut events: [Handle; 2] = [std::ptr::null_mut(); 2];
        let name =
            CString::new(format!("sleep_{}us", plan.kernel_us)).map_err(|e| e.to_string())?;
        // SAFETY: driver calls with valid out-pointers, in the order the API requires.
        unsafe {
            check("cuInit", init(0))?;
            check("cuDeviceGet", device_get(&mut device, 0))?;
            check("cuCtxCreate", ctx_create(&mut ctx, 0, device))?;
            check(
                "cuModuleLoadData",
                module_load(&mut module, c"image".as_ptr().cast()),
            )?;
            check(
                "cuModuleGetFunction",
                get_function(&mut function, module, name.as_ptr()),
            )?;
            check("cuStreamCreate", stream_create(&mut stream, 0))?;
            for event in &mut events {
                check("cuEventCreate", event_create(event, 0))?;
            }
        }
        let graph = match plan.graph {
            Some(n) => Some(capture(&driver, function, stream, n)?),
            None => None,
        };
        let per_step = u64::from(plan.graph.unwrap_or(1));
        let step = || -> Result<(), String> {
            // SAFETY: launches of a function this process loaded, on its own stream.
            unsafe {
                match graph {
                    Some(exec) => check("cuGraphLaunch", (driver.graph_launch)(exec, stream)),
                    None if plan.cooperative => check(
                        "cuLaunchCooperativeKernel",
                        (driver.cooperative)(
                            function,
                            1,
                            1,
                            1,
                            1,
                            1,
                            1,
                            0,
                            stream,
                            std::ptr::null_mut(),
                        ),
                    ),
                    None if plan.ex => {
                        let config = LaunchConfig {
                            grid: [1, 1, 1],
                            block: [1, 1, 1],
                            shared_mem_bytes: 0,
                            stream,
                            attrs: std::ptr::null_mut(),
                            num_attrs: 0,
                        };
                        check(
                            "cuLaunchKernelEx",
                            (driver.launch_ex)(
                                &config,
                                function,
                                std::ptr::null_mut(),
                                std::ptr::null_mut(),
                            ),
                        )
                    }
                    None => check("cuLaunchKernel", driver.launch_one(function, stream)),
                }
            }
        };
        // SAFETY: synchronising this process's own stream.
        let sync = || check("cuStreamSynchronize", unsafe { (driver.sync)(stream) });
        // Queues a step and waits for the previous one.
        let pipelined = |i: u64| -> Result<(), String> {
            step()?;
            let (now, before) = (events[(i % 2) as usize], events[((i + 1) % 2) as usize]);
            // SAFETY: events this process created, recorded on its own stream.
            unsafe {
                check("cuEventRecord", (driver.event_record)(now, stream))?;
                if i > 0 {
                    check("cuEventSynchronize", (driver.event_sync)(before))?;
                }
            }
            Ok(())
        };
        let started = Instant::now();
        let mut kernels = 0u64;
        if let Some(launches) = plan.launches {
            for i in 0..launches {
                step()?;
                if i % 1000 == 999 {
                    sync()?;
                }
            }
            sync()?;
            let elapsed = started.elapsed().as_secs_f64();
            return Ok(serde_json::json!({
                "pid": std::process::id(),
                "kernels": launches,
                "launchesPerSecond": launches as f64 / elapsed,
            }));
        }
        let deadline = started + Duration::from_secs_f64(plan.seconds);
        match plan.busy_ms {
            None => {
                let mut i = 0;
                while Instant::now() < deadline {
                    pipelined(i)?;
                    i += 1;
                    kernels += per_step;
                }
                sync()?;
            }
            Some(busy_ms) => {
                let period = Duration::from_millis(busy_ms + plan.idle_ms);
                let work = busy_ms * 1000 / plan.kernel_us.max(1);
                let mut period_start = started;
                while period_start < deadline {
                    for i in 0..work {
                        pipelined(i)?;
                        kernels += 1;
                    }
                    sync()?;
                    period_start += period;
                    if let Some(rest) = period_start.checked_duration_since(Instant::now()) {
                        std::thread::sleep(rest);
                    }
                }
            }
        }
        Ok(serde_json::json!({"pid": std::process::id(), "kernels": kernels}))
    }

    fn capture(
        driver: &Driver,
        function: Handle,
        stream: Handle,
        n: u32,
    ) -> Result<Handle, String> {
        let mut graph: Handle = std::ptr::null_mut();
        let mut exec: Handle = std::ptr::null_mut();
        // SAFETY: a capture of kernel launches on this process's own stream, then its graph.
        unsafe {
            check("cuStreamBeginCapture", (driver.begin_capture)(stream, 0))?;
            for _ in 0..n {
                check(
                    "cuLaunchKernel (captured)",
                    driver.launch_one(function, stream),
                )?;
            }
            check(
                "cuStreamEndCapture",
                (driver.end_capture)(stream, &mut graph),
            )?;
            check(
                "cuGraphInstantiate",
                (driver.instantiate)(&mut exec, graph, 0),
            )?;
        }
        Ok(exec)
    }
}

/// Runs every scenario (or those whose names contain `only`) and the overhead measurement.
pub fn run_all(
    seconds: u64,
    only: &[String],
    overhead: bool,
) -> Result<(String, bool), ComputeBenchError> {
    let exe = std::env::current_exe()
        .map_err(|e| ComputeBenchError::Missing("gpuslice", e.to_string()))?;
    let all = scenarios();
    let bench = Bench::new(&exe, &all)?;
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
    let overhead = if overhead {
        Some(bench.overhead(5)?)
    } else {
        None
    };
    Ok(render(&results, overhead))
}
