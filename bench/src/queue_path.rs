//! `gpuslice bench placement --queue`: the queue's path replayed offline on the trace's nodes.
//! The trace's GPU pods arrive in creation order at the gates of two pools cut as `queue-scale`
//! cuts its nodes — on each node a quarter of the GPUs (rounded up, the last ones) in four
//! slices (pool `shared`, 20 GiB each), the others whole (pool `whole`) — and each is admitted
//! by the queue's own code (`gpuslice_planning::queue::admit`: the same candidates, rooms and
//! scoring the operator uses) or stays out. A pod asking for a share of a GPU takes a slice
//! (policy `quarter`), any other its GPUs whole (policy `whole`, `count` = its GPUs, on one
//! node). Nodes bring the trace's CPU and memory; each pod its requests. Printed: the GPU share
//! left unallocated once all have arrived, under our policy and under BestFit.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use chrono::{DateTime, Utc};
use gpuslice_planning::placement::policies::{self, BestFit};
use gpuslice_planning::placement::{Node, Policy, WHOLE};
use gpuslice_planning::queue::replay::{Arrival, Pool, Replayed, replay};
use gpuslice_planning::queue::{EnginePlacer, FreeDevice, Need, Room, Waiting};

use crate::placement::BenchError;

const GIB: u64 = 1 << 30;
/// Slices of each shared GPU.
const SLICES: u32 = 4;
/// Arrived GPU demand, in percent of the GPUs, at which the unallocated share is read.
pub const MARKS: [f64; 2] = [100.0, 130.0];

#[derive(serde::Deserialize)]
struct PodRow {
    name: String,
    cpu_milli: u64,
    memory_mib: u64,
    num_gpu: u32,
    gpu_milli: u32,
    creation_time: u64,
}

/// The pools of `nodes` as `queue-scale` cuts them, and the nodes' rooms.
pub fn cluster_of(nodes: &[Node]) -> (BTreeMap<String, Pool>, BTreeMap<String, Room>) {
    let mut shared = Pool {
        devices: Vec::new(),
        needs: BTreeMap::from([(
            "quarter".to_string(),
            Need {
                memory_bytes: 16 * GIB,
                compute: 0,
            },
        )]),
    };
    let mut whole = Pool {
        devices: Vec::new(),
        needs: BTreeMap::from([(
            "whole".to_string(),
            Need {
                memory_bytes: 70 * GIB,
                compute: 0,
            },
        )]),
    };
    let mut rooms = BTreeMap::new();
    for node in nodes {
        rooms.insert(
            node.name.clone(),
            Room::empty(node.cpu_total, node.memory_total),
        );
        let gpus = node.gpus.len() as u32;
        let first_shared = gpus - gpus.div_ceil(4);
        let device =
            |gpu: u32, device: String, memory_bytes: u64, compute: u32, share: u32| FreeDevice {
                node: node.name.clone(),
                gpu,
                device,
                memory_bytes,
                compute,
                share,
                recut_at: None,
                nvlink_domain: None,
            };
        for gpu in 0..gpus {
            if gpu < first_shared {
                whole
                    .devices
                    .push(device(gpu, format!("gpu{gpu}"), 80 * GIB, 100, WHOLE));
            } else {
                for s in 0..SLICES {
                    shared.devices.push(device(
                        gpu,
                        format!("gpu{gpu}-s{s}"),
                        20 * GIB,
                        100 / SLICES,
                        WHOLE / SLICES,
                    ));
                }
            }
        }
    }
    let pools = BTreeMap::from([("shared".to_string(), shared), ("whole".to_string(), whole)]);
    (pools, rooms)
}

/// The GPU pods of a trace file in creation order, each at its pool's gate.
pub fn arrivals(path: &Path) -> Result<Vec<Arrival>, BenchError> {
    let err = |source| BenchError::Csv {
        path: path.display().to_string(),
        source,
    };
    let mut rows: Vec<PodRow> = csv::Reader::from_path(path)
        .map_err(err)?
        .deserialize()
        .collect::<Result<_, _>>()
        .map_err(err)?;
    rows.retain(|r| r.num_gpu > 0);
    rows.sort_by_key(|r| r.creation_time);
    let created = DateTime::<Utc>::UNIX_EPOCH;
    Ok(rows
        .into_iter()
        .map(|r| {
            let share = r.num_gpu == 1 && r.gpu_milli < WHOLE;
            let (pool, policy, count) = if share {
                ("shared", "quarter", 1)
            } else {
                ("whole", "whole", r.num_gpu)
            };
            Arrival {
                demand: u64::from(count) * u64::from(if share { WHOLE / SLICES } else { WHOLE }),
                pool: pool.to_string(),
                pod: Waiting {
                    namespace: "trace".to_string(),
                    name: r.name,
                    policy: policy.to_string(),
                    priority: 0,
                    created,
                    runs_until: None,
                    count,
                    nvlink: false,
                    cpu_milli: r.cpu_milli,
                    memory_mib: r.memory_mib,
                },
            }
        })
        .collect())
}

/// One policy's replay of the queue's path.
pub struct PathResult {
    pub policy: String,
    pub replayed: Replayed,
}

/// Replays `arrivals` on `nodes` through the queue under our policy and under BestFit.
pub fn run(nodes: &[Node], arrivals: &[Arrival]) -> Vec<PathResult> {
    let (pools, rooms) = cluster_of(nodes);
    let policies: Vec<Box<dyn Policy + Send>> =
        vec![Box::new(BestFit), Box::new(policies::Mix::default())];
    policies
        .into_iter()
        .map(|policy| {
            let mut placer = EnginePlacer::new(policy);
            let replayed = replay(&pools, rooms.clone(), arrivals, &mut placer, &MARKS);
            PathResult {
                policy: placer.policy_name().to_string(),
                replayed,
            }
        })
        .collect()
}

/// The table: per trace, each policy's unallocated GPU share at 100% and 130% arrived demand;
/// PASS where ours leaves less unallocated than BestFit at both.
pub fn render(results: &[(String, Vec<PathResult>)]) -> (String, bool) {
    let mut out = String::from(
        "The queue's path, offline (trace GPU pods in creation order, again from the start until 130% of the GPUs are asked for; a quarter of each node's GPUs in 4 slices, the rest whole)\n\n\
         | trace | policy | pods arrived | placed | unallocated GPU % at 100% | at 130% | ours below BestFit |\n|---|---|---|---|---|---|---|\n",
    );
    let mut ok = true;
    for (trace, rows) in results {
        let of = |name: &str| {
            rows.iter()
                .find(|r| r.policy == name)
                .map(|r| r.replayed.unallocated.clone())
        };
        let pass = match (of("gpuslice"), of("BestFit")) {
            (Some(ours), Some(best_fit)) => {
                ours.len() == MARKS.len() && ours.iter().zip(&best_fit).all(|(o, b)| o < b)
            }
            _ => false,
        };
        ok &= pass;
        for r in rows {
            let verdict = if r.policy == "gpuslice" {
                if pass { "PASS" } else { "FAIL" }
            } else {
                ""
            };
            let at = |i: usize| {
                r.replayed
                    .unallocated
                    .get(i)
                    .map_or("-".to_string(), |u| format!("{u:.2}"))
            };
            let _ = writeln!(
                out,
                "| {trace} | {} | {} | {} | {} | {} | {verdict} |",
                r.policy,
                r.replayed.arrived,
                r.replayed.placed,
                at(0),
                at(1)
            );
        }
    }
    (out, ok)
}
