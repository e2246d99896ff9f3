//! Compaction planning (pure): which workloads to move so that whole GPUs come free. A node is
//! fragmented when much of its free GPU capacity sits on GPUs something already runs on — the
//! placement engine's fragment for a whole-GPU task ([`crate::placement::fragment`]): capacity
//! no whole-GPU workload (and no re-cut to a larger layout) can use. Over the pool's threshold,
//! the planner empties that node's least-used GPUs, one at a time, by moving their workloads to
//! free capacity on GPUs that are already in use elsewhere in the pool (best fit, never onto an
//! empty GPU, which would only move the fragment); a GPU is emptied only when every workload on
//! it may move (preemptible, with a CheckpointPolicy) and all of them find room.

use std::collections::BTreeMap;

/// A GPU's capacity, in units the workloads' sizes use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Capacity {
    /// Shared by fractions (e.g. GPU thousandths): `free` of `total`.
    Shared { free: u64, total: u64 },
    /// Cut into `total` equal slices of `size` (e.g. bytes of memory), `free` of them free.
    Slices { size: u64, total: u32, free: u32 },
}

impl Capacity {
    fn fits(&self, size: u64) -> bool {
        match self {
            Capacity::Shared { free, .. } => *free >= size,
            Capacity::Slices { size: s, free, .. } => *free > 0 && size <= *s,
        }
    }

    fn take(&mut self, size: u64) {
        match self {
            Capacity::Shared { free, .. } => *free -= size,
            Capacity::Slices { free, .. } => *free -= 1,
        }
    }

    /// What is left after taking `size` (for best fit).
    fn left_after(&self, size: u64) -> u64 {
        match self {
            Capacity::Shared { free, .. } => free - size,
            Capacity::Slices { size: s, free, .. } => u64::from(*free - 1) * s + (s - size),
        }
    }

    fn free_units(&self) -> u64 {
        match self {
            Capacity::Shared { free, .. } => *free,
            Capacity::Slices { size, free, .. } => u64::from(*free) * size,
        }
    }

    fn empty(&mut self) {
        match self {
            Capacity::Shared { free, total } => *free = *total,
            Capacity::Slices { free, total, .. } => *free = *total,
        }
    }
}

/// A workload on a GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    /// How the caller names it (`namespace/claim`, a pod index).
    pub id: String,
    /// The capacity it needs (a share, or its policy's memory for a slice).
    pub size: u64,
    /// Whether it may be moved: preemptible and with a CheckpointPolicy.
    pub movable: bool,
}

/// One GPU of the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuState {
    pub node: String,
    pub gpu: u32,
    pub capacity: Capacity,
    pub workloads: Vec<Workload>,
}

impl GpuState {
    fn in_use(&self) -> bool {
        !self.workloads.is_empty()
    }
}

/// A move.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Move {
    pub workload: String,
    pub from: (String, u32),
    pub to: (String, u32),
}

/// What compaction would do.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    pub moves: Vec<Move>,
    /// GPUs emptied, in the order they were.
    pub freed: Vec<(String, u32)>,
    /// Node → its fragmentation before and after the plan (fractions of its free capacity).
    pub fragmentation: BTreeMap<String, (f64, f64)>,
    /// GPUs that could not be emptied, and why.
    pub kept: Vec<String>,
}

/// A node's fragmentation: the share of its free capacity on GPUs in use.
pub fn node_fragmentation(gpus: &[GpuState], node: &str) -> f64 {
    let on = || gpus.iter().filter(|g| g.node == node);
    let free: u64 = on().map(|g| g.capacity.free_units()).sum();
    if free == 0 {
        return 0.0;
    }
    let stranded: u64 = on()
        .filter(|g| g.in_use())
        .map(|g| g.capacity.free_units())
        .sum();
    stranded as f64 / free as f64
}

