//! The queue's path replayed offline: pods arrive in order, each is admitted as the queue admits
//! it ([`super::admit`], the same scoring and inputs the operator builds from the cluster) or
//! stays out, and nothing leaves. What `queue-scale` measures in a cluster, without one: the
//! GPU share left unallocated at the end.

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
}

/// What a replay found.
#[derive(Clone, Debug, PartialEq)]
pub struct Replayed {
    pub arrived: usize,
    pub placed: usize,
    /// GPU thousandths the admitted pods took.
    pub allocated: u64,
    /// GPU thousandths of every GPU of the pools.
    pub total: u64,
}

impl Replayed {
    /// The GPU share left unallocated, in percent.
    pub fn unallocated_percent(&self) -> f64 {
        if self.total == 0 {
            return 0.0;
        }
        100.0 - self.allocated as f64 / self.total as f64 * 100.0
    }
}

/// Replays `arrivals` in order on `pools` (by name) and nodes of `rooms`, through `placer`.
pub fn replay(
    pools: &BTreeMap<String, Pool>,
    rooms: BTreeMap<String, Room>,
    arrivals: &[Arrival],
    placer: &mut dyn Placer,
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
    let mut out = Replayed {
        arrived: arrivals.len(),
        placed: 0,
        allocated: 0,
        total: every_gpu.len() as u64 * u64::from(WHOLE),
    };
    let mut pool_of_nodes: Option<&str> = None;
    for arrival in arrivals {
        let (Some(pool), Some(devices)) = (pools.get(&arrival.pool), free.get_mut(&*arrival.pool))
        else {
            continue;
        };
        if pool_of_nodes != Some(&arrival.pool) {
            nodes.gpus = gpus.get(&*arrival.pool).cloned().unwrap_or_default();
            pool_of_nodes = Some(&arrival.pool);
        }
        let before: u64 = devices.iter().map(|d| u64::from(d.share)).sum();
        let need = pool.needs.get(&arrival.pod.policy);
        if admit(&arrival.pod, need, devices, &mut nodes, placer).is_ok() {
            out.placed += 1;
            out.allocated += before - devices.iter().map(|d| u64::from(d.share)).sum::<u64>();
        }
    }
    out
}
