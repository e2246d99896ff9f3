//! The node contract (`docs/contracts.md`): what the node agent, the shim, `gpuslice run` and the
//! benchmarks agree on, written once. Types and names only, no behaviour: the state directory's
//! layout ([`paths`]), a slice's read-only config ([`slice`]), every message on the agent's
//! socket in both directions ([`socket`]), the environment variables ([`env`]), and the CUDA
//! driver ABI the shim, the CUDA emulator and the benchmark worker share ([`cuda`]).

pub mod cuda;
pub mod env;
pub mod paths;
pub mod slice;
pub mod socket;

pub use paths::StateDir;
pub use slice::{SliceConfig, SliceKind};
