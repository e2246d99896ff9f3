//! The queue's path replayed offline: pods arrive in order (the list again from its start once it
//! is used up), each is admitted as the queue admits it ([`super::admit`], the same scoring and
//! inputs the operator builds from the cluster) or stays out, and nothing leaves; at each mark
//! of arrived GPU demand (percent of the GPUs) the GPU share left unallocated is recorded, as the
//! placement benchmark's replay does. What `queue-scale` measures in a cluster, without one.

use std::collections::{BTreeMap, BTreeSet};

use super::{FreeDevice, Need, Nodes, Placer, Room, Waiting, admit};
use crate::placement::WHOLE;

/// A pool's devices (all free at the start) and its policies' needs.
#[derive(Clone, Debug, Default)]
pub struct Pool {
    pub devices: Vec<FreeDevice>,
    pub needs: BTreeMap<String, Need>,
}

/// A pod arriving at the gate of a pool.
#[derive(Clone, Debug)]
pub struct Arrival {
    pub pool: String,
    pub pod: Waiting,
    /// The GPU thousandths it asks for (what it counts toward the marks).
    pub demand: u64,
}

/// What a replay found.
#[derive(Clone, Debug, PartialEq)]
pub struct Replayed {
    pub arrived: usize,
    pub placed: usize,
    /// Unallocated GPU % at each mark, in the order of the marks.
    pub unallocated: Vec<f64>,
}

/// Replays `arrivals` in order on `pools` (by name) and nodes of `rooms`, through `placer`,
/// until the arrived demand passes the last of `marks` (ascending percents of the GPUs).
pub fn replay(
    pools: &BTreeMap<String, Pool>,
    rooms: BTreeMap<String, Room>,
    arrivals: &[Arrival],
    placer: &mut dyn Placer,
    marks: &[f64],
) -> Replayed {
    let mut free: BTreeMap<&str, Vec<FreeDevice>> = BTreeMap::new();
    let mut gpus: BTreeMap<&str, BTreeMap<String, u32>> = BTreeMap::new();
    let mut every_gpu: BTreeSet<(&str, u32)> = BTreeSet::new();
    for (name, pool) in pools {
        free.insert(name, pool.devices.clone());
        let mut per_node: BTreeMap<&str, BTreeSet<u32>> = BTreeMap::new();
        for d in &pool.devices {
            per_node.entry(&d.node).or_default().insert(d.gpu);
            every_gpu.insert((&d.node, d.gpu));
        }
        gpus.insert(
            name,
            per_node
                .into_iter()
                .map(|(node, set)| (node.to_string(), set.len() as u32))
                .collect(),
        );
    }
    let mut nodes = Nodes {
        rooms,
        gpus: BTreeMap::new(),
    };
    let total = (every_gpu.len() as u64 * u64::from(WHOLE)) as f64;
    let mut out = Replayed {
        arrived: 0,
        placed: 0,
        unallocated: Vec::with_capacity(marks.len()),
    };
    if total == 0.0 || arrivals.iter().all(|a| a.demand == 0) {
        return out;
    }
    let (mut arrived_demand, mut allocated) = (0.0, 0.0);
    let mut pool_of_nodes: Option<&str> = None;
    for arrival in arrivals.iter().cycle() {
        if out.unallocated.len() == marks.len() {
            break;
        }
        out.arrived += 1;
        arrived_demand += arrival.demand as f64;
        if let (Some(pool), Some(devices)) =
            (pools.get(&arrival.pool), free.get_mut(&*arrival.pool))
        {
            if pool_of_nodes != Some(&arrival.pool) {
                nodes.gpus = gpus.get(&*arrival.pool).cloned().unwrap_or_default();
                pool_of_nodes = Some(&arrival.pool);
            }
            let before: u64 = devices.iter().map(|d| u64::from(d.share)).sum();
            let need = pool.needs.get(&arrival.pod.policy);
            // Each arrival is a new pod (the list may come round again).
            let mut pod = arrival.pod.clone();
            pod.name = format!("{}-{}", pod.name, out.arrived);
            if admit(&pod, need, devices, &mut nodes, placer).is_ok() {
                out.placed += 1;
                let after: u64 = devices.iter().map(|d| u64::from(d.share)).sum();
                allocated += (before - after) as f64;
            }
        }
        while out.unallocated.len() < marks.len()
            && arrived_demand / total * 100.0 >= marks[out.unallocated.len()]
        {
            out.unallocated.push(100.0 - allocated / total * 100.0);
        }
    }
    out
}
