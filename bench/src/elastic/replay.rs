//! The event-driven replay: arrivals, departures, the queue, re-cuts and drains, under one way
//! of shaping the pool.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::time::Instant;

use chrono::{DateTime, Utc};
use gpuslice_api::layout::Layout;
use gpuslice_planning::catalog;
use gpuslice_planning::elastic::{
    Decision, Demand, Forecast, GpuNow, Input, ModelSlots, Rules, Shape, Slot, decide, slots,
};

use super::workload::{
    CHECKPOINT_SECONDS, CLASSES, DAY, GI, HEADROOM, HOUR, MODELS, Pod, QUEUES, RECUT_SECONDS,
    START, TICK, WEEK, weight_key,
};

/// The elastic set: four 20 GiB slices, two 40 GiB slices, or the whole GPU.
pub(super) fn shapes() -> (Vec<Shape>, Vec<Layout>) {
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
pub(super) fn model_slots(layouts: &[Layout]) -> Vec<ModelSlots> {
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
pub(super) enum Shaper {
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

pub(super) struct Gpu {
    pub(super) model: usize,
    pub(super) shape: usize,
    pub(super) slots: Vec<Option<usize>>,
    pub(super) recut_until: Option<f64>,
    pub(super) last_recut: Option<f64>,
    /// The windows' next shape, once idle.
    pub(super) next: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Event {
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

pub(super) struct Replay<'a> {
    pub(super) pods: Vec<Pod>,
    pub(super) gpus: Vec<Gpu>,
    pub(super) layouts: &'a [ModelSlots],
    pub(super) shapes: &'a [Shape],
    /// Waiting pods by queue: (arrival ms, pod).
    pub(super) queues: [BTreeSet<(u64, usize)>; QUEUES],
    /// GPUs' worth (slices, or GPUs of multi-GPU pods) running and waiting per class.
    pub(super) running: [u32; 3],
    pub(super) waiting: [u32; 3],
    pub(super) events: BinaryHeap<Reverse<(u64, Event)>>,
    pub(super) now: f64,
    pub(super) recuts: u32,
    pub(super) lost: f64,
    pub(super) slice_seconds: f64,
    pub(super) slowest: f64,
}

pub(super) fn millis(t: f64) -> u64 {
    (t * 1000.0) as u64
}

pub(super) fn measured(t: f64) -> bool {
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
                // Checkpoints every 30 min, no maxLoss declared: the replay has none to keep.
                past_max_loss: false,
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

pub(super) fn instant(t: f64) -> DateTime<Utc> {
    DateTime::from_timestamp(START + t as i64, 0).unwrap_or_default()
}

/// Replays `pods` on a pool of `per_model` GPUs of each model shaped by `shaper`.
pub(super) fn replay(
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
