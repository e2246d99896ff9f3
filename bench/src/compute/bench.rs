//! The bench itself: the GPU (emulated or real), the slices' directories, the agent's socket,
//! and the workers it spawns under the shim.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use gpuslice_contract::{SliceConfig, SliceKind, StateDir, env};
use gpuslice_emulator::{Machine, Store};
use gpuslice_node::workloads::socket;

use super::{
    ARBITRATED, ComputeBenchError, INFER, JOBS, KERNEL_US, MPS_INFER, MPS_TRAIN, PLAIN, Scenario,
    TRAIN, job_slice, setup, slice_id,
};

/// On a real GPU, workers start their clocks this long after they are spawned (context
/// creation and the PTX's compilation take a while).
const REAL_GPU_LEAD_NS: u64 = 5_000_000_000;

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
    pub(super) gpu: Gpu,
    pub(super) state: StateDir,
    shim: PathBuf,
    pub(super) exe: PathBuf,
    pub(super) agent: socket::Node,
}

pub(super) fn next_to(
    exe: &Path,
    names: &[&str],
    what: &'static str,
) -> Result<PathBuf, ComputeBenchError> {
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
        configs.extend([software(INFER, 50), software(TRAIN, 50)]);
        configs.extend([MPS_INFER, MPS_TRAIN].map(|id| SliceConfig {
            kind: SliceKind::Mps,
            ..software(id, 50)
        }));
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
    pub(super) fn worker_command(&self, slice: &str, args: &[String]) -> Command {
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
    pub(super) fn report<T: serde::de::DeserializeOwned>(
        &self,
        slice: &str,
        args: &[String],
    ) -> Result<T, ComputeBenchError> {
        finish(slice, self.worker(slice, args)?)
    }

    /// When workers spawned now should start their clocks: a real GPU's contexts take a while
    /// to create, so every worker starts at the same moment, after that.
    pub(super) fn start_time(&self) -> u64 {
        let lead = match self.gpu {
            Gpu::Emulated { .. } => 0,
            Gpu::Real { .. } => REAL_GPU_LEAD_NS,
        };
        gpuslice_emulator::timeline::now_ns() + lead
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
}

/// Waits for a worker on `slice` and reads its JSON report.
pub(super) fn finish<T: serde::de::DeserializeOwned>(
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
