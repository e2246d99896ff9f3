//! The gpuslice operator: reconciles `GpuPool`s into each node's desired layout (`GpuNode.spec`,
//! which the node agent applies) and reports per-pool status, as a pipeline — read (watch
//! caches) → build the desired state (pure, [`desired`]) → server-side apply → status.

pub mod admission;
pub mod classes;
pub mod compaction;
pub mod controller;
pub mod desired;
pub mod election;
pub mod evictions;
pub mod published;
pub mod queue;
pub mod signals;

/// The field manager of everything the operator writes.
pub const MANAGER: &str = "gpuslice-operator";
