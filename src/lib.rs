//! The `gpuslice` command line. Each plane lives in its own crate (api, planning, source, node,
//! operator, shim, bench); this crate only parses arguments and calls them. Its library half holds
//! the two commands that are only a front: `plan`'s inventory reading and rendering, and `run`,
//! a client of the node agent's socket.

pub mod plan;
pub mod run;
