//! Elastic layouts in the cluster. Each pass, for every pool whose elastic set is in force (its
//! open window's, else its own), the shape of each of its GPUs is chosen by
//! [`gpuslice_planning::elastic::decide`] from the pool's demand: pods running and waiting per
//! policy, and what the forecast kept in the pool's status expects. A GPU re-cut to another
//! shape has it staged a short [`LEAD`] ahead (`next` with `recutAt`), as a window change has:
//! its agent taints its devices at once and switches by itself at that time, and the queue
//! admits nothing onto it meanwhile. Under an elastic set a GPU's layout changes only so;
//! Git's `layout` is what a GPU new to the pool starts with. Pure: [`crate::desired`] calls it.

use std::collections::BTreeMap;

use chrono::{DateTime, TimeDelta, Utc};
use gpuslice_api::{
    AssignedShape, Assignment, Elastic, ElasticDrain, ElasticRecut, ElasticStatus, GpuInventory,
    GpuPool, GpuSlicePolicy, NextAssignment,
};
use gpuslice_planning::catalog;
use gpuslice_planning::cluster::{ClusterPlan, plan_assigned};
use gpuslice_planning::elastic::{self, Demand, Forecast, GpuNow, ModelSlots, Rules, Shape};

use crate::desired::{NodeReport, Observed};

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
pub fn shape(observed: &Observed, plan: &mut ClusterPlan, at: DateTime<Utc>) -> Shaped {
    let mut out = Shaped::default();
    let windows: Vec<Option<String>> = plan.pools.iter().map(|t| t.window.clone()).collect();
    for (pool, window) in observed.pools.iter().zip(windows) {
        if let Some(set) = set_in_force(pool, window.as_deref()) {
            shape_pool(observed, plan, pool, set, at, &mut out);
        }
    }
    out
}

/// A GPU of the pool being shaped, as found in the plan and its node's report.
struct Member<'a> {
    /// Positions in the plan (the same as in `observed.nodes`).
    node: usize,
    slot: usize,
    inventory: &'a GpuInventory,
    /// What Git gives it now (pool, window, time slice, checkpoint policy, base layout).
    base: Assignment,
    /// The layout it has now, as last written (Git's base layout when new to the pool).
    layout: gpuslice_api::Layout,
    /// Its shape now and since when.
    shape: Option<usize>,
    since: Option<DateTime<Utc>>,
    /// A re-cut staged earlier and not yet due: to which shape, and the staging.
    staged: Option<(usize, NextAssignment)>,
}

fn shape_pool(
    observed: &Observed,
    plan: &mut ClusterPlan,
    pool: &GpuPool,
    set: &Elastic,
    at: DateTime<Utc>,
    out: &mut Shaped,
) {
    let name = pool.metadata.name.clone().unwrap_or_default();
    let mut members = members(observed, plan, &name, set, at);
    let policies: Vec<&GpuSlicePolicy> = observed
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
    let demand = demand(observed, pool, &policies, set, &mut forecast, at);
    let (models, model_of) = model_slots(set, &members);
    let gpus: Vec<GpuNow> = members
        .iter_mut()
        .zip(&model_of)
        .map(|(m, &model)| gpu_now(observed, pool, &policies, set, m, model, at))
        .collect();
    let shapes: Vec<Shape> = set
        .shapes
        .iter()
        .map(|s| Shape {
            name: s.name.clone(),
            min_gpus: s.min_gpus.unwrap_or(0),
            max_gpus: s.max_gpus,
        })
        .collect();
    let rules = rules(set, members.len());
    let decision = elastic::decide(&elastic::Input {
        shapes: &shapes,
        models: &models,
        gpus: &gpus,
        demand: &demand,
        rules: &rules,
    });
    let switch_at = gpuslice_api::time_of(at + LEAD);
    let mut counts: BTreeMap<String, u32> = BTreeMap::new();
    let mut recutting = 0;
    for (i, m) in members.iter().enumerate() {
        // A GPU no shape is chosen for (none holds it, or it is busy in none) follows Git's
        // layout as in a pool without an elastic set.
        let shape = decision.shapes[i].and(m.shape);
        let now = Assignment {
            layout: match shape {
                Some(_) => m.layout.clone(),
                None => m.base.layout.clone(),
            },
            shape: shape.map(|s| AssignedShape {
                name: set.shapes[s].name.clone(),
                since: m.since.and_then(gpuslice_api::time_of),
            }),
            ..m.base.clone()
        };
        let next = match (&m.staged, decision.recuts.iter().find(|r| r.gpu == i)) {
            (_, Some(r)) => switch_at.clone().map(|at| NextAssignment {
                at: at.clone(),
                assigned: Assignment {
                    layout: set.shapes[r.to].layout.clone(),
                    shape: Some(AssignedShape {
                        name: set.shapes[r.to].name.clone(),
                        since: Some(at),
                    }),
                    ..m.base.clone()
                },
            }),
            (Some((to, staged)), None) if decision.shapes[i] == Some(*to) => Some(staged.clone()),
            _ => None,
        };
        let planned = plan_assigned(m.inventory, now.clone());
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

fn earliest(a: Option<DateTime<Utc>>, b: DateTime<Utc>) -> Option<DateTime<Utc>> {
    Some(a.map_or(b, |a| a.min(b)))
}

/// The pool's GPUs that can be planned, each with the layout and shape it has now and any
/// re-cut staged for it.
fn members<'a>(
    observed: &'a Observed,
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
    for (n, (node, report)) in plan.nodes.iter().zip(&observed.nodes).enumerate() {
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
            let staged = written
                .and_then(|(_, next)| next)
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
            });
        }
    }
    out
}

