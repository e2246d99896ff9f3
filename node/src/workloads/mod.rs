//! The workloads on the slices: the agent's socket, claims that hold a slice, compute shares
//! arbitrated between processes, drains that stop busy work as its CheckpointPolicy says, and
//! the checkpoint intervals it asks for.

pub mod arbiter;
pub mod claims;
pub mod compute;
pub mod drain;
pub mod interval;
pub mod process;
pub mod socket;
