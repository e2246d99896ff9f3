//! Elastic layouts in the cluster. Each pass, for every pool whose elastic set is in force (its
//! open window's, else its own), the shape of each of its GPUs is chosen by
//! [`crate::elastic::decide`] from the pool's demand: pods running and waiting per
//! policy, and what the forecast kept in the pool's status expects. A GPU re-cut to another
//! shape has it staged a short [`LEAD`] ahead (`next` with `recutAt`), as a window change has:
//! its agent taints its devices at once and switches by itself at that time, and the queue
//! admits nothing onto it meanwhile. Under an elastic set a GPU's layout changes only so;
//! Git's `layout` is what a GPU new to the pool starts with. Pure: the operator calls it on the
//! cluster as read, the standalone agent on its own node with its `gpuslice run` line.

use std::collections::BTreeMap;

use crate::catalog;
use crate::cluster::{ClusterPlan, plan_assigned};
use crate::elastic::{self, Demand, Forecast, GpuNow, ModelSlots, Rules, Shape};
use chrono::{DateTime, TimeDelta, Utc};
use gpuslice_api::{
    AssignedShape, Assignment, Elastic, ElasticDrain, ElasticRecut, ElasticStatus, GpuAssignment,
    GpuInventory, GpuPool, GpuSlicePolicy, Layout, NextAssignment, NodeInventory,
};

/// How far ahead of its switch a re-cut is staged: long enough for the agent to taint the
/// GPU's devices and for the queue to see the staging before the layout goes.
pub const LEAD: TimeDelta = TimeDelta::seconds(15);
/// How soon a pool whose decision waits for something (minDwell, maxInFlight) is looked at
/// again when nothing else changes.
const LOOK_AGAIN: TimeDelta = TimeDelta::seconds(60);
/// How much more demand another shape must serve before a GPU leaves its own.
const MIN_GAIN: f64 = 1.0;
const DEFAULT_MIN_DWELL: std::time::Duration = std::time::Duration::from_secs(30 * 60);
const DEFAULT_MAX_IN_FLIGHT_PERCENT: u32 = 10;
const DEFAULT_HORIZON: std::time::Duration = std::time::Duration::from_secs(3600);

/// One device allocated to a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct Allocated {
    /// The GpuPool of the device (its `pool` attribute as published).
    pub pool: Option<String>,
    /// The policy the workload asked with.
    pub policy: Option<String>,
    /// The node and the GPU index of the device, where known.
    pub node: String,
    pub gpu: Option<u32>,
    /// When its workload last wrote a checkpoint, as its agent reports it.
    pub last_checkpoint: Option<DateTime<Utc>>,
    /// Since when its workload has not computed, as its agent reports it (`None`: computing, or
    /// not timed).
    pub idle_since: Option<DateTime<Utc>>,
    /// Its CheckpointPolicy's `maxLoss` in seconds (its policy's, else its pool's).
    pub max_loss: Option<f64>,
}

/// The `maxLoss` in seconds of the CheckpointPolicy that drains a workload of `policy` in
/// `pool`: the policy's own CheckpointPolicy, else the pool's (`spec_of` finds one by name).
pub fn max_loss_of<'a>(
    policy: Option<&'a GpuSlicePolicy>,
    pool: Option<&'a GpuPool>,
    spec_of: impl Fn(&str) -> Option<&'a gpuslice_api::CheckpointPolicySpec>,
) -> Option<f64> {
    let name = policy
        .and_then(|p| p.spec.checkpoint_policy.as_deref())
        .or_else(|| pool.and_then(|p| p.spec.checkpoint_policy.as_deref()))?;
    let most: std::time::Duration = spec_of(name)?.max_loss?.into();
    Some(most.as_secs_f64())
}

impl Allocated {
    /// Whether a drain at `at` would lose more than its `maxLoss` (never having checkpointed,
    /// it may have lost any amount).
    pub fn past_max_loss(&self, at: DateTime<Utc>) -> bool {
        self.max_loss
            .is_some_and(|most| self.loss(at).is_none_or(|loss| loss > most))
    }

    /// Seconds of GPU work a drain would lose at `at`: from its last checkpoint until it stopped
    /// computing (or until now); `None` when it never checkpointed.
    pub fn loss(&self, at: DateTime<Utc>) -> Option<f64> {
        Some(crate::queue::work_lost(
            self.last_checkpoint?,
            self.idle_since,
            at,
        ))
    }
}

