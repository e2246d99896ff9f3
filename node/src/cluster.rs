//! Cluster mode (`gpuslice agent --kube`): the source is this node's `GpuNode` (written by the
//! operator) with the policies claims may name, read from the API; the sink is
//! `GpuNode.status`: the inventory, the generation applied, and `Ready` / `Blocked` conditions.
//! The agent owns the status under its own field manager and states all of it in every apply.
//! Passes are the standalone agent's: claims, drains and compute shares work the same. After each
//! pass the slices in force are published as DRA devices ([`crate::dra`]) in ResourceSlices the
//! Node owns, written only when a device changed.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use futures::StreamExt as _;
use gpuslice_api::k8s_openapi::api::core::v1::{Node, ObjectReference};
use gpuslice_api::k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use gpuslice_api::k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use gpuslice_api::{
    CheckpointPolicy, DriverMinimum, GpuNode, GpuNodeStatus, GpuPool, GpuSlicePolicy, NodeInventory,
};
use gpuslice_contract::SliceKind;
use gpuslice_planning::clock::Clock;
use gpuslice_planning::cluster::{Assignment, ClusterPlan, GpuPlan, NodePlan, plan_assigned};
use gpuslice_planning::driver;
use gpuslice_runtime::apply_body;
use gpuslice_runtime::conditions::{condition, keep_transition_times};
use gpuslice_runtime::telemetry::Telemetry;
use gpuslice_source::last_good::Config;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::dra::{self, NodeRef};
use crate::faults::{self, Notice, Quarantine, Quarantines};
use crate::pass::{Agent, Eviction, Intent, Pass, PassError};

/// The field manager of what the agent writes.
pub const MANAGER: &str = "gpuslice-agent";
/// While a transition waits for busy processes, pass again at least this often.
const BLOCKED_RETRY: Duration = Duration::from_secs(5);
/// The shortest wait between passes.
const MIN_WAIT: Duration = Duration::from_millis(200);
/// After a staged switch at a window boundary, how long a status that only says so (the slices
/// in force, `appliedSwitch`) waits: the operator writes the new layout as the spec 20 s after
/// the boundary, and the one write that answers it reports both. So a thousand nodes switching
/// at once write only their ResourceSlices then, which the scheduler waits for.
const SWITCH_REPORT_AFTER: chrono::TimeDelta = chrono::TimeDelta::seconds(40);

/// Why the agent stopped.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("GpuNode/{node}: {source}")]
    Kube { node: String, source: kube::Error },
    #[error(transparent)]
    Pass(#[from] PassError),
    #[error(transparent)]
    Faults(#[from] faults::FaultError),
}

/// The plan of each GPU the spec names, from the node as this pass read it; and what the spec
/// asks that cannot be done.
fn plan_spec(
    node: &NodeInventory,
    spec: &gpuslice_api::GpuNodeSpec,
) -> (Vec<GpuPlan>, Vec<String>) {
    let mut plans = Vec::new();
    let mut problems = Vec::new();
    for assignment in &spec.gpus {
        let Some(gpu) = node.gpus.iter().find(|g| g.index == assignment.index) else {
            problems.push(format!(
                "GPU {}: this node has no such GPU",
                assignment.index
            ));
            continue;
        };
        if let (Some(want), Some(have)) = (&assignment.uuid, &gpu.uuid)
            && want != have
        {
            problems.push(format!(
                "GPU {}: the spec is for {want} but the GPU is {have}; not applied",
                assignment.index
            ));
            continue;
        }
        let plan = plan_assigned(
            gpu,
            Assignment {
                pool: &assignment.pool,
                window: assignment.window.as_deref(),
                layout: &assignment.layout,
                time_slice: assignment.time_slice,
                checkpoint_policy: assignment.checkpoint_policy.as_deref(),
            },
        );
        if let Some(e) = &plan.error {
            problems.push(format!("GPU {}: {e}", assignment.index));
        }
        plans.push(plan);
    }
    (plans, problems)
}

/// Each pool of this node's GPUs whose software slices the node's driver cannot serve, with
/// what it falls short of (see [`gpuslice_planning::driver`]); and the `DriverSupported`
/// condition saying so. A node in no pool is checked against the shim alone.
fn driver_check(
    inventory: &NodeInventory,
    assignments: &[gpuslice_api::GpuAssignment],
    minimums: &BTreeMap<String, DriverMinimum>,
    generation: Option<i64>,
) -> (BTreeMap<String, driver::Shortfall>, Condition) {
    let found = inventory.driver.as_ref();
    let pools: std::collections::BTreeSet<&str> =
        assignments.iter().map(|a| a.pool.as_str()).collect();
    let mut short = BTreeMap::new();
    for pool in &pools {
        let minimum = minimums.get(*pool).map(|m| (*pool, m));
        if let Err(e) = driver::check(found, minimum) {
            short.insert(pool.to_string(), e);
        }
    }
    let shim = driver::check(found, None);
    let supported = short.is_empty() && shim.is_ok();
    let message = if supported {
        let found = found.map_or_else(String::new, |d| {
            format!("driver {} (CUDA {})", d.version, d.cuda)
        });
        format!(
            "{found} meets the gpuslice shim's minimum (driver {}, CUDA {}) and its pools'",
            driver::SHIM_MIN_DRIVER,
            driver::SHIM_MIN_CUDA
        )
    } else {
        let mut texts: Vec<String> = short
            .iter()
            .map(|(pool, e)| format!("pool {pool}: {e}"))
            .collect();
        if texts.is_empty()
            && let Err(e) = &shim
        {
            texts.push(e.to_string());
        }
        texts.join("; ")
    };
    let reason = if supported {
        "Supported"
    } else if found.is_none() {
        "DriverUnknown"
    } else {
        "DriverTooOld"
    };
    (
        short,
        condition("DriverSupported", supported, reason, message, generation),
    )
}

/// The `Quarantined` condition: what XID errors took out of service, and how each comes back.
fn quarantine_condition(list: &[Quarantine], node: &str, generation: Option<i64>) -> Condition {
    let described: Vec<String> = list.iter().map(|q| q.describe(node)).collect();
    condition(
        "Quarantined",
        !list.is_empty(),
        if list.is_empty() {
            "NoFaults"
        } else {
            "XidFault"
        },
        described.join("; "),
        generation,
    )
}

/// Tells what fault isolation did: Events on the GpuNode and on the pods of a quarantined
/// slice, and the log.
async fn tell_faults(
    recorder: &Recorder,
    gpu_node: &ObjectReference,
    node: &str,
    notices: &[Notice],
) {
    let publish = |type_: EventType, reason: &str, note: String, regarding: ObjectReference| {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: "IsolateFault".into(),
            secondary: None,
        };
        async move {
            if let Err(e) = recorder.publish(&event, &regarding).await {
                tracing::warn!("recording a fault event: {e}");
            }
        }
    };
    for notice in notices {
        let (warning, text) = notice.text(node);
        if warning {
            tracing::warn!("node {node}: {text}");
        } else {
            tracing::info!("node {node}: {text}");
        }
        let (reason, type_) = match notice {
            Notice::SliceQuarantined { .. } => ("SliceQuarantined", EventType::Warning),
            Notice::GpuOut(_) => ("GpuOutOfService", EventType::Warning),
            Notice::Lifted { .. } => ("QuarantineLifted", EventType::Normal),
            Notice::Unattributed { .. } => ("XidUnattributed", EventType::Warning),
            Notice::BadReset { .. } => ("BadGpuReset", EventType::Warning),
            // Counted only: the log and the metric say it.
            Notice::Counted { .. } => continue,
        };
        publish(type_, reason, text, gpu_node.clone()).await;
        if let Notice::SliceQuarantined {
            quarantine,
            pods,
            uids,
        } = notice
        {
            for (i, pod) in pods.iter().enumerate() {
                let Some((namespace, name)) = pod.split_once('/') else {
                    continue;
                };
                let note = format!(
                    "{} on its slice {}{}: the slice takes no new work until this pod releases it; the other slices of GPU {} keep running",
                    quarantine.what(),
                    quarantine.slice.as_deref().unwrap_or_default(),
                    quarantine
                        .pid
                        .map(|p| format!(" (pid {p})"))
                        .unwrap_or_default(),
                    quarantine.gpu
                );
                let regarding = pod_reference(namespace, name, uids.get(i).cloned());
                publish(EventType::Warning, "GpuFault", note, regarding).await;
            }
        }
    }
}