/// Plans compaction of `gpus` (a pool) for nodes whose fragmentation passes `threshold`.
pub fn plan(gpus: &[GpuState], threshold: f64) -> Plan {
    let mut state = gpus.to_vec();
    let mut out = Plan::default();
    let mut nodes: Vec<String> = state.iter().map(|g| g.node.clone()).collect();
    nodes.sort();
    nodes.dedup();
    for node in &nodes {
        let before = node_fragmentation(&state, node);
        // GPUs of the node tried and kept (a workload may not move, or found no room).
        let mut tried: Vec<usize> = Vec::new();
        loop {
            if node_fragmentation(&state, node) <= threshold {
                break;
            }
            // The least used GPU in use, as things stand now (a GPU that took workloads
            // from another is fuller now, and is emptied later if at all).
            let Some(i) = (0..state.len())
                .filter(|&i| state[i].node == *node && state[i].in_use() && !tried.contains(&i))
                .min_by_key(|&i| {
                    let used: u64 = state[i].workloads.iter().map(|w| w.size).sum();
                    (state[i].workloads.len(), used, state[i].gpu)
                })
            else {
                break;
            };
            tried.push(i);
            let here = (state[i].node.clone(), state[i].gpu);
            if let Some(fixed) = state[i].workloads.iter().find(|w| !w.movable) {
                out.kept.push(format!(
                    "node {} GPU {}: {} may not move (not preemptible, or no CheckpointPolicy)",
                    here.0, here.1, fixed.id
                ));
                continue;
            }
            let mut trial = state.clone();
            let mut moves = Vec::new();
            let mut workloads = trial[i].workloads.clone();
            workloads.sort_by(|a, b| b.size.cmp(&a.size).then(a.id.cmp(&b.id)));
            let mut stuck = None;
            for w in &workloads {
                let target = (0..trial.len())
                    .filter(|&t| {
                        t != i
                            && trial[t].in_use()
                            && !out.freed.contains(&(trial[t].node.clone(), trial[t].gpu))
                            && trial[t].capacity.fits(w.size)
                    })
                    .min_by_key(|&t| {
                        (
                            trial[t].node != *node,
                            trial[t].capacity.left_after(w.size),
                            trial[t].node.clone(),
                            trial[t].gpu,
                        )
                    });
                let Some(t) = target else {
                    stuck = Some(w.id.clone());
                    break;
                };
                trial[t].capacity.take(w.size);
                trial[t].workloads.push(w.clone());
                moves.push(Move {
                    workload: w.id.clone(),
                    from: here.clone(),
                    to: (trial[t].node.clone(), trial[t].gpu),
                });
            }
            if let Some(id) = stuck {
                out.kept.push(format!(
                    "node {} GPU {}: no room in use elsewhere for {id}",
                    here.0, here.1
                ));
                continue;
            }
            trial[i].workloads.clear();
            trial[i].capacity.empty();
            state = trial;
            out.moves.extend(moves);
            out.freed.push(here);
        }
        out.fragmentation
            .insert(node.clone(), (before, node_fragmentation(&state, node)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared(node: &str, gpu: u32, used: &[(&str, u64, bool)]) -> GpuState {
        let taken: u64 = used.iter().map(|u| u.1).sum();
        GpuState {
            node: node.into(),
            gpu,
            capacity: Capacity::Shared {
                free: 1000 - taken,
                total: 1000,
            },
            workloads: used
                .iter()
                .map(|(id, size, movable)| Workload {
                    id: (*id).into(),
                    size: *size,
                    movable: *movable,
                })
                .collect(),
        }
    }

    #[test]
    fn the_least_used_gpus_are_emptied_into_gpus_in_use() {
        // Node a: three GPUs a quarter used each; 75 % of its free capacity is stranded.
        let gpus = vec![
            shared("a", 0, &[("p0", 250, true)]),
            shared("a", 1, &[("p1", 250, true)]),
            shared("a", 2, &[("p2", 250, true)]),
            shared("a", 3, &[]),
        ];
        assert!((node_fragmentation(&gpus, "a") - 2250.0 / 3250.0).abs() < 1e-9);
        let plan = plan(&gpus, 0.3);
        // GPU 0 goes into GPU 1, which is then the fuller; GPU 2 goes there too. No workload
        // moves twice.
        assert_eq!(plan.freed, vec![("a".into(), 0), ("a".into(), 2)]);
        assert_eq!(plan.moves.len(), 2);
        assert!(plan.moves.iter().all(|m| m.to == ("a".to_string(), 1)));
        let (before, after) = plan.fragmentation["a"];
        assert!(before > 0.6 && after < 0.3, "{before} → {after}");
    }

    #[test]
    fn workloads_that_may_not_move_keep_their_gpu_and_nothing_lands_on_empty_gpus() {
        let gpus = vec![
            shared("a", 0, &[("serving", 250, false)]),
            shared("a", 1, &[("train", 250, true)]),
            shared("b", 0, &[]),
        ];
        let plan = plan(&gpus, 0.3);
        assert_eq!(
            plan.freed,
            vec![("a".into(), 1)],
            "train moves in beside serving"
        );
        assert_eq!(plan.moves[0].to, ("a".to_string(), 0));
        assert!(plan.kept.is_empty() || plan.kept[0].contains("serving"));
        let lonely = vec![shared("a", 0, &[("x", 250, true)]), shared("b", 0, &[])];
        let plan = super::plan(&lonely, 0.3);
        assert!(
            plan.moves.is_empty(),
            "only an empty GPU has room: {plan:?}"
        );
        assert!(plan.kept[0].contains("no room"));
    }

    #[test]
    fn slices_take_one_workload_each_if_it_fits() {
        let sliced = |gpu: u32, held: &[&str]| GpuState {
            node: "n".into(),
            gpu,
            capacity: Capacity::Slices {
                size: 20,
                total: 4,
                free: 4 - held.len() as u32,
            },
            workloads: held
                .iter()
                .map(|id| Workload {
                    id: (*id).into(),
                    size: 18,
                    movable: true,
                })
                .collect(),
        };
        let gpus = vec![
            sliced(0, &["a"]),
            sliced(1, &["b", "c", "d"]),
            sliced(2, &["e"]),
        ];
        let plan = plan(&gpus, 0.3);
        // GPU 1 has one free slice: GPU 0's workload goes there; GPU 2's has nowhere to go.
        assert_eq!(plan.freed, vec![("n".into(), 0)]);
        assert_eq!(plan.moves[0].to, ("n".to_string(), 1));
    }
}
