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
use std::time::{Duration, Instant};

use gpuslice_api::NodeInventory;
use gpuslice_contract::slice::{gpu_slice_id, mig_slice_id};
use gpuslice_contract::{SliceConfig, StateDir, env};
use gpuslice_planning::transition::Desired;

/// The control daemon's socket in its pipe directory, and its pid file.
pub const CONTROL_SOCKET: &str = "control";
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";

/// NVIDIA's control tool, found on `PATH` unless the agent is told where it is.
pub const DEFAULT_CONTROL: &str = "nvidia-cuda-mps-control";

/// How long the control tool may take to answer before the pass goes on without it.
const TOOL_DEADLINE: Duration = Duration::from_secs(10);

/// Why a GPU's MPS daemon could not be started or told its defaults.
#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    #[error(
        "cannot run {} -d: {source}; install the driver's MPS tools (or pass --mps-control; with --emulate, cargo build --workspace builds the emulated one), or give the pool a software layout",
        tool.display()
    )]
    NoTool {
        tool: PathBuf,
        source: std::io::Error,
    },
    #[error("{} -d failed ({status}): {stderr}", tool.display())]
    StartFailed {
        tool: PathBuf,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("`{command}`: {reply}")]
    Refused { command: String, reply: String },
    #[error("`{command}`: no answer within {} s", TOOL_DEADLINE.as_secs())]
    NoAnswer { command: String },
    #[error("`{command}`: {source}")]
    Wait {
        command: String,
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{device} has no UUID from NVML, and its MPS daemon must be given one (CUDA_VISIBLE_DEVICES); give its pool a layout without MPS"
    )]
    NoUuid { device: String },
    #[error("{device}'s slice memory {memory:?} is not a size")]
    Memory { device: String, memory: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> MpsError + '_ {
    move |source| MpsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// One MPS control daemon, reached through the control tool (`tool`) with the pipe and log
/// directories it was started in.
#[derive(Clone, Debug)]
pub struct MpsControl {
    pub tool: PathBuf,
    pub pipe: PathBuf,
    pub log: PathBuf,
}

impl MpsControl {
    fn command(&self) -> Command {
        let mut command = Command::new(&self.tool);
        command
            .env(env::MPS_PIPE_DIRECTORY, &self.pipe)
            .env(env::MPS_LOG_DIRECTORY, &self.log);
        command
    }

    /// Starts the daemon in the background for the GPU `visible` names (`CUDA_VISIBLE_DEVICES`).
    pub fn start(&self, visible: &str) -> Result<(), MpsError> {
        for dir in [&self.pipe, &self.log] {
            std::fs::create_dir_all(dir).map_err(io(dir))?;
        }
        // Containers of any user reach the daemon through the pipe directory.
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&self.pipe, std::fs::Permissions::from_mode(0o755))
            .map_err(io(&self.pipe))?;
        let child = self
            .command()
            .arg("-d")
            .env("CUDA_VISIBLE_DEVICES", visible)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| MpsError::NoTool {
                tool: self.tool.clone(),
                source,
            })?;
        let output = finish_within(child, "-d")?;
        if !output.status.success() {
            return Err(MpsError::StartFailed {
                tool: self.tool.clone(),
                status: output.status,
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_string(),
            });
        }
        Ok(())
    }

    /// Sets the defaults of the clients the daemon serves next: their share of the SMs, and
    /// where given their pinned memory on device 0 (the daemon's only device).
    pub fn set_defaults(&self, compute: u32, pinned: Option<u64>) -> Result<(), MpsError> {
        self.send(&format!("set_default_active_thread_percentage {compute}"))?;
        if let Some(bytes) = pinned {
            self.send(&format!(
                "set_default_device_pinned_mem_limit 0 {}M",
                bytes >> 20
            ))?;
        }
        Ok(())
    }

    /// Tells the daemon to quit; one that is gone already is no error to anyone.
    pub fn quit(&self) {
        let _ = self.send("quit");
    }

    /// Sends one command to the daemon through the control tool; its reply, or why not.
    pub fn send(&self, line: &str) -> Result<String, MpsError> {
        let mut child = self
            .command()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(io(&self.tool))?;
        if let Some(mut stdin) = child.stdin.take() {
            let _ = writeln!(stdin, "{line}");
        }
        let output = finish_within(child, line)?;
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(MpsError::Refused {
                command: line.to_string(),
                reply: String::from_utf8_lossy(&output.stderr).trim().to_string(),
            })
        }
    }
}

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

    fn of(&self, state: &StateDir, device: &str) -> MpsControl {
        MpsControl {
            tool: self.control.clone(),
            pipe: state.mps_pipe(device),
            log: state.mps_log(device),
        }
    }

    /// Brings each daemon in line with the layouts: one running with its slices' defaults for
    /// each GPU whose slices are `mps` and each MIG instance with MPS slices, none elsewhere.
    /// Returns, per GPU, why a daemon of it could not be started.
    pub fn keep(&self, state: &StateDir, node: &NodeInventory) -> BTreeMap<u32, MpsError> {
        let mut failed = BTreeMap::new();
        let mut kept = std::collections::BTreeSet::new();
        for (gpu, device, wanted) in mps_devices(node) {
            if let Err(why) = wanted.and_then(|w| self.keep_running(state, &device, &w)) {
                tracing::warn!(gpu, device, "MPS control daemon: {why}");
                failed.insert(gpu, why);
            }
            kept.insert(device);
        }
        // Devices no longer shared through MPS: their daemons quit (one that died already is
        // no matter) and their folders go.
        let gone = std::fs::read_dir(state.mps_daemons())
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|device| !kept.contains(device));
        for device in gone {
            self.of(state, &device).quit();
            let dir = state.mps(&device);
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                tracing::warn!("{}: {e}", dir.display());
            } else {
                tracing::info!(device, "MPS control daemon stopped");
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
    ) -> BTreeMap<u32, MpsError> {
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
            let device = gpu_slice_id(gpu.index);
            let wanted = Wanted::of(&device, gpu.uuid.as_deref(), table.compute, &memory);
            if let Err(why) = wanted.and_then(|w| self.keep_running(state, &device, &w)) {
                tracing::warn!(gpu = gpu.index, "MPS control daemon: {why}");
                plan.ops.clear();
                refused.insert(gpu.index, why);
            }
        }
        refused
    }

    fn keep_running(
        &self,
        state: &StateDir,
        device: &str,
        wanted: &Wanted,
    ) -> Result<(), MpsError> {
        let daemon = self.of(state, device);
        let alive = daemon.send("get_server_list").is_ok();
        let started = std::fs::read_to_string(started_file(state, device)).ok();
        if alive && started.as_deref() == Some(wanted.record().as_str()) {
            // Its defaults again, whoever may have changed them since (they apply to the next
            // server it starts).
            return daemon.set_defaults(wanted.compute, Some(wanted.memory));
        }
        if alive {
            // Running with other defaults (the layout changed): start it again with these.
            daemon.quit();
            tracing::info!(
                device,
                "MPS control daemon restarted for the new slice size"
            );
        } else if started.is_some() {
            tracing::warn!(
                device,
                "MPS control daemon not answering; starting it again"
            );
        }
        daemon.start(&wanted.uuid)?;
        daemon.set_defaults(wanted.compute, Some(wanted.memory))?;
        let record = started_file(state, device);
        std::fs::write(&record, wanted.record()).map_err(io(&record))?;
        tracing::info!(
            device,
            compute = wanted.compute,
            "MPS control daemon started ({})",
            daemon.pipe.display()
        );
        Ok(())
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

/// Waits for the control tool to end, killing it past [`TOOL_DEADLINE`]: a wedged daemon must
/// not hold up the agent's passes.
fn finish_within(
    mut child: std::process::Child,
    command: &str,
) -> Result<std::process::Output, MpsError> {
    let deadline = Instant::now() + TOOL_DEADLINE;
    let gone = |source| MpsError::Wait {
        command: command.to_string(),
        source,
    };
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return child.wait_with_output().map_err(gone),
            Ok(None) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(MpsError::NoAnswer {
                    command: command.to_string(),
                });
            }
            Err(e) => return Err(gone(e)),
        }
    }
}

