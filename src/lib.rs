//! The `gpuslice` command: the CLI front of the planes (validate, crds; later plan, agent,
//! operator, run). The library half holds what the commands do, so tests call it directly.

pub mod agent;
pub mod bench;
pub mod claims;
pub mod compute;
pub mod compute_bench;
pub mod drain;
pub mod incluster;
pub mod plan;
pub mod run;
pub mod standalone;
pub mod validate;

/// The variable that names a slice's config to the shim (see `shim/src/limits.rs`).
pub const SLICE_CONFIG_VAR: &str = "GPUSLICE_SLICE_CONFIG";
