//! Elastic layouts: which of the shapes a pool allows (in Git) each GPU should have now, from
//! the demand per policy (pods running and waiting, and what the [`Forecast`] expects within
//! its horizon). Pure, so that what `gpuslice bench elastic` measures is what the operator and
//! the standalone agent run (through [`crate::shaping`]): the benchmark and the tests call
//! [`decide`].
//!
//! The decision in steps: GPUs that must keep their shape (being re-cut, re-cut less than
//! `min_dwell` ago, or holding work that may not be drained) serve what they can first. The
//! others are shaped one at a time: first every GPU whose own shape still serves unserved demand
//! about as well as any other keeps it; then each remaining GPU gets the shape serving the most
//! unserved demand (weighted by priority), its own shape winning unless another serves
//! `min_gain` more. Shapes below their `min_gpus` take idle GPUs nothing else wants; none goes
//! past `max_gpus`. Only idle GPUs are re-cut for a forecast; work that may be drained is drained
//! only for pods that already wait; at most `max_in_flight` GPUs are re-cut at once.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use chrono::{DateTime, Utc};
use gpuslice_api::layout::Layout;
use serde::{Deserialize, Serialize};

use crate::catalog::GpuModel;
use crate::transition::Desired;

/// A slice one GPU of a shape offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Its memory, bytes.
    pub memory: u64,
    /// Its compute share in percent (100 for MIG instances and whole GPUs, whose compute no
    /// policy's limit can exceed).
    pub compute: u32,
}

/// The slots one GPU has in `layout`: `None` when the GPU cannot hold it (a MIG layout on a
/// model without MIG or that does not fit, software slices whose memory adds up to more than
/// the GPU's).
pub fn slots(
    layout: &Layout,
    model: Option<&GpuModel>,
    model_name: &str,
    gpu_memory: u64,
) -> Option<Vec<Slot>> {
    let whole = 100;
    match Desired::of(layout, model, model_name).ok()? {
        Desired::Software(t) => {
            (u64::from(t.slices).saturating_mul(t.memory) <= gpu_memory).then(|| {
                let slot = Slot {
                    memory: t.memory,
                    compute: t.compute,
                };
                vec![slot; t.slices as usize]
            })
        }
        Desired::Mig(counts) => {
            let model = model?;
            let mut slots = Vec::new();
            for (name, n) in counts {
                let memory = model.profile(&name)?.memory_bytes();
                slots.extend((0..n).map(|_| Slot {
                    memory,
                    compute: whole,
                }));
            }
            Some(slots)
        }
        Desired::MigMps { profiles, slices } => {
            let model = model?;
            let mut slots = Vec::new();
            for (name, n) in profiles {
                let (memory, _) = crate::transition::mps_slice_of_instance(
                    model.profile(&name)?.memory_bytes(),
                    slices,
                );
                // A share of an instance: a slot of the instance's SMs, whole as far as a
                // policy's GPU-wide compute limit goes.
                slots.extend((0..n * slices).map(|_| Slot {
                    memory,
                    compute: whole,
                }));
            }
            Some(slots)
        }
        Desired::Exclusive => Some(vec![Slot {
            memory: gpu_memory,
            compute: whole,
        }]),
    }
}

/// One policy's demand on the pool.
#[derive(Clone, Debug, PartialEq)]
pub struct Demand {
    pub policy: String,
    /// Memory a slice must have: the policy's memory plus the pool's headroom.
    pub memory: u64,
    /// Compute share a slice must give (its limit; 0 when it sets none).
    pub compute: u32,
    /// Priority weight: one pod of weight 2 counts as two of weight 1.
    pub weight: f64,
    /// Pods of the policy holding a slice.
    pub running: u32,
    /// Pods of the policy waiting for one.
    pub waiting: u32,
    /// The forecast's expected peak (running + waiting) within its horizon; 0 without one.
    pub forecast: f64,
}

impl Slot {
    /// Whether a workload needing `memory` bytes and `compute` percent fits it.
    pub fn holds(&self, memory: u64, compute: u32) -> bool {
        self.memory >= memory && self.compute >= compute
    }
}

impl Demand {
    fn fits(&self, slot: &Slot) -> bool {
        slot.holds(self.memory, self.compute)
    }
}

/// A shape of the elastic set and its bounds.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    pub name: String,
    /// At least this many GPUs keep the shape (when enough GPUs are free to take it).
    pub min_gpus: u32,
    /// At most this many GPUs are given the shape.
    pub max_gpus: Option<u32>,
}

/// One GPU of the pool as the decision sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuNow {
    /// Index into [`Input::models`].
    pub model: usize,
    /// Index into [`Input::shapes`]: the shape it has, or is being re-cut to; `None` while its
    /// layout is none of the elastic set's.
    pub shape: Option<usize>,
    /// Slices held by workloads.
    pub busy: u32,
    /// Whether every workload on it may be drained (preemptible, with a CheckpointPolicy).
    pub drainable: bool,
    /// Seconds since its last re-cut; `None` when it never was.
    pub since_recut: Option<f64>,
    /// A re-cut is under way.
    pub recutting: bool,
    /// Seconds of GPU work a drain would lose now, the most of its workloads': from a last
    /// checkpoint until the workload stopped computing, or until now (0 when it holds none);
    /// `None` when one of them never wrote a checkpoint.
    pub loss: Option<f64>,
    /// A drain now would lose more than a workload's CheckpointPolicy `maxLoss`: it goes after
    /// every drain within its workloads' maxLoss.
    pub past_max_loss: bool,
}