/// A node as the shaping sees it: its GPUs, and what it was last given (`GpuNode.spec.gpus`).
#[derive(Clone, Copy, Debug)]
pub struct NodeNow<'a> {
    pub inventory: &'a NodeInventory,
    pub assigned: &'a [GpuAssignment],
}

/// What the shaping reads: the pools (with their status as last written: the forecast and the
/// last re-cut), their policies, every node in the plan's order, the devices allocated, and
/// the pods (or commands) waiting per policy.
#[derive(Clone, Copy, Debug)]
pub struct Seen<'a> {
    pub pools: &'a [GpuPool],
    pub policies: &'a [GpuSlicePolicy],
    pub nodes: &'a [NodeNow<'a>],
    pub allocated: &'a [Allocated],
    pub waiting: &'a BTreeMap<String, u32>,
    /// Pool → what its set's Prometheus (`elastic.prometheus`) expects per policy, or why it
    /// could not be read (then only the other signals count).
    pub prometheus: &'a BTreeMap<String, Prometheus>,
}

/// What an elastic set's Prometheus answered last: pods expected per policy, or why not.
pub type Prometheus = Result<BTreeMap<String, f64>, String>;

/// A GPU of an elastic pool: what it has now and the re-cut staged for it, if any.
#[derive(Clone, Debug, PartialEq)]
pub struct ShapedGpu {
    pub now: Assignment,
    pub next: Option<NextAssignment>,
}

/// What the elastic sets decided this pass.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Shaped {
    /// (node, GPU index) → the GPU's assignment now and what is staged.
    pub gpus: BTreeMap<(String, u32), ShapedGpu>,
    /// Pool → its elastic status.
    pub status: BTreeMap<String, ElasticStatus>,
    /// When to decide again though nothing changes (a staged switch, a held-back re-cut).
    pub next_look: Option<DateTime<Utc>>,
}

/// The elastic set in force on `pool` while `window` (by name) is open, or outside every
/// window: a window's own set replaces the pool's, and a window without one has its layout.
pub fn set_in_force<'a>(pool: &'a GpuPool, window: Option<&str>) -> Option<&'a Elastic> {
    match window {
        Some(w) => pool
            .spec
            .windows
            .iter()
            .find(|x| x.name == w)?
            .elastic
            .as_ref(),
        None => pool.spec.elastic.as_ref(),
    }
}

/// Shapes the GPUs of every elastic pool in `plan` (re-planning them for the layout each has)
/// at `at`.
pub fn shape(seen: &Seen, plan: &mut ClusterPlan, at: DateTime<Utc>) -> Shaped {
    let mut out = Shaped::default();
    let windows: Vec<Option<String>> = plan.pools.iter().map(|t| t.window.clone()).collect();
    for (pool, window) in seen.pools.iter().zip(windows) {
        if let Some(set) = set_in_force(pool, window.as_deref()) {
            shape_pool(seen, plan, pool, set, at, &mut out);
        }
    }
    out
}

/// A GPU of the pool being shaped, as found in the plan and its node's report.
struct Member<'a> {
    /// Positions in the plan (the same as in `seen.nodes`).
    node: usize,
    slot: usize,
    inventory: &'a GpuInventory,
    /// What Git gives it now (pool, window, time slice, checkpoint policy, base layout).
    base: Assignment,
    /// The layout it has now, as last written (Git's base layout when new to the pool).
    layout: Layout,
    /// Its shape now and since when.
    shape: Option<usize>,
    since: Option<DateTime<Utc>>,
    /// A re-cut staged earlier and not yet due: to which shape, and the staging.
    staged: Option<(usize, NextAssignment)>,
    /// Whatever switch was staged earlier and is not yet due.
    pending: Option<NextAssignment>,
    /// Its plan for the layout it has now.
    planned: Option<crate::cluster::GpuPlan>,
}

