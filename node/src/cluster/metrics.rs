//! The agent's Prometheus metrics (`/metrics`): per pass, per GPU and per slice; names and
//! labels are listed in `docs/observability.md`.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::pass::{Eviction, Pass};
use crate::protections::faults::Quarantine;

/// The agent's metrics.
#[derive(Clone)]
pub struct Metrics {
    passes: Counter,
    errors: Counter,
    operations: Counter,
    blocked_seconds: Counter<f64, AtomicU64>,
    duration: Histogram,
    slice_limit: Family<SliceLabel, Gauge>,
    slice_guarantee: Family<SliceLabel, Gauge>,
    evictions: Family<EvictionLabel, Counter>,
    blocked: Gauge,
    gpu_memory_total: Family<GpuLabel, Gauge>,
    gpu_memory_used: Family<GpuLabel, Gauge>,
    gpu_utilization: Family<GpuLabel, Gauge>,
    gpu_temperature: Family<GpuLabel, Gauge>,
    gpu_power: Family<GpuLabel, Gauge<f64, AtomicU64>>,
    gpu_switches: Family<GpuLabel, Counter>,
    mps_daemon_up: Family<GpuLabel, Gauge>,
    gpu_xids: Family<XidLabel, Counter>,
    memory_overruns: Family<OverrunLabel, Counter>,
    compute_overruns: Family<OverrunLabel, Counter>,
    stray_processes: Family<StrayLabel, Counter>,
    quarantined: Family<QuarantineLabel, Gauge>,
    cache_hits: Family<CacheLabel, Counter>,
    cache_misses: Family<CacheLabel, Counter>,
    cache_evictions: Family<CacheLabel, Counter>,
    cache_bytes: Family<CacheLabel, Gauge>,
    cache_capacity: Family<CacheLabel, Gauge>,
    slice_memory: Family<HolderLabel, Gauge>,
    slice_memory_used: Family<HolderLabel, Gauge>,
    slice_memory_peak: Family<HolderLabel, Gauge>,
    slice_since_checkpoint: Family<HolderLabel, Gauge>,
    slice_holder: Family<HolderLabel, Gauge>,
    slice_refusals: Family<SliceKey, Counter>,
    slice_compute_used: Family<SliceKey, Counter<f64, AtomicU64>>,
    slice_compute_busy: Family<SliceKey, Counter<f64, AtomicU64>>,
    slice_compute_wait: Family<SliceKey, Counter<f64, AtomicU64>>,
    slice_grants: Family<SliceKey, Counter>,
    /// The slices whose counters the last pass set (to drop those of slices gone).
    counted: std::sync::Arc<std::sync::Mutex<std::collections::HashSet<SliceKey>>>,
}

/// A slice, for its counters: the labels stay while the slice is cut, whoever holds it, so that
/// a counter never starts over at a hand-over (`slice_holder` says who holds it).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SliceKey {
    gpu: String,
    slice: String,
    kind: String,
    pool: String,
}

/// Brings a counter up to `total`, a running total kept elsewhere (a ledger, an arbiter); one
/// whose source started again from zero starts again too.
fn follow<K, N, A>(family: &Family<K, Counter<N, A>>, key: &K, total: N)
where
    K: Clone + std::hash::Hash + Eq,
    N: Copy + PartialOrd + std::ops::Sub<Output = N>,
    A: prometheus_client::metrics::counter::Atomic<N> + Default,
{
    let now = family.get_or_create(key).get();
    if total >= now {
        family.get_or_create(key).inc_by(total - now);
    } else {
        family.remove(key);
        family.get_or_create(key).inc_by(total);
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabel {
    gpu: String,
    model: String,
    /// The pool the GPU is in now (empty: none).
    pool: String,
}

/// A slice, and who holds it (empty while free). One series per slice in force: at most a
/// GPU's slice count (≤ 64 software slices, ≤ 7 MIG instances) × its GPUs per node.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HolderLabel {
    gpu: String,
    slice: String,
    /// `software` or `mig`.
    kind: String,
    pool: String,
    policy: String,
    /// The policy's `class` (training, inference, interactive; empty when it names none).
    class: String,
    namespace: String,
    pod: String,
}

/// One series per (GPU, XID code) seen since the agent started.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct XidLabel {
    gpu: String,
    xid: String,
}

