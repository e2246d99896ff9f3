//! The queue's metrics: pools' fragmentation, pods waiting, time to admission and preemptions
//! (under `gpuslice_queue_`), and how a pass sets them.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use super::Plan;

/// The queue's metrics (under `gpuslice_queue_`).
#[derive(Clone)]
pub struct QueueMetrics {
    fragmentation: Family<PoolLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    waiting: Family<PoolNamespace, Gauge>,
    wait: Family<PoolNamespace, Histogram>,
    preemptions: Family<PreemptionLabel, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabel {
    pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolNamespace {
    pool: String,
    namespace: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PreemptionLabel {
    pool: String,
    /// `priority` or `fair_share`.
    reason: String,
}

impl QueueMetrics {
    pub fn register(registry: &mut Registry) -> QueueMetrics {
        let m = QueueMetrics {
            fragmentation: Family::default(),
            waiting: Family::default(),
            wait: Family::new_with_constructor(|| {
                Histogram::new([1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 14400.0])
            }),
            preemptions: Family::default(),
        };
        registry.sub_registry_with_prefix("gpuslice").register(
            "pool_fragmentation_percent",
            "Free slice memory of a pool that its policies cannot use, weighted by their demand (allocated and waiting pods): the FGD paper's expected fragment on the pool's slices",
            m.fragmentation.clone(),
        );
        let r = registry.sub_registry_with_prefix("gpuslice_queue");
        r.register(
            "waiting_pods",
            "Pods waiting at the gate gpuslice.io/queue, per pool and namespace",
            m.waiting.clone(),
        );
        r.register_with_unit(
            "wait",
            "Time from a pod's creation to its admission by the queue",
            Unit::Seconds,
            m.wait.clone(),
        );
        r.register(
            "preemptions",
            "Slices the queue took back for waiting pods, by why",
            m.preemptions.clone(),
        );
        m
    }

    /// Sets the pools' fragmentation and their pods waiting per namespace from a pass's plan.
    pub(super) fn record_plan(&self, plan: &Plan) {
        self.fragmentation.clear();
        for (pool, percent) in &plan.fragmentation {
            self.fragmentation
                .get_or_create(&PoolLabel { pool: pool.clone() })
                .set(*percent);
        }
        self.waiting.clear();
        for ((pool, namespace), n) in &plan.waiting {
            self.waiting
                .get_or_create(&PoolNamespace {
                    pool: pool.clone(),
                    namespace: namespace.clone(),
                })
                .set(*n);
        }
    }

    /// Counts a pod of `namespace` admitted into `pool` after waiting `seconds`.
    pub(super) fn admitted(&self, pool: String, namespace: String, seconds: f64) {
        self.wait
            .get_or_create(&PoolNamespace { pool, namespace })
            .observe(seconds);
    }

    /// Counts a slice of `pool` taken back, for `reason` (`priority` or `fair_share`).
    pub(super) fn preempted(&self, pool: String, reason: &str) {
        self.preemptions
            .get_or_create(&PreemptionLabel {
                pool,
                reason: reason.into(),
            })
            .inc();
    }
}