fn shape_pool(
    seen: &Seen,
    plan: &mut ClusterPlan,
    pool: &GpuPool,
    set: &Elastic,
    at: DateTime<Utc>,
    out: &mut Shaped,
) {
    let name = pool.metadata.name.clone().unwrap_or_default();
    let mut members = members(seen, plan, &name, set, at);
    let policies: Vec<&GpuSlicePolicy> = seen
        .policies
        .iter()
        .filter(|p| p.spec.pool == name)
        .collect();
    let mut forecast = pool
        .status
        .as_ref()
        .and_then(|s| s.elastic.as_ref())
        .and_then(|e| e.forecast.as_ref())
        .map(Forecast::from)
        .unwrap_or_default();
    let demand = demand(seen, pool, &policies, set, &mut forecast, at);
    let (models, model_of) = model_slots(set, &members);
    let gpus = gpus_now(seen, pool, &policies, set, &mut members, &model_of, at);
    let rules = rules(set, members.len());
    let decision = elastic::decide(&elastic::Input {
        shapes: &shapes(set),
        models: &models,
        gpus: &gpus,
        demand: &demand,
        rules: &rules,
    });
    let switch_at = gpuslice_api::time_of(at + LEAD);
    let mut counts: BTreeMap<String, u32> = BTreeMap::new();
    let mut recutting = 0;
    for (i, m) in members.iter().enumerate() {
        let now = m.now(set);
        let next = m.next(set, &decision, i, gpus[i].busy, switch_at.as_ref());
        // Planned for its layout already; the shape changes nothing the agent does.
        let Some(mut planned) = m.planned.clone() else {
            continue;
        };
        planned.assigned = Some(now.clone());
        if planned.error.is_some() {
            // The layout it has cannot be planned any more (the GPU changed): Git's base
            // layout is what the plan already holds for it.
            continue;
        }
        plan.nodes[m.node].gpus[m.slot] = planned;
        if let Some(s) = &now.shape {
            *counts.entry(s.name.clone()).or_default() += 1;
        }
        recutting += u32::from(next.is_some());
        let node = plan.nodes[m.node].node.clone();
        out.gpus
            .insert((node, m.inventory.index), ShapedGpu { now, next });
    }
    let old = pool.status.as_ref().and_then(|s| s.elastic.as_ref());
    let last_recut = if decision.recuts.is_empty() {
        old.and_then(|e| e.last_recut.clone())
    } else {
        gpuslice_api::time_of(at).map(|at| ElasticRecut {
            at,
            reason: decision.reason.clone(),
        })
    };
    if recutting > 0 {
        out.next_look = earliest(out.next_look, at + LEAD);
    }
    if !decision.waiting_for.is_empty() {
        out.next_look = earliest(out.next_look, at + LOOK_AGAIN);
    }
    out.status.insert(
        name,
        ElasticStatus {
            shapes: counts,
            recutting,
            decision: decision.reason,
            waiting_for: decision.waiting_for,
            last_recut,
            forecast: Some((&forecast).into()),
        },
    );
}

/// The pool's GPUs as the decision reads them (`model_of`: each member's slot model).
fn gpus_now(
    seen: &Seen,
    pool: &GpuPool,
    policies: &[&GpuSlicePolicy],
    set: &Elastic,
    members: &mut [Member],
    model_of: &[usize],
    at: DateTime<Utc>,
) -> Vec<GpuNow> {
    // (node, GPU index) → the work it holds.
    let mut held: BTreeMap<(&str, u32), Vec<&Allocated>> = BTreeMap::new();
    for a in seen.allocated {
        if let Some(gpu) = a.gpu {
            held.entry((a.node.as_str(), gpu)).or_default().push(a);
        }
    }
    members
        .iter_mut()
        .zip(model_of)
        .map(|(m, &model)| {
            let node = seen.nodes[m.node].inventory.name.as_str();
            let on_it = held
                .get(&(node, m.inventory.index))
                .map_or(&[][..], Vec::as_slice);
            gpu_now(pool, policies, set, m, on_it, model, at)
        })
        .collect()
}

/// The set's shapes as the decision reads them.
fn shapes(set: &Elastic) -> Vec<Shape> {
    set.shapes
        .iter()
        .map(|s| Shape {
            name: s.name.clone(),
            min_gpus: s.min_gpus.unwrap_or(0),
            max_gpus: s.max_gpus,
        })
        .collect()
}

