//! `gpuslice bench elastic`: two weeks of arrivals and departures replayed event by event on a
//! pool of A100, H100 and H200 GPUs, under four ways of shaping it: the best static layout
//! (chosen in hindsight among every split of the GPUs between the shapes), day and night
//! windows, and the elastic decision ([`gpuslice_planning::elastic::decide`], the operator's)
//! without and with its forecast. The first week warms the forecast up; the table measures the
//! second.
//!
//! The workload: the Alibaba trace's pods give the sizes (`gpu_milli`, `num_gpu`) and run times
//! (`deletion_time - creation_time`, between 2 minutes and 12 hours); the trace's own arrival
//! times are spread over 149 days, so arrivals are drawn anew with a diurnal mix: notebooks
//! (a share of at most a quarter GPU) and inference (at most half) by day, training (more than
//! half a GPU, or several whole GPUs) at night and at weekends.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use chrono::{DateTime, Utc};
use gpuslice_api::layout::Layout;
use gpuslice_planning::catalog;
use gpuslice_planning::elastic::{
    Decision, Demand, Forecast, GpuNow, Input, ModelSlots, Rules, Shape, Slot, decide, slots,
};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom as _;
use rand::{Rng as _, SeedableRng as _};

use crate::placement::BenchError;

const GI: u64 = 1 << 30;
const HOUR: f64 = 3600.0;
const DAY: f64 = 24.0 * HOUR;
const WEEK: f64 = 7.0 * DAY;
/// How long a re-cut takes (the agent's pass, the new devices published), seconds.
const RECUT_SECONDS: f64 = 30.0;
/// How often the operator's queue pass (and the elastic decision) runs, seconds.
const TICK: f64 = 60.0;
/// Training checkpoints this often; a drain loses the work since the last one.
const CHECKPOINT_SECONDS: f64 = 1800.0;
/// Memory kept back in each slice (`memoryHeadroom`).
const HEADROOM: u64 = GI;
/// Monday 2026-11-30 00:00 UTC: the replay's time 0.
const START: i64 = 1_795_996_800;