/// One series per (slice, what the memory watchdog did).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OverrunLabel {
    gpu: String,
    slice: String,
    action: String,
}

/// A GPU and what the watchdog did about a process there that holds no slice of it.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StrayLabel {
    gpu: String,
    action: String,
}

/// A pool's dataset cache.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheLabel {
    pool: String,
}

/// A slice or GPU (slice empty) out of service.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QuarantineLabel {
    gpu: String,
    slice: String,
    xid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EvictionLabel {
    /// `preemption`, `window` or `fault` (a GPU error drained the GPU).
    cause: String,
    /// `taken`, `grace_over` or `none` (no checkpoint policy).
    checkpoint: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SliceLabel {
    slice: String,
}

/// What a pass's metrics read besides the pass itself.
pub struct Readings<'a> {
    pub state: &'a gpuslice_contract::paths::StateDir,
    /// NVML's figures for each GPU.
    pub telemetry: &'a [crate::gpu::nvml::GpuTelemetry],
    /// The arbiters' figures per GPU: each slice's usage, and hand-overs.
    pub compute: &'a BTreeMap<u32, (BTreeMap<String, crate::workloads::arbiter::Usage>, u64)>,
    /// Each policy's class, by policy name.
    pub classes: &'a BTreeMap<String, String>,
}

impl Metrics {
    /// One pod this agent asked the operator to evict.
    pub(super) fn count_eviction(&self, eviction: &Eviction) {
        self.evictions
            .get_or_create(&EvictionLabel {
                cause: eviction.cause.into(),
                checkpoint: eviction.checkpoint.into(),
            })
            .inc();
    }