/// What an Event about a pod names.
fn pod_reference(namespace: &str, name: &str, uid: Option<String>) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        uid,
        ..ObjectReference::default()
    }
}

/// An Event on each pod of a slice the memory watchdog acted on.
async fn tell_overrun(recorder: &Recorder, report: &crate::watchdog::Report) {
    let holding = &report.overrun.holding;
    for (i, pod) in holding.pods.iter().enumerate() {
        let Some((namespace, name)) = pod.split_once('/') else {
            continue;
        };
        let event = Event {
            type_: EventType::Warning,
            reason: "GpuMemoryOverCap".into(),
            note: Some(report.text()),
            action: "EnforceMemoryCap".into(),
            secondary: None,
        };
        let regarding = pod_reference(namespace, name, holding.pod_uids.get(i).cloned());
        if let Err(e) = recorder.publish(&event, &regarding).await {
            tracing::warn!("recording a memory overrun event: {e}");
        }
    }
}

/// The `IoLimited` condition: whether the pools of this node that limit I/O per slice get it.
fn io_condition(
    io: Result<&crate::iolimit::Cgroups, &str>,
    assignments: &[gpuslice_api::GpuAssignment],
    bandwidths: &BTreeMap<String, u64>,
    generation: Option<i64>,
) -> Condition {
    let mut asking: Vec<String> = assignments
        .iter()
        .filter_map(|a| {
            let limit = bandwidths.get(&a.pool)?;
            Some(format!(
                "pool {}: {}/s",
                a.pool,
                gpuslice_api::quantity::format_bytes(*limit)
            ))
        })
        .collect();
    asking.sort();
    asking.dedup();
    if asking.is_empty() {
        return condition(
            "IoLimited",
            true,
            "NoLimits",
            "no pool of this node limits I/O per slice".into(),
            generation,
        );
    }
    match io {
        Ok(io) => {
            let disks: Vec<String> = io.disks.iter().map(ToString::to_string).collect();
            condition(
                "IoLimited",
                true,
                "Applied",
                format!(
                    "each slice's workload is held to {} on disks {} ({})",
                    asking.join(", "),
                    disks.join(", "),
                    io.kind()
                ),
                generation,
            )
        }
        Err(why) => condition(
            "IoLimited",
            false,
            "NoIoController",
            format!("{} asked, not applied: {why}", asking.join(", ")),
            generation,
        ),
    }
}

