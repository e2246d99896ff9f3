//! Compaction on the Alibaba trace: the default trace's pods are placed (our placement policy,
//! the FGD paper's replay order) until they ask for `load` % of the cluster's GPUs; then the
//! compaction planner ([`gpuslice_planning::compaction`]) runs over the whole cluster as one pool
//! with a 30 % threshold, after a share of the pods ended (churn leaves the holes compaction
//! exists for; the trace itself has no departures). Pods that share a GPU may move when checkpointable (a seeded share of
//! them); pods with whole GPUs never move. The figure: GPUs freed against workloads moved, as
//! the plan goes.

use std::collections::BTreeMap;
use std::path::Path;

use gpuslice_planning::compaction::{
    Capacity, GpuState, Move, Plan as CompactionPlan, Workload, node_fragmentation, plan,
};
use gpuslice_planning::placement::policies::Mix;
use gpuslice_planning::placement::{Cluster, Gpu, GpuAsk, Policy as _, WHOLE};
use rand::rngs::StdRng;
use rand::seq::SliceRandom as _;
use rand::{Rng as _, SeedableRng as _};

use crate::placement::BenchError;

/// The threshold of the example pools (`compaction.fragmentationThreshold`).
pub const THRESHOLD: f64 = 0.3;

/// What to replay.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// Arrived GPU demand at which to stop placing, in percent of the cluster's GPUs.
    pub load: f64,
    /// Share of GPU-sharing pods that may move (checkpointable and preemptible).
    pub movable: f64,
    /// Share of placed pods that then end (the trace has no departures; churn is what leaves
    /// holes to compact).
    pub depart: f64,
    pub seed: u64,
}

/// The GPUs after the moves are carried out.
fn replay(gpus: &[GpuState], moves: &[Move]) -> Vec<GpuState> {
    let mut after = gpus.to_vec();
    for m in moves {
        let from = after
            .iter()
            .position(|g| (g.node.clone(), g.gpu) == m.from)
            .unwrap_or(0);
        let Some(k) = after[from]
            .workloads
            .iter()
            .position(|w| w.id == m.workload)
        else {
            continue;
        };
        let w = after[from].workloads.remove(k);
        let to = after
            .iter()
            .position(|g| (g.node.clone(), g.gpu) == m.to)
            .unwrap_or(0);
        after[to].workloads.push(w);
    }
    after
}

/// The figure: after each freed GPU, how many moves so far; and why the others were kept.
fn moves_figure(planned: &CompactionPlan) -> String {
    let mut figure = String::from("| GPUs freed | workloads moved |\n|---:|---:|\n");
    let mut moved = 0;
    let step = (planned.freed.len() / 10).max(1);
    for (k, gpu) in planned.freed.iter().enumerate() {
        moved += planned.moves.iter().filter(|m| m.from == *gpu).count();
        if (k + 1) % step == 0 || k + 1 == planned.freed.len() {
            figure.push_str(&format!("| {} | {moved} |\n", k + 1));
        }
    }
    let fixed = planned
        .kept
        .iter()
        .filter(|k| k.contains("may not move"))
        .count();
    let no_room = planned.kept.len() - fixed;
    figure.push_str(&format!(
        "\nGPUs kept: {fixed} hold a pod that may not move, {no_room} found no room in use elsewhere\n"
    ));
    figure
}

/// Departures: each placed pod ends with probability `share` (all its GPUs at once).
fn depart(on: &mut BTreeMap<(usize, usize), Vec<Workload>>, share: f64, seed: u64) {
    let mut ids: Vec<String> = on.values().flatten().map(|w| w.id.clone()).collect();
    ids.sort();
    ids.dedup();
    let mut leave = StdRng::seed_from_u64(seed ^ 0xdead);
    let gone: std::collections::BTreeSet<String> = ids
        .into_iter()
        .filter(|_| leave.random_bool(share))
        .collect();
    for workloads in on.values_mut() {
        workloads.retain(|w| !gone.contains(&w.id));
    }
}

