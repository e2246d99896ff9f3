//! Trace replay as the FGD paper's simulator does it, so results compare with the published ones:
//! the pods are shuffled with a seed, each is tried once (no deletions) and dropped if it does
//! not fit, and once the trace is used up more pods are drawn from it with replacement, until the
//! GPU requested by arrived pods reaches the last mark (e.g. 130% of the cluster's GPUs). At each
//! mark the unallocated GPU share is recorded: 100 − allocated ÷ total, in percent.

use rand::rngs::StdRng;
use rand::seq::SliceRandom as _;
use rand::{Rng as _, SeedableRng as _};

use super::{Cluster, Node, Policy, Request};

/// What one replay found.
#[derive(Clone, Debug, PartialEq)]
pub struct Replay {
    /// Unallocated GPU % at each mark, in the order of the marks.
    pub unallocated: Vec<f64>,
    pub arrived: usize,
    pub placed: usize,
}

/// Replays `pods` on a fresh cluster of `nodes` under `policy`. `marks` are arrived-GPU loads in
/// percent of the cluster's GPUs, ascending.
pub fn replay(
    nodes: &[Node],
    pods: &[Request],
    seed: u64,
    policy: &mut dyn Policy,
    marks: &[f64],
) -> Replay {
    let mut cluster = Cluster::new(nodes.to_vec());
    let total = cluster.gpu_total() as f64;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut order: Vec<usize> = (0..pods.len()).collect();
    order.shuffle(&mut rng);
    let mut out = Replay {
        unallocated: Vec::with_capacity(marks.len()),
        arrived: 0,
        placed: 0,
    };
    if pods.is_empty() || total == 0.0 {
        return out;
    }
    let mut arrived_gpu = 0.0;
    let mut allocated = 0.0;
    let mut next = 0;
    while out.unallocated.len() < marks.len() {
        let i = if next < order.len() {
            order[next]
        } else {
            rng.random_range(0..pods.len())
        };
        next += 1;
        let pod = &pods[i];
        policy.observe(pod);
        if cluster.place(pod, policy).is_ok() {
            allocated += pod.gpu_milli() as f64;
            out.placed += 1;
        }
        out.arrived += 1;
        arrived_gpu += pod.gpu_milli() as f64;
        while out.unallocated.len() < marks.len()
            && arrived_gpu / total * 100.0 >= marks[out.unallocated.len()]
        {
            out.unallocated.push(100.0 - allocated / total * 100.0);
        }
    }
    out
}