impl GpuNow {
    fn idle(&self) -> bool {
        self.busy == 0
    }
}

/// The pool's elastic rules.
#[derive(Clone, Debug, PartialEq)]
pub struct Rules {
    /// A GPU is not re-cut again sooner than this, seconds.
    pub min_dwell: f64,
    /// GPUs of the pool being re-cut at once, at most.
    pub max_in_flight: u32,
    /// Whether work that may be drained is drained for waiting pods (otherwise only idle GPUs
    /// are re-cut).
    pub drain: bool,
    /// How much more weighted demand another shape must serve before a GPU leaves its own.
    pub min_gain: f64,
}

/// One GPU model's slots in each shape of the elastic set (`None` where it cannot hold it).
pub type ModelSlots = Vec<Option<Vec<Slot>>>;

/// What [`decide`] is given.
#[derive(Clone, Copy, Debug)]
pub struct Input<'a> {
    pub shapes: &'a [Shape],
    /// Per GPU model, per shape: the slots one GPU of that model has in that shape, or `None`
    /// when the model cannot hold it.
    pub models: &'a [ModelSlots],
    pub gpus: &'a [GpuNow],
    pub demand: &'a [Demand],
    pub rules: &'a Rules,
}

/// A GPU to re-cut.
#[derive(Clone, Debug, PartialEq)]
pub struct Recut {
    /// Index into [`Input::gpus`].
    pub gpu: usize,
    pub from: Option<usize>,
    pub to: usize,
    /// Its workloads are drained first (their CheckpointPolicy's signal and grace).
    pub drain: bool,
    /// Weighted demand the new shape serves beyond the old.
    pub gain: f64,
    /// Made only to bring its shape up to `minGpus` (nothing wanted the GPU otherwise).
    pub minimum: bool,
}

/// Drains cost the work since the workloads' last checkpoints: those within their
/// CheckpointPolicies' `maxLoss` first, then the least, a GPU whose loss is unknown last.
fn by_loss(a: &GpuNow, b: &GpuNow) -> std::cmp::Ordering {
    let key = |g: &GpuNow| g.loss.unwrap_or(f64::INFINITY);
    a.past_max_loss
        .cmp(&b.past_max_loss)
        .then(key(a).total_cmp(&key(b)))
}

/// The decision and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The shape each GPU is to have (its own when kept).
    pub shapes: Vec<Option<usize>>,
    /// The re-cuts to start now, most gain first.
    pub recuts: Vec<Recut>,
    /// Demand here now per policy (index into [`Input::demand`]) no GPU serves after the
    /// decision.
    pub unserved: Vec<f64>,
    /// What the decision does and for whom, in words.
    pub reason: String,
    /// What holds further re-cuts back (dwell, in-flight limit, work that may not move).
    pub waiting_for: Vec<String>,
}

/// Demand not yet served: what is here now (running and waiting) and what the forecast expects
/// beyond it.
#[derive(Clone, Debug)]
struct Left {
    now: Vec<f64>,
    ahead: Vec<f64>,
}

/// What one GPU in a shape would serve: demand here now first; the forecast's only with slots
/// nothing here now fits.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Value {
    now: f64,
    ahead: f64,
}

const EPSILON: f64 = 1e-9;

impl Value {
    fn any(&self) -> bool {
        self.now > EPSILON || self.ahead > EPSILON
    }

    fn order(&self, other: &Value) -> std::cmp::Ordering {
        self.now
            .total_cmp(&other.now)
            .then(self.ahead.total_cmp(&other.ahead))
    }
}

/// Why a GPU would leave its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gain {
    /// Pods here now are served better.
    Now,
    /// Pods here now are served as well, and the forecast's better.
    Ahead,
}

fn gain(best: &Value, own: &Value, min_gain: f64) -> Option<Gain> {
    if best.now >= own.now + min_gain && best.now > EPSILON {
        Some(Gain::Now)
    } else if best.now + EPSILON >= own.now && best.ahead >= own.ahead + min_gain {
        Some(Gain::Ahead)
    } else {
        None
    }
}

/// Serves `left` with `slots`, smallest slot first, each to the fitting policy of the highest
/// weight (the largest need among equals, so that small slots are left for small pods); a slot
/// no demand here now fits serves the forecast's. Takes what it serves from `left` when `take`.
fn fill(slots: &[Slot], demand: &[Demand], left: &mut Left, take: bool) -> Value {
    let mut sorted: Vec<&Slot> = slots.iter().collect();
    sorted.sort_by_key(|s| (s.memory, s.compute));
    let mut scratch;
    let left: &mut Left = if take {
        left
    } else {
        scratch = left.clone();
        &mut scratch
    };
    let best = |left: &[f64], slot: &Slot| {
        demand
            .iter()
            .enumerate()
            .filter(|(p, d)| left[*p] > EPSILON && d.fits(slot))
            .max_by(|(_, a), (_, b)| {
                a.weight
                    .total_cmp(&b.weight)
                    .then(a.memory.cmp(&b.memory))
                    .then(a.compute.cmp(&b.compute))
            })
            .map(|(p, d)| (p, d.weight))
    };
    let mut value = Value::default();
    for slot in sorted {
        if let Some((p, weight)) = best(&left.now, slot) {
            let served = left.now[p].min(1.0);
            left.now[p] -= served;
            value.now += served * weight;
        } else if let Some((p, weight)) = best(&left.ahead, slot) {
            let served = left.ahead[p].min(1.0);
            left.ahead[p] -= served;
            value.ahead += served * weight;
        }
    }
    value
}

