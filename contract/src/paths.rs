//! The agent's state directory (default [`DEFAULT`]), of which the agent is the only writer:
//!
//! ```text
//! <state>/socket/agent.sock          the agent's socket (claims and compute shares), alone in its
//!                                    directory: containers get the directory, so a restarted
//!                                    agent's new socket reaches them
//! <state>/gpu-<index>.slices.json    a GPU's software slice table (and its MIG instances' MPS
//!                                    slices, each naming its instance)
//! <state>/slices/<id>/config         a slice's read-only config (SliceConfig as JSON)
//! <state>/slices/<id>/memory         the slice's memory ledger (shared by its processes)
//! <state>/slices/<id>/checkpoint-done  written by the workload when it has checkpointed
//! <state>/mps/<device>/pipe/         the MPS control daemon of a device shared through MPS: a
//!                                    GPU (`gpu0`, layout `mps`) or a MIG instance
//!                                    (`gpu0-mig4-3g.40gb`, layout `mig.mps`): its pipe
//!                                    directory, which containers of its slices get
//! <state>/mps/<device>/log/          and its log directory
//! <state>/drains.json                what the agent signalled when (survives restarts)
//! <state>/source/                    standalone: Git mirrors and the last good config
//! <state>/emulated-<node>.json       with --emulate: the emulated machine
//! ```

use std::path::{Path, PathBuf};

/// Where the agent keeps its state unless told otherwise.
pub const DEFAULT: &str = "/run/gpuslice";

/// In a container given a software slice: the slice's config at a fixed path, bind-mounted
/// read-only by the CDI spec. The shim reads it there whatever the environment says, so a
/// workload cannot switch its cap off by unsetting or redirecting `GPUSLICE_SLICE_CONFIG`; the
/// container's node contract is at [`DEFAULT`].
pub const PINNED_CONFIG: &str = "/etc/gpuslice/slice-config";
/// The file that makes the dynamic loader preload a library into every process of a container;
/// the CDI spec of a software slice names the shim in it.
pub const SYSTEM_PRELOAD: &str = "/etc/ld.so.preload";

/// In a container given an MPS slice: where its GPU's MPS pipe directory is mounted. CUDA's own
/// default (`CUDA_MPS_PIPE_DIRECTORY` unset), so unsetting the variable still reaches the
/// node's daemon rather than a server the workload could start itself.
pub const MPS_PIPE_IN_CONTAINER: &str = "/tmp/nvidia-mps";

/// A slice's config, inside its directory.
pub const CONFIG_FILE: &str = "config";
/// A slice's memory ledger, beside its config.
pub const LEDGER_FILE: &str = "memory";
/// The marker a workload writes into its slice's directory once it has checkpointed.
pub const CHECKPOINT_DONE_FILE: &str = "checkpoint-done";

/// An agent's state directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    pub fn new(root: impl Into<PathBuf>) -> StateDir {
        StateDir { root: root.into() }
    }

    /// The state directory a slice config lives in (`<state>/slices/<id>/config`).
    pub fn of_slice_config(config: &Path) -> Option<StateDir> {
        let slices = config.parent()?.parent()?;
        if slices.file_name()? != "slices" {
            return None;
        }
        Some(StateDir::new(slices.parent()?))
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The agent's Unix socket.
    pub fn socket(&self) -> PathBuf {
        self.root.join("socket").join("agent.sock")
    }

    /// A GPU's software slice table.
    pub fn slice_table(&self, gpu: u32) -> PathBuf {
        self.root.join(format!("gpu-{gpu}.slices.json"))
    }

    /// The folder holding one directory per slice.
    pub fn slices(&self) -> PathBuf {
        self.root.join("slices")
    }

    /// One slice's directory.
    pub fn slice(&self, id: &str) -> PathBuf {
        self.slices().join(id)
    }

    pub fn slice_config(&self, id: &str) -> PathBuf {
        self.slice(id).join(CONFIG_FILE)
    }

    pub fn slice_ledger(&self, id: &str) -> PathBuf {
        self.slice(id).join(LEDGER_FILE)
    }

    pub fn checkpoint_done(&self, id: &str) -> PathBuf {
        self.slice(id).join(CHECKPOINT_DONE_FILE)
    }

    /// What the agent signalled when.
    pub fn drains(&self) -> PathBuf {
        self.root.join("drains.json")
    }

    /// The standalone agent's elastic shapes: each GPU's shape, staged re-cuts, the forecast.
    pub fn elastic(&self) -> PathBuf {
        self.root.join("elastic.json")
    }

    /// Slices and GPUs taken out of service after XID errors.
    pub fn quarantines(&self) -> PathBuf {
        self.root.join("quarantine.json")
    }

    /// The MPS control daemons' directories, one per device shared through MPS.
    pub fn mps_daemons(&self) -> PathBuf {
        self.root.join("mps")
    }

    /// The directory of the MPS control daemon of `device` (pipe and log directories inside):
    /// a whole GPU (`gpu0`) or a MIG instance (`gpu0-mig4-3g.40gb`), named by its slice id (see
    /// [`crate::slice::mps_device_of`]).
    pub fn mps(&self, device: &str) -> PathBuf {
        self.mps_daemons().join(device)
    }

    /// The pipe directory of `device`'s MPS control daemon (`CUDA_MPS_PIPE_DIRECTORY`).
    pub fn mps_pipe(&self, device: &str) -> PathBuf {
        self.mps(device).join("pipe")
    }

    /// The log directory of `device`'s MPS control daemon (`CUDA_MPS_LOG_DIRECTORY`).
    pub fn mps_log(&self, device: &str) -> PathBuf {
        self.mps(device).join("log")
    }

    /// Standalone mode: Git mirrors and the last good config.
    pub fn source(&self) -> PathBuf {
        self.root.join("source")
    }

    /// With `--emulate`: the emulated machine of a node.
    pub fn emulated_machine(&self, node: &str) -> PathBuf {
        self.root.join(format!("emulated-{node}.json"))
    }
}

/// A slice's memory ledger, found from the path of its config.
pub fn ledger_beside(config: &Path) -> PathBuf {
    config.with_file_name(LEDGER_FILE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slice_config_leads_back_to_its_state_directory() {
        let state = StateDir::new("/run/gpuslice");
        let config = state.slice_config("gpu0-s1");
        assert_eq!(config, Path::new("/run/gpuslice/slices/gpu0-s1/config"));
        assert_eq!(StateDir::of_slice_config(&config), Some(state.clone()));
        assert_eq!(ledger_beside(&config), state.slice_ledger("gpu0-s1"));
        assert_eq!(StateDir::of_slice_config(Path::new("/tmp/x/config")), None);
    }
}