/// The status to report after a pass.
fn status(
    pass: &Pass,
    generation: Option<i64>,
    switched: Option<chrono::DateTime<chrono::Utc>>,
    previous: Option<&GpuNodeStatus>,
    driver_supported: Condition,
    quarantined: Condition,
    io_limited: Condition,
) -> GpuNodeStatus {
    let blocked: Vec<String> = pass
        .outcomes
        .iter()
        .filter(|o| !o.blocked_by.is_empty())
        .map(|o| {
            let what: Vec<String> = o.blocked_by.iter().map(ToString::to_string).collect();
            let pids: Vec<String> = o
                .blocking
                .iter()
                .map(|b| {
                    let why = pass
                        .draining
                        .iter()
                        .find(|w| w.pid == b.pid && w.slice == b.slice)
                        .map(|w| format!(": {}", w.reason))
                        .unwrap_or_default();
                    if b.pid == 0 {
                        format!("a pod's ResourceClaim on {}{why}", b.slice)
                    } else {
                        format!("pid {} on {}{why}", b.pid, b.slice)
                    }
                })
                .collect();
            format!("GPU {}: {} ({})", o.index, what.join(", "), pids.join("; "))
        })
        .collect();
    let failed: Vec<String> = pass
        .outcomes
        .iter()
        .filter_map(|o| o.error.as_ref().map(|e| format!("GPU {}: {e}", o.index)))
        .chain(pass.problems.iter().cloned())
        .chain(pass.drain_errors.iter().cloned())
        .collect();
    let converged = pass.converged();
    let mut conditions = vec![
        condition(
            "Ready",
            converged,
            if converged {
                "Applied"
            } else if !failed.is_empty() {
                "Failed"
            } else {
                "Progressing"
            },
            failed.join("; "),
            generation,
        ),
        condition(
            "Blocked",
            !blocked.is_empty(),
            if blocked.is_empty() {
                "NothingBusy"
            } else {
                "BusyInstances"
            },
            blocked.join("; "),
            generation,
        ),
        driver_supported,
        quarantined,
        io_limited,
    ];
    keep_transition_times(
        &mut conditions,
        previous.map(|p| p.conditions.as_slice()).unwrap_or(&[]),
    );
    let mut claims: Vec<gpuslice_api::SliceClaim> = pass
        .claims
        .iter()
        .map(|c| gpuslice_api::SliceClaim {
            slice: c.slice.clone(),
            resource_claim: c.resource_claim.clone(),
            pods: c.pod_names.clone(),
            pid: c
                .resource_claim
                .is_none()
                .then(|| c.workload.unwrap_or(c.client)),
            policy: c.policy.clone(),
            last_checkpoint: pass
                .checkpoints
                .get(&c.slice)
                .and_then(|t| gpuslice_api::time_of(*t)),
            draining: c.resource_claim.as_ref().and_then(|_| {
                pass.draining
                    .iter()
                    .find(|w| w.pid == 0 && w.slice == c.slice)
                    .map(|w| w.reason.clone())
            }),
        })
        .collect();
    claims.dedup();
    GpuNodeStatus {
        claims,
        evictions: pass
            .evictions
            .iter()
            .map(|e| gpuslice_api::EvictionRequest {
                pod: e.pod.clone(),
                uid: e.uid.clone(),
                cause: e.cause.to_string(),
                checkpoint: e.checkpoint.to_string(),
                message: e.note.clone(),
            })
            .collect(),
        inventory: Some(pass.inventory.clone()),
        gpu_count: u32::try_from(pass.inventory.gpus.len()).ok(),
        applied_generation: if converged {
            generation
        } else {
            previous.and_then(|p| p.applied_generation)
        },
        applied_switch: if converged {
            switched.and_then(gpuslice_api::time_of)
        } else {
            previous.and_then(|p| p.applied_switch.clone())
        },
        conditions,
    }
}

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
    gpu_xids: Family<XidLabel, Counter>,
    memory_overruns: Family<OverrunLabel, Counter>,
    quarantined: Family<QuarantineLabel, Gauge>,
    cache_hits: Family<CacheLabel, Counter>,
    cache_misses: Family<CacheLabel, Counter>,
    cache_evictions: Family<CacheLabel, Counter>,
    cache_bytes: Family<CacheLabel, Gauge>,
    cache_capacity: Family<CacheLabel, Gauge>,
    slice_memory: Family<HolderLabel, Gauge>,
    slice_memory_used: Family<HolderLabel, Gauge>,
    slice_memory_peak: Family<HolderLabel, Gauge>,
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
    pub telemetry: &'a [crate::nvml::GpuTelemetry],
    /// The arbiters' figures per GPU: each slice's usage, and hand-overs.
    pub compute: &'a BTreeMap<u32, (BTreeMap<String, crate::arbiter::Usage>, u64)>,
    /// Each policy's class, by policy name.
    pub classes: &'a BTreeMap<String, String>,
}