fn slots_on<'a>(input: &Input<'a>, gpu: &GpuNow, shape: usize) -> Option<&'a [Slot]> {
    input.models.get(gpu.model)?.get(shape)?.as_deref()
}

/// Why a GPU keeps its shape whatever the demand, if it must.
fn pinned(gpu: &GpuNow, rules: &Rules, pods_wait: bool) -> Option<&'static str> {
    if gpu.recutting {
        Some("being re-cut")
    } else if gpu.since_recut.is_some_and(|s| s < rules.min_dwell) {
        Some("re-cut less than minDwell ago")
    } else if gpu.idle() || rules.drain && gpu.drainable && pods_wait {
        None
    } else if rules.drain && gpu.drainable {
        Some("holding work drained only for waiting pods")
    } else {
        Some("holding work that may not be drained")
    }
}

/// The decision's working state: demand left, GPUs per shape.
struct Shaping<'i, 'a> {
    input: &'i Input<'a>,
    left: Left,
    count: Vec<u32>,
}

impl Shaping<'_, '_> {
    fn value(&mut self, gpu: &GpuNow, shape: Option<usize>, take: bool) -> Value {
        let input = self.input;
        match shape.and_then(|s| slots_on(input, gpu, s)) {
            Some(slots) => fill(slots, input.demand, &mut self.left, take),
            None => Value::default(),
        }
    }

    fn best(&mut self, gpu: &GpuNow) -> Option<(usize, Value)> {
        let shapes = self.input.shapes;
        let open: Vec<usize> = (0..shapes.len())
            .filter(|&s| {
                gpu.shape == Some(s) || shapes[s].max_gpus.is_none_or(|m| self.count[s] < m)
            })
            .filter(|&s| slots_on(self.input, gpu, s).is_some())
            .collect();
        open.into_iter()
            .map(|s| (s, self.value(gpu, Some(s), false)))
            .max_by(|a, b| a.1.order(&b.1).then(b.0.cmp(&a.0)))
    }

    fn keep(&mut self, gpu: &GpuNow) {
        if let Some(s) = gpu.shape {
            self.count[s] += 1;
            self.value(gpu, Some(s), true);
        }
    }
}

impl<'i, 'a> Shaping<'i, 'a> {
    /// Nothing served yet: the demand now (running + waiting) and what the forecast adds.
    fn new(input: &'i Input<'a>) -> Self {
        let now: Vec<f64> = input
            .demand
            .iter()
            .map(|d| f64::from(d.running + d.waiting))
            .collect();
        let ahead = input
            .demand
            .iter()
            .zip(&now)
            .map(|(d, n)| (d.forecast - n).max(0.0))
            .collect();
        Shaping {
            input,
            left: Left { now, ahead },
            count: vec![0; input.shapes.len()],
        }
    }

