//! The GPUs themselves: discovery and MIG changes through NVML, the software slice tables, MPS
//! daemons and slice directories of the node contract, and converging each GPU to its planned layout.

pub mod converge;
#[cfg(feature = "emulate")]
pub mod emulate;
pub mod mps;
pub mod nvml;
pub mod slices;