impl Member<'_> {
    /// What it has now: its layout and shape stay until a staged switch changes them.
    fn now(&self, set: &Elastic) -> Assignment {
        Assignment {
            layout: self.layout.clone(),
            shape: self.shape.map(|s| AssignedShape {
                name: set.shapes[s].name.clone(),
                since: self.since.and_then(gpuslice_api::time_of),
            }),
            ..self.base.clone()
        }
    }

    /// The switch staged for it (the `i`th GPU of the decision, `busy` slices in use) at
    /// `switch_at`: a re-cut decided now, one staged earlier and still chosen, or Git's layout.
    fn next(
        &self,
        set: &Elastic,
        decision: &elastic::Decision,
        i: usize,
        busy: u32,
        switch_at: Option<&gpuslice_api::k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    ) -> Option<NextAssignment> {
        let stage = |layout: &Layout| {
            let shape = set.shapes.iter().position(|x| x.layout == *layout);
            switch_at.map(|at| NextAssignment {
                at: at.clone(),
                assigned: Assignment {
                    layout: layout.clone(),
                    shape: shape.map(|s| AssignedShape {
                        name: set.shapes[s].name.clone(),
                        since: Some(at.clone()),
                    }),
                    ..self.base.clone()
                },
            })
        };
        let recut = decision.recuts.iter().find(|r| r.gpu == i);
        match (&self.staged, recut) {
            (_, Some(r)) => stage(&set.shapes[r.to].layout),
            (Some((to, staged)), None) if decision.shapes[i] == Some(*to) => Some(staged.clone()),
            // A GPU no shape is chosen for (none holds it, or nothing wants one) goes to Git's
            // layout for now, as a pool without an elastic set does, once it is idle: staged
            // like a re-cut, and kept staged at the same time on later passes.
            _ if decision.shapes[i].is_none() && self.layout != self.base.layout && busy == 0 => {
                match &self.pending {
                    Some(p) if p.assigned.layout == self.base.layout => Some(p.clone()),
                    _ => stage(&self.base.layout),
                }
            }
            _ => None,
        }
    }
}

fn earliest(a: Option<DateTime<Utc>>, b: DateTime<Utc>) -> Option<DateTime<Utc>> {
    Some(a.map_or(b, |a| a.min(b)))
}

/// The pool's GPUs that can be planned, each with the layout and shape it has now and any
/// re-cut staged for it.
fn members<'a>(
    seen: &'a Seen<'a>,
    plan: &ClusterPlan,
    pool: &str,
    set: &Elastic,
    at: DateTime<Utc>,
) -> Vec<Member<'a>> {
    let shape_of = |a: &Assignment| -> Option<usize> {
        let named = a.shape.as_ref().and_then(|s| {
            set.shapes
                .iter()
                .position(|x| x.name == s.name && x.layout == a.layout)
        });
        named.or_else(|| set.shapes.iter().position(|x| x.layout == a.layout))
    };
    let mut out = Vec::new();
    for (n, (node, report)) in plan.nodes.iter().zip(seen.nodes).enumerate() {
        if node.node != report.inventory.name {
            continue;
        }
        for (slot, g) in node.gpus.iter().enumerate() {
            if g.pool() != Some(pool) || g.error.is_some() {
                continue;
            }
            let (Some(base), Some(inventory)) = (
                g.assigned.clone(),
                report.inventory.gpus.iter().find(|x| x.index == g.index),
            ) else {
                continue;
            };
            let written = written(report, g.index, pool, at);
            let layout = written
                .as_ref()
                .map_or(base.layout.clone(), |(a, _)| a.layout.clone());
            let now = Assignment {
                layout: layout.clone(),
                ..written.as_ref().map_or(base.clone(), |(a, _)| a.clone())
            };
            let shape = shape_of(&now);
            let since = shape
                .and(now.shape.as_ref())
                .filter(|s| Some(s.name.as_str()) == shape.map(|i| set.shapes[i].name.as_str()))
                .and_then(|s| s.since.as_ref())
                .and_then(gpuslice_api::chrono_of);
            let pending = written.and_then(|(_, next)| next);
            let staged = pending
                .clone()
                .filter(|next| next.assigned.shape.is_some())
                .and_then(|next| Some((shape_of(&next.assigned)?, next)));
            out.push(Member {
                node: n,
                slot,
                inventory,
                base,
                layout,
                shape,
                since,
                staged,
                pending,
                planned: None,
            });
        }
    }
    out
}

