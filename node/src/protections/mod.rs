//! What keeps one tenant from hurting another beyond the shim: the memory watchdog, XID fault
//! isolation, I/O and host CPU/memory limits, and the node-local dataset cache.

pub mod cache;
pub mod faults;
pub mod hostlimit;
pub mod iolimit;
pub mod watchdog;
