//! The node agent, whole: it reads the node's GPUs through NVML, takes what they should look like
//! from one of two sources (a folder or Git repository standalone, its `GpuNode` in a cluster),
//! converges them in one [`pass`], drains what blocks, publishes the slice directories of the node
//! contract, and serves claims and compute shares on its socket. Design: `docs/agent.md`.
//!
//! One folder per concern: [`gpu`] (what the GPUs are and how they change), [`workloads`] (who
//! holds a slice and for how long), [`protections`] (what keeps one workload from hurting
//! another), [`cluster`] (the agent in Kubernetes), [`kubelet`] (the DRA kubelet plugin). The
//! pass and the standalone source sit at the top.

pub mod cluster;
pub mod gpu;
pub mod kubelet;
pub mod pass;
pub mod protections;
pub mod render;
pub mod standalone;
pub mod workloads;

pub use gpu::converge::{BlockingProcess, GpuOutcome, Held, converge_to, read_node};
pub use gpu::nvml::{NvmlError, NvmlGpus};
