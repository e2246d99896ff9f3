//! The node agent, whole: it reads the node's GPUs through NVML, takes what they should look like
//! from one of two sources (a folder or Git repository standalone, its `GpuNode` in a cluster),
//! converges them in one [`pass`], drains what blocks, publishes the slice directories of the node
//! contract, and serves claims and compute shares on its socket. Design: `docs/agent.md`.

pub mod arbiter;
pub mod cache;
pub mod claims;
pub mod cluster;
pub mod compute;
pub mod converge;
pub mod dra;
pub mod drain;
pub mod emulate;
pub mod faults;
pub mod hostlimit;
pub mod iolimit;
pub mod kubelet;
pub mod nvml;
pub mod pass;
pub mod process;
pub mod render;
pub mod slices;
pub mod socket;
pub mod standalone;
pub mod watchdog;

pub use converge::{BlockingProcess, GpuOutcome, Held, converge_to, read_node};
pub use nvml::{NvmlError, NvmlGpus};