    /// Metrics registered under `gpuslice_agent_`.
    pub fn register(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            passes: Counter::default(),
            errors: Counter::default(),
            operations: Counter::default(),
            blocked_seconds: Counter::default(),
            duration: Histogram::new(gpuslice_runtime::duration_buckets()),
            slice_limit: Family::default(),
            slice_guarantee: Family::default(),
            evictions: Family::default(),
            blocked: Gauge::default(),
            gpu_memory_total: Family::default(),
            memory_overruns: Family::default(),
            compute_overruns: Family::default(),
            stray_processes: Family::default(),
            gpu_memory_used: Family::default(),
            gpu_utilization: Family::default(),
            gpu_temperature: Family::default(),
            gpu_power: Family::default(),
            gpu_switches: Family::default(),
            mps_daemon_up: Family::default(),
            gpu_xids: Family::default(),
            quarantined: Family::default(),
            cache_hits: Family::default(),
            cache_misses: Family::default(),
            cache_evictions: Family::default(),
            cache_bytes: Family::default(),
            cache_capacity: Family::default(),
            slice_memory: Family::default(),
            slice_memory_used: Family::default(),
            slice_memory_peak: Family::default(),
            slice_since_checkpoint: Family::default(),
            slice_holder: Family::default(),
            slice_refusals: Family::default(),
            slice_compute_used: Family::default(),
            slice_compute_busy: Family::default(),
            slice_compute_wait: Family::default(),
            slice_grants: Family::default(),
            counted: Default::default(),
        };
        let r = registry.sub_registry_with_prefix("gpuslice_agent");
        m.register_pass(r);
        m.register_gpus(r);
        m.register_slices(r);
        m.register_caches(r);
        m
    }

    /// The passes: how many, how long, what they did and what blocked them; evictions asked.
    fn register_pass(&self, r: &mut Registry) {
        r.register(
            "transition_blocked",
            "1 while a layout change waits for busy slices (their pods draining), else 0",
            self.blocked.clone(),
        );
        r.register("passes", "Reconcile passes", self.passes.clone());
        r.register(
            "errors",
            "GPUs a pass could not bring to their layout",
            self.errors.clone(),
        );
        r.register(
            "operations",
            "MIG and slice-table operations applied",
            self.operations.clone(),
        );
        r.register(
            "blocked_seconds",
            "Time transitions spent waiting for busy instances",
            self.blocked_seconds.clone(),
        );
        r.register(
            "pass_duration_seconds",
            "Time of one pass, NVML changes included",
            self.duration.clone(),
        );
        r.register(
            "evictions",
            "Pods evicted to take their slices back (a preemption, a window change or a GPU fault), by whether they checkpointed",
            self.evictions.clone(),
        );
    }

    /// Each GPU as NVML reports it, its XID errors, and what fault isolation took out.
    fn register_gpus(&self, r: &mut Registry) {
        r.register(
            "gpu_memory_bytes",
            "Memory of each GPU, as NVML reports it",
            self.gpu_memory_total.clone(),
        );
        r.register(
            "gpu_memory_used_bytes",
            "Memory in use on each GPU, as NVML reports it (every process and instance)",
            self.gpu_memory_used.clone(),
        );
        r.register(
            "gpu_utilization_percent",
            "Percent of NVML's last sample period a kernel ran on the GPU (absent in MIG mode, where NVML gives none)",
            self.gpu_utilization.clone(),
        );
        r.register(
            "gpu_temperature_celsius",
            "GPU core temperature (NVML)",
            self.gpu_temperature.clone(),
        );
        r.register(
            "gpu_power_watts",
            "GPU board power draw (NVML)",
            self.gpu_power.clone(),
        );
        r.register(
            "gpu_compute_handovers",
            "Times the compute arbiter gave a GPU to another process of its software slices",
            self.gpu_switches.clone(),
        );
        r.register(
            "mps_daemon_up",
            "For each GPU with MPS slices: 1 while its MPS control daemon answers, 0 when the agent could not start it",
            self.mps_daemon_up.clone(),
        );
        r.register(
            "gpu_xid_errors",
            "XID critical errors NVML reported for each GPU since the agent started, by XID code",
            self.gpu_xids.clone(),
        );
        r.register(
            "quarantined",
            "1 for each slice (or whole GPU: slice empty) taken out of service after an XID error, by the XID",
            self.quarantined.clone(),
        );
    }

    /// Each slice: its memory and who holds it, and its compute share as the arbiter keeps it.
    fn register_slices(&self, r: &mut Registry) {
        r.register(
            "slice_memory_overruns",
            "Times the memory watchdog found a software slice holding more than its cap (NVML's per-process figures) and signalled (action=signalled), killed (killed) or failed to stop (failed) its biggest process",
            self.memory_overruns.clone(),
        );
        r.register(
            "slice_compute_overruns",
            "Times the watchdog found a software slice using more of its GPU's time than its compute limit (NVML's per-process SM use; kernels launched around the shim) and signalled (action=signalled), killed (killed) or failed to stop (failed) its busiest process",
            self.compute_overruns.clone(),
        );
        r.register(
            "stray_gpu_processes",
            "Times the watchdog found a process on a pool's GPU that holds no slice of that GPU (a workload given the GPU past its slice) and signalled (action=signalled), killed (killed), only reported (reported, --stray-processes report) or failed to stop (failed) it",
            self.stray_processes.clone(),
        );
        r.register(
            "slice_memory_bytes",
            "Memory of a slice (a software slice's cap before the policy's headroom; a MIG instance's memory)",
            self.slice_memory.clone(),
        );
        r.register(
            "slice_memory_used_bytes",
            "Device memory the workload of a slice holds now (a software slice: the shim's ledger, exact across processes; a MIG instance: NVML)",
            self.slice_memory_used.clone(),
        );
        r.register(
            "slice_memory_peak_bytes",
            "The most the workload of a software slice held at once since it took the slice (the shim's ledger)",
            self.slice_memory_peak.clone(),
        );
        r.register(
            "slice_seconds_since_checkpoint",
            "Seconds since the workload of a slice last wrote its checkpoint-done marker (slices whose workload has written one); its CheckpointPolicy's interval is how often it should",
            self.slice_since_checkpoint.clone(),
        );
        r.register(
            "slice_holder",
            "1 for each slice, labelled with who holds it (policy, class, namespace, pod; empty while free): join a slice's counters to it on (instance, slice)",
            self.slice_holder.clone(),
        );
        r.register(
            "slice_memory_refusals",
            "Allocations the shim refused because they would pass the software slice's cap",
            self.slice_refusals.clone(),
        );
        r.register(
            "slice_compute_used_seconds",
            "GPU time a software slice's processes held (the compute arbiter)",
            self.slice_compute_used.clone(),
        );
        r.register(
            "slice_compute_busy_seconds",
            "Time a software slice had work: holding the GPU or waiting for it; used / busy is the share it got while it wanted the GPU, what its guarantee promises",
            self.slice_compute_busy.clone(),
        );
        r.register(
            "slice_compute_wait_seconds",
            "Time a software slice's processes spent waiting for the GPU, from asking to being granted, summed over processes",
            self.slice_compute_wait.clone(),
        );
        r.register(
            "slice_compute_grants",
            "Times the compute arbiter gave the GPU to a process of a software slice",
            self.slice_grants.clone(),
        );
        r.register(
            "slice_compute_limit_percent",
            "The compute cap the arbiter enforces on a software slice (its claim's policy's limit, else the slice's share)",
            self.slice_limit.clone(),
        );
        r.register(
            "slice_compute_guarantee_percent",
            "The compute floor the arbiter gives a software slice under contention",
            self.slice_guarantee.clone(),
        );
    }

    /// The pools' dataset caches.
    fn register_caches(&self, r: &mut Registry) {
        r.register(
            "cache_hits",
            "Dataset files the pool's local cache gave from disk, since the agent started",
            self.cache_hits.clone(),
        );
        r.register(
            "cache_misses",
            "Dataset files the pool's local cache fetched from their source, since the agent started",
            self.cache_misses.clone(),
        );
        r.register(
            "cache_evictions",
            "Files the pool's local cache dropped (least recently used) to stay within its size",
            self.cache_evictions.clone(),
        );
        r.register(
            "cache_bytes",
            "Bytes the pool's local cache holds now",
            self.cache_bytes.clone(),
        );
        r.register(
            "cache_capacity_bytes",
            "The most the pool's local cache may hold",
            self.cache_capacity.clone(),
        );
    }

    /// The dataset caches' figures now.
    pub fn record_caches(
        &self,
        caches: &BTreeMap<String, std::sync::Arc<crate::protections::cache::Cache>>,
    ) {
        use std::sync::atomic::Ordering::Relaxed;
        for (pool, cache) in caches {
            let key = CacheLabel { pool: pool.clone() };
            follow(&self.cache_hits, &key, cache.stats.hits.load(Relaxed));
            follow(&self.cache_misses, &key, cache.stats.misses.load(Relaxed));
            follow(
                &self.cache_evictions,
                &key,
                cache.stats.evictions.load(Relaxed),
            );
            let gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
            self.cache_bytes
                .get_or_create(&key)
                .set(gauge(cache.used()));
            self.cache_capacity
                .get_or_create(&key)
                .set(gauge(cache.capacity()));
        }
    }

    /// The quarantines in force now.
    pub fn record_quarantines(&self, list: &[Quarantine]) {
        self.quarantined.clear();
        for q in list {
            self.quarantined
                .get_or_create(&QuarantineLabel {
                    gpu: q.gpu.to_string(),
                    slice: q.slice.clone().unwrap_or_default(),
                    xid: q.xid.to_string(),
                })
                .set(1);
        }
    }

    /// Counts an XID critical error NVML reported for a GPU.
    /// Counts what the watchdog did: a slice over its memory cap or compute limit, or a stray
    /// process.
    pub fn count_watchdog(&self, report: &crate::protections::watchdog::Report) {
        use crate::protections::watchdog::Finding;
        let action = report.step.label().to_string();
        match &report.finding {
            Finding::Overrun(o) => self.memory_overruns.get_or_create(&OverrunLabel {
                gpu: o.holding.gpu.to_string(),
                slice: o.holding.slice.clone(),
                action,
            }),
            Finding::Compute(c) => self.compute_overruns.get_or_create(&OverrunLabel {
                gpu: c.holding.gpu.to_string(),
                slice: c.holding.slice.clone(),
                action,
            }),
            Finding::Stray(s) => self.stray_processes.get_or_create(&StrayLabel {
                gpu: s.gpu.to_string(),
                action,
            }),
        }
        .inc();
    }

    pub fn count_xid(&self, gpu: u32, xid: u64) {
        self.gpu_xids
            .get_or_create(&XidLabel {
                gpu: gpu.to_string(),
                xid: xid.to_string(),
            })
            .inc();
    }

    pub(super) fn record(
        &self,
        pass: &Pass,
        readings: &Readings<'_>,
        started: std::time::Instant,
        blocked_since: &mut Option<std::time::Instant>,
    ) {
        self.blocked.set(i64::from(pass.blocked()));
        self.record_gpus(pass, readings);
        self.record_slices(pass, readings);
        self.passes.inc();
        self.errors
            .inc_by(pass.outcomes.iter().filter(|o| o.error.is_some()).count() as u64);
        self.operations.inc_by(
            pass.outcomes
                .iter()
                .filter(|o| o.blocked_by.is_empty())
                .map(|o| o.ops.len() as u64)
                .sum(),
        );
        if let Some(since) = *blocked_since {
            self.blocked_seconds.inc_by(since.elapsed().as_secs_f64());
        }
        *blocked_since = pass.blocked().then(std::time::Instant::now);
        self.slice_limit.clear();
        self.slice_guarantee.clear();
        for (slice, share) in pass.shares.values().flat_map(|gpu| &gpu.slices) {
            let label = SliceLabel {
                slice: slice.clone(),
            };
            self.slice_limit
                .get_or_create(&label)
                .set(i64::from(share.limit));
            self.slice_guarantee
                .get_or_create(&label)
                .set(i64::from(share.guarantee));
        }
        self.duration.observe(started.elapsed().as_secs_f64());
    }

    /// Each GPU's memory, load, temperature and power (NVML) and hand-overs (the arbiter).
    fn record_gpus(&self, pass: &Pass, readings: &Readings<'_>) {
        for family in [
            &self.gpu_memory_total,
            &self.gpu_memory_used,
            &self.gpu_utilization,
            &self.gpu_temperature,
        ] {
            family.clear();
        }
        self.gpu_power.clear();
        self.gpu_switches.clear();
        self.mps_daemon_up.clear();
        for gpu in &pass.inventory.gpus {
            let label = GpuLabel {
                gpu: gpu.index.to_string(),
                model: gpu.model.clone(),
                pool: pool_of(pass, gpu.index),
            };
            let set = |family: &Family<GpuLabel, Gauge>, value: Option<u64>| {
                if let Some(v) = value {
                    family
                        .get_or_create(&label)
                        .set(i64::try_from(v).unwrap_or(i64::MAX));
                }
            };
            set(
                &self.gpu_memory_total,
                gpu.memory
                    .as_ref()
                    .and_then(|m| gpuslice_api::bytes_of(&m.0).ok()),
            );
            if let Some(t) = readings.telemetry.iter().find(|t| t.index == gpu.index) {
                set(&self.gpu_memory_used, t.memory_used_bytes);
                set(&self.gpu_utilization, t.utilization_percent.map(u64::from));
                set(&self.gpu_temperature, t.temperature_celsius.map(u64::from));
                if let Some(mw) = t.power_milliwatts {
                    self.gpu_power
                        .get_or_create(&label)
                        .set(f64::from(mw) / 1000.0);
                }
            }
            if let Some((_, switches)) = readings.compute.get(&gpu.index) {
                self.gpu_switches.get_or_create(&label).inc_by(*switches);
            }
            if let Some(up) = pass.mps_daemons.get(&gpu.index) {
                self.mps_daemon_up.get_or_create(&label).set(i64::from(*up));
            }
        }
    }

    /// Each slice's size, what its workload holds, its high-water mark and refusals (its
    /// ledger), and what the arbiter gave it; software slices and MIG instances, with who holds
    /// them. Gauges are rebuilt every pass (a slice changing hands replaces its series); counters
    /// keep the slice's labels and follow the ledgers' and arbiters' running totals.
    fn record_slices(&self, pass: &Pass, readings: &Readings<'_>) {
        self.slice_memory.clear();
        self.slice_memory_used.clear();
        self.slice_memory_peak.clear();
        self.slice_since_checkpoint.clear();
        let now = chrono::Utc::now();
        let since_checkpoint = |label: &HolderLabel| {
            if let Some(t) = pass.checkpoints.get(&label.slice) {
                self.slice_since_checkpoint
                    .get_or_create(label)
                    .set((now - *t).num_seconds().max(0));
            }
        };
        self.slice_holder.clear();
        let mut last = self.counted.lock().unwrap_or_else(|p| p.into_inner());
        let mut counted = std::collections::HashSet::new();
        let bytes = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for gpu in &pass.inventory.gpus {
            let label = |slice: &str, kind: &str| {
                let claim = pass.claims.iter().find(|c| c.slice == slice);
                let (namespace, pod) = claim
                    .and_then(|c| c.pod_names.first())
                    .and_then(|p| p.split_once('/'))
                    .map_or((String::new(), String::new()), |(ns, name)| {
                        (ns.to_string(), name.to_string())
                    });
                let policy = claim.and_then(|c| c.policy.clone()).unwrap_or_default();
                HolderLabel {
                    gpu: gpu.index.to_string(),
                    slice: slice.to_string(),
                    kind: kind.to_string(),
                    pool: pool_of(pass, gpu.index),
                    class: readings.classes.get(&policy).cloned().unwrap_or_default(),
                    policy,
                    namespace,
                    pod,
                }
            };
            let usage = readings.compute.get(&gpu.index).map(|(u, _)| u);
            for slice in &gpu.slices {
                let label = label(&slice.id, "software");
                since_checkpoint(&label);
                let key = SliceKey {
                    gpu: label.gpu.clone(),
                    slice: label.slice.clone(),
                    kind: label.kind.clone(),
                    pool: label.pool.clone(),
                };
                self.slice_holder.get_or_create(&label).set(1);
                let size = gpuslice_api::bytes_of(&slice.memory.0).unwrap_or(0);
                self.slice_memory.get_or_create(&label).set(bytes(size));
                // Opened only if there (opening makes one); a slice without one holds nothing.
                let path = readings.state.slice_ledger(&slice.id);
                let ledger = path
                    .exists()
                    .then(|| gpuslice_shm::Ledger::open(&path).ok())
                    .flatten();
                let (used, peak, refusals) = ledger
                    .as_ref()
                    .map_or((0, 0, 0), |l| (l.total(), l.peak(), l.refusals()));
                self.slice_memory_used
                    .get_or_create(&label)
                    .set(bytes(used));
                self.slice_memory_peak
                    .get_or_create(&label)
                    .set(bytes(peak));
                follow(&self.slice_refusals, &key, refusals);
                let u = usage
                    .and_then(|u| u.get(&slice.id))
                    .copied()
                    .unwrap_or_default();
                let seconds = |ns: u64| ns as f64 / 1e9;
                follow(&self.slice_compute_used, &key, seconds(u.used));
                follow(&self.slice_compute_busy, &key, seconds(u.busy));
                follow(&self.slice_compute_wait, &key, seconds(u.waited));
                follow(&self.slice_grants, &key, u.grants);
                counted.insert(key);
            }
            let telemetry = readings.telemetry.iter().find(|t| t.index == gpu.index);
            for instance in gpu.mig.iter().flat_map(|m| &m.instances) {
                let id = gpuslice_contract::slice::mig_slice_id(
                    gpu.index,
                    instance.placement.start,
                    &instance.profile,
                );
                let Some((used, total)) = instance
                    .uuid
                    .as_ref()
                    .and_then(|uuid| telemetry?.mig_memory_bytes.get(uuid))
                else {
                    continue;
                };
                let label = label(&id, "mig");
                since_checkpoint(&label);
                self.slice_holder.get_or_create(&label).set(1);
                self.slice_memory.get_or_create(&label).set(bytes(*total));
                self.slice_memory_used
                    .get_or_create(&label)
                    .set(bytes(*used));
            }
        }
        for gone in last.difference(&counted) {
            self.slice_refusals.remove(gone);
            self.slice_compute_used.remove(gone);
            self.slice_compute_busy.remove(gone);
            self.slice_compute_wait.remove(gone);
            self.slice_grants.remove(gone);
        }
        *last = counted;
    }
}

/// The pool a GPU is in now (empty: none).
fn pool_of(pass: &Pass, index: u32) -> String {
    pass.plan
        .nodes
        .iter()
        .flat_map(|n| &n.gpus)
        .find(|g| g.index == index)
        .and_then(|g| g.pool().map(str::to_string))
        .unwrap_or_default()
}
