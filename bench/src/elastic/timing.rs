//! What the decision and the operator's elastic step cost on a 1,000-node pool.

use std::collections::BTreeMap;
use std::time::Instant;

use chrono::{DateTime, Utc};
use gpuslice_planning::elastic::{Demand, GpuNow, Input, ModelSlots, Rules, Shape, decide};
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};

use super::workload::{CLASSES, GI, HEADROOM, MODELS};

/// The decision's time on a 1,000-node pool (8 GPUs each, the three models, busy and idle
/// GPUs in every shape, demand waiting in every class), seconds: the slowest of five.
pub fn decision_time(layouts: &[ModelSlots], shapes: &[Shape]) -> f64 {
    let mut rng = StdRng::seed_from_u64(7);
    let gpus: Vec<GpuNow> = (0..8000)
        .map(|i| GpuNow {
            model: (i / 8) % MODELS.len(),
            shape: Some(rng.random_range(0..shapes.len())),
            busy: if rng.random::<f64>() < 0.6 { 1 } else { 0 },
            drainable: rng.random::<f64>() < 0.5,
            since_recut: Some(rng.random_range(0.0..7200.0)),
            recutting: rng.random::<f64>() < 0.01,
            loss: Some(rng.random_range(0.0..1800.0)),
            past_max_loss: false,
        })
        .collect();
    let demand: Vec<Demand> = CLASSES
        .iter()
        .map(|c| Demand {
            policy: c.policy.to_string(),
            memory: c.memory_gib * GI + HEADROOM,
            compute: c.compute,
            weight: c.weight,
            running: 3000,
            waiting: 1500,
            forecast: 5000.0,
        })
        .collect();
    let rules = Rules {
        min_dwell: 1800.0,
        max_in_flight: 800,
        drain: true,
        min_gain: 1.0,
    };
    (0..5)
        .map(|_| {
            let started = Instant::now();
            let d = decide(&Input {
                shapes,
                models: layouts,
                gpus: &gpus,
                demand: &demand,
                rules: &rules,
            });
            std::hint::black_box(d);
            started.elapsed().as_secs_f64()
        })
        .fold(0.0, f64::max)
}

/// The operator's whole elastic step on a 1,000-node pool (8 GPUs each, cut in quarters; 60 %
/// of them holding a notebook; notebooks and training waiting): reading every GPU, the demand
/// and the forecast, the decision, and re-planning each GPU for its shape — seconds, the
/// slowest of five.
pub fn shaping_time() -> f64 {
    use gpuslice_api::{GpuPool, GpuSlicePolicy, NodeInventory};
    use gpuslice_planning::shaping::{Allocated, NodeNow, Seen};
    let pool: GpuPool = serde_yaml::from_str(
        "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata: {name: big}\nspec:\n  nodeSelector: {matchLabels: {pool: big}}\n  layout: {software: {slices: 4, memory: 20Gi, compute: 25}}\n  elastic:\n    shapes:\n    - {name: quarters, layout: {software: {slices: 4, memory: 20Gi, compute: 25}}}\n    - {name: halves, layout: {software: {slices: 2, memory: 40Gi, compute: 50}}}\n    - {name: whole, layout: {exclusive: {}}}\n",
    )
    .expect("the benchmark's pool");
    let policy = |name: &str, memory: &str| -> GpuSlicePolicy {
        serde_yaml::from_str(&format!(
            "apiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {{name: {name}}}\nspec: {{pool: big, memory: {memory}}}\n"
        ))
        .expect("the benchmark's policy")
    };
    let policies = vec![policy("notebook", "10Gi"), policy("training", "70Gi")];
    let quarters: String = (0..4)
        .map(|s| format!("{{id: gpu{{i}}-s{s}, memory: 20Gi, compute: 25}}"))
        .collect::<Vec<_>>()
        .join(", ");
    let mut rng = StdRng::seed_from_u64(11);
    let mut allocated = Vec::new();
    let nodes: Vec<NodeInventory> = (0..1000)
        .map(|n| {
            let gpus: String = (0..8)
                .map(|i| {
                    format!(
                        "- {{index: {i}, model: {}, slices: [{}]}}\n",
                        MODELS[n % MODELS.len()],
                        quarters.replace("{i}", &i.to_string())
                    )
                })
                .collect();
            let name = format!("node-{n}");
            for i in 0..8 {
                if rng.random::<f64>() < 0.6 {
                    allocated.push(Allocated {
                        pool: Some("big".into()),
                        policy: Some("notebook".into()),
                        node: name.clone(),
                        gpu: Some(i),
                        last_checkpoint: None,
                        idle_since: None,
                        max_loss: None,
                    });
                }
            }
            serde_yaml::from_str(&format!(
                "name: {name}\nlabels: {{pool: big}}\ngpus:\n{gpus}"
            ))
            .expect("the benchmark's node")
        })
        .collect();
    let at: DateTime<Utc> = "2026-12-07T10:00:00Z".parse().expect("an instant");
    let pools = vec![pool];
    let plan = gpuslice_planning::cluster::plan_cluster(&pools, &nodes, at);
    let now: Vec<NodeNow> = nodes
        .iter()
        .map(|n| NodeNow {
            inventory: n,
            assigned: &[],
        })
        .collect();
    let waiting = BTreeMap::from([
        ("notebook".to_string(), 1500),
        ("training".to_string(), 1500),
    ]);
    let seen = Seen {
        pools: &pools,
        policies: &policies,
        nodes: &now,
        allocated: &allocated,
        waiting: &waiting,
        prometheus: &BTreeMap::new(),
    };
    (0..5)
        .map(|_| {
            let mut plan = plan.clone();
            let started = Instant::now();
            let shaped = gpuslice_planning::shaping::shape(&seen, &mut plan, at);
            std::hint::black_box(shaped);
            started.elapsed().as_secs_f64()
        })
        .fold(0.0, f64::max)
}
