//! This process as an MPS client: at `cuInit` the driver connects to the control daemon of
//! `CUDA_MPS_PIPE_DIRECTORY` (default `/tmp/nvidia-mps`); if none answers it runs without MPS,
//! as CUDA does. A client's kernels run beside other clients' on its share of the SMs: the
//! daemon's default active thread percentage, lowered (never raised) by the client's
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`. Its allocations on a device stop at the pinned memory
//! limit, the daemon's default or the client's `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, the lower.

use std::collections::BTreeMap;
use std::os::unix::net::UnixStream;

use gpuslice_contract::env;
use gpuslice_emulator::mps;

pub(crate) struct Client {
    /// Held open while the process lives: the daemon counts it as a client.
    _control: UnixStream,
    /// Percent of each device's SMs its kernels run on.
    pub(crate) share: u32,
    /// Device ordinal → the most device memory it may allocate.
    pub(crate) pinned: BTreeMap<usize, u64>,
}

/// Connects to the MPS control daemon, if one answers.
pub(crate) fn connect(pid: u32) -> Option<Client> {
    let (control, terms) = mps::connect_client(&mps::pipe_directory(), pid)?;
    let asked = std::env::var(env::MPS_ACTIVE_THREAD_PERCENTAGE)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|p| *p > 0.0)
        .map(|p| p.ceil().min(100.0) as u32);
    let share = asked.map_or(terms.thread_percentage, |a| a.min(terms.thread_percentage));
    let mut pinned: BTreeMap<usize, u64> = terms
        .pinned
        .into_iter()
        .map(|(d, b)| (d as usize, b))
        .collect();
    if let Ok(text) = std::env::var(env::MPS_PINNED_DEVICE_MEM_LIMIT) {
        for (device, bytes) in mps::parse_pinned_limits(&text) {
            let limit = pinned.entry(device as usize).or_insert(bytes);
            *limit = (*limit).min(bytes);
        }
    }
    Some(Client {
        _control: control,
        share: share.clamp(1, 100),
        pinned,
    })
}
