//! The replay's workload and pool: the three policies, their diurnal profiles, the pods drawn
//! from the trace's sizes and run times, and the constants of the model.

use std::path::Path;

use rand::rngs::StdRng;
use rand::seq::IndexedRandom as _;
use rand::{Rng as _, SeedableRng as _};

use crate::placement::BenchError;

pub(super) const GI: u64 = 1 << 30;
pub(super) const HOUR: f64 = 3600.0;
pub(super) const DAY: f64 = 24.0 * HOUR;
pub(super) const WEEK: f64 = 7.0 * DAY;
/// How long a re-cut takes (the agent's pass, the new devices published), seconds.
pub(super) const RECUT_SECONDS: f64 = 30.0;
/// How often the operator's queue pass (and the elastic decision) runs, seconds.
pub(super) const TICK: f64 = 60.0;
/// Training checkpoints this often; a drain loses the work since the last one.
pub(super) const CHECKPOINT_SECONDS: f64 = 1800.0;
/// Memory kept back in each slice (`memoryHeadroom`).
pub(super) const HEADROOM: u64 = GI;
/// Monday 2026-11-30 00:00 UTC: the replay's time 0.
pub(super) const START: i64 = 1_795_996_800;

/// The GPU models of the pool.
pub(super) const MODELS: [&str; 3] = [
    "NVIDIA A100-SXM4-80GB",
    "NVIDIA H100 80GB HBM3",
    "NVIDIA H200",
];

/// What to replay.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub seed: u64,
    /// GPUs of each model (the pool has three models).
    pub gpus_per_model: u32,
    /// Scales every class's arrival rate (1.0: each class's busiest hour asks for its peak
    /// share of the pool).
    pub load: f64,
    /// How much the mix swings over the day (0: every class arrives at its weekly mean rate all
    /// week, nothing to adapt to; 1: the diurnal profile in full). The mean load is the same.
    pub swing: f64,
}

/// A kind of workload and the policy it asks through.
pub(super) struct Class {
    pub(super) policy: &'static str,
    pub(super) memory_gib: u64,
    pub(super) compute: u32,
    pub(super) weight: f64,
    /// Work that checkpoints and may be drained.
    pub(super) checkpoints: bool,
    /// At its busiest hour, the GPUs' worth it asks for, as a share of the pool.
    pub(super) peak_load: f64,
}

pub(super) const CLASSES: [Class; 3] = [
    Class {
        policy: "notebook",
        memory_gib: 18,
        compute: 25,
        weight: 1.0,
        checkpoints: false,
        peak_load: 0.45,
    },
    Class {
        policy: "inference",
        memory_gib: 30,
        compute: 50,
        weight: 2.0,
        checkpoints: false,
        peak_load: 0.30,
    },
    Class {
        policy: "training",
        memory_gib: 70,
        compute: 100,
        weight: 2.0,
        checkpoints: true,
        peak_load: 0.85,
    },
];

/// A GPU's worth each pod of a class takes in the shape made for it.
pub(super) const GPU_SHARE: [f64; 3] = [0.25, 0.5, 1.0];

/// How busy a class is at `t` (0–1): notebooks on weekdays 08–20, inference 07–22 and a little
/// at night, training at night and at weekends.
pub(super) fn profile(class: usize, t: f64) -> f64 {
    let hour = (t % DAY) / HOUR;
    let weekday = (t % WEEK) / DAY < 5.0;
    match class {
        0 if weekday && (8.0..20.0).contains(&hour) => 1.0,
        0 => 0.1,
        1 if (7.0..22.0).contains(&hour) => {
            if weekday {
                1.0
            } else {
                0.5
            }
        }
        1 => 0.3,
        _ if !weekday => 0.8,
        _ if (8.0..20.0).contains(&hour) => 0.15,
        _ => 1.0,
    }
}

/// Queues of waiting pods: one per class, and one for training over several GPUs.
pub(super) const QUEUES: usize = 4;

/// A queue's weight (its class's), as an integer to order by.
pub(super) fn weight_key(queue: usize) -> u64 {
    (CLASSES[queue.min(CLASSES.len() - 1)].weight * 1000.0) as u64
}

