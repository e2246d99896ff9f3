//! GPU fragmentation as the FGD paper defines it (Weng et al., ATC '23): the fragment of a node
//! for a task is the idle GPU capacity that task could not use there; a node's expected fragment
//! is that averaged over the mix of tasks the cluster expects. Placing a task so the expected
//! fragment grows least keeps capacity usable for what comes next.

use std::collections::HashMap;

use super::{Choice, Gpu, GpuAsk, Node, Request, WHOLE};

/// A kind of task and its share of arrivals.
#[derive(Clone, Debug, PartialEq)]
pub struct Typical {
    pub request: Request,
    pub weight: f64,
}

/// Idle GPU thousandths on `node` that `task` could not use.
pub fn fragment(node: &Node, task: &Request) -> f64 {
    let shared = || {
        node.gpus.iter().filter_map(|g| match g {
            Gpu::Shared { free } => Some(*free),
            Gpu::Mig { .. } => None,
        })
    };
    let idle: u32 = shared().sum();
    let unusable_all = f64::from(idle);
    // A task that cannot run here at all leaves every idle GPU unusable to it.
    if node.cpu_free < task.cpu_milli
        || node.memory_free < task.memory_mib
        || !task.allows(&node.model)
    {
        return unusable_all;
    }
    match task.gpu {
        GpuAsk::None | GpuAsk::Mig(_) => unusable_all,
        GpuAsk::Share(d) => {
            if shared().any(|f| f >= d) {
                f64::from(shared().filter(|f| *f < d).sum::<u32>())
            } else {
                unusable_all
            }
        }
        GpuAsk::Whole(k) => {
            if shared().filter(|f| *f == WHOLE).count() >= k as usize {
                f64::from(shared().filter(|f| *f < WHOLE).sum::<u32>())
            } else {
                unusable_all
            }
        }
    }
}

/// The expected fragment of `node` under a task mix.
pub fn expected(node: &Node, mix: &[Typical]) -> f64 {
    mix.iter()
        .map(|t| t.weight * fragment(node, &t.request))
        .sum()
}

/// `node` after `choice` takes `request` from it.
pub fn after(node: &Node, request: &Request, choice: &Choice) -> Node {
    // Saturating: a caller that scores a choice the node cannot hold gets an empty node back,
    // never a panic.
    let mut next = node.clone();
    next.cpu_free = next.cpu_free.saturating_sub(request.cpu_milli);
    next.memory_free = next.memory_free.saturating_sub(request.memory_mib);
    for &(g, milli) in &choice.gpus {
        if let Some(Gpu::Shared { free }) = next.gpus.get_mut(g) {
            *free = free.saturating_sub(milli);
        }
    }
    next
}

/// The task mix of a list of requests: each distinct shape (CPU, memory, GPU ask, models) with
/// its share of arrivals. GPU-less tasks are left out: they leave every idle GPU unusable
/// wherever they go, so they never change which placement fragments least.
pub fn mix_of<'a>(requests: impl IntoIterator<Item = &'a Request>) -> Vec<Typical> {
    let mut by_shape: HashMap<&Request, f64> = HashMap::new();
    for r in requests {
        if r.gpu != GpuAsk::None {
            *by_shape.entry(r).or_default() += 1.0;
        }
    }
    let total: f64 = by_shape.values().sum();
    let mut mix: Vec<Typical> = by_shape
        .into_iter()
        .map(|(shape, n)| Typical {
            request: shape.clone(),
            weight: n / total.max(1.0),
        })
        .collect();
    mix.sort_by(|a, b| {
        b.weight
            .total_cmp(&a.weight)
            .then_with(|| a.request.cmp(&b.request))
    });
    mix
}