impl Metrics {
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
            gpu_memory_used: Family::default(),
            gpu_utilization: Family::default(),
            gpu_temperature: Family::default(),
            gpu_power: Family::default(),
            gpu_switches: Family::default(),
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
            slice_holder: Family::default(),
            slice_refusals: Family::default(),
            slice_compute_used: Family::default(),
            slice_compute_busy: Family::default(),
            slice_compute_wait: Family::default(),
            slice_grants: Family::default(),
            counted: Default::default(),
        };
        let r = registry.sub_registry_with_prefix("gpuslice_agent");
        r.register(
            "transition_blocked",
            "1 while a layout change waits for busy slices (their pods draining), else 0",
            m.blocked.clone(),
        );
        r.register(
            "gpu_memory_bytes",
            "Memory of each GPU, as NVML reports it",
            m.gpu_memory_total.clone(),
        );
        r.register(
            "gpu_memory_used_bytes",
            "Memory in use on each GPU, as NVML reports it (every process and instance)",
            m.gpu_memory_used.clone(),
        );
        r.register(
            "gpu_utilization_percent",
            "Percent of NVML's last sample period a kernel ran on the GPU (absent in MIG mode, where NVML gives none)",
            m.gpu_utilization.clone(),
        );
        r.register(
            "gpu_temperature_celsius",
            "GPU core temperature (NVML)",
            m.gpu_temperature.clone(),
        );
        r.register(
            "gpu_power_watts",
            "GPU board power draw (NVML)",
            m.gpu_power.clone(),
        );
        r.register(
            "slice_memory_overruns",
            "Times the memory watchdog found a software slice holding more than its cap (NVML's per-process figures) and signalled (action=signalled), killed (killed) or failed to stop (failed) its biggest process",
            m.memory_overruns.clone(),
        );
        r.register(
            "gpu_compute_handovers",
            "Times the compute arbiter gave a GPU to another process of its software slices",
            m.gpu_switches.clone(),
        );
        r.register(
            "slice_memory_bytes",
            "Memory of a slice (a software slice's cap before the policy's headroom; a MIG instance's memory)",
            m.slice_memory.clone(),
        );
        r.register(
            "slice_memory_used_bytes",
            "Device memory the workload of a slice holds now (a software slice: the shim's ledger, exact across processes; a MIG instance: NVML)",
            m.slice_memory_used.clone(),
        );
        r.register(
            "slice_memory_peak_bytes",
            "The most the workload of a software slice held at once since it took the slice (the shim's ledger)",
            m.slice_memory_peak.clone(),
        );
        r.register(
            "gpu_xid_errors",
            "XID critical errors NVML reported for each GPU since the agent started, by XID code",
            m.gpu_xids.clone(),
        );
        r.register(
            "cache_hits",
            "Dataset files the pool's local cache gave from disk, since the agent started",
            m.cache_hits.clone(),
        );
        r.register(
            "cache_misses",
            "Dataset files the pool's local cache fetched from their source, since the agent started",
            m.cache_misses.clone(),
        );
        r.register(
            "cache_evictions",
            "Files the pool's local cache dropped (least recently used) to stay within its size",
            m.cache_evictions.clone(),
        );
        r.register(
            "cache_bytes",
            "Bytes the pool's local cache holds now",
            m.cache_bytes.clone(),
        );
        r.register(
            "cache_capacity_bytes",
            "The most the pool's local cache may hold",
            m.cache_capacity.clone(),
        );
        r.register(
            "quarantined",
            "1 for each slice (or whole GPU: slice empty) taken out of service after an XID error, by the XID",
            m.quarantined.clone(),
        );
        r.register(
            "slice_holder",
            "1 for each slice, labelled with who holds it (policy, class, namespace, pod; empty while free): join a slice's counters to it on (instance, slice)",
            m.slice_holder.clone(),
        );
        r.register(
            "slice_memory_refusals",
            "Allocations the shim refused because they would pass the software slice's cap",
            m.slice_refusals.clone(),
        );
        r.register(
            "slice_compute_used_seconds",
            "GPU time a software slice's processes held (the compute arbiter)",
            m.slice_compute_used.clone(),
        );
        r.register(
            "slice_compute_busy_seconds",
            "Time a software slice had work: holding the GPU or waiting for it; used / busy is the share it got while it wanted the GPU, what its guarantee promises",
            m.slice_compute_busy.clone(),
        );
        r.register(
            "slice_compute_wait_seconds",
            "Time a software slice's processes spent waiting for the GPU, from asking to being granted, summed over processes",
            m.slice_compute_wait.clone(),
        );
        r.register(
            "slice_compute_grants",
            "Times the compute arbiter gave the GPU to a process of a software slice",
            m.slice_grants.clone(),
        );
        r.register("passes", "Reconcile passes", m.passes.clone());
        r.register(
            "errors",
            "GPUs a pass could not bring to their layout",
            m.errors.clone(),
        );
        r.register(
            "operations",
            "MIG and slice-table operations applied",
            m.operations.clone(),
        );
        r.register(
            "blocked_seconds",
            "Time transitions spent waiting for busy instances",
            m.blocked_seconds.clone(),
        );
        r.register(
            "pass_duration_seconds",
            "Time of one pass, NVML changes included",
            m.duration.clone(),
        );
        r.register(
            "slice_compute_limit_percent",
            "The compute cap the arbiter enforces on a software slice (its claim's policy's limit, else the slice's share)",
            m.slice_limit.clone(),
        );
        r.register(
            "evictions",
            "Pods evicted to take their slices back (a preemption, a window change or a GPU fault), by whether they checkpointed",
            m.evictions.clone(),
        );
        r.register(
            "slice_compute_guarantee_percent",
            "The compute floor the arbiter gives a software slice under contention",
            m.slice_guarantee.clone(),
        );
        m
    }

    /// The dataset caches' figures now.
    pub fn record_caches(&self, caches: &BTreeMap<String, std::sync::Arc<crate::cache::Cache>>) {
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
    pub fn count_overrun(&self, report: &crate::watchdog::Report) {
        let action = match report.step {
            crate::watchdog::Step::Signalled => "signalled",
            crate::watchdog::Step::Killed => "killed",
            crate::watchdog::Step::Failed(_) => "failed",
        };
        self.memory_overruns
            .get_or_create(&OverrunLabel {
                gpu: report.overrun.holding.gpu.to_string(),
                slice: report.overrun.holding.slice.clone(),
                action: action.into(),
            })
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

    fn record(
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
        .and_then(|g| g.pool.clone())
        .unwrap_or_default()
}

/// The policies claims may name, their pools' headroom, and the checkpoint policies drains
/// follow, as the API has them now. A list that fails leaves that part empty (claims naming a
/// policy are then refused, drains wait) and is retried next pass.
async fn read_config(client: &Client) -> Config {
    let params = ListParams::default();
    let pools = Api::<GpuPool>::all(client.clone()).list(&params).await;
    let policies = Api::<GpuSlicePolicy>::all(client.clone())
        .list(&params)
        .await;
    let checkpoints = Api::<CheckpointPolicy>::all(client.clone())
        .list(&params)
        .await;
    for (kind, e) in [
        ("GpuPool", pools.as_ref().err()),
        ("GpuSlicePolicy", policies.as_ref().err()),
        ("CheckpointPolicy", checkpoints.as_ref().err()),
    ] {
        if let Some(e) = e {
            tracing::warn!("listing {kind}: {e}");
        }
    }
    Config {
        pools: pools.map(|l| l.items).unwrap_or_default(),
        policies: policies
            .map(|l| l.items)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|p| Some((p.metadata.name?, p.spec)))
            .collect(),
        checkpoints: checkpoints
            .map(|l| l.items)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|c| Some((c.metadata.name?, c.spec)))
            .collect(),
        revision: None,
    }
}