/// What the node's spec gives GPU `index` at `at` for `pool`, and a switch it stages later.
fn written(
    report: &NodeNow,
    index: u32,
    pool: &str,
    at: DateTime<Utc>,
) -> Option<(Assignment, Option<NextAssignment>)> {
    let raw = report.assigned.iter().find(|a| a.index == index)?;
    let in_force = raw.in_force(at);
    (in_force.assigned.pool == pool).then(|| {
        let later = in_force
            .next
            .filter(|n| gpuslice_api::chrono_of(&n.at).is_some_and(|t| t > at));
        (in_force.assigned, later)
    })
}

/// Each policy's demand on the pool: pods running and waiting, slice size, priority weight, and
/// what the forecast (which this observation teaches) expects within the horizon.
fn demand(
    seen: &Seen,
    pool: &GpuPool,
    policies: &[&GpuSlicePolicy],
    set: &Elastic,
    forecast: &mut Forecast,
    at: DateTime<Utc>,
) -> Vec<Demand> {
    let name = pool.metadata.name.as_deref().unwrap_or_default();
    let headroom = pool.spec.headroom_bytes();
    let horizon: std::time::Duration = set
        .forecast_horizon
        .map_or(DEFAULT_HORIZON, std::time::Duration::from);
    let from_prometheus = seen.prometheus.get(name).and_then(|r| r.as_ref().ok());
    let mut out: Vec<Demand> = policies
        .iter()
        .map(|p| {
            let policy = p.metadata.name.clone().unwrap_or_default();
            let running = seen
                .allocated
                .iter()
                .filter(|a| {
                    a.pool.as_deref() == Some(name) && a.policy.as_deref() == Some(policy.as_str())
                })
                .count() as u32;
            let waiting = seen.waiting.get(&policy).copied().unwrap_or(0);
            let priority = crate::queue::priority_in_force(
                pool,
                &policy,
                &p.spec.priority,
                at,
                &BTreeMap::new(),
            );
            Demand {
                memory: p.spec.memory.bytes().unwrap_or(0).saturating_add(headroom),
                compute: p.spec.compute.as_ref().map_or(0, |c| c.limit),
                // low 0.5, normal 1, high 5.5: every policy counts, priority most.
                weight: (priority.max(0) as f64 + 100.0) / 200.0,
                running,
                waiting,
                forecast: 0.0,
                policy,
            }
        })
        .collect();
    let seen: BTreeMap<String, f64> = out
        .iter()
        .map(|d| (d.policy.clone(), f64::from(d.running + d.waiting)))
        .collect();
    forecast.observe(at, &seen);
    if !horizon.is_zero() {
        let horizon = TimeDelta::from_std(horizon).unwrap_or(TimeDelta::hours(1));
        for d in &mut out {
            d.forecast = forecast.expected(&d.policy, at, horizon);
        }
    }
    for d in &mut out {
        if let Some(&expected) = from_prometheus.and_then(|p| p.get(&d.policy)) {
            d.forecast = d.forecast.max(expected);
        }
    }
    out
}

/// The slots of each shape on each GPU model of the members, and each member's model.
fn model_slots(set: &Elastic, members: &[Member]) -> (Vec<ModelSlots>, Vec<usize>) {
    let mut keys: Vec<(String, u64)> = Vec::new();
    let mut models: Vec<ModelSlots> = Vec::new();
    let model_of = members
        .iter()
        .map(|m| {
            let gpu = m.inventory;
            let known = catalog::model(&gpu.model).ok();
            let memory = known.map(|k| k.memory_bytes()).unwrap_or_else(|| {
                gpu.memory
                    .as_ref()
                    .and_then(|q| gpuslice_api::bytes_of(&q.0).ok())
                    .unwrap_or(0)
            });
            let key = (gpu.model.clone(), memory);
            if let Some(i) = keys.iter().position(|k| *k == key) {
                return i;
            }
            models.push(
                set.shapes
                    .iter()
                    .map(|s| elastic::slots(&s.layout, known, &gpu.model, memory))
                    .collect(),
            );
            keys.push(key);
            keys.len() - 1
        })
        .collect();
    (models, model_of)
}