/// The GPU models of the pool.
const MODELS: [&str; 3] = [
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
struct Class {
    policy: &'static str,
    memory_gib: u64,
    compute: u32,
    weight: f64,
    /// Work that checkpoints and may be drained.
    checkpoints: bool,
    /// At its busiest hour, the GPUs' worth it asks for, as a share of the pool.
    peak_load: f64,
}

const CLASSES: [Class; 3] = [
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
const GPU_SHARE: [f64; 3] = [0.25, 0.5, 1.0];

/// How busy a class is at `t` (0–1): notebooks on weekdays 08–20, inference 07–22 and a little
/// at night, training at night and at weekends.
fn profile(class: usize, t: f64) -> f64 {
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
const QUEUES: usize = 4;

/// A queue's weight (its class's), as an integer to order by.
fn weight_key(queue: usize) -> u64 {
    (CLASSES[queue.min(CLASSES.len() - 1)].weight * 1000.0) as u64
}

/// A pod of the replay.
#[derive(Clone, Debug)]
struct Pod {
    class: usize,
    /// Whole GPUs it needs (training over several GPUs), or 1 slice.
    gpus: u32,
    arrival: f64,
    /// Work left, seconds.
    work: f64,
    started: Option<f64>,
    /// When it last started running (after a drain it starts again).
    running_since: Option<f64>,
    /// Bumped at each start, so that a departure scheduled before a drain is ignored.
    run: u32,
    /// Where it runs: (GPU, slot).
    on: Vec<(usize, usize)>,
}

/// The trace's run times per class, and the GPU counts of training pods.
struct Sizes {
    runs: [Vec<(f64, u32)>; 3],
}

#[derive(serde::Deserialize)]
struct PodRow {
    num_gpu: u32,
    gpu_milli: u32,
    creation_time: f64,
    deletion_time: f64,
}

fn sizes(trace: &Path) -> Result<Sizes, BenchError> {
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
fn arrivals(sizes: &Sizes, pool_gpus: u32, plan: &Plan) -> Vec<Pod> {
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

/// The elastic set: four 20 GiB slices, two 40 GiB slices, or the whole GPU.
fn shapes() -> (Vec<Shape>, Vec<Layout>) {
    let layouts = vec![
        Layout::software(4, "20Gi", 25),
        Layout::software(2, "40Gi", 50),
        Layout {
            exclusive: Some(Default::default()),
            ..Layout::default()
        },
    ];
    let shapes = ["4x20Gi", "2x40Gi", "whole"]
        .iter()
        .map(|name| Shape {
            name: name.to_string(),
            min_gpus: 0,
            max_gpus: None,
        })
        .collect();
    (shapes, layouts)
}

/// Per model, per shape, its slots.
fn model_slots(layouts: &[Layout]) -> Vec<ModelSlots> {
    MODELS
        .iter()
        .map(|name| {
            let model = catalog::model(name).ok();
            let memory = model.map_or(80 * GI, |m| m.memory_bytes());
            layouts
                .iter()
                .map(|l| slots(l, model, name, memory))
                .collect()
        })
        .collect()
}

/// How the pool is shaped over the replay.
enum Shaper {
    /// One shape per GPU, never changed.
    Static(Vec<usize>),
    /// One shape per GPU by day (08:00–20:00), another by night: a GPU due to change takes no
    /// new pod and is re-cut once idle (what the operator's windows do).
    Windows { day: Vec<usize>, night: Vec<usize> },
    /// The elastic decision each tick, with or without the forecast.
    Elastic {
        forecast: Option<Forecast>,
        rules: Rules,
    },
}

struct Gpu {
    model: usize,
    shape: usize,
    slots: Vec<Option<usize>>,
    recut_until: Option<f64>,
    last_recut: Option<f64>,
    /// The windows' next shape, once idle.
    next: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A re-cut is done.
    Recut(usize),
    /// A pod (at its run) ends.
    Depart(usize, u32),
    Arrive(usize),
    Tick,
}

/// What a replay measured over the second week.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub name: String,
    pub mean_wait: f64,
    pub p95_wait: f64,
    /// Slice-hours held over GPU-hours in the pool.
    pub allocated: f64,
    pub recuts_per_gpu_day: f64,
    /// GPU-hours of work drains threw away.
    pub lost_gpu_hours: f64,
    /// The slowest decision, seconds.
    pub slowest_decision: f64,
}

struct Replay<'a> {
    pods: Vec<Pod>,
    gpus: Vec<Gpu>,
    layouts: &'a [ModelSlots],
    shapes: &'a [Shape],
    /// Waiting pods by queue: (arrival ms, pod).
    queues: [BTreeSet<(u64, usize)>; QUEUES],
    /// GPUs' worth (slices, or GPUs of multi-GPU pods) running and waiting per class.
    running: [u32; 3],
    waiting: [u32; 3],
    events: BinaryHeap<Reverse<(u64, Event)>>,
    now: f64,
    recuts: u32,
    lost: f64,
    slice_seconds: f64,
    slowest: f64,
}

fn millis(t: f64) -> u64 {
    (t * 1000.0) as u64
}

fn measured(t: f64) -> bool {
    (WEEK..2.0 * WEEK).contains(&t)
}

impl Replay<'_> {
    fn slots(&self, gpu: usize) -> &[Slot] {
        let g = &self.gpus[gpu];
        self.layouts[g.model][g.shape]
            .as_deref()
            .unwrap_or_default()
    }

    fn open(&self, gpu: usize) -> bool {
        let g = &self.gpus[gpu];
        g.recut_until.is_none() && g.next.is_none()
    }

    fn busy(&self, gpu: usize) -> u32 {
        self.gpus[gpu].slots.iter().filter(|s| s.is_some()).count() as u32
    }

    fn fits(class: usize, slot: &Slot) -> bool {
        let c = &CLASSES[class];
        slot.memory >= c.memory_gib * GI + HEADROOM && slot.compute >= c.compute
    }

    /// Where a pod would run: the smallest fitting free slot, on the busiest GPU among equals;
    /// for several GPUs, that many idle GPUs whose one slot fits.
    fn find(&self, pod: &Pod) -> Option<Vec<(usize, usize)>> {
        if pod.gpus > 1 {
            let idle: Vec<(usize, usize)> = (0..self.gpus.len())
                .filter(|&g| self.open(g) && self.busy(g) == 0)
                .filter(|&g| self.slots(g).len() == 1 && Self::fits(pod.class, &self.slots(g)[0]))
                .map(|g| (g, 0))
                .take(pod.gpus as usize)
                .collect();
            return (idle.len() == pod.gpus as usize).then_some(idle);
        }
        (0..self.gpus.len())
            .filter(|&g| self.open(g))
            .flat_map(|g| {
                let busy = self.busy(g);
                self.slots(g)
                    .iter()
                    .enumerate()
                    .filter(move |(k, s)| {
                        self.gpus[g].slots[*k].is_none() && Self::fits(pod.class, s)
                    })
                    .map(move |(k, s)| ((s.memory, s.compute, Reverse(busy)), (g, k)))
            })
            .min()
            .map(|(_, at)| vec![at])
    }

    /// Starts waiting pods, highest weight first, then oldest. Pods wait in four queues (one
    /// per class, and multi-GPU training); a queue whose head finds no room waits for the next
    /// event.
    fn schedule(&mut self) {
        let mut blocked = [false; QUEUES];
        loop {
            let head = (0..QUEUES)
                .filter(|&q| !blocked[q])
                .filter_map(|q| self.queues[q].first().map(|k| (q, *k)))
                .min_by_key(|&(q, (arrival, id))| (Reverse(weight_key(q)), arrival, id));
            let Some((q, key)) = head else { break };
            match self.find(&self.pods[key.1]) {
                Some(on) => {
                    self.queues[q].remove(&key);
                    self.start(key.1, on);
                }
                None => blocked[q] = true,
            }
        }
    }

    fn enqueue(&mut self, id: usize) {
        let pod = &self.pods[id];
        let queue = if pod.gpus > 1 { QUEUES - 1 } else { pod.class };
        self.queues[queue].insert((millis(pod.arrival), id));
        self.waiting[pod.class] += pod.gpus;
    }

    fn start(&mut self, id: usize, on: Vec<(usize, usize)>) {
        for &(g, k) in &on {
            self.gpus[g].slots[k] = Some(id);
        }
        let now = self.now;
        let pod = &mut self.pods[id];
        self.waiting[pod.class] -= pod.gpus;
        self.running[pod.class] += pod.gpus;
        pod.started.get_or_insert(now);
        pod.running_since = Some(now);
        pod.run += 1;
        pod.on = on;
        let end = millis(now + pod.work);
        self.events.push(Reverse((end, Event::Depart(id, pod.run))));
    }

    fn release(&mut self, id: usize) {
        for (g, k) in std::mem::take(&mut self.pods[id].on) {
            self.gpus[g].slots[k] = None;
        }
        let pod = &mut self.pods[id];
        pod.running_since = None;
        self.running[pod.class] -= pod.gpus;
    }

    /// Drains a GPU's pods (each loses its work since its last checkpoint) and re-queues them.
    fn drain(&mut self, gpu: usize) {
        let ids: Vec<usize> = self.gpus[gpu].slots.iter().flatten().copied().collect();
        for id in ids {
            let since = self.pods[id].running_since.unwrap_or(self.now);
            let ran = self.now - since;
            let lost = ran % CHECKPOINT_SECONDS;
            let pod = &mut self.pods[id];
            pod.work = pod.work - ran + lost;
            if measured(self.now) {
                self.lost += lost * f64::from(pod.gpus) / HOUR;
            }
            self.release(id);
            self.enqueue(id);
        }
    }

    fn recut(&mut self, gpu: usize, to: usize) {
        let slots = self.layouts[self.gpus[gpu].model][to]
            .as_ref()
            .map_or(0, Vec::len);
        let g = &mut self.gpus[gpu];
        g.shape = to;
        g.slots = vec![None; slots];
        g.next = None;
        g.recut_until = Some(self.now + RECUT_SECONDS);
        g.last_recut = Some(self.now);
        if measured(self.now) {
            self.recuts += 1;
        }
        self.events.push(Reverse((
            millis(self.now + RECUT_SECONDS),
            Event::Recut(gpu),
        )));
    }

    /// Demand per class as the operator sees it: pods (GPUs for multi-GPU pods) running and
    /// waiting.
    fn demand(&self, forecast: Option<&Forecast>) -> Vec<Demand> {
        let (running, waiting) = (self.running, self.waiting);
        let at = instant(self.now);
        CLASSES
            .iter()
            .enumerate()
            .map(|(k, c)| Demand {
                policy: c.policy.to_string(),
                memory: c.memory_gib * GI + HEADROOM,
                compute: c.compute,
                weight: c.weight,
                running: running[k],
                waiting: waiting[k],
                forecast: forecast.map_or(0.0, |f| {
                    f.expected(c.policy, at, chrono::Duration::hours(1))
                }),
            })
            .collect()
    }

    fn elastic(&mut self, forecast: &mut Option<Forecast>, rules: &Rules) {
        let demand = self.demand(forecast.as_ref());
        if let Some(f) = forecast {
            let seen = demand
                .iter()
                .map(|d| (d.policy.clone(), f64::from(d.running + d.waiting)))
                .collect::<BTreeMap<_, _>>();
            f.observe(instant(self.now), &seen);
        }
        let now = self.now;
        let gpus: Vec<GpuNow> = self
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| GpuNow {
                model: g.model,
                shape: Some(g.shape),
                busy: self.busy(i),
                drainable: g
                    .slots
                    .iter()
                    .flatten()
                    .all(|&p| CLASSES[self.pods[p].class].checkpoints),
                since_recut: g.last_recut.map(|t| now - t),
                recutting: g.recut_until.is_some(),
                loss: Some(
                    g.slots
                        .iter()
                        .flatten()
                        .map(|&p| {
                            self.pods[p]
                                .running_since
                                .map_or(0.0, |s| (now - s) % CHECKPOINT_SECONDS)
                        })
                        .fold(0.0, f64::max),
                ),
            })
            .collect();
        let started = Instant::now();
        let decision: Decision = decide(&Input {
            shapes: self.shapes,
            models: self.layouts,
            gpus: &gpus,
            demand: &demand,
            rules,
        });
        self.slowest = self.slowest.max(started.elapsed().as_secs_f64());
        for r in decision.recuts {
            if r.drain {
                self.drain(r.gpu);
            }
            self.recut(r.gpu, r.to);
        }
    }

    fn windows(&mut self, day: &[usize], night: &[usize]) {
        let hour = (self.now % DAY) / HOUR;
        let want = if (8.0..20.0).contains(&hour) {
            day
        } else {
            night
        };
        for (g, &to) in want.iter().enumerate() {
            let idle = self.busy(g) == 0;
            let gpu = &mut self.gpus[g];
            gpu.next = (gpu.shape != to).then_some(to);
            if gpu.next.is_some() && gpu.recut_until.is_none() && idle {
                self.recut(g, to);
            }
        }
    }

    fn account(&mut self, until: f64) {
        let from = self.now.max(WEEK);
        let to = until.min(2.0 * WEEK);
        if to <= from {
            return;
        }
        let held: f64 = (0..self.gpus.len())
            .map(|g| f64::from(self.busy(g)) / self.gpus[g].slots.len().max(1) as f64)
            .sum();
        self.slice_seconds += held * (to - from);
    }
}

fn instant(t: f64) -> DateTime<Utc> {
    DateTime::from_timestamp(START + t as i64, 0).unwrap_or_default()
}

/// Replays `pods` on a pool of `per_model` GPUs of each model shaped by `shaper`.
fn replay(
    name: &str,
    pods: &[Pod],
    per_model: u32,
    mut shaper: Shaper,
    shapes: &[Shape],
    layouts: &[ModelSlots],
) -> Outcome {
    let models = MODELS.len();
    let initial: Vec<usize> = match &shaper {
        Shaper::Static(s) => s.clone(),
        Shaper::Windows { night, .. } => night.clone(),
        Shaper::Elastic { .. } => vec![0; models * per_model as usize],
    };
    let gpus = initial
        .iter()
        .enumerate()
        .map(|(i, &shape)| Gpu {
            model: i / per_model as usize,
            shape,
            slots: vec![
                None;
                layouts[i / per_model as usize][shape]
                    .as_ref()
                    .map_or(0, Vec::len)
            ],
            recut_until: None,
            last_recut: None,
            next: None,
        })
        .collect();
    let mut r = Replay {
        pods: pods.to_vec(),
        gpus,
        layouts,
        shapes,
        queues: Default::default(),
        running: [0; 3],
        waiting: [0; 3],
        events: BinaryHeap::new(),
        now: 0.0,
        recuts: 0,
        lost: 0.0,
        slice_seconds: 0.0,
        slowest: 0.0,
    };
    for (id, pod) in pods.iter().enumerate() {
        r.events
            .push(Reverse((millis(pod.arrival), Event::Arrive(id))));
    }
    r.events.push(Reverse((0, Event::Tick)));
    let end = 2.0 * WEEK;
    while let Some(Reverse((at, event))) = r.events.pop() {
        let t = at as f64 / 1000.0;
        if t > end {
            break;
        }
        r.account(t);
        r.now = t;
        match event {
            Event::Arrive(id) => r.enqueue(id),
            Event::Depart(id, run) => {
                if r.pods[id].run == run && r.pods[id].running_since.is_some() {
                    r.release(id);
                }
            }
            Event::Recut(g) => r.gpus[g].recut_until = None,
            Event::Tick => {
                match &mut shaper {
                    Shaper::Static(_) => {}
                    Shaper::Windows { day, night } => {
                        let (day, night) = (day.clone(), night.clone());
                        r.windows(&day, &night);
                    }
                    Shaper::Elastic { forecast, rules } => r.elastic(forecast, rules),
                }
                r.events.push(Reverse((millis(t + TICK), Event::Tick)));
            }
        }
        r.schedule();
    }
    let mut waits: Vec<f64> = r
        .pods
        .iter()
        .filter(|p| measured(p.arrival))
        .map(|p| (p.started.unwrap_or(end) - p.arrival).max(0.0))
        .collect();
    waits.sort_by(f64::total_cmp);
    let gpus = r.gpus.len() as f64;
    Outcome {
        name: name.to_string(),
        mean_wait: waits.iter().sum::<f64>() / waits.len().max(1) as f64,
        p95_wait: waits
            .get((waits.len() as f64 * 0.95) as usize)
            .copied()
            .unwrap_or_default(),
        allocated: r.slice_seconds / (gpus * WEEK),
        recuts_per_gpu_day: f64::from(r.recuts) / (gpus * 7.0),
        lost_gpu_hours: r.lost,
        slowest_decision: r.slowest,
    }
}

/// Every split of `n` GPUs between three shapes, in steps of `step`.
fn splits(n: u32, step: u32) -> Vec<[u32; 3]> {
    let mut all = Vec::new();
    for a in (0..=n).step_by(step as usize) {
        for b in (0..=n - a).step_by(step as usize) {
            all.push([a, b, n - a - b]);
        }
    }
    all
}

/// One shape per GPU: each model's GPUs split the same way.
fn per_gpu(split: [u32; 3], models: usize) -> Vec<usize> {
    (0..models)
        .flat_map(|_| {
            split
                .iter()
                .enumerate()
                .flat_map(|(s, &n)| std::iter::repeat_n(s, n as usize))
        })
        .collect()
}

/// The split a team would declare for some hours from last week's demand: GPUs in proportion
/// to each class's GPU-seconds asked in those hours.
fn split_for(pods: &[Pod], per_model: u32, hours: impl Fn(f64) -> bool) -> [u32; 3] {
    let mut asked = [0.0f64; 3];
    for p in pods.iter().filter(|p| p.arrival < WEEK && hours(p.arrival)) {
        asked[p.class] += p.work * f64::from(p.gpus) * GPU_SHARE[p.class];
    }
    let total: f64 = asked.iter().sum::<f64>().max(1.0);
    let mut split = asked.map(|a| (a / total * f64::from(per_model)).round() as u32);
    let sum: u32 = split.iter().sum();
    // Rounding may miss by one either way; the largest share absorbs it.
    let largest = (0..3)
        .max_by(|&a, &b| asked[a].total_cmp(&asked[b]))
        .unwrap_or(2);
    split[largest] = (split[largest] + per_model).saturating_sub(sum);
    split
}

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

/// The four ways of shaping the pool on the same arrivals, and the decision's time at scale.
#[derive(Clone, Debug)]
pub struct Comparison {
    pub pool_gpus: u32,
    pub pods: usize,
    pub best_static: Outcome,
    pub windows: Outcome,
    pub elastic: Outcome,
    pub elastic_forecast: Outcome,
    /// The decision's time on 1,000 nodes × 8 GPUs, seconds.
    pub decision_seconds: f64,
    /// The operator's whole elastic step on 1,000 nodes × 8 GPUs, seconds.
    pub shaping_seconds: f64,
}

/// Replays the arrivals `plan` makes from the trace in `data` under each way of shaping.
pub fn compare(data: &Path, plan: &Plan) -> Result<Comparison, BenchError> {
    let sizes = sizes(&data.join("openb_pod_list_default.csv"))?;
    let per_model = plan.gpus_per_model.max(1);
    let pool_gpus = per_model * MODELS.len() as u32;
    let pods = arrivals(&sizes, pool_gpus, plan);
    let (shapes, layouts) = shapes();
    let layouts = model_slots(&layouts);
    let models = MODELS.len();
    let run =
        |name: &str, shaper: Shaper| replay(name, &pods, per_model, shaper, &shapes, &layouts);

    let step = (per_model / 8).max(1);
    let mut best: Option<(Outcome, [u32; 3])> = None;
    for split in splits(per_model, step) {
        let o = run("static", Shaper::Static(per_gpu(split, models)));
        if best.as_ref().is_none_or(|(b, _)| o.mean_wait < b.mean_wait) {
            best = Some((o, split));
        }
    }
    let (mut best_static, split) = best.expect("at least one split");
    best_static.name = format!("best static {}/{}/{}", split[0], split[1], split[2]);
    let by_day = |t: f64| (8.0..20.0).contains(&((t % DAY) / HOUR));
    let day = split_for(&pods, per_model, by_day);
    let night = split_for(&pods, per_model, |t| !by_day(t));
    let windows = run(
        &format!(
            "windows {}/{}/{} · {}/{}/{}",
            day[0], day[1], day[2], night[0], night[1], night[2]
        ),
        Shaper::Windows {
            day: per_gpu(day, models),
            night: per_gpu(night, models),
        },
    );
    let rules = Rules {
        min_dwell: 1800.0,
        max_in_flight: (pool_gpus / 10).max(1),
        drain: true,
        min_gain: 1.0,
    };
    let elastic = |forecast: Option<Forecast>, name: &str| {
        run(
            name,
            Shaper::Elastic {
                forecast,
                rules: rules.clone(),
            },
        )
    };
    Ok(Comparison {
        pool_gpus,
        pods: pods.len(),
        best_static,
        windows,
        elastic: elastic(None, "elastic"),
        elastic_forecast: elastic(Some(Forecast::default()), "elastic + forecast"),
        decision_seconds: decision_time(&layouts, &shapes),
        shaping_seconds: shaping_time(),
    })
}

/// How much lower elastic + forecast's mean wait is than the best static layout's (0–1).
pub fn wait_cut(c: &Comparison) -> f64 {
    1.0 - c.elastic_forecast.mean_wait / c.best_static.mean_wait.max(1e-9)
}

/// Runs the comparison; the table and whether every target holds.
pub fn run(data: &Path, plan: Plan) -> Result<(String, bool), BenchError> {
    let c = compare(data, &plan)?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "elastic layouts: {} GPUs ({} each of A100 80GB, H100 80GB, H200), shapes 4x20Gi/2x40Gi/whole, \
         {} pods over two weeks (seed {}, load {}, swing {}), the second week measured",
        c.pool_gpus,
        plan.gpus_per_model.max(1),
        c.pods,
        plan.seed,
        plan.load,
        plan.swing
    );
    let _ = writeln!(
        out,
        "| layout | mean wait s | p95 wait s | allocated % | re-cuts / GPU / day | GPU-h lost to drains |\n|---|---:|---:|---:|---:|---:|"
    );
    for o in [&c.best_static, &c.windows, &c.elastic, &c.elastic_forecast] {
        let _ = writeln!(
            out,
            "| {} | {:.0} | {:.0} | {:.1} | {:.2} | {:.1} |",
            o.name,
            o.mean_wait,
            o.p95_wait,
            o.allocated * 100.0,
            o.recuts_per_gpu_day,
            o.lost_gpu_hours
        );
    }
    let cut = wait_cut(&c);
    let recuts = c.elastic_forecast.recuts_per_gpu_day;
    let checks = [
        (
            "elastic + forecast: mean wait below the best static layout's",
            format!("{:.0}% lower", cut * 100.0),
            "≥ 25% lower",
            cut >= 0.25,
        ),
        (
            "elastic + forecast: re-cuts per GPU per day",
            format!("{recuts:.2}"),
            "≤ 2",
            recuts <= 2.0,
        ),
        (
            "the decision for 1,000 nodes × 8 GPUs",
            format!("{:.1} ms", c.decision_seconds * 1000.0),
            "< 100 ms",
            c.decision_seconds < 0.1,
        ),
        (
            "the operator's elastic step (GPUs read, decision, re-plans) for 1,000 nodes × 8 GPUs",
            format!("{:.1} ms", c.shaping_seconds * 1000.0),
            "< 100 ms",
            c.shaping_seconds < 0.1,
        ),
    ];
    let _ = writeln!(
        out,
        "\n| target | measured | goal | result |\n|---|---:|---:|---|"
    );
    let mut ok = true;
    for (what, measured, goal, pass) in checks {
        ok &= pass;
        let _ = writeln!(
            out,
            "| {what} | {measured} | {goal} | {} |",
            if pass { "PASS" } else { "FAIL" }
        );
    }
    Ok((out, ok))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_split_adds_up_to_the_models_gpus() {
        let all = splits(16, 2);
        assert_eq!(all.len(), 45);
        assert!(all.iter().all(|s| s.iter().sum::<u32>() == 16));
    }

    #[test]
    fn notebooks_are_busy_by_day_and_training_by_night() {
        let monday = |h: f64| h * HOUR;
        assert_eq!(profile(0, monday(10.0)), 1.0);
        assert!(profile(0, monday(23.0)) < 0.2);
        assert!(profile(2, monday(10.0)) < 0.2);
        assert_eq!(profile(2, monday(23.0)), 1.0);
        assert_eq!(hour(START), 0, "the replay starts on a Monday at midnight");
    }

    fn hour(timestamp: i64) -> usize {
        gpuslice_planning::elastic::hour_of_week(DateTime::from_timestamp(timestamp, 0).unwrap())
    }
}
