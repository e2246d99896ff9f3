//! The `gpuslice` command: the CLI front of the planes (validate, crds; later plan, agent,
//! operator, run). The library half holds what the commands do, so tests call it directly.

pub mod agent;
pub mod drain;
pub mod plan;
pub mod standalone;
pub mod validate;