/// The decision's view of member `m`: slices held, whether its work may be drained, its shape
/// (the staged one while a re-cut is under way) and how long since its last re-cut. A staged
/// re-cut whose GPU has since taken work that may not be drained is called off.
fn gpu_now(
    pool: &GpuPool,
    policies: &[&GpuSlicePolicy],
    set: &Elastic,
    m: &mut Member,
    held: &[&Allocated],
    model: usize,
    at: DateTime<Utc>,
) -> GpuNow {
    let gpu = m.inventory;
    let with_processes = gpu
        .slices
        .iter()
        .filter(|s| !s.processes.is_empty())
        .count()
        + gpu
            .mig
            .iter()
            .flat_map(|mig| &mig.instances)
            .filter(|i| !i.processes.is_empty())
            .count()
        + usize::from(!gpu.processes.is_empty());
    let busy = held.len().max(with_processes) as u32;
    let checkpointable = |policy: Option<&str>| {
        policies
            .iter()
            .find(|p| p.metadata.name.as_deref() == policy && policy.is_some())
            .is_some_and(|p| {
                p.spec.preemptible
                    && (p.spec.checkpoint_policy.is_some() || pool.spec.checkpoint_policy.is_some())
            })
    };
    // Processes outside any pod's claim cannot be evicted: only pods' work drains.
    let drainable = set.drain == ElasticDrain::Checkpointable
        && with_processes <= held.len()
        && held.iter().all(|a| checkpointable(a.policy.as_deref()));
    if busy > 0 && !drainable {
        m.staged = None;
    }
    let planned = plan_assigned(
        gpu,
        Assignment {
            layout: m.layout.clone(),
            ..m.base.clone()
        },
    );
    let converging = !planned.ops.is_empty();
    m.planned = Some(planned);
    GpuNow {
        model,
        shape: m.staged.as_ref().map(|(to, _)| *to).or(m.shape),
        busy,
        drainable,
        since_recut: m
            .since
            .map(|s| (at - s).num_milliseconds().max(0) as f64 / 1000.0),
        recutting: m.staged.is_some() || converging,
        loss: held
            .iter()
            .map(|a| a.loss(at))
            .try_fold(0.0, |most: f64, loss| Some(most.max(loss?))),
        past_max_loss: held.iter().any(|a| a.past_max_loss(at)),
    }
}

/// The set's rules for a pool of `gpus` GPUs.
fn rules(set: &Elastic, gpus: usize) -> Rules {
    let dwell: std::time::Duration = set
        .min_dwell
        .map_or(DEFAULT_MIN_DWELL, std::time::Duration::from);
    let percent = set
        .max_in_flight
        .unwrap_or(DEFAULT_MAX_IN_FLIGHT_PERCENT)
        .clamp(1, 100);
    Rules {
        min_dwell: dwell.as_secs_f64(),
        max_in_flight: (gpus as u32 * percent).div_ceil(100).max(1),
        drain: set.drain == ElasticDrain::Checkpointable,
        min_gain: MIN_GAIN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drain_loses_the_gpu_work_since_the_checkpoint_not_the_idle_time() {
        let at: DateTime<Utc> = "2026-12-07T10:00:00Z".parse().unwrap();
        let minutes = |m| at - TimeDelta::minutes(m);
        let notebook = |checkpoint: Option<i64>, idle: Option<i64>| Allocated {
            pool: None,
            policy: None,
            node: "n1".into(),
            gpu: Some(0),
            last_checkpoint: checkpoint.map(minutes),
            idle_since: idle.map(minutes),
            max_loss: None,
        };
        // Computing since its checkpoint 30 minutes ago: 30 minutes lost.
        assert_eq!(notebook(Some(30), None).loss(at), Some(1800.0));
        // Stopped 20 minutes ago: the 10 minutes it computed.
        assert_eq!(notebook(Some(30), Some(20)).loss(at), Some(600.0));
        // Idle since before its checkpoint: nothing.
        assert_eq!(notebook(Some(30), Some(40)).loss(at), Some(0.0));
        // Never checkpointed: unknown, however idle.
        assert_eq!(notebook(None, Some(40)).loss(at), None);
        // Past its maxLoss (15 min): 30 min computing is, 10 min is not; never checkpointed is.
        let strict = |checkpoint, idle| Allocated {
            max_loss: Some(900.0),
            ..notebook(checkpoint, idle)
        };
        assert!(strict(Some(30), None).past_max_loss(at));
        assert!(!strict(Some(30), Some(20)).past_max_loss(at));
        assert!(strict(None, None).past_max_loss(at));
        assert!(
            !notebook(Some(30), None).past_max_loss(at),
            "no maxLoss, no limit"
        );
    }
}