/// How the agent runs in a cluster.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Pass at least this often (processes come and go).
    pub interval: Duration,
    /// Taint a GPU's devices this long before a window change re-cuts it.
    pub recut_lookahead: Duration,
    /// Serve the DRA kubelet plugin with these paths.
    pub kubelet: Option<crate::kubelet::Paths>,
    /// XID errors (and the kernel's records of them) as the watcher threads receive them.
    pub faults: faults::Inbox,
    /// Where `/var/lib/gpuslice/cache`, the pools' dataset caches' root, is.
    pub cache_root: std::path::PathBuf,
}

/// Writes the node's devices as ResourceSlices, remembering what it last wrote so that an
/// unchanged pass costs no request. (Public for the scale benchmark's simulated agents.)
///
/// The agent is the only writer of its node's ResourceSlices, so it writes them whole: a create,
/// or an update of the object it last read back (its resourceVersion makes a concurrent change a
/// conflict, after which it reads them again). Server-side apply would merge into an object no
/// one else owns fields of, and costs the API server about 1.6 times the CPU per write (docs/dra.md,
/// `slice-writes`): at a window boundary every node writes its slices at once.
pub struct Publisher {
    client: Client,
    node: String,
    owner: Option<NodeRef>,
    published: Option<Vec<Device>>,
    /// The ResourceSlices as the API server returned them, so that the next change needs no
    /// list first and can update them.
    written: Option<Vec<ResourceSlice>>,
}

impl Publisher {
    pub fn new(client: Client, node: &str) -> Publisher {
        Publisher {
            client,
            node: node.to_string(),
            owner: None,
            published: None,
            written: None,
        }
    }

    /// Publishes `devices`; a failure is logged and retried on the next pass.
    pub async fn publish(&mut self, devices: Vec<Device>) {
        if self.published.as_ref() == Some(&devices) {
            return;
        }
        match self.write(&devices).await {
            Ok(()) => self.published = Some(devices),
            Err(e) => tracing::warn!("ResourceSlices of node {}: {e}", self.node),
        }
    }

    async fn write(&mut self, devices: &[Device]) -> Result<(), kube::Error> {
        let owner = match &self.owner {
            Some(owner) => owner.clone(),
            None => {
                let node = Api::<Node>::all(self.client.clone())
                    .get(&self.node)
                    .await?;
                let owner = NodeRef {
                    name: self.node.clone(),
                    uid: node.metadata.uid.unwrap_or_default(),
                };
                self.owner = Some(owner.clone());
                owner
            }
        };
        // Written against what the agent last knew; if someone else changed a slice meanwhile
        // (a conflict), once more against what is there now.
        let known = self.written.is_some();
        let existing = match self.written.take() {
            Some(written) => written,
            None => self.list().await?,
        };
        match self.write_over(&owner, devices, existing).await {
            Err(kube::Error::Api(s)) if s.code == 409 && known => {
                let existing = self.list().await?;
                self.write_over(&owner, devices, existing).await
            }
            other => other,
        }
    }

    /// The node's ResourceSlices now (an agent restarted finds its earlier ones).
    async fn list(&self) -> Result<Vec<ResourceSlice>, kube::Error> {
        let api: Api<ResourceSlice> = Api::all(self.client.clone());
        let selector = format!(
            "spec.nodeName={},spec.driver={}",
            self.node,
            gpuslice_api::dra::DRIVER
        );
        Ok(api
            .list(&ListParams::default().fields(&selector))
            .await?
            .items)
    }

    /// Replaces `existing` by the slices that publish `devices`. On a failure `written` stays
    /// empty, so the next attempt lists first.
    async fn write_over(
        &mut self,
        owner: &NodeRef,
        devices: &[Device],
        existing: Vec<ResourceSlice>,
    ) -> Result<(), kube::Error> {
        let Some(generation) = dra::next_generation(&existing, devices) else {
            self.written = Some(existing);
            return Ok(());
        };
        let api: Api<ResourceSlice> = Api::all(self.client.clone());
        let params = PostParams {
            field_manager: Some(MANAGER.to_string()),
            ..PostParams::default()
        };
        let mut written = Vec::new();
        for slice in dra::resource_slices(owner, MANAGER, devices, generation) {
            let name = slice.metadata.name.clone().unwrap_or_default();
            let stored = match existing
                .iter()
                .find(|e| e.metadata.name == slice.metadata.name)
            {
                Some(old) => api.replace(&name, &params, &dra::over(old, slice)).await?,
                None => api.create(&params, &slice).await?,
            };
            written.push(stored);
        }
        for old in existing {
            let name = old.metadata.name.unwrap_or_default();
            if !written
                .iter()
                .any(|w| w.metadata.name.as_ref() == Some(&name))
            {
                match api.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => return Err(e),
                }
            }
        }
        self.written = Some(written);
        tracing::info!(
            "node {}: published {} devices (pool generation {generation})",
            self.node,
            devices.len()
        );
        Ok(())
    }
}