impl Wanted {
    /// What `device`'s daemon is started with for slices of `compute` % and `memory` (a
    /// quantity) on the device of `uuid`, or why it cannot be.
    fn of(
        device: &str,
        uuid: Option<&str>,
        compute: u32,
        memory: &str,
    ) -> Result<Wanted, MpsError> {
        let uuid = uuid
            .filter(|u| !u.is_empty())
            .ok_or_else(|| MpsError::NoUuid {
                device: device.to_string(),
            })?
            .to_string();
        let memory = gpuslice_api::bytes_of(memory)
            .ok()
            .filter(|m| *m >= 1 << 20)
            .ok_or_else(|| MpsError::Memory {
                device: device.to_string(),
                memory: memory.to_string(),
            })?;
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

/// Each device of `node` shared through MPS: its GPU, its name (its slice id: `gpu0`, or
/// `gpu0-mig4-3g.40gb` for a MIG instance) and what its daemon must be started with.
fn mps_devices(node: &NodeInventory) -> Vec<(u32, String, Result<Wanted, MpsError>)> {
    let mut out = Vec::new();
    for gpu in &node.gpus {
        if let Some(s) = gpu.slices.first().filter(|s| s.mps) {
            let device = gpu_slice_id(gpu.index);
            let wanted = Wanted::of(&device, gpu.uuid.as_deref(), s.compute, &s.memory.0);
            out.push((gpu.index, device, wanted));
        }
        for i in gpu.mig.iter().flat_map(|m| &m.instances) {
            if let Some(s) = i.slices.first() {
                let device = mig_slice_id(gpu.index, i.placement.start, &i.profile);
                let wanted = Wanted::of(&device, i.uuid.as_deref(), s.compute, &s.memory.0);
                out.push((gpu.index, device, wanted));
            }
        }
    }
    out
}

/// Where the agent records what `device`'s daemon was started with (its defaults cannot be
/// read back in a form every driver version prints alike).
fn started_file(state: &StateDir, device: &str) -> PathBuf {
    state.mps(device).join("started")
}

/// The MPS servers the agent's daemons started (children of a daemon whose pid file is under
/// the state directory), among `pids`: each shows on its GPU as a compute process of its own,
/// holding no slice, and must not be taken for a stray.
pub fn servers_among(state: &StateDir, pids: impl IntoIterator<Item = u32>) -> Vec<u32> {
    let daemons: Vec<u32> = std::fs::read_dir(state.mps_daemons())
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|gpu| {
            let pid = std::fs::read_to_string(gpu.path().join("pipe").join(PID_FILE)).ok()?;
            pid.trim().parse().ok()
        })
        .collect();
    if daemons.is_empty() {
        return Vec::new();
    }
    pids.into_iter()
        .filter(|pid| {
            daemons.contains(pid)
                || crate::workloads::process::parent_of(*pid).is_some_and(|p| daemons.contains(&p))
        })
        .collect()
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
