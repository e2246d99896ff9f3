//! The operator's Prometheus metrics: pools, windows, policies and passes.

use std::collections::BTreeMap;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// The operator's metrics.
#[derive(Clone)]
pub struct Metrics {
    pub(super) reconciles: Counter,
    pub(super) errors: Counter,
    pub(super) duration: Histogram,
    pool_nodes: Family<PoolLabel, Gauge>,
    pool_gpus: Family<PoolLabel, Gauge>,
    pool_slices: Family<PoolLabel, Gauge>,
    pool_allocated: Family<PoolLabel, Gauge>,
    pool_condition: Family<ConditionLabel, Gauge>,
    pool_window: Family<WindowLabel, Gauge>,
    policy_allocated: Family<PolicyLabel, Gauge>,
    policy_waiting: Family<PolicyLabel, Gauge>,
    pool_elastic_gpus: Family<ShapeLabel, Gauge>,
    pool_elastic_recutting: Family<PoolLabel, Gauge>,
    pub(super) queue: crate::queue::QueueMetrics,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabel {
    pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConditionLabel {
    pool: String,
    /// `Ready`, `Progressing` or `Degraded`.
    condition: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WindowLabel {
    pool: String,
    /// The window in force, `default` outside every window.
    window: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShapeLabel {
    pool: String,
    /// A shape of the pool's elastic set in force.
    shape: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabel {
    policy: String,
    pool: String,
    /// The policy's `class` (training, inference, interactive; empty when it names none).
    class: String,
}

impl Metrics {
    /// Metrics registered under `gpuslice_`.
    pub fn register(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            reconciles: Counter::default(),
            errors: Counter::default(),
            duration: Histogram::new(gpuslice_runtime::duration_buckets()),
            pool_nodes: Family::default(),
            pool_gpus: Family::default(),
            pool_slices: Family::default(),
            pool_allocated: Family::default(),
            pool_condition: Family::default(),
            pool_window: Family::default(),
            policy_allocated: Family::default(),
            policy_waiting: Family::default(),
            pool_elastic_gpus: Family::default(),
            pool_elastic_recutting: Family::default(),
            queue: crate::queue::QueueMetrics::register(registry),
        };
        let r = registry.sub_registry_with_prefix("gpuslice");
        r.register(
            "operator_reconciles",
            "Reconcile passes",
            m.reconciles.clone(),
        );
        r.register(
            "operator_reconcile_errors",
            "Writes that failed (retried on the next pass)",
            m.errors.clone(),
        );
        r.register(
            "operator_reconcile_duration_seconds",
            "Time of one reconcile pass, writes included",
            m.duration.clone(),
        );
        r.register("pool_nodes", "Nodes a pool selects", m.pool_nodes.clone());
        r.register("pool_gpus", "GPUs in a pool", m.pool_gpus.clone());
        r.register("pool_slices", "Slices in a pool", m.pool_slices.clone());
        r.register(
            "pool_slices_allocated",
            "Slices of a pool allocated to pods (ResourceClaims)",
            m.pool_allocated.clone(),
        );
        r.register(
            "pool_condition",
            "1 while the pool's condition is True, else 0 (Ready, Progressing: nodes converging or a transition blocked, Degraded)",
            m.pool_condition.clone(),
        );
        r.register(
            "pool_window",
            "1 for the window in force in each pool (window=\"default\" outside every window)",
            m.pool_window.clone(),
        );
        r.register(
            "policy_slices_allocated",
            "Slices allocated to pods through a policy's DeviceClass",
            m.policy_allocated.clone(),
        );
        r.register(
            "policy_pods_waiting",
            "Pods naming a policy that wait at the queue's gate",
            m.policy_waiting.clone(),
        );
        r.register(
            "pool_elastic_gpus",
            "GPUs of an elastic pool given each shape of the set in force",
            m.pool_elastic_gpus.clone(),
        );
        r.register(
            "pool_elastic_recutting",
            "GPUs of an elastic pool staged to be re-cut to another shape",
            m.pool_elastic_recutting.clone(),
        );
        m
    }

    /// Sets the per-pool and per-policy gauges from the statuses a pass wants.
    pub(super) fn record_state(
        &self,
        want: &crate::desired::DesiredState,
        pool_and_class: &BTreeMap<String, (String, String)>,
    ) {
        for family in [
            &self.pool_nodes,
            &self.pool_gpus,
            &self.pool_slices,
            &self.pool_allocated,
        ] {
            family.clear();
        }
        self.pool_condition.clear();
        self.pool_window.clear();
        self.policy_allocated.clear();
        self.policy_waiting.clear();
        self.pool_elastic_gpus.clear();
        self.pool_elastic_recutting.clear();
        for (pool, status) in &want.pool_status {
            if let Some(elastic) = &status.elastic {
                for (shape, gpus) in &elastic.shapes {
                    self.pool_elastic_gpus
                        .get_or_create(&ShapeLabel {
                            pool: pool.clone(),
                            shape: shape.clone(),
                        })
                        .set(i64::from(*gpus));
                }
                self.pool_elastic_recutting
                    .get_or_create(&PoolLabel { pool: pool.clone() })
                    .set(i64::from(elastic.recutting));
            }
            let label = PoolLabel { pool: pool.clone() };
            for (family, value) in [
                (&self.pool_nodes, status.nodes),
                (&self.pool_gpus, status.gpus),
                (&self.pool_slices, status.slices.total),
                (&self.pool_allocated, status.slices.allocated),
            ] {
                family.get_or_create(&label).set(i64::from(value));
            }
            for c in &status.conditions {
                self.pool_condition
                    .get_or_create(&ConditionLabel {
                        pool: pool.clone(),
                        condition: c.type_.clone(),
                    })
                    .set(i64::from(c.status == "True"));
            }
            self.pool_window
                .get_or_create(&WindowLabel {
                    pool: pool.clone(),
                    window: status
                        .active_window
                        .clone()
                        .unwrap_or_else(|| gpuslice_api::DEFAULT_WINDOW.into()),
                })
                .set(1);
        }
        for (policy, status) in &want.policy_status {
            let (pool, class) = pool_and_class.get(policy).cloned().unwrap_or_default();
            let label = PolicyLabel {
                policy: policy.clone(),
                pool,
                class,
            };
            self.policy_allocated
                .get_or_create(&label)
                .set(i64::from(status.allocated));
            self.policy_waiting
                .get_or_create(&label)
                .set(i64::from(status.waiting));
        }
    }
}