/// Runs the agent until the process ends: a pass whenever its GpuNode changes, every
/// `interval` (processes come and go), and sooner while a transition waits for busy processes.
pub async fn run(
    client: Client,
    agent: &Agent,
    clock: &Clock,
    settings: Settings,
    metrics: Metrics,
    telemetry: Option<Telemetry>,
) -> Result<(), ClusterError> {
    let interval = settings.interval;
    let lookahead =
        chrono::Duration::from_std(settings.recut_lookahead).unwrap_or(chrono::Duration::zero());
    let node = agent.node().to_string();
    let api: Api<GpuNode> = Api::all(client.clone());
    let kube_err = |source| ClusterError::Kube {
        node: node.clone(),
        source,
    };
    let params = PatchParams::apply(MANAGER).force();
    // The object must exist (with an empty spec, which the operator fills) before its status.
    if api.get_opt(&node).await.map_err(kube_err)?.is_none() {
        let object = apply_body("GpuNode", &node, "spec", &serde_json::json!({}));
        api.patch(&node, &params, &Patch::Apply(&object))
            .await
            .map_err(kube_err)?;
    }
    let changes = watcher(
        api.clone(),
        watcher::Config::default().fields(&format!("metadata.name={node}")),
    );
    futures::pin_mut!(changes);
    let mut blocked_since: Option<std::time::Instant> = None;
    let mut publisher = Publisher::new(client.clone(), &node);
    // Pods asked to be evicted and not gone yet, so that each is logged and counted once.
    let mut asked = std::collections::BTreeSet::new();
    // The slices as the last pass left them, and the claims allocated on slices a pass re-cut
    // before they were prepared (by UID), asked to be evicted until they are gone.
    let mut last_slices: Option<Vec<gpuslice_contract::slice::SliceConfig>> = None;
    let mut stale_claims = std::collections::BTreeSet::new();
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: MANAGER.into(),
            instance: Some(node.clone()),
        },
    );
    let mut quarantines = Quarantines::load(agent.state())?;
    agent.serve_socket()?;
    // The memory watchdog's reports: counted, and told to the pods of the slice.
    let (overruns, mut told) = tokio::sync::mpsc::unbounded_channel();
    let counted = metrics.clone();
    agent.start_watchdog(move |report| {
        counted.count_overrun(report);
        let _ = overruns.send(report.clone());
    });
    let teller = recorder.clone();
    tokio::spawn(async move {
        while let Some(report) = told.recv().await {
            tell_overrun(&teller, &report).await;
        }
    });
    if let Some(paths) = settings.kubelet.clone() {
        let plugin = crate::kubelet::Plugin::new(
            client.clone(),
            &node,
            agent.state().clone(),
            paths,
            agent.caches(),
            agent.claims(),
        );
        tokio::spawn(async move {
            if let Err(e) = plugin.serve().await {
                tracing::error!("{e}");
            }
        });
    }
    loop {
        let started = std::time::Instant::now();
        let current = api.get(&node).await.map_err(kube_err)?;
        let config = read_config(&client).await;
        let classes: BTreeMap<String, String> = config
            .policies
            .iter()
            .filter_map(|(name, p)| Some((name.clone(), p.class?.as_str().to_string())))
            .collect();
        let isolating: std::collections::BTreeSet<String> = config
            .pools
            .iter()
            .filter(|p| p.spec.fault_isolation.as_ref().is_some_and(|f| f.enabled))
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        let bandwidths: BTreeMap<String, u64> = config
            .pools
            .iter()
            .filter_map(|p| {
                Some((
                    p.metadata.name.clone()?,
                    crate::iolimit::bandwidth_of(&p.spec)?,
                ))
            })
            .collect();
        let driver_minimums: BTreeMap<String, DriverMinimum> = config
            .pools
            .iter()
            .filter_map(|p| Some((p.metadata.name.clone()?, p.spec.driver.clone()?)))
            .collect();
        let now = clock.now();
        // A layout staged for a window boundary is in force from the boundary on this node's
        // clock, before the operator writes it as the spec.
        let spec = current.spec.in_force(now);
        let (switched, next_switch) =
            (current.spec.last_switch(now), current.spec.next_switch(now));
        let mut pass = agent.pass(now, |inventory| {
            let (gpus, problems) = plan_spec(inventory, &spec);
            Intent {
                plan: ClusterPlan {
                    at: now,
                    pools: Vec::new(),
                    nodes: vec![NodePlan {
                        node: inventory.name.clone(),
                        gpus,
                    }],
                },
                config: Config {
                    revision: current.spec.source_revision.clone(),
                    ..config
                },
                problems,
                preemptions: current.spec.preemptions.clone(),
                gpus_out: quarantines.gpus_out(),
            }
        })?;
        pass.evictions
            .extend(unprepared_victims(&client, &current.spec.preemptions, &pass.claims).await);
        let slices = crate::slices::configs(&pass.inventory);
        let recut = recut_devices(last_slices.as_deref().unwrap_or_default(), &slices);
        last_slices = Some(slices);
        pass.evictions.extend(
            stale_allocations(&client, &node, &recut, &pass.claims, &mut stale_claims).await,
        );
        ask_evictions(&metrics, &pass.evictions, &mut asked);
        let notices = isolate_faults(
            &api,
            &current,
            &pass,
            &mut quarantines,
            &settings.faults,
            &isolating,
            clock,
        )
        .await;
        let gpu_node = ObjectReference {
            api_version: Some("gpuslice.io/v1alpha1".into()),
            kind: Some("GpuNode".into()),
            name: Some(node.clone()),
            uid: current.metadata.uid.clone(),
            ..ObjectReference::default()
        };
        tell_faults(&recorder, &gpu_node, &node, &notices).await;
        metrics.record_quarantines(&quarantines.list);
        metrics.record_caches(&agent.caches().all());
        let readings = Readings {
            state: agent.state(),
            telemetry: &agent.telemetry(),
            compute: &agent.compute_usage(),
            classes: &classes,
        };
        metrics.record(&pass, &readings, started, &mut blocked_since);
        if let Some(t) = &telemetry {
            t.pass_done();
        }
        let (outdated, driver_supported) = driver_check(
            &pass.inventory,
            &spec.gpus,
            &driver_minimums,
            current.metadata.generation,
        );
        let was_supported = current
            .status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "DriverSupported"))
            .map(|c| c.status == "True");
        if driver_supported.status == "False" && was_supported != Some(false) {
            tracing::warn!("node {node}: {}", driver_supported.message);
        }
        // What DRA does not offer, `gpuslice run` is not given either.
        let closed = crate::slices::configs(&pass.inventory)
            .into_iter()
            .filter(|c| {
                let pool = spec.gpus.iter().find(|a| a.index == c.gpu);
                let outdated = c.kind == SliceKind::Software
                    && pool.is_some_and(|a| outdated.contains_key(&a.pool));
                outdated || !quarantines.taints(c.gpu, &c.id).is_empty()
            })
            .map(|c| c.id)
            .collect();
        agent.close_slices(closed);
        let now = clock.now();
        // A GPU whose new layout waits for busy slices is about to be re-cut as well.
        let waiting: Vec<u32> = pass
            .outcomes
            .iter()
            .filter(|o| !o.blocked_by.is_empty())
            .map(|o| o.index)
            .collect();
        // Slices `gpuslice run` commands hold: one holder per slice, so no pod goes there.
        let held_locally: BTreeMap<&str, u32> = pass
            .claims
            .iter()
            .filter(|c| c.resource_claim.is_none())
            .map(|c| (c.slice.as_str(), c.client))
            .collect();
        let devices = dra::devices(&pass.inventory, &spec.gpus, &|a, slice| {
            // Old drivers break the shim's isolation; MIG's is the hardware's.
            if slice.kind == SliceKind::Software && outdated.contains_key(&a.pool) {
                return None;
            }
            let recut = if waiting.contains(&a.index) {
                Some(dra::pending_recut_taint())
            } else {
                dra::recut_taint(
                    a.recut_at.as_ref().and_then(gpuslice_api::chrono_of),
                    lookahead,
                    now,
                )
            };
            let mut taints: Vec<_> = recut.into_iter().collect();
            if current.spec.compacting.contains(&a.index) {
                taints.push(dra::compacting_taint());
            }
            taints.extend(quarantines.taints(a.index, &slice.id));
            if let Some(pid) = held_locally.get(slice.id.as_str()) {
                taints.push(dra::held_locally_taint(*pid));
            }
            Some(taints)
        });
        publisher.publish(devices).await;
        // After the devices, which the scheduler waits for; the status is for people and the
        // operator's counts.
        let report = status(
            &pass,
            current.metadata.generation,
            switched,
            current.status.as_ref(),
            driver_supported,
            quarantine_condition(&quarantines.list, &node, current.metadata.generation),
            io_condition(
                agent.io(),
                &spec.gpus,
                &bandwidths,
                current.metadata.generation,
            ),
        );
        let report_due = switched.map(|at| at + SWITCH_REPORT_AFTER);
        let only_switched = current.status.as_ref().is_some_and(|old| {
            old.conditions == report.conditions
                && old.claims == report.claims
                && old.applied_generation == report.applied_generation
        });
        let wait_for_catch_up = only_switched && report_due.is_some_and(|due| due > clock.now());
        if current.status.as_ref() != Some(&report) && !wait_for_catch_up {
            let patch = apply_body("GpuNode", &node, "status", &report);
            if let Err(e) = api
                .patch_status(&node, &params, &Patch::Apply(&patch))
                .await
            {
                tracing::warn!("GpuNode/{node}: reporting status: {e}");
            }
        }
        // Our own status write comes back as a change too; that pass finds nothing to do.
        let mut wake = next_wake(&pass, clock, interval)
            .min(until_taint(&spec.gpus, lookahead, clock))
            .min(next_switch.map_or(Duration::MAX, |at| clock.until(at)));
        if let Some(due) = report_due.filter(|_| wait_for_catch_up) {
            wake = wake.min(clock.until(due).max(MIN_WAIT));
        }
        // An XID waiting for its kernel record; a GPU just taken out starts draining at once.
        if let Some(due) = settings.faults.next_due(std::time::Instant::now()) {
            wake = wake.min(due.max(MIN_WAIT));
        }
        if notices.iter().any(|n| matches!(n, Notice::GpuOut(_))) {
            wake = MIN_WAIT;
        }
        let _ = tokio::time::timeout(wake, async {
            tokio::select! {
                _ = changes.next() => {}
                _ = settings.faults.changed() => {}
            }
        })
        .await;
    }
}

