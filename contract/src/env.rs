//! Environment variables of the node contract. Limits never come from these alone: the slice
//! config a variable names must be one the workload cannot write (see the shim's `limits`).

/// The absolute path of a slice's read-only config (`<state>/slices/<id>/config`).
pub const SLICE_CONFIG: &str = "GPUSLICE_SLICE_CONFIG";
/// The id of the slice a workload runs on (informational; the config is what counts).
pub const SLICE: &str = "GPUSLICE_SLICE";
/// Lowers (never raises) a slice's memory cap for one process, e.g. `8Gi`.
pub const MEMORY_LIMIT: &str = "GPUSLICE_MEMORY_LIMIT";
/// The emulated machine's state file that the emulated NVML and CUDA libraries open.
pub const EMULATOR_STATE: &str = "GPUSLICE_EMULATOR_STATE";
/// Where the workload writes its checkpoint-done marker (the container's path of
/// `<state>/slices/<id>/checkpoint-done`): after each checkpoint it takes, and after the
/// checkpoint signal. Set for a pod whose policy or pool names a CheckpointPolicy.
pub const CHECKPOINT_DONE: &str = "GPUSLICE_CHECKPOINT_DONE";
/// Seconds between the checkpoints its CheckpointPolicy asks of the workload (`interval`).
pub const CHECKPOINT_INTERVAL: &str = "GPUSLICE_CHECKPOINT_INTERVAL";
/// The signal that asks it to checkpoint now (`SIGUSR1`, …).
pub const CHECKPOINT_SIGNAL: &str = "GPUSLICE_CHECKPOINT_SIGNAL";
/// Where its CheckpointPolicy's `storage` (a PersistentVolumeClaim of the pod's namespace) is
/// mounted in every container: checkpoints written there outlive the pod, so its replacement
/// resumes from them. Set by the chart's admission with the volume, not by the agent.
pub const CHECKPOINT_DIR: &str = "GPUSLICE_CHECKPOINT_DIR";

/// CUDA MPS (NVIDIA's names). Where a client finds its MPS control daemon's pipes (default
/// `/tmp/nvidia-mps`).
pub const MPS_PIPE_DIRECTORY: &str = "CUDA_MPS_PIPE_DIRECTORY";
/// Where the MPS control daemon and servers write their logs (default `/var/log/nvidia-mps`).
pub const MPS_LOG_DIRECTORY: &str = "CUDA_MPS_LOG_DIRECTORY";
/// The percentage of the GPU's SMs (threads) an MPS client may use.
pub const MPS_ACTIVE_THREAD_PERCENTAGE: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
/// The device memory an MPS client may pin: `<device>=<size>[,…]`, a device being an ordinal or
/// a UUID and a size a number with `K`, `M` or `G`, for example `0=2048M`.
pub const MPS_PINNED_DEVICE_MEM_LIMIT: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
