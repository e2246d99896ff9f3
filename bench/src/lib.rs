//! The benchmarks behind `gpuslice bench`: each prints a table whose last column is PASS or FAIL
//! against its target. [`placement`] replays the Alibaba GPU-sharing traces under each placement
//! policy, and [`queue_path`] the admission queue's own path on them; [`compute`] runs real processes under the shim on the emulated (or a real) GPU and
//! measures the shares the agent's arbiter gives them; [`cache`] reads a dataset twice through
//! the node's dataset cache from a rate-limited source; [`elastic`] replays two weeks of arrivals
//! under static, windowed and elastic layouts.

pub mod cache;
pub mod compaction;
pub mod compute;
pub mod elastic;
pub mod placement;
pub mod queue_path;
