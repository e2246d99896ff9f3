//! CUDA MPS for GPUs with an `mps` layout: one control daemon per GPU, started with
//! NVIDIA's command-line tool (`nvidia-cuda-mps-control -d`) in a pipe and log directory of its
//! own under the state directory (`<state>/mps/gpu<i>/`), checked each pass and started again if
//! it died, and told to quit (`echo quit | nvidia-cuda-mps-control`) when the GPU's layout is
//! no longer `mps`.
//!
//! Each daemon's defaults are the GPU's slice: its active thread percentage is the slice's
//! compute share and its pinned device memory limit the slice's memory, so a client that drops
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` or `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` still gets no more
//! (a client's variables only lower the daemon's).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use gpuslice_api::NodeInventory;
use gpuslice_contract::{SliceConfig, StateDir, env};
use gpuslice_planning::transition::Desired;

/// The control daemon's socket in its pipe directory, and its pid file.
pub const CONTROL_SOCKET: &str = "control";
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";

/// NVIDIA's control tool, found on `PATH` unless the agent is told where it is.
pub const DEFAULT_CONTROL: &str = "nvidia-cuda-mps-control";

/// What a GPU's daemon must be started with: the GPU and its slices' share and memory.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Wanted {
    uuid: String,
    compute: u32,
    memory: u64,
}

/// The MPS control daemons of the node's GPUs.
#[derive(Clone, Debug)]
pub struct MpsDaemons {
    control: PathBuf,
}

impl Default for MpsDaemons {
    fn default() -> Self {
        MpsDaemons::new(PathBuf::from(DEFAULT_CONTROL))
    }
}

impl MpsDaemons {
    /// Daemons run with the control tool at `control`.
    pub fn new(control: PathBuf) -> MpsDaemons {
        MpsDaemons { control }
    }

    /// Brings each GPU's daemon in line with its layout: running with the slice's defaults on a
    /// GPU whose slices are `mps`, stopped elsewhere. Returns, per GPU, why its daemon could not
    /// be started.
    pub fn keep(&self, state: &StateDir, node: &NodeInventory) -> BTreeMap<u32, String> {
        let mut failed = BTreeMap::new();
        for gpu in &node.gpus {
            let wanted = gpu
                .slices
                .first()
                .filter(|s| s.mps)
                .map(|s| Wanted::of(gpu, s.compute, &s.memory.0));
            let dir = state.mps(gpu.index);
            match wanted {
                Some(wanted) => {
                    if let Err(why) = wanted.and_then(|w| self.keep_running(state, gpu.index, &w)) {
                        tracing::warn!(gpu = gpu.index, "MPS control daemon: {why}");
                        failed.insert(gpu.index, why);
                    }
                }
                None if dir.exists() => {
                    // Quit may find no daemon (it died): the directory goes either way.
                    let _ = self.send(state, gpu.index, "quit");
                    if let Err(e) = std::fs::remove_dir_all(&dir) {
                        tracing::warn!("{}: {e}", dir.display());
                    } else {
                        tracing::info!(gpu = gpu.index, "MPS control daemon stopped");
                    }
                }
                None => {}
            }
        }
        failed
    }

    /// Before a GPU is cut into MPS slices: starts its daemon with the new slices' defaults, and
    /// where it cannot (no MPS tool, a failing one), takes that GPU's operations out of its
    /// plan, so that no slice is cut without a daemon to share it. Returns why, per GPU.
    pub fn ready_for(
        &self,
        state: &StateDir,
        node: &NodeInventory,
        plans: &mut [gpuslice_planning::cluster::GpuPlan],
    ) -> BTreeMap<u32, String> {
        let mut refused = BTreeMap::new();
        for plan in plans.iter_mut() {
            let Some(Desired::Software(table)) = &plan.desired else {
                continue;
            };
            let Some(gpu) = node.gpus.iter().find(|g| g.index == plan.index) else {
                continue;
            };
            if !table.mps || plan.ops.is_empty() || !plan.blocked_by.is_empty() {
                continue;
            }
            if too_old(gpu).is_some() {
                // Converging says why; it cuts nothing.
                continue;
            }
            // As the slices will read it back (NodeInventory's quantity), so that the next
            // pass finds the daemon started for what it sees.
            let memory = gpuslice_api::quantity::format_bytes(table.memory);
            let wanted = Wanted::of(gpu, table.compute, &memory);
            if let Err(why) = wanted.and_then(|w| self.keep_running(state, gpu.index, &w)) {
                tracing::warn!(gpu = gpu.index, "MPS control daemon: {why}");
                plan.ops.clear();
                refused.insert(gpu.index, why);
            }
        }
        refused
    }

    fn keep_running(&self, state: &StateDir, gpu: u32, wanted: &Wanted) -> Result<(), String> {
        let alive = self.send(state, gpu, "get_server_list").is_ok();
        let started = std::fs::read_to_string(started_file(state, gpu)).ok();
        if alive && started.as_deref() == Some(wanted.record().as_str()) {
            // Its defaults again, whoever may have changed them since (they apply to the next
            // server it starts).
            return self.set_defaults(state, gpu, wanted);
        }
        if alive {
            // Running with other defaults (the layout changed): start it again with these.
            let _ = self.send(state, gpu, "quit");
            tracing::info!(gpu, "MPS control daemon restarted for the new slice size");
        } else if started.is_some() {
            tracing::warn!(gpu, "MPS control daemon not answering; starting it again");
        }
        self.start(state, gpu, wanted)
    }

    fn start(&self, state: &StateDir, gpu: u32, wanted: &Wanted) -> Result<(), String> {
        let (pipe, log) = (state.mps_pipe(gpu), state.mps_log(gpu));
        for dir in [&pipe, &log] {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        // Containers of any user reach the daemon through the pipe directory.
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&pipe, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("{}: {e}", pipe.display()))?;
        let child = self
            .command(state, gpu)
            .arg("-d")
            .env("CUDA_VISIBLE_DEVICES", &wanted.uuid)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                format!(
                    "cannot run {} -d: {e}; install the driver's MPS tools (or pass --mps-control; with --emulate, cargo build --workspace builds the emulated one), or give the pool a software layout",
                    self.control.display()
                )
            })?;
        let output = finish_within(child, &format!("{} -d", self.control.display()))?;
        if !output.status.success() {
            return Err(format!(
                "{} -d failed ({}): {}",
                self.control.display(),
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
        self.set_defaults(state, gpu, wanted)?;
        let record = started_file(state, gpu);
        std::fs::write(&record, wanted.record())
            .map_err(|e| format!("{}: {e}", record.display()))?;
        tracing::info!(
            gpu,
            compute = wanted.compute,
            "MPS control daemon started ({})",
            pipe.display()
        );
        Ok(())
    }

    fn set_defaults(&self, state: &StateDir, gpu: u32, wanted: &Wanted) -> Result<(), String> {
        self.send(
            state,
            gpu,
            &format!("set_default_active_thread_percentage {}", wanted.compute),
        )?;
        self.send(
            state,
            gpu,
            &format!("set_default_device_pinned_mem_limit 0 {}", mib(wanted)),
        )?;
        Ok(())
    }

    fn command(&self, state: &StateDir, gpu: u32) -> Command {
        let mut command = Command::new(&self.control);
        command
            .env(env::MPS_PIPE_DIRECTORY, state.mps_pipe(gpu))
            .env(env::MPS_LOG_DIRECTORY, state.mps_log(gpu));
        command
    }

    /// Sends one command to GPU `gpu`'s daemon through the control tool; its reply, or why not.
    fn send(&self, state: &StateDir, gpu: u32, line: &str) -> Result<String, String> {
        let mut child = self
            .command(state, gpu)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", self.control.display()))?;
        if let Some(mut stdin) = child.stdin.take() {
            let _ = writeln!(stdin, "{line}");
        }
        let output = finish_within(child, line)?;
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&output.stderr).trim().to_string())
        }
    }
}

/// Why GPU `gpu` cannot share its SMs through MPS: compute capability below 7.0 (before Volta,
/// MPS has no execution-resource provisioning, so a client's share would not hold). A GPU whose
/// capability NVML did not give is tried.
pub fn too_old(gpu: &gpuslice_api::GpuInventory) -> Option<String> {
    let capability = gpu.compute_capability.as_deref()?;
    let major: u32 = capability.split('.').next()?.parse().ok()?;
    (major < 7).then(|| {
        format!(
            "GPU {} ({}) is of compute capability {capability}: MPS compute shares need 7.0 (Volta) or newer; give its pool a software layout",
            gpu.index, gpu.model
        )
    })
}

/// How long the control tool may take to answer before the pass goes on without it.
const TOOL_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Waits for the control tool to end, killing it past [`TOOL_DEADLINE`]: a wedged daemon must
/// not hold up the agent's passes.
fn finish_within(
    mut child: std::process::Child,
    what: &str,
) -> Result<std::process::Output, String> {
    let deadline = std::time::Instant::now() + TOOL_DEADLINE;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return child.wait_with_output().map_err(|e| e.to_string()),
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{what}: no answer within {} s",
                    TOOL_DEADLINE.as_secs()
                ));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

impl Wanted {
    /// What GPU `gpu`'s daemon is started with for slices of `compute` % and `memory` (a
    /// quantity), or why it cannot be.
    fn of(gpu: &gpuslice_api::GpuInventory, compute: u32, memory: &str) -> Result<Wanted, String> {
        let uuid = gpu.uuid.clone().filter(|u| !u.is_empty()).ok_or_else(|| {
            format!(
                "GPU {} has no UUID from NVML, and its MPS daemon must be given one (CUDA_VISIBLE_DEVICES); give its pool a software layout",
                gpu.index
            )
        })?;
        let memory = gpuslice_api::bytes_of(memory)
            .ok()
            .filter(|m| *m >= 1 << 20)
            .ok_or_else(|| format!("GPU {}'s slice memory {memory:?} is not a size", gpu.index))?;
        Ok(Wanted {
            uuid,
            compute,
            memory,
        })
    }

    /// What the daemon was started for, as recorded beside its directories.
    fn record(&self) -> String {
        format!("{} {} {}\n", self.uuid, self.compute, self.memory)
    }
}

/// Where the agent records what GPU `gpu`'s daemon was started with (its defaults cannot be read
/// back in a form every driver version prints alike).
fn started_file(state: &StateDir, gpu: u32) -> PathBuf {
    state.mps(gpu).join("started")
}

fn mib(wanted: &Wanted) -> String {
    format!("{}M", wanted.memory >> 20)
}

/// Whether process `pid` is an MPS server one of the agent's daemons started (a child of a
/// daemon whose pid file is under the state directory): it shows on its GPU as a compute
/// process of its own, holding no slice, and must not be taken for a stray.
pub fn is_server(state: &StateDir, pid: u32) -> bool {
    let Some(parent) = crate::workloads::process::parent_of(pid) else {
        return false;
    };
    let Ok(gpus) = std::fs::read_dir(state.root().join("mps")) else {
        return false;
    };
    gpus.flatten().any(|gpu| {
        std::fs::read_to_string(gpu.path().join("pipe").join(PID_FILE))
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok())
            .is_some_and(|daemon| daemon == parent || daemon == pid)
    })
}

/// What a workload on an MPS slice is told: where its GPU's daemon is (`pipe`, as the workload
/// sees it), its share of the SMs and its pinned memory limit on device `ordinal` (its place
/// in `CUDA_VISIBLE_DEVICES`), `memory` being its cap.
pub fn client_env(
    slice: &SliceConfig,
    pipe: &Path,
    ordinal: usize,
    memory: u64,
) -> Vec<(&'static str, String)> {
    vec![
        (env::MPS_PIPE_DIRECTORY, pipe.display().to_string()),
        (
            env::MPS_ACTIVE_THREAD_PERCENTAGE,
            slice.compute_percent.to_string(),
        ),
        (
            env::MPS_PINNED_DEVICE_MEM_LIMIT,
            format!("{ordinal}={}M", memory >> 20),
        ),
    ]
}