/// A pod of the replay.
#[derive(Clone, Debug)]
pub(super) struct Pod {
    pub(super) class: usize,
    /// Whole GPUs it needs (training over several GPUs), or 1 slice.
    pub(super) gpus: u32,
    pub(super) arrival: f64,
    /// Work left, seconds.
    pub(super) work: f64,
    pub(super) started: Option<f64>,
    /// When it last started running (after a drain it starts again).
    pub(super) running_since: Option<f64>,
    /// Bumped at each start, so that a departure scheduled before a drain is ignored.
    pub(super) run: u32,
    /// Where it runs: (GPU, slot).
    pub(super) on: Vec<(usize, usize)>,
}

/// The trace's run times per class, and the GPU counts of training pods.
pub(super) struct Sizes {
    pub(super) runs: [Vec<(f64, u32)>; 3],
}

#[derive(serde::Deserialize)]
pub(super) struct PodRow {
    pub(super) num_gpu: u32,
    pub(super) gpu_milli: u32,
    pub(super) creation_time: f64,
    pub(super) deletion_time: f64,
}

pub(super) fn sizes(trace: &Path) -> Result<Sizes, BenchError> {
    let err = |source| BenchError::Csv {
        path: trace.display().to_string(),
        source,
    };
    let mut runs: [Vec<(f64, u32)>; 3] = Default::default();
    for row in csv::Reader::from_path(trace).map_err(err)?.deserialize() {
        let row: PodRow = row.map_err(err)?;
        let class = match (row.num_gpu, row.gpu_milli) {
            (0, _) => continue,
            (1, m) if m <= 250 => 0,
            (1, m) if m <= 500 => 1,
            _ => 2,
        };
        let run = (row.deletion_time - row.creation_time).clamp(120.0, 12.0 * HOUR);
        runs[class].push((run, row.num_gpu.clamp(1, 8)));
    }
    if runs.iter().any(Vec::is_empty) {
        return Err(BenchError::Thin(trace.display().to_string()));
    }
    Ok(Sizes { runs })
}

/// Two weeks of arrivals: per class a Poisson process whose rate follows [`profile`], scaled
/// so that the busiest hour asks for `peak_load × load` of the pool, each arrival taking a
/// run time (and GPU count) drawn from the trace.
pub(super) fn arrivals(sizes: &Sizes, pool_gpus: u32, plan: &Plan) -> Vec<Pod> {
    let mut rng = StdRng::seed_from_u64(plan.seed);
    let mut pods = Vec::new();
    for (class, c) in CLASSES.iter().enumerate() {
        let runs = &sizes.runs[class];
        let mean_gpu_seconds = runs
            .iter()
            .map(|(r, n)| r * f64::from(*n) * GPU_SHARE[class])
            .sum::<f64>()
            / runs.len() as f64;
        let peak_rate = c.peak_load * plan.load * f64::from(pool_gpus) / mean_gpu_seconds;
        let hours = (0..168).map(|h| profile(class, f64::from(h) * HOUR + 1.0));
        let mean_level = hours.sum::<f64>() / 168.0;
        let swing = plan.swing.clamp(0.0, 1.0);
        let level = |t: f64| (1.0 - swing) * mean_level + swing * profile(class, t);
        // Thinning: candidates at the peak rate, each kept with the hour's profile.
        let mut t = 0.0;
        loop {
            t += -rng.random::<f64>().max(1e-12).ln() / peak_rate;
            if t >= 2.0 * WEEK {
                break;
            }
            if rng.random::<f64>() < level(t) {
                let &(work, gpus) = runs.choose(&mut rng).expect("checked non-empty");
                pods.push(Pod {
                    class,
                    gpus: if class == 2 { gpus } else { 1 },
                    arrival: t,
                    work,
                    started: None,
                    running_since: None,
                    run: 0,
                    on: Vec::new(),
                });
            }
        }
    }
    pods.sort_by(|a, b| a.arrival.total_cmp(&b.arrival));
    pods
}
