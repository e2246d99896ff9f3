//! The planning core of gpuslice: pure functions over plain data, no I/O. The agent, the
//! operator and the `gpuslice` CLI share it.

pub mod catalog;
pub mod cluster;
pub mod compaction;
pub mod diff;
pub mod driver;
pub mod elastic;
pub mod fit;
pub mod mig;
pub mod placement;
pub mod queue;
pub mod shaping;
pub mod transition;
pub mod validate;
pub mod windows;
pub mod xid;