    /// Keepers first among the `free` GPUs, busy GPUs (their work is on them) and then those
    /// whose own shape serves the most, so that a GPU already shaped for the demand is not
    /// re-cut while another, shaped for nothing, is left alone. Returns the GPUs left to decide.
    fn keep_those_that_serve(&mut self, free: &[usize]) -> Vec<usize> {
        let input = self.input;
        let mut keys: Vec<(bool, Value, usize)> = free
            .iter()
            .map(|&i| {
                let gpu = &input.gpus[i];
                (gpu.idle(), self.value(gpu, gpu.shape, false), i)
            })
            .collect();
        keys.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.order(&a.1)).then(a.2.cmp(&b.2)));
        let mut deferred = Vec::new();
        for (_, _, i) in keys {
            let gpu = &input.gpus[i];
            let own = self.value(gpu, gpu.shape, false);
            let best = self.best(gpu).map_or(Value::default(), |b| b.1);
            if own.any() && gain(&best, &own, input.rules.min_gain).is_none() {
                self.keep(gpu);
            } else {
                deferred.push(i);
            }
        }
        deferred
    }

    /// Re-cuts each `deferred` GPU to the shape that serves the most where that gains enough
    /// (busy ones only for pods that wait, when `pods_wait`). Returns the re-cuts, and the GPUs
    /// nothing wants.
    fn recut_for_demand(
        &mut self,
        deferred: &[usize],
        pods_wait: bool,
    ) -> (Vec<Recut>, Vec<usize>) {
        let input = self.input;
        let mut wanted: Vec<Recut> = Vec::new();
        let mut spare = Vec::new();
        // Idle GPUs first (a re-cut costs them nothing), then drains by what they lose.
        let mut order = deferred.to_vec();
        order.sort_by(|&a, &b| {
            let (a, b) = (&input.gpus[a], &input.gpus[b]);
            b.idle().cmp(&a.idle()).then(by_loss(a, b))
        });
        for i in order {
            let gpu = &input.gpus[i];
            let own = self.value(gpu, gpu.shape, false);
            let best = self.best(gpu);
            let why = best.and_then(|(_, value)| gain(&value, &own, input.rules.min_gain));
            // A forecast alone never drains work: busy GPUs move only for pods that wait.
            let allowed = gpu.idle() || (why == Some(Gain::Now) && pods_wait);
            match (best, why) {
                (Some((s, value)), Some(_)) if allowed && gpu.shape != Some(s) => {
                    self.count[s] += 1;
                    self.value(gpu, Some(s), true);
                    wanted.push(Recut {
                        gpu: i,
                        from: gpu.shape,
                        to: s,
                        drain: !gpu.idle(),
                        gain: value.now - own.now + value.ahead - own.ahead,
                        minimum: false,
                    });
                }
                _ if own.any() || !gpu.idle() => self.keep(gpu),
                _ => spare.push(i),
            }
        }
        (wanted, spare)
    }

    /// Spare GPUs (nothing wants them) fill shapes below their minimum, then keep their own.
    fn fill_minimums(&mut self, spare: &[usize], wanted: &mut Vec<Recut>) {
        let input = self.input;
        for &i in spare {
            let gpu = &input.gpus[i];
            let short = (0..input.shapes.len()).find(|&s| {
                self.count[s] < input.shapes[s].min_gpus
                    && gpu.shape != Some(s)
                    && slots_on(input, gpu, s).is_some()
            });
            match short {
                Some(s) => {
                    self.count[s] += 1;
                    wanted.push(Recut {
                        gpu: i,
                        from: gpu.shape,
                        to: s,
                        drain: false,
                        gain: 0.0,
                        minimum: true,
                    });
                }
                None => self.keep(gpu),
            }
        }
    }
}

/// The re-cuts `wanted` that fit under maxInFlight (idle GPUs and the largest gains first);
/// what waits is added to `waiting_for`.
fn within_max_in_flight(
    input: &Input,
    mut wanted: Vec<Recut>,
    waiting_for: &mut Vec<String>,
) -> Vec<Recut> {
    wanted.sort_by(|a, b| {
        a.drain
            .cmp(&b.drain)
            .then(by_loss(&input.gpus[a.gpu], &input.gpus[b.gpu]))
            .then(b.gain.total_cmp(&a.gain))
            .then(a.gpu.cmp(&b.gpu))
    });
    let max = input.rules.max_in_flight;
    let in_flight = input.gpus.iter().filter(|g| g.recutting).count() as u32;
    let room = max.saturating_sub(in_flight) as usize;
    if wanted.len() > room {
        waiting_for.push(format!(
            "maxInFlight: {} more re-cut(s) wait while {in_flight} of at most {max} are under way",
            wanted.len() - room,
        ));
        wanted.truncate(room);
    }
    wanted
}

/// Chooses each GPU's shape. See the module's documentation for the steps.
pub fn decide(input: &Input) -> Decision {
    let mut shaping = Shaping::new(input);
    let pods_wait = input.demand.iter().any(|d| d.waiting > 0);
    let mut held: BTreeMap<&'static str, u32> = BTreeMap::new();
    let mut free = Vec::new();
    for (i, gpu) in input.gpus.iter().enumerate() {
        match pinned(gpu, input.rules, pods_wait) {
            Some(why) => {
                *held.entry(why).or_default() += 1;
                shaping.keep(gpu);
            }
            None => free.push(i),
        }
    }
    let deferred = shaping.keep_those_that_serve(&free);
    let (mut wanted, spare) = shaping.recut_for_demand(&deferred, pods_wait);
    shaping.fill_minimums(&spare, &mut wanted);
    let mut waiting_for: Vec<String> = held
        .iter()
        .map(|(why, n)| format!("{n} GPU(s) {why}"))
        .collect();
    let recuts = within_max_in_flight(input, wanted, &mut waiting_for);
    let mut shapes: Vec<Option<usize>> = input.gpus.iter().map(|g| g.shape).collect();
    for r in &recuts {
        shapes[r.gpu] = Some(r.to);
    }
    let unserved = shaping.left.now;
    let reason = explain(input, &recuts, &unserved);
    Decision {
        shapes,
        recuts,
        unserved,
        reason,
        waiting_for,
    }
}