/// Runs it; returns the report and whether the plan freed GPUs and every move left its GPU
/// empty.
pub fn run(data: &Path, trace: &Path, run: Plan) -> Result<(String, bool), BenchError> {
    let nodes = crate::placement::cluster(data)?;
    let pods = crate::placement::pods(trace)?;
    let (cluster, mut on) = place_to_load(&nodes, &pods, &run);
    let total = cluster.gpu_total() as f64;
    // Sanity: the engine's view and ours agree on what is free (before departures).
    let engine_free: u64 = cluster
        .nodes
        .iter()
        .flat_map(|n| &n.gpus)
        .map(|g| match g {
            Gpu::Shared { free } => u64::from(*free),
            Gpu::Mig { .. } => 0,
        })
        .sum();
    let placed_free: u64 = nodes
        .iter()
        .enumerate()
        .flat_map(|(n, node)| (0..node.gpus.len()).map(move |g| (n, g)))
        .map(|key| {
            let used: u64 = on.get(&key).map_or(0, |w| w.iter().map(|w| w.size).sum());
            u64::from(WHOLE).saturating_sub(used)
        })
        .sum();
    depart(&mut on, run.depart, run.seed);
    let gpus = gpu_states(&nodes, &on);
    let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
    let whole_free = |gpus: &[GpuState]| gpus.iter().filter(|g| g.workloads.is_empty()).count();
    let over = |gpus: &[GpuState]| {
        names
            .iter()
            .filter(|n| node_fragmentation(gpus, n) > THRESHOLD)
            .count()
    };
    let sharing = gpus
        .iter()
        .flat_map(|g| &g.workloads)
        .filter(|w| w.size < 1000)
        .count();
    let planned = plan(&gpus, THRESHOLD);
    // The state after: replay the moves.
    let after = replay(&gpus, &planned.moves);
    let emptied = planned.freed.iter().all(|f| {
        after
            .iter()
            .any(|g| (g.node.clone(), g.gpu) == *f && g.workloads.is_empty())
    });
    let figure = moves_figure(&planned);
    let ok = !planned.freed.is_empty() && emptied && engine_free == placed_free;
    let report = format!(
        "compaction on {} (seed {}): pods placed until {:.0} % of {} GPUs were asked for, then {:.0} % of them ended; {:.0} % of GPU-sharing pods may move; threshold {:.0} %\n\n\
         | | before | after |\n|---|---:|---:|\n\
         | empty GPUs | {} | {} |\n\
         | nodes over the threshold | {} | {} |\n\
         | GPU-sharing pods | {sharing} | moved: {} |\n\n{figure}\n{}\n",
        trace
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default(),
        run.seed,
        run.load,
        total / 1000.0,
        run.depart * 100.0,
        run.movable * 100.0,
        THRESHOLD * 100.0,
        whole_free(&gpus),
        whole_free(&after),
        over(&gpus),
        over(&after),
        planned.moves.len(),
        if ok {
            "PASS: GPUs freed, each left empty"
        } else {
            "FAIL"
        }
    );
    Ok((report, ok))
}

/// The pods of the trace placed (in a shuffled order, then drawn again) until they have asked
/// for `run.load` % of the cluster's GPUs: the cluster after, and (node, GPU) → the pods on it.
fn place_to_load(
    nodes: &[gpuslice_planning::placement::Node],
    pods: &[gpuslice_planning::placement::Request],
    run: &Plan,
) -> (Cluster, BTreeMap<(usize, usize), Vec<Workload>>) {
    let mut cluster = Cluster::new(nodes.to_vec());
    let total = cluster.gpu_total() as f64;
    let mut rng = StdRng::seed_from_u64(run.seed);
    let mut order: Vec<usize> = (0..pods.len()).collect();
    order.shuffle(&mut rng);
    let mut policy = Mix::default();
    // (node, gpu) → the pods on it: (id, thousandths, movable).
    let mut on: BTreeMap<(usize, usize), Vec<Workload>> = BTreeMap::new();
    let mut arrived = 0.0;
    let mut next = 0;
    let mut pick = StdRng::seed_from_u64(run.seed ^ 0x5eed);
    while arrived / total * 100.0 < run.load {
        let i = if next < order.len() {
            order[next]
        } else {
            rng.random_range(0..pods.len())
        };
        next += 1;
        let pod = &pods[i];
        arrived += pod.gpu_milli() as f64;
        policy.observe(pod);
        let Ok(choice) = cluster.place(pod, &mut policy) else {
            continue;
        };
        let movable = matches!(pod.gpu, GpuAsk::Share(_)) && pick.random_bool(run.movable);
        for (g, milli) in choice.gpus {
            on.entry((choice.node, g)).or_default().push(Workload {
                id: format!("pod-{next}"),
                size: u64::from(milli),
                movable,
            });
        }
    }
    (cluster, on)
}

/// Each GPU's state for the planner: its pods (`on`) and what they leave free.
fn gpu_states(
    nodes: &[gpuslice_planning::placement::Node],
    on: &BTreeMap<(usize, usize), Vec<Workload>>,
) -> Vec<GpuState> {
    nodes
        .iter()
        .enumerate()
        .flat_map(|(n, node)| {
            (0..node.gpus.len()).map(move |g| {
                let workloads = on.get(&(n, g)).cloned().unwrap_or_default();
                let used: u64 = workloads.iter().map(|w| w.size).sum();
                GpuState {
                    node: node.name.clone(),
                    gpu: g as u32,
                    capacity: Capacity::Shared {
                        free: u64::from(WHOLE).saturating_sub(used),
                        total: u64::from(WHOLE),
                    },
                    workloads,
                }
            })
        })
        .collect()
}
