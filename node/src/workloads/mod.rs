//! The workloads on the slices: the agent's socket, claims that hold a slice, compute shares
//! arbitrated between processes, and drains that stop busy work as its CheckpointPolicy says.

pub mod arbiter;
pub mod claims;
pub mod compute;
pub mod drain;
pub mod process;
pub mod socket;