/// "3 GPUs quarter → whole, 1 GPU half → whole (drained): for training (5 waiting, 7.0
/// expected)" or why nothing changes.
fn explain(input: &Input, recuts: &[Recut], unserved: &[f64]) -> String {
    let name = |s: Option<usize>| {
        s.map_or("(outside the elastic set)", |s| {
            input.shapes[s].name.as_str()
        })
    };
    let mut moves: BTreeMap<(&str, &str, bool, bool), u32> = BTreeMap::new();
    for r in recuts {
        *moves
            .entry((name(r.from), name(Some(r.to)), r.drain, r.minimum))
            .or_default() += 1;
    }
    let mut text = String::new();
    for ((from, to, drain, minimum), n) in &moves {
        if !text.is_empty() {
            text.push_str(", ");
        }
        let _ = write!(text, "{n} GPU(s) {from} → {to}");
        if *drain {
            text.push_str(" (drained)");
        }
        if *minimum {
            let _ = write!(text, " (for the minGpus of {to})");
        }
    }
    let drained: Vec<Option<f64>> = recuts
        .iter()
        .filter(|r| r.drain)
        .map(|r| input.gpus[r.gpu].loss)
        .collect();
    if !drained.is_empty() {
        match drained.iter().copied().collect::<Option<Vec<f64>>>() {
            Some(losses) => {
                let most = losses.into_iter().fold(0.0, f64::max);
                if most == 0.0 {
                    text.push_str(" (losing no work: idle since the last checkpoints)");
                } else {
                    let _ = write!(
                        text,
                        " (losing at most {:.0} min of work since the last checkpoints)",
                        most / 60.0
                    );
                }
            }
            None => text.push_str(" (a drained workload has written no checkpoint yet)"),
        }
    }
    let demand: Vec<String> = input
        .demand
        .iter()
        .filter(|d| d.waiting > 0 || d.forecast > f64::from(d.running))
        .map(|d| {
            format!(
                "{} ({} running, {} waiting, {:.1} expected)",
                d.policy, d.running, d.waiting, d.forecast
            )
        })
        .collect();
    if text.is_empty() {
        text.push_str("no re-cut");
    }
    if !demand.is_empty() {
        let _ = write!(text, ": demand {}", demand.join(", "));
    }
    let short: Vec<String> = input
        .demand
        .iter()
        .zip(unserved)
        .filter(|(_, u)| **u >= 0.5)
        .map(|(d, u)| format!("{} {u:.0}", d.policy))
        .collect();
    if !short.is_empty() {
        let _ = write!(text, "; unserved after it: {}", short.join(", "));
    }
    text
}

/// Hours in a week: the forecast's buckets.
pub const HOURS_PER_WEEK: usize = 168;

/// The hour of the week (Monday 00:00 UTC is 0) of `at`.
pub fn hour_of_week(at: DateTime<Utc>) -> usize {
    // 1970-01-01 was a Thursday: Monday 00:00 came 72 hours before it.
    (at.timestamp().div_euclid(3600) + 72).rem_euclid(HOURS_PER_WEEK as i64) as usize
}

/// Demand per policy learned per hour of the week from the pool's own history: each hour's
/// peak (running + waiting) is folded into that hour's bucket, the newest week counting half.
/// Serializable, so that the operator keeps it in the pool's status and a restarted operator
/// carries on.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Forecast {
    /// Policy → expected peak per hour of the week (`None` where the hour was never seen).
    pub policies: BTreeMap<String, Vec<Option<f64>>>,
    /// The hour being observed and each policy's peak in it so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<(usize, BTreeMap<String, f64>)>,
}

/// How much the newest week counts against what was learned before.
const LEARNING_RATE: f64 = 0.5;

impl Forecast {
    /// Takes one observation of the demand per policy at `at`.
    pub fn observe(&mut self, at: DateTime<Utc>, demand: &BTreeMap<String, f64>) {
        let hour = hour_of_week(at);
        if self.current.as_ref().is_some_and(|(h, _)| *h != hour) {
            self.fold();
        }
        let (_, peaks) = self.current.get_or_insert_with(|| (hour, BTreeMap::new()));
        for (policy, d) in demand {
            let peak = peaks.entry(policy.clone()).or_insert(0.0);
            *peak = peak.max(*d);
        }
    }

    /// Folds the hour being observed into its bucket.
    fn fold(&mut self) {
        let Some((hour, peaks)) = self.current.take() else {
            return;
        };
        for (policy, peak) in peaks {
            let buckets = self
                .policies
                .entry(policy)
                .or_insert_with(|| vec![None; HOURS_PER_WEEK]);
            let bucket = &mut buckets[hour];
            *bucket = Some(bucket.map_or(peak, |old| old + LEARNING_RATE * (peak - old)));
        }
    }

    /// The most `policy` is expected to want from `at` to `at + horizon` (0 when nothing was
    /// learned for those hours).
    pub fn expected(&self, policy: &str, at: DateTime<Utc>, horizon: chrono::Duration) -> f64 {
        let Some(buckets) = self.policies.get(policy) else {
            return 0.0;
        };
        let hours = horizon.num_hours().max(0) as usize + 1;
        let first = hour_of_week(at);
        (0..hours.min(HOURS_PER_WEEK))
            .filter_map(|k| buckets[(first + k) % HOURS_PER_WEEK])
            .fold(0.0, f64::max)
    }
}

/// As a pool's status keeps it.
impl From<&Forecast> for gpuslice_api::ElasticForecast {
    fn from(f: &Forecast) -> Self {
        let (hour, peaks) = f
            .current
            .clone()
            .map_or((None, BTreeMap::new()), |(h, p)| (Some(h as u32), p));
        gpuslice_api::ElasticForecast {
            policies: f.policies.clone(),
            hour,
            peaks,
        }
    }
}