/// Fault isolation after a pass: acts on the XIDs received (for GPUs whose pool isolates
/// faults), lifts the quarantines of slices their faulting workloads released and of GPUs the
/// `gpuslice.io/gpu-reset` annotation says were reset (then removes it), and keeps the list.
async fn isolate_faults(
    api: &Api<GpuNode>,
    current: &GpuNode,
    pass: &Pass,
    quarantines: &mut Quarantines,
    inbox: &faults::Inbox,
    isolating: &std::collections::BTreeSet<String>,
    clock: &Clock,
) -> Vec<Notice> {
    let before = quarantines.list.clone();
    let held = pass.holdings();
    let events = inbox.take(std::time::Instant::now());
    let in_force = current.spec.in_force(clock.now());
    let isolating_gpu = |gpu: u32| {
        in_force
            .gpus
            .iter()
            .any(|a| a.index == gpu && isolating.contains(&a.pool))
    };
    let node = &pass.node;
    let key = gpuslice_api::dra::GPU_RESET_ANNOTATION;
    let annotated = current
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .cloned();
    // Root may also say so on the node (`gpuslice gpu-reset`).
    let mut resets = inbox.take_resets();
    resets.extend(annotated.clone());
    let notices = faults::isolate(
        &mut quarantines.list,
        &events,
        &pass.inventory,
        &held,
        &isolating_gpu,
        &resets,
        clock.now(),
    );
    if annotated.is_some() {
        // Said once: the annotation is a request, not a state.
        let patch = serde_json::json!({"metadata": {"annotations": {key: null}}});
        if let Err(e) = api
            .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            tracing::warn!("GpuNode/{node}: removing {key}: {e}");
        }
    }
    if quarantines.list != before
        && let Err(e) = quarantines.save()
    {
        tracing::error!("keeping the quarantines: {e}");
    }
    notices
}

