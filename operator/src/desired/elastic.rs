//! Elastic layouts in the cluster: the operator's pass hands the cluster as read to
//! [`gpuslice_planning::shaping::shape`], which shapes each GPU of a pool whose elastic set is in
//! force by demand and stages its re-cuts (see there). Pure: [`crate::desired`] calls it.

use chrono::{DateTime, Utc};
use gpuslice_planning::cluster::ClusterPlan;
use gpuslice_planning::shaping::{NodeNow, Seen, Shaped};

use super::Observed;

/// Shapes the GPUs of every elastic pool in `plan` (the plan of `observed.nodes`, in order) at
/// `at`.
pub fn shape(observed: &Observed, plan: &mut ClusterPlan, at: DateTime<Utc>) -> Shaped {
    let nodes: Vec<NodeNow> = observed
        .nodes
        .iter()
        .map(|n| NodeNow {
            inventory: &n.inventory,
            assigned: &n.assigned,
        })
        .collect();
    gpuslice_planning::shaping::shape(
        &Seen {
            pools: &observed.pools,
            policies: &observed.policies,
            nodes: &nodes,
            allocated: &observed.allocated,
            waiting: &observed.waiting,
            prometheus: &observed.prometheus,
        },
        plan,
        at,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    use chrono::TimeDelta;
    use gpuslice_api::{ElasticDrain, GpuSlicePolicy};
    use gpuslice_planning::elastic;
    use gpuslice_planning::shaping::LEAD;

    use crate::desired::NodeReport;
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
            last_checkpoint: None,
            idle_since: None,
            max_loss: None,
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

    /// The GPUs with a re-cut staged.
    fn staged(out: &crate::desired::DesiredState) -> Vec<&gpuslice_api::GpuAssignment> {
        spec(out).gpus.iter().filter(|g| g.next.is_some()).collect()
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
        let staged = staged(&out);
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
    fn a_policy_only_a_shape_of_the_elastic_set_holds_is_ready_while_no_gpu_has_that_shape() {
        // Both GPUs in quarters; `train` (100Gi) fits only the set's `whole`: it is usable (the
        // pool re-cuts a GPU for it), not Degraded as a policy no slice could ever hold.
        let out = desired(&observed(), at("2026-12-07T10:00:00Z"));
        let ready = |policy: &str| {
            let status = &out.policy_status[policy];
            let c = &status.conditions[0];
            (c.status.clone(), c.reason.clone(), c.message.clone())
        };
        let (status, reason, message) = ready("train");
        assert_eq!(
            (status.as_str(), reason.as_str()),
            ("True", "ShapeFits"),
            "{message}"
        );
        assert!(message.contains("elastic shape \"whole\""), "{message}");
        assert_eq!(ready("notebook").1, "SliceFits");
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
        assert_eq!(staged(&out).len(), 1);
        // Not when the notebooks may not be preempted.
        observed.policies[0].spec.preemptible = false;
        let out = desired(&observed, t0);
        assert!(spec(&out).gpus.iter().all(|g| g.next.is_none()));
    }

    /// The pool as written back at `t0`, its work drainable (CheckpointPolicy `ckpt`,
    /// `drain: Checkpointable`), and a training pod waiting.
    fn training_waits_on_drainable_notebooks(t0: DateTime<Utc>) -> Observed {
        let mut observed = observed();
        let first = desired(&observed, t0);
        written_back(&mut observed, &first);
        let pool = &mut observed.pools[0].spec;
        pool.checkpoint_policy = Some("ckpt".into());
        pool.elastic.as_mut().unwrap().drain = ElasticDrain::Checkpointable;
        observed.waiting.insert("train".into(), 1);
        observed
    }

    #[test]
    fn the_drain_of_a_workload_idle_since_its_checkpoint_goes_first_and_loses_nothing() {
        // Both GPUs hold a notebook that checkpointed 30 minutes ago; a training pod waits. The
        // notebook on GPU 0 computes; the one on GPU 1 stopped computing before its checkpoint
        // (its agent says so): draining GPU 1 loses nothing, so it goes, not GPU 0.
        let t0 = at("2026-12-07T10:00:00Z");
        let mut observed = training_waits_on_drainable_notebooks(t0);
        let checkpointed = |gpu, idle_since| Allocated {
            last_checkpoint: Some(t0 - TimeDelta::minutes(30)),
            idle_since,
            ..running("notebook", gpu)
        };
        let recut = |observed: &Observed| {
            let out = desired(observed, t0);
            let staged: Vec<u32> = staged(&out).iter().map(|g| g.index).collect();
            let status = out.pool_status["shared"].elastic.clone().unwrap();
            (staged, status.decision)
        };
        observed.allocated = vec![
            checkpointed(0, None),
            checkpointed(1, Some(t0 - TimeDelta::minutes(40))),
        ];
        let (staged, decision) = recut(&observed);
        assert_eq!(staged, [1], "{decision}");
        assert!(
            decision.contains("(losing no work: idle since the last checkpoints)"),
            "{decision}"
        );
        // GPU 1's notebook computed for 20 of the 30 minutes since: still less than GPU 0's.
        observed.allocated[1].idle_since = Some(t0 - TimeDelta::minutes(10));
        let (staged, decision) = recut(&observed);
        assert_eq!(staged, [1], "{decision}");
        assert!(
            decision.contains("(losing at most 20 min of work since the last checkpoints)"),
            "{decision}"
        );
    }

    #[test]
    fn a_drain_past_its_checkpoint_policys_max_loss_waits_behind_one_within_its_own() {
        // GPU 0's notebook checkpointed 5 min ago under a maxLoss of 1 min; GPU 1's 20 min ago
        // under 30 min: GPU 1 is drained for the training pod, though it loses more.
        let t0 = at("2026-12-07T10:00:00Z");
        let mut observed = training_waits_on_drainable_notebooks(t0);
        let notebook = |gpu, minutes_ago, max_loss_minutes: f64| Allocated {
            last_checkpoint: Some(t0 - TimeDelta::minutes(minutes_ago)),
            max_loss: Some(max_loss_minutes * 60.0),
            ..running("notebook", gpu)
        };
        observed.allocated = vec![notebook(0, 5, 1.0), notebook(1, 20, 30.0)];
        let out = desired(&observed, t0);
        let staged: Vec<u32> = staged(&out).iter().map(|g| g.index).collect();
        assert_eq!(staged, [1], "{:?}", out.pool_status["shared"].elastic);
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

    #[test]
    fn what_prometheus_expects_shapes_idle_gpus_and_a_failed_read_changes_nothing() {
        let mut observed = observed();
        let t0 = at("2026-12-07T10:00:00Z");
        let first = desired(&observed, t0);
        written_back(&mut observed, &first);
        let pool = &mut observed.pools[0].spec;
        pool.elastic.as_mut().unwrap().prometheus = Some(gpuslice_api::ElasticPrometheus {
            url: "http://prometheus:9090".into(),
            query: "gpuslice_expected".into(),
        });
        let signal = |out: &crate::desired::DesiredState| {
            out.pool_status["shared"]
                .conditions
                .iter()
                .find(|c| c.type_ == "ElasticSignal")
                .cloned()
                .unwrap()
        };
        // Not read yet: said, and nothing moves.
        let out = desired(&observed, t0);
        assert_eq!(signal(&out).reason, "PrometheusNotReadYet");
        assert!(spec(&out).gpus.iter().all(|g| g.next.is_none()));
        // Prometheus expects a training pod: an idle GPU is cut whole ahead of it.
        observed.prometheus.insert(
            "shared".into(),
            Ok(BTreeMap::from([("train".to_string(), 1.0)])),
        );
        let out = desired(&observed, t0);
        let c = signal(&out);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", "PrometheusRead")
        );
        assert!(c.message.contains("train 1"), "{}", c.message);
        assert_eq!(
            spec(&out).gpus.iter().filter(|g| g.next.is_some()).count(),
            1
        );
        // It cannot be read: the condition says why, and no re-cut is made on missing data.
        observed.prometheus.insert(
            "shared".into(),
            Err("Prometheus http://prometheus:9090: connection refused".into()),
        );
        let out = desired(&observed, t0);
        let c = signal(&out);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "PrometheusUnavailable")
        );
        assert!(
            c.message
                .contains("connection refused; the queue and the learned forecast stay in force")
        );
        assert!(spec(&out).gpus.iter().all(|g| g.next.is_none()));
    }

    #[test]
    fn a_window_replaces_the_elastic_set_and_a_window_without_one_is_staged_as_usual() {
        let mut observed = observed();
        let night: gpuslice_api::TimeWindow = serde_yaml::from_str(
            "{name: night, timeZone: UTC, start: '22:00', end: '06:00', layout: {exclusive: {}}, elastic: {shapes: [{name: whole, layout: {exclusive: {}}}], maxInFlight: 50}}",
        )
        .unwrap();
        observed.pools[0].spec.windows = vec![night];
        let evening = at("2026-12-07T21:00:00Z");
        let out = desired(&observed, evening);
        // The night brings its own set: nothing is staged for the boundary itself.
        assert!(
            spec(&out).gpus.iter().all(|g| g.next.is_none()),
            "{:?}",
            spec(&out).gpus
        );
        written_back(&mut observed, &out);
        let evening_gpus = spec(&out).gpus.clone();
        // At night only whole GPUs are allowed: the quarters, in no shape of the night's set,
        // go to the window's layout once idle — staged like a re-cut, kept on later passes. A
        // busy GPU keeps its quarters until it is idle.
        observed.allocated = vec![running("notebook", 0)];
        let night = at("2026-12-07T23:00:00Z");
        let out = desired(&observed, night);
        let staged = staged(&out);
        assert_eq!(staged.len(), 1, "{:?}", spec(&out).gpus);
        assert_eq!(staged[0].index, 1);
        let next = staged[0].next.as_ref().unwrap();
        assert_eq!(next.assigned.shape.as_ref().unwrap().name, "whole");
        assert_eq!(next.assigned.window.as_deref(), Some("night"));
        assert!(
            staged[0].assigned.layout.software.is_some(),
            "quarters until the switch"
        );
        let status = out.pool_status["shared"].elastic.clone().unwrap();
        assert!(
            status.shapes.is_empty(),
            "quarters are not in the night's set: {status:?}"
        );
        written_back(&mut observed, &out);
        let later = desired(&observed, night + TimeDelta::seconds(5));
        assert_eq!(spec(&later).gpus, spec(&out).gpus, "the same staging");
        observed.allocated.clear();
        observed.nodes[0].assigned = evening_gpus;
        observed.pools[0].status = None;
        // A night window without a set has its own layout, staged ahead of the boundary.
        observed.pools[0].spec.windows[0].elastic = None;
        let out = desired(&observed, evening);
        for g in &spec(&out).gpus {
            let next = g.next.as_ref().expect("the night layout staged");
            assert_eq!(
                gpuslice_api::chrono_of(&next.at),
                Some(at("2026-12-07T22:00:00Z"))
            );
            assert!(next.assigned.layout.exclusive.is_some() && next.assigned.shape.is_none());
        }
        let night = desired(&observed, at("2026-12-07T23:00:00Z"));
        assert!(night.pool_status["shared"].elastic.is_none());
    }
}