/// From a pool's status; a policy's buckets of another length than a week's are dropped (not
/// learned from), never trusted.
impl From<&gpuslice_api::ElasticForecast> for Forecast {
    fn from(f: &gpuslice_api::ElasticForecast) -> Self {
        Forecast {
            policies: f
                .policies
                .iter()
                .filter(|(_, buckets)| buckets.len() == HOURS_PER_WEEK)
                .map(|(p, b)| (p.clone(), b.clone()))
                .collect(),
            current: f
                .hour
                .filter(|&h| (h as usize) < HOURS_PER_WEEK)
                .map(|h| (h as usize, f.peaks.clone())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GI: u64 = 1 << 30;

    fn quarter_half_whole() -> (Vec<Shape>, Vec<ModelSlots>) {
        let shape = |name: &str| Shape {
            name: name.into(),
            min_gpus: 0,
            max_gpus: None,
        };
        let slot = |memory, compute| Slot {
            memory: memory * GI,
            compute,
        };
        (
            vec![shape("quarter"), shape("half"), shape("whole")],
            vec![vec![
                Some(vec![slot(20, 25); 4]),
                Some(vec![slot(40, 50); 2]),
                Some(vec![slot(80, 100)]),
            ]],
        )
    }

    fn demand(policy: &str, memory: u64, compute: u32, running: u32, waiting: u32) -> Demand {
        Demand {
            policy: policy.into(),
            memory: memory * GI,
            compute,
            weight: 1.0,
            running,
            waiting,
            forecast: 0.0,
        }
    }

    fn gpus(shapes: &[usize]) -> Vec<GpuNow> {
        shapes
            .iter()
            .map(|s| GpuNow {
                model: 0,
                shape: Some(*s),
                busy: 0,
                drainable: false,
                since_recut: None,
                recutting: false,
                loss: Some(0.0),
                past_max_loss: false,
            })
            .collect()
    }

    fn rules() -> Rules {
        Rules {
            min_dwell: 1800.0,
            max_in_flight: 8,
            drain: false,
            min_gain: 1.0,
        }
    }

    fn decide_with(gpus: &[GpuNow], demand: &[Demand], rules: &Rules) -> Decision {
        let (shapes, models) = quarter_half_whole();
        decide(&Input {
            shapes: &shapes,
            models: &models,
            gpus,
            demand,
            rules,
        })
    }

    #[test]
    fn idle_half_gpus_are_cut_in_four_for_waiting_notebooks() {
        let notebooks = [demand("notebook", 18, 25, 0, 8)];
        let d = decide_with(&gpus(&[1, 1, 1, 1]), &notebooks, &rules());
        // Eight notebooks: two GPUs in four serve them; the other two are left as they are.
        assert_eq!(d.shapes, vec![Some(0), Some(0), Some(1), Some(1)]);
        assert_eq!(d.recuts.len(), 2, "{d:?}");
        assert!(d.reason.contains("2 GPU(s) half → quarter"), "{}", d.reason);
        assert!(d.unserved.iter().all(|u| *u < 1e-9));
    }

    #[test]
    fn a_gpu_already_shaped_for_the_demand_keeps_its_shape() {
        // Two GPUs in four and two whole: eight notebooks fit the quarter GPUs as they are.
        let notebooks = [demand("notebook", 18, 25, 0, 8)];
        let d = decide_with(&gpus(&[2, 2, 0, 0]), &notebooks, &rules());
        assert!(d.recuts.is_empty(), "{d:?}");
        assert_eq!(d.reason.split(':').next(), Some("no re-cut"));
    }

    #[test]
    fn a_busy_gpu_is_not_drained_for_a_forecast_and_not_at_all_unless_allowed() {
        let mut pool = gpus(&[0, 0]);
        for g in &mut pool {
            g.busy = 1;
            g.drainable = true;
        }
        let mut training = demand("training", 70, 100, 0, 0);
        training.forecast = 2.0;
        let notebooks = demand("notebook", 18, 25, 2, 0);
        let mut drain = rules();
        drain.drain = true;
        let d = decide_with(&pool, &[notebooks.clone(), training.clone()], &drain);
        assert!(d.recuts.is_empty(), "a forecast drained work: {d:?}");
        training.waiting = 2;
        let d = decide_with(&pool, &[notebooks.clone(), training.clone()], &rules());
        assert!(d.recuts.is_empty(), "drained without drain allowed: {d:?}");
        assert!(
            d.waiting_for
                .iter()
                .any(|w| w.contains("may not be drained"))
        );
        // Weight the training higher: with drains allowed, the notebooks' GPUs go to it.
        training.weight = 3.0;
        let d = decide_with(&pool, &[notebooks, training], &drain);
        assert_eq!(d.recuts.len(), 2, "{d:?}");
        assert!(d.recuts.iter().all(|r| r.drain && r.to == 2));
    }

    #[test]
    fn the_drain_that_loses_least_since_its_checkpoint_goes_first() {
        // Three GPUs in quarters, a notebook on each (checkpointable); one training pod (worth
        // three notebooks) waits. GPU 0's quarters serve the notebooks; of the other two, the
        // one whose notebook checkpointed a minute ago is drained, not the one that never did.
        let mut pool = gpus(&[0, 0, 0]);
        for (g, loss) in pool.iter_mut().zip([Some(1200.0), None, Some(60.0)]) {
            g.busy = 1;
            g.drainable = true;
            g.loss = loss;
        }
        let mut training = demand("training", 70, 100, 0, 1);
        training.weight = 3.0;
        let mut drain = rules();
        drain.drain = true;
        let d = decide_with(&pool, &[demand("notebook", 18, 25, 3, 0), training], &drain);
        assert_eq!(d.recuts.len(), 1, "{d:?}");
        assert_eq!(
            (d.recuts[0].gpu, d.recuts[0].to, d.recuts[0].drain),
            (2, 2, true)
        );
        assert!(
            d.reason
                .contains("(losing at most 1 min of work since the last checkpoints)"),
            "{}",
            d.reason
        );
    }

    #[test]
    fn a_drain_within_its_max_loss_goes_before_a_smaller_one_past_its_own() {
        // As the least-loss test (GPU 0's quarters keep serving the notebooks), but of the
        // other two, GPU 2's notebook (1 min lost) is past its CheckpointPolicy's maxLoss and
        // GPU 1's (20 min) is not: GPU 1 is drained.
        let mut pool = gpus(&[0, 0, 0]);
        for (g, loss) in pool
            .iter_mut()
            .zip([Some(1200.0), Some(1200.0), Some(60.0)])
        {
            g.busy = 1;
            g.drainable = true;
            g.loss = loss;
        }
        pool[2].past_max_loss = true;
        let mut training = demand("training", 70, 100, 0, 1);
        training.weight = 3.0;
        let mut drain = rules();
        drain.drain = true;
        let notebooks = demand("notebook", 18, 25, 3, 0);
        let d = decide_with(&pool, &[notebooks, training], &drain);
        assert_eq!(d.recuts.len(), 1, "{d:?}");
        assert_eq!((d.recuts[0].gpu, d.recuts[0].drain), (1, true));
        // Without the maxLoss, the least loss: GPU 2.
        pool[2].past_max_loss = false;
        let notebooks = demand("notebook", 18, 25, 3, 0);
        let mut training = demand("training", 70, 100, 0, 1);
        training.weight = 3.0;
        let d = decide_with(&pool, &[notebooks, training], &drain);
        assert_eq!(d.recuts[0].gpu, 2, "{d:?}");
    }

    #[test]
    fn min_dwell_and_max_in_flight_hold_re_cuts_back() {
        let mut pool = gpus(&[1, 1, 1, 1]);
        pool[0].since_recut = Some(60.0);
        let notebooks = [demand("notebook", 18, 25, 0, 16)];
        let mut few = rules();
        few.max_in_flight = 2;
        let d = decide_with(&pool, &notebooks, &few);
        assert_eq!(d.recuts.len(), 2, "{d:?}");
        assert!(d.recuts.iter().all(|r| r.gpu != 0));
        assert!(
            d.waiting_for.iter().any(|w| w.contains("minDwell"))
                && d.waiting_for.iter().any(|w| w.contains("maxInFlight")),
            "{:?}",
            d.waiting_for
        );
    }

    #[test]
    fn spare_gpus_fill_a_shape_up_to_its_minimum_and_say_so() {
        let (mut shapes, models) = quarter_half_whole();
        shapes[0].min_gpus = 2;
        let pool = gpus(&[1, 1, 1]);
        let d = decide(&Input {
            shapes: &shapes,
            models: &models,
            gpus: &pool,
            demand: &[],
            rules: &rules(),
        });
        // Nothing wants any GPU: two go to quarters for its minimum, the third keeps its half.
        assert_eq!(d.shapes, vec![Some(0), Some(0), Some(1)], "{d:?}");
        assert!(d.recuts.iter().all(|r| r.minimum && !r.drain));
        assert!(
            d.reason
                .starts_with("2 GPU(s) half → quarter (for the minGpus of quarter)"),
            "{}",
            d.reason
        );
    }

    #[test]
    fn a_tenant_flipping_its_waiting_pods_cannot_re_cut_a_gpu_more_often_than_min_dwell() {
        // A hostile tenant creates and deletes gated pods every 5 minutes, 16 notebooks then 4
        // trainings, for four hours, to make the pool thrash. Passes every 60 s; a re-cut
        // takes one pass.
        let mut pool = gpus(&[0, 0, 0, 0]);
        let mut rules = rules();
        rules.max_in_flight = 2;
        let mut last: Vec<Option<u32>> = vec![None; pool.len()];
        let mut recuts = 0;
        for minute in 0..240u32 {
            let notebooks = (minute / 5) % 2 == 0;
            let demand = [
                demand("notebook", 18, 25, 0, if notebooks { 16 } else { 0 }),
                demand("training", 70, 100, 0, if notebooks { 0 } else { 4 }),
            ];
            let d = decide_with(&pool, &demand, &rules);
            assert!(d.recuts.len() <= 2, "maxInFlight broken at {minute}: {d:?}");
            for g in &mut pool {
                g.recutting = false;
                g.since_recut = g.since_recut.map(|s| s + 60.0);
            }
            for r in &d.recuts {
                if let Some(before) = last[r.gpu] {
                    assert!(
                        f64::from(minute - before) * 60.0 >= rules.min_dwell,
                        "GPU {} re-cut at minute {before} and again at {minute}",
                        r.gpu
                    );
                }
                last[r.gpu] = Some(minute);
                recuts += 1;
                let g = &mut pool[r.gpu];
                g.shape = Some(r.to);
                g.since_recut = Some(0.0);
                g.recutting = true;
            }
        }
        // At most one re-cut per GPU per 30 minutes, whatever the tenant does.
        assert!(recuts <= 4 * 8, "{recuts} re-cuts in four hours");
        assert!(recuts > 0, "the pool never answered the demand");
    }

    #[test]
    fn the_forecast_shapes_idle_gpus_ahead_of_the_rise() {
        let mut training = demand("training", 70, 100, 0, 0);
        training.forecast = 3.0;
        let d = decide_with(&gpus(&[0, 0, 0, 0]), &[training], &rules());
        assert_eq!(d.recuts.len(), 3, "{d:?}");
        assert!(d.reason.contains("3.0 expected"), "{}", d.reason);
    }

    #[test]
    fn the_forecast_never_takes_a_gpu_from_pods_waiting_now() {
        // Training (weight 2) is expected on four GPUs; eight notebooks (weight 1) wait now.
        let mut training = demand("training", 70, 100, 0, 0);
        training.weight = 2.0;
        training.forecast = 4.0;
        let notebooks = demand("notebook", 18, 25, 0, 8);
        let d = decide_with(&gpus(&[1, 1, 1]), &[training, notebooks], &rules());
        assert_eq!(d.shapes, vec![Some(0), Some(0), Some(2)], "{d:?}");
    }

    #[test]
    fn bounds_are_kept() {
        let (mut shapes, models) = quarter_half_whole();
        shapes[2].max_gpus = Some(1);
        shapes[1].min_gpus = 1;
        let training = [demand("training", 70, 100, 0, 4)];
        let pool = gpus(&[0, 0, 0, 0]);
        let d = decide(&Input {
            shapes: &shapes,
            models: &models,
            gpus: &pool,
            demand: &training,
            rules: &rules(),
        });
        let whole = d.shapes.iter().filter(|s| **s == Some(2)).count();
        let half = d.shapes.iter().filter(|s| **s == Some(1)).count();
        assert_eq!((whole, half), (1, 1), "{d:?}");
        assert!(d.unserved[0] > 2.9);
    }

    #[test]
    fn slots_follow_the_layout_and_the_gpu() {
        let a100 = crate::catalog::model("NVIDIA A100-SXM4-80GB").unwrap();
        let memory = a100.memory_bytes();
        let quarter = Layout::software(4, "20Gi", 25);
        let four = slots(&quarter, Some(a100), a100.name, memory).unwrap();
        assert_eq!(
            four,
            vec![
                Slot {
                    memory: 20 * GI,
                    compute: 25
                };
                4
            ]
        );
        let too_big = Layout::software(4, "30Gi", 25);
        assert_eq!(slots(&too_big, Some(a100), a100.name, memory), None);
        let mig = Layout::mig_profiles([("3g.40gb", 1), ("1g.10gb", 2)]);
        let instances = slots(&mig, Some(a100), a100.name, memory).unwrap();
        assert_eq!(instances.len(), 3);
        assert!(instances.iter().all(|s| s.compute == 100));
        assert_eq!(slots(&mig, None, "Tesla T4", 16 * GI), None);
    }

    #[test]
    fn the_forecast_learns_each_hour_of_the_week_and_survives_a_round_trip() {
        let monday_nine = DateTime::parse_from_rfc3339("2026-12-07T09:10:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let mut f = Forecast::default();
        for (minutes, d) in [(0, 2.0), (20, 6.0), (40, 4.0), (60, 1.0)] {
            let at = monday_nine + chrono::Duration::minutes(minutes);
            f.observe(at, &BTreeMap::from([("notebook".to_string(), d)]));
        }
        let hour = chrono::Duration::hours(1);
        assert_eq!(hour_of_week(monday_nine), 9);
        assert_eq!(
            f.expected("notebook", monday_nine, chrono::Duration::zero()),
            6.0
        );
        // Asked from 08:00 with an hour's horizon, 09:00's peak is ahead.
        assert_eq!(f.expected("notebook", monday_nine - hour, hour), 6.0);
        assert_eq!(f.expected("training", monday_nine, hour), 0.0);
        // A week later the same hour peaks at 2: the bucket moves halfway.
        let week = chrono::Duration::weeks(1);
        f.observe(
            monday_nine + week,
            &BTreeMap::from([("notebook".to_string(), 2.0)]),
        );
        f.observe(monday_nine + week + hour, &BTreeMap::new());
        assert_eq!(
            f.expected("notebook", monday_nine, chrono::Duration::zero()),
            4.0
        );
        let kept: Forecast = serde_json::from_str(&serde_json::to_string(&f).unwrap()).unwrap();
        assert_eq!(kept, f);
    }
}