/// The pods of preemption victims whose claim was never prepared on this node (a pod whose
/// container has not started, an image still pulling, or no kubelet at all): nothing runs on the
/// slice and nothing could checkpoint, so they are asked to be evicted at once rather than
/// waited on.
async fn unprepared_victims(
    client: &Client,
    preemptions: &[gpuslice_api::Preemption],
    prepared: &[crate::claims::Claim],
) -> Vec<Eviction> {
    use gpuslice_api::k8s_openapi::api::resource::v1::ResourceClaim;
    let mut out = Vec::new();
    for preemption in preemptions {
        let claim = preemption.resource_claim.as_str();
        if prepared
            .iter()
            .any(|c| c.resource_claim.as_deref() == Some(claim))
        {
            continue;
        }
        let Some((namespace, name)) = claim.split_once('/') else {
            continue;
        };
        let found = Api::<ResourceClaim>::namespaced(client.clone(), namespace)
            .get_opt(name)
            .await;
        let reserved = match found {
            Ok(found) => found
                .and_then(|c| c.status?.reserved_for)
                .unwrap_or_default(),
            Err(e) => {
                tracing::warn!("ResourceClaim {claim} (a preemption's victim): {e}");
                continue;
            }
        };
        for holder in reserved.iter().filter(|r| r.resource == "pods") {
            out.push(Eviction {
                pod: format!("{namespace}/{}", holder.name),
                uid: holder.uid.clone(),
                note: format!(
                    "{}; its slice was never prepared on this node, so nothing ran there to checkpoint",
                    preemption.reason
                ),
                cause: if preemption.for_pod.is_empty() {
                    "compaction"
                } else {
                    "preemption"
                },
                checkpoint: "none",
            });
        }
    }
    out
}

/// The DRA device names of the slices in `before` that `after` no longer has as they were (gone,
/// or cut to another size): a claim allocated on one of them refers to a slice that is not there.
fn recut_devices(
    before: &[gpuslice_contract::slice::SliceConfig],
    after: &[gpuslice_contract::slice::SliceConfig],
) -> std::collections::BTreeSet<String> {
    before
        .iter()
        .filter(|old| !after.contains(old))
        .map(|old| gpuslice_api::dra::device_name(&old.id))
        .collect()
}

/// The pods whose claims were allocated on slices of this node that a pass re-cut before the
/// claim was prepared (no kubelet had started them, or none runs there): nothing ran on the old
/// slice and nothing could checkpoint, and preparing the claim would fail or give the pod a slice
/// of another size, so they are asked to be evicted at once and their controllers make new pods.
/// Such claims are remembered by UID in `stale` (the new slices may reuse the device names) and
/// asked for on every pass until they are gone.
async fn stale_allocations(
    client: &Client,
    node: &str,
    recut: &std::collections::BTreeSet<String>,
    prepared: &[crate::claims::Claim],
    stale: &mut std::collections::BTreeSet<String>,
) -> Vec<Eviction> {
    use gpuslice_api::k8s_openapi::api::resource::v1::ResourceClaim;
    if recut.is_empty() && stale.is_empty() {
        return Vec::new();
    }
    let claims = match Api::<ResourceClaim>::all(client.clone())
        .list(&Default::default())
        .await
    {
        Ok(list) => list.items,
        Err(e) => {
            tracing::warn!("listing ResourceClaims (allocated on re-cut slices): {e}");
            return Vec::new();
        }
    };
    let mut still = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for claim in claims {
        let uid = claim.metadata.uid.clone().unwrap_or_default();
        let namespace = claim.metadata.namespace.clone().unwrap_or_default();
        let key = format!(
            "{namespace}/{}",
            claim.metadata.name.clone().unwrap_or_default()
        );
        let Some(status) = claim.status else { continue };
        let on_recut = status
            .allocation
            .and_then(|a| a.devices)
            .map(|d| d.results)
            .unwrap_or_default()
            .into_iter()
            .flatten()
            .filter(|r| r.driver == gpuslice_api::dra::DRIVER && r.pool == node)
            .find(|r| recut.contains(&r.device))
            .map(|r| r.device);
        let is_prepared = prepared
            .iter()
            .any(|c| c.resource_claim.as_deref() == Some(key.as_str()));
        if is_prepared || !(stale.contains(&uid) || on_recut.is_some()) {
            continue;
        }
        still.insert(uid);
        let device = on_recut.map_or_else(String::new, |d| format!(" {d}"));
        for holder in status
            .reserved_for
            .unwrap_or_default()
            .iter()
            .filter(|r| r.resource == "pods")
        {
            out.push(Eviction {
                pod: format!("{namespace}/{}", holder.name),
                uid: holder.uid.clone(),
                note: format!(
                    "its slice{device} on {node} was re-cut for a new layout before it was prepared; nothing ran there to checkpoint"
                ),
                cause: "window",
                checkpoint: "none",
            });
        }
    }
    *stale = still;
    out
}

/// Counts and logs the pods this pass asks the operator to evict (in the GpuNode's status), each
/// once while it is asked for.
fn ask_evictions(
    metrics: &Metrics,
    evictions: &[Eviction],
    asked: &mut std::collections::BTreeSet<String>,
) {
    asked.retain(|p| evictions.iter().any(|e| e.pod == *p));
    for eviction in evictions {
        if asked.insert(eviction.pod.clone()) {
            tracing::info!(
                "asking the operator to evict pod {}: {}",
                eviction.pod,
                eviction.note
            );
            metrics
                .evictions
                .get_or_create(&EvictionLabel {
                    cause: eviction.cause.into(),
                    checkpoint: eviction.checkpoint.into(),
                })
                .inc();
        }
    }
}

/// Until the next re-cut taint is due (never, when none is ahead).
fn until_taint(
    gpus: &[gpuslice_api::GpuAssignment],
    lookahead: chrono::Duration,
    clock: &Clock,
) -> Duration {
    let now = clock.now();
    gpus.iter()
        .filter_map(|a| a.recut_at.as_ref().and_then(gpuslice_api::chrono_of))
        .map(|at| at - lookahead)
        .filter(|due| *due > now)
        .map(|due| clock.until(due))
        .min()
        .unwrap_or(Duration::MAX)
}

/// The interval, or (while blocked) the next retry or grace deadline.
fn next_wake(pass: &Pass, clock: &Clock, interval: Duration) -> Duration {
    let mut wake = interval;
    if pass.blocked() || !pass.draining.is_empty() {
        wake = wake.min(BLOCKED_RETRY);
        for until in pass.draining.iter().filter_map(|w| w.until) {
            wake = wake.min(clock.until(until));
        }
    }
    wake.max(MIN_WAIT)
}