/// What the node's spec gives GPU `index` at `at` for `pool`, and a switch it stages later.
fn written(
    report: &NodeReport,
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
    observed: &Observed,
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
    let mut out: Vec<Demand> = policies
        .iter()
        .map(|p| {
            let policy = p.metadata.name.clone().unwrap_or_default();
            let running = observed
                .allocated
                .iter()
                .filter(|a| {
                    a.pool.as_deref() == Some(name) && a.policy.as_deref() == Some(policy.as_str())
                })
                .count() as u32;
            let waiting = observed.waiting.get(&policy).copied().unwrap_or(0);
            let priority = gpuslice_planning::queue::priority_in_force(
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
    observed: &Observed,
    pool: &GpuPool,
    policies: &[&GpuSlicePolicy],
    set: &Elastic,
    m: &mut Member,
    model: usize,
    at: DateTime<Utc>,
) -> GpuNow {
    let node = &observed.nodes[m.node].inventory.name;
    let held: Vec<Option<&str>> = observed
        .allocated
        .iter()
        .filter(|a| &a.node == node && a.gpu == Some(m.inventory.index))
        .map(|a| a.policy.as_deref())
        .collect();
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
        && held.iter().all(|p| checkpointable(*p));
    if busy > 0 && !drainable {
        m.staged = None;
    }
    let converging = !plan_assigned(
        gpu,
        Assignment {
            layout: m.layout.clone(),
            ..m.base.clone()
        },
    )
    .ops
    .is_empty();
    GpuNow {
        model,
        shape: m.staged.as_ref().map(|(to, _)| *to).or(m.shape),
        busy,
        drainable,
        since_recut: m
            .since
            .map(|s| (at - s).num_milliseconds().max(0) as f64 / 1000.0),
        recutting: m.staged.is_some() || converging,
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
    use crate::desired::{Allocated, desired};
    use gpuslice_api::{GpuNodeSpec, NodeInventory};

    const POOL: &str = "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata: {name: shared, generation: 1}\nspec:\n  nodeSelector: {matchLabels: {team: a}}\n  layout: {software: {slices: 4, memory: 30Gi, compute: 25}}\n  elastic:\n    minDwell: 10m\n    maxInFlight: 50\n    shapes:\n    - {name: quarters, layout: {software: {slices: 4, memory: 30Gi, compute: 25}}}\n    - {name: whole, layout: {exclusive: {}}}\n";

    fn policy(name: &str, memory: &str) -> GpuSlicePolicy {
        serde_yaml::from_str(&format!(
            "apiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {{name: {name}}}\nspec: {{pool: shared, memory: {memory}}}\n"
        ))
        .unwrap()
    }

    /// Two H200s, each cut in the quarters the pool starts with.
    fn node() -> NodeReport {
        let quarters: String = (0..4)
            .map(|s| format!("    - {{id: g{{i}}s{s}, memory: 30Gi, compute: 25}}\n"))
            .collect();
        let gpus: String = (0..2)
            .map(|i| {
                format!(
                    "- index: {i}\n  model: NVIDIA H200\n  slices:\n{}",
                    quarters.replace("{i}", &i.to_string())
                )
            })
            .collect();
        let mut inventory: NodeInventory =
            serde_yaml::from_str(&format!("name: n1\ngpus:\n{gpus}")).unwrap();
        inventory.labels.insert("team".into(), "a".into());
        NodeReport {
            inventory,
            generation: Some(1),
            applied_generation: Some(1),
            ..NodeReport::default()
        }
    }

    fn observed() -> Observed {
        Observed {
            pools: vec![serde_yaml::from_str(POOL).unwrap()],
            policies: vec![policy("notebook", "20Gi"), policy("train", "100Gi")],
            nodes: vec![node()],
            ..Observed::default()
        }
    }

    fn at(text: &str) -> DateTime<Utc> {
        text.parse().unwrap()
    }

    fn running(policy: &str, gpu: u32) -> Allocated {
        Allocated {
            pool: Some("shared".into()),
            policy: Some(policy.into()),
            node: "n1".into(),
            gpu: Some(gpu),
        }
    }

    /// What the operator wrote, as the next pass reads it back; the status on the pool.
    fn written_back(observed: &mut Observed, out: &crate::desired::DesiredState) {
        observed.nodes[0].assigned = out.node_specs["n1"].gpus.clone();
        observed.pools[0].status = Some(out.pool_status["shared"].clone());
    }

    fn spec(out: &crate::desired::DesiredState) -> &GpuNodeSpec {
        &out.node_specs["n1"]
    }

    #[test]
    fn a_waiting_pod_gets_an_idle_gpu_re_cut_staged_ahead_and_kept_for_min_dwell() {
        let mut observed = observed();
        let t0 = at("2026-12-07T10:00:00Z");
        // Nothing waits: both GPUs keep the quarters Git starts them in, nothing is staged.
        let quiet = desired(&observed, t0);
        assert!(spec(&quiet).gpus.iter().all(|g| g.next.is_none()));
        let status = quiet.pool_status["shared"].elastic.clone().unwrap();
        assert_eq!(status.shapes, BTreeMap::from([("quarters".into(), 2)]));
        assert_eq!(status.last_recut, None);
        written_back(&mut observed, &quiet);

        // A training pod needs a whole GPU: one idle GPU is staged to become whole, LEAD ahead.
        observed.waiting.insert("train".into(), 1);
        let out = desired(&observed, t0);
        let staged: Vec<_> = spec(&out)
            .gpus
            .iter()
            .filter(|g| g.next.is_some())
            .collect();
        assert_eq!(staged.len(), 1, "{:?}", spec(&out).gpus);
        let next = staged[0].next.as_ref().unwrap();
        assert_eq!(gpuslice_api::chrono_of(&next.at), Some(t0 + LEAD));
        assert_eq!(staged[0].recut_at.as_ref(), Some(&next.at));
        assert_eq!(next.assigned.shape.as_ref().unwrap().name, "whole");
        assert!(next.assigned.layout.exclusive.is_some());
        // Until the switch the GPU keeps its quarters.
        assert!(staged[0].assigned.layout.software.is_some());
        let status = out.pool_status["shared"].elastic.clone().unwrap();
        assert_eq!(status.recutting, 1);
        assert!(status.decision.contains("train"), "{}", status.decision);
        assert!(out.next_change <= Some(t0 + LEAD));
        let events =
            crate::desired::events(quiet.pool_status.get("shared"), &out.pool_status["shared"]);
        assert!(
            events
                .iter()
                .any(|e| e.reason == "ElasticRecut" && e.note.contains("whole")),
            "{events:?}"
        );
        written_back(&mut observed, &out);

        // A pass before the switch keeps the staging as it was (no second GPU, same time).
        let again = desired(&observed, t0 + TimeDelta::seconds(5));
        assert_eq!(spec(&again).gpus, spec(&out).gpus);

        // After the switch the GPU is whole (the agent switched by itself) and stays so for
        // minDwell though nothing waits any more and notebooks do.
        let index = staged[0].index;
        observed.waiting.clear();
        observed.waiting.insert("notebook".into(), 8);
        let after = t0 + TimeDelta::minutes(5);
        // The agent has cut the GPU whole.
        observed.nodes[0].inventory.gpus[index as usize]
            .slices
            .clear();
        let kept = desired(&observed, after);
        let gpu = spec(&kept).gpus.iter().find(|g| g.index == index).unwrap();
        assert!(gpu.assigned.layout.exclusive.is_some());
        assert!(gpu.next.is_none());
        let status = kept.pool_status["shared"].elastic.clone().unwrap();
        assert_eq!(
            status.shapes,
            BTreeMap::from([("quarters".into(), 1), ("whole".into(), 1)])
        );
        assert!(
            status.waiting_for.iter().any(|w| w.contains("minDwell")),
            "{status:?}"
        );
        written_back(&mut observed, &kept);
        // Past minDwell the idle whole GPU goes back to quarters for the notebooks.
        let later = desired(&observed, t0 + TimeDelta::minutes(11));
        let gpu = spec(&later).gpus.iter().find(|g| g.index == index).unwrap();
        let back = gpu.next.as_ref().expect("re-cut back to quarters");
        assert_eq!(back.assigned.shape.as_ref().unwrap().name, "quarters");
    }

    #[test]
    fn busy_gpus_are_not_re_cut_unless_their_work_may_be_drained() {
        let mut observed = observed();
        let t0 = at("2026-12-07T10:00:00Z");
        let first = desired(&observed, t0);
        written_back(&mut observed, &first);
        observed.allocated = vec![running("notebook", 0), running("notebook", 1)];
        observed.waiting.insert("train".into(), 1);
        let out = desired(&observed, t0);
        assert!(spec(&out).gpus.iter().all(|g| g.next.is_none()));
        let status = out.pool_status["shared"].elastic.clone().unwrap();
        assert!(
            status
                .waiting_for
                .iter()
                .any(|w| w.contains("may not be drained")),
            "{status:?}"
        );

        // With `drain: Checkpointable`, preemptible notebooks under a CheckpointPolicy drain
        // for the waiting pod.
        let pool = &mut observed.pools[0].spec;
        pool.checkpoint_policy = Some("ckpt".into());
        pool.elastic.as_mut().unwrap().drain = ElasticDrain::Checkpointable;
        let out = desired(&observed, t0);
        assert_eq!(
            spec(&out).gpus.iter().filter(|g| g.next.is_some()).count(),
            1
        );
        // Not for a forecast, nor when the notebooks may not be preempted.
        observed.policies[0].spec.preemptible = false;
        let out = desired(&observed, t0);
        assert!(spec(&out).gpus.iter().all(|g| g.next.is_none()));
    }

    #[test]
    fn a_staged_re_cut_is_called_off_when_its_gpu_takes_work_first() {
        let mut observed = observed();
        let t0 = at("2026-12-07T10:00:00Z");
        let first = desired(&observed, t0);
        written_back(&mut observed, &first);
        observed.waiting.insert("train".into(), 1);
        let out = desired(&observed, t0);
        let index = spec(&out)
            .gpus
            .iter()
            .find(|g| g.next.is_some())
            .unwrap()
            .index;
        written_back(&mut observed, &out);
        // A pod got a slice of it before the taint was in place.
        observed.allocated = vec![running("notebook", index)];
        let out = desired(&observed, t0 + TimeDelta::seconds(3));
        let gpu = spec(&out).gpus.iter().find(|g| g.index == index).unwrap();
        assert!(gpu.next.is_none() && gpu.recut_at.is_none(), "{gpu:?}");
        assert!(gpu.assigned.layout.software.is_some());
    }

    #[test]
    fn the_forecast_lives_in_the_pool_status_and_a_new_operator_carries_on_from_it() {
        let mut observed = observed();
        let quarters = desired(&observed, at("2026-12-07T09:00:00Z")).node_specs["n1"].clone();
        observed.waiting.insert("train".into(), 3);
        let monday = at("2026-12-07T10:15:00Z");
        let out = desired(&observed, monday);
        written_back(&mut observed, &out);
        // An hour later (any operator: it reads only the pool's status) the hour is folded.
        observed.waiting.clear();
        let out = desired(&observed, monday + TimeDelta::hours(1));
        let forecast = out.pool_status["shared"]
            .elastic
            .as_ref()
            .and_then(|e| e.forecast.clone())
            .unwrap();
        let hour = elastic::hour_of_week(monday);
        assert_eq!(forecast.policies["train"][hour], Some(3.0));
        assert_eq!(forecast.hour, Some(hour as u32 + 1));
        // A week later, half an hour before that hour, nothing waits yet: an idle GPU is cut
        // whole ahead of the expected training pods.
        written_back(&mut observed, &out);
        observed.nodes[0].assigned = quarters.gpus.clone();
        let ahead = desired(
            &observed,
            monday + TimeDelta::days(7) - TimeDelta::minutes(30),
        );
        let staged: Vec<_> = ahead.node_specs["n1"]
            .gpus
            .iter()
            .filter_map(|g| g.next.as_ref())
            .collect();
        assert_eq!(staged.len(), 1, "{:?}", ahead.pool_status["shared"].elastic);
        assert_eq!(staged[0].assigned.shape.as_ref().unwrap().name, "whole");
        // With the forecast turned off, nothing moves.
        let pool = &mut observed.pools[0].spec;
        pool.elastic.as_mut().unwrap().forecast_horizon = Some("0s".parse().unwrap());
        let off = desired(
            &observed,
            monday + TimeDelta::days(7) - TimeDelta::minutes(30),
        );
        assert!(off.node_specs["n1"].gpus.iter().all(|g| g.next.is_none()));
    }
}
