//! `GpuPool`: a set of GPUs on matching nodes and how they are cut up, by time of day.

use std::collections::BTreeMap;

use crate::quantity::Size;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::CustomResource;
use kube::core::Duration;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::layout::Layout;
use crate::time::{ClockTime, DailyWindow, Weekday, utc};

/// A pool of GPUs: which nodes and GPUs belong to it, how each GPU is cut up (MIG partitions,
/// software slices or whole GPUs), how that changes by time of day, and how work is scheduled on it.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[kube(
    group = "gpuslice.io",
    version = "v1alpha1",
    kind = "GpuPool",
    plural = "gpupools",
    shortname = "gpool",
    category = "gpuslice",
    status = "GpuPoolStatus",
    printcolumn = r#"{"name":"Nodes","type":"integer","jsonPath":".status.nodes"}"#,
    printcolumn = r#"{"name":"GPUs","type":"integer","jsonPath":".status.gpus"}"#,
    printcolumn = r#"{"name":"Slices","type":"integer","jsonPath":".status.slices.total"}"#,
    printcolumn = r#"{"name":"Free","type":"integer","jsonPath":".status.slices.free"}"#,
    printcolumn = r#"{"name":"Window","type":"string","jsonPath":".status.activeWindow"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct GpuPoolSpec {
    /// Which nodes belong to the pool. Two pools may select the same node only when their
    /// `gpuSelector`s pick disjoint GPUs.
    pub node_selector: LabelSelector,
    /// Which GPUs of the selected nodes belong to the pool; all of them when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_selector: Option<GpuSelector>,
    /// The layout of each GPU outside every window (with `elastic`, the shape GPUs start in).
    pub layout: Layout,
    /// Elastic layouts: each GPU's shape chosen among those listed here by the demand (pods
    /// waiting and running per policy, and a forecast learned per hour of the week), within the
    /// bounds set here. Git declares what is allowed; the operator never writes the pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elastic: Option<Elastic>,
    /// Time-of-day windows with a different layout (elastic slicing). Windows of one pool must not overlap.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub windows: Vec<TimeWindow>,
    /// The shortest time a slice keeps the GPU once the compute arbiter grants it (Go duration,
    /// 1ms–1s; default 10ms). Longer slices mean fewer context switches for compute-bound training.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1ms') && duration(self) <= duration('1s')").message("timeSlice must be between 1ms and 1s"))]
    #[schemars(pattern(crate::time::DURATION_PATTERN), length(max = 32))]
    pub time_slice: Option<Duration>,
    /// Memory kept back in each slice for the CUDA context and allocator overhead. A policy fits a
    /// slice when its `memory` plus this headroom is at most the slice's memory. Default 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("isQuantity(self) && !quantity(self).isLessThan(quantity('0'))").message("memoryHeadroom must be a quantity such as 1Gi, not negative"))]
    pub memory_headroom: Option<Size>,
    /// How queued work is ordered and whether it may preempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduling: Option<Scheduling>,
    /// Name of the `CheckpointPolicy` for workloads whose `GpuSlicePolicy` names none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_policy: Option<String>,
    /// Periodic repacking of slices to reduce fragmentation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compaction: Option<Compaction>,
    /// Per-slice I/O limits and a node-local dataset cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io: Option<IoLimits>,
    /// Isolation of GPU faults (XID errors) to the slice that caused them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault_isolation: Option<FaultIsolation>,
    /// The oldest NVIDIA driver the pool's nodes may run, on top of what the gpuslice shim
    /// itself needs (driver 525.60.13, CUDA 12.0). A node below either offers none of its
    /// software slices (MIG instances and whole GPUs still), its GpuNode's `DriverSupported`
    /// condition names the versions found and needed, and `status.driverOutdated` counts it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<DriverMinimum>,
    /// Workloads on the pool's slices may not run as root: a pod that names one of the pool's
    /// policies is refused at admission unless every container (init, sidecar and ephemeral
    /// ones too) has `runAsNonRoot: true`, its own or the pod's. Root in a container can rewrite
    /// what the agent keeps in the slice's folder (the memory ledger the shim reads); the agent's
    /// memory watchdog still stops a workload past its cap, but later.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub require_non_root: bool,
}

impl GpuPoolSpec {
    /// `memoryHeadroom` in bytes (0 when unset; a value the schema would refuse counts as 0,
    /// and `validate` reports it).
    pub fn headroom_bytes(&self) -> u64 {
        self.memory_headroom
            .as_ref()
            .and_then(|h| h.bytes().ok())
            .unwrap_or(0)
    }
}

/// A driver version: one to three dot-separated numbers.
pub const DRIVER_VERSION_PATTERN: &str = r"^[0-9]+(\.[0-9]+){0,2}$";
/// A CUDA version: `major` or `major.minor`.
pub const CUDA_VERSION_PATTERN: &str = r"^[0-9]+(\.[0-9]+)?$";

/// A minimum NVIDIA driver.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriverMinimum {
    /// The oldest driver version, for example `550.54.15` (`550` reads as `550.0.0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(DRIVER_VERSION_PATTERN), length(max = 32))]
    pub min_version: Option<String>,
    /// The oldest CUDA version the driver must support, `major.minor`, for example `12.4`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(CUDA_VERSION_PATTERN), length(max = 16))]
    pub min_cuda_version: Option<String>,
}

/// Selects GPUs on a node by model, index or UUID. A GPU belongs to the pool when it matches every
/// list that is set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuSelector {
    /// GPU model names as NVML reports them, for example `NVIDIA H200` or `NVIDIA A100-SXM4-80GB`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    /// GPU indices on the node (as `nvidia-smi` numbers them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub indices: Vec<u32>,
    /// GPU UUIDs (`GPU-…`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub uuids: Vec<String>,
}

/// A weekly time-of-day window during which the pool uses another layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.start != self.end").message("start and end must differ (a window of zero length never opens)"))]
#[x_kube(validation = Rule::new("self.name != 'default'").message("the window name default is reserved: status.activeWindow says default while no window is open; name the window after when it opens (night, weekend)"))]
pub struct TimeWindow {
    /// Name of the window, unique in the pool; shown in status and events. `default` is
    /// reserved: it names the pool's layout outside every window.
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// IANA time zone in which `start`, `end` and `days` are read, for example `Asia/Shanghai`. Default UTC.
    #[serde(default = "utc")]
    #[schemars(length(min = 1, max = 64))]
    pub time_zone: String,
    /// Days on which the window opens (it may close on the next day). Default: every day.
    #[serde(default = "every_day")]
    #[schemars(length(min = 1, max = 7))]
    #[x_kube(validation = Rule::new("self.all(d, self.exists_one(e, e == d))").message("days must not repeat"))]
    pub days: Vec<Weekday>,
    /// When the window opens, `HH:MM`.
    pub start: ClockTime,
    /// When the window closes, `HH:MM`; earlier than `start` means the window crosses midnight.
    pub end: ClockTime,
    /// The layout in force while the window is open.
    pub layout: Layout,
    /// The elastic set while the window is open, in place of the pool's `elastic` (for example
    /// only whole GPUs and halves at night).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elastic: Option<Elastic>,
    /// Priorities of the pool's policies while the window is open (policy name → `low`,
    /// `normal`, `high` or a PriorityClass name), for example training first at night; a policy
    /// not named keeps its own `priority`. The queue and preemption use the window in force.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 64, "additionalProperties" = {"type": "string", "maxLength": 253, "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}))]
    pub priorities: BTreeMap<String, String>,
}

/// Elastic layouts: the shapes a GPU of the pool may be given and the rules for changing them.
/// The operator gives each GPU the shape that serves the most demand (pods waiting and running
/// per policy, weighted by priority; then what the forecast expects within its horizon), keeps
/// a GPU's shape unless another serves clearly more, re-cuts idle GPUs first, drains work only
/// as `drain` allows and only for pods that already wait, never a GPU sooner than `minDwell`
/// after its last re-cut, and never more than `maxInFlight` at once. A re-cut goes the way a
/// window change goes (staged layout, device taints ahead, drains by the CheckpointPolicy).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Elastic {
    /// The shapes a GPU may be given (1–8), each a named layout; every GPU of the pool must be
    /// able to hold at least one, and every policy of the pool must fit at least one.
    #[schemars(length(min = 1, max = 8), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub shapes: Vec<ElasticShape>,
    /// No GPU is re-cut again sooner than this after its last re-cut (Go duration, at least 1m;
    /// default 30m).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1m')").message("minDwell must be at least 1m"))]
    #[schemars(pattern(crate::time::DURATION_PATTERN), length(max = 32))]
    pub min_dwell: Option<Duration>,
    /// Most of the pool's GPUs being re-cut at once, in percent (1–100; default 10, and at
    /// least one GPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub max_in_flight: Option<u32>,
    /// Which GPUs may be re-cut: `IdleOnly` (default) only those nothing runs on;
    /// `Checkpointable` also those whose workloads are all preemptible with a CheckpointPolicy,
    /// drained for pods that wait (never for a forecast).
    #[serde(default)]
    pub drain: ElasticDrain,
    /// How far ahead the forecast looks (Go duration, 0s–24h; default 1h; `0s` turns it off):
    /// idle GPUs are shaped for the most demand it expects within this time, learned per hour
    /// of the week from the pool's own history.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("duration(self) >= duration('0s') && duration(self) <= duration('24h')").message("forecastHorizon must be between 0s and 24h"))]
    #[schemars(pattern(crate::time::DURATION_PATTERN), length(max = 32))]
    pub forecast_horizon: Option<Duration>,
    /// A forecast from your own Prometheus, beside the one learned here: an instant query
    /// whose samples carry a `policy` label, each the number of pods of that policy expected
    /// within `forecastHorizon`. Read about every 30 s through Prometheus' HTTP API; while it
    /// cannot be read the other signals stay in force and the pool's `ElasticSignal` condition
    /// says why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prometheus: Option<ElasticPrometheus>,
}

/// Where an elastic set reads demand expected by the user's Prometheus.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ElasticPrometheus {
    /// Base URL of the Prometheus server (`http://`, e.g.
    /// `http://prometheus.monitoring.svc:9090`); `/api/v1/query` is appended.
    #[schemars(length(min = 8, max = 2048), pattern(r"^http://[^\s]+$"))]
    pub url: String,
    /// The PromQL instant query, e.g. `max by (policy) (predict_linear(gpuslice_policy_pods_waiting[1h], 3600))`.
    #[schemars(length(min = 1, max = 4096))]
    pub query: String,
}

/// A shape of an elastic set.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.minGpus) || !has(self.maxGpus) || self.minGpus <= self.maxGpus").message("minGpus must not exceed maxGpus"))]
pub struct ElasticShape {
    /// Name of the shape, unique in the set; shown in status, Events and metrics.
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// The layout of a GPU in this shape.
    pub layout: Layout,
    /// At least this many GPUs keep the shape, when enough idle GPUs are there to take it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_gpus: Option<u32>,
    /// At most this many GPUs are given the shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_gpus: Option<u32>,
}

/// Which GPUs an elastic pool may re-cut.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ElasticDrain {
    /// Only GPUs nothing runs on.
    #[default]
    IdleOnly,
    /// Also GPUs whose workloads may all be drained (preemptible, with a CheckpointPolicy),
    /// for pods that wait.
    Checkpointable,
}

fn every_day() -> Vec<Weekday> {
    Weekday::ALL.to_vec()
}

/// Queueing and preemption on the pool.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Scheduling {
    /// Order of the queue: `Fifo`, `Priority`, `Fair` (fair share between namespaces) or
    /// `PriorityFair` (priority first, fair share within a priority). Default `PriorityFair`.
    #[serde(default)]
    pub policy: SchedulingPolicy,
    /// Whether higher-priority work may preempt preemptible work, after its checkpoint signal and grace period.
    #[serde(default)]
    pub preemption: bool,
    /// Fair-share weight of each namespace (default 1): a namespace of weight 2 gets twice the
    /// slices of one of weight 1 when both want more than the pool has.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub weights: BTreeMap<String, u32>,
    /// How fast past usage is forgotten in fair share: usage (slice-seconds) halves every
    /// `halfLife` (Go duration). Default 1h.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub half_life: Option<Duration>,
}

/// Queue ordering of a pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum SchedulingPolicy {
    Fifo,
    Priority,
    Fair,
    #[default]
    PriorityFair,
}

/// Compaction: moving checkpointable workloads so that whole GPUs come free. Inside `window`
/// (or at once when the pool is annotated `gpuslice.io/compact-now`, which `gpuslice compact
/// POOL` sets), for each node whose fragmentation passes the threshold the operator empties the
/// node's least-used GPUs into free software slices of GPUs already in use: each workload moved
/// is drained like a preemption (its CheckpointPolicy's signal, the checkpoint-done marker or the
/// grace period, the Eviction API) and its replacement is placed elsewhere by the queue, while
/// the GPUs being emptied carry the device taint `gpuslice.io/compacting`. Only pods of
/// preemptible policies with a CheckpointPolicy (the policy's or the pool's) move; a GPU with any
/// other workload is kept. MIG instances and whole GPUs are not compacted. The round is shown in
/// `status.compaction`; `gpuslice plan --compaction` shows what a round would do.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!self.enabled || has(self.window)").message("compaction is enabled but has no window: add window {start, end, timeZone}"))]
pub struct Compaction {
    /// Whether compaction runs at all (the window and the annotation both need it).
    #[serde(default)]
    pub enabled: bool,
    /// A node's fragmentation (0–1: the share of its free slice capacity that sits on GPUs
    /// something already runs on, where no whole-GPU workload or larger layout can use it) above
    /// which its GPUs are compacted. Default 0.3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub fragmentation_threshold: Option<f64>,
    /// Daily window in which compaction may move workloads (one round per opening). Required
    /// when enabled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<DailyWindow>,
}

/// I/O limits per slice.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct IoLimits {
    /// Disk read and write bandwidth of each slice's workload, bytes per second (for example
    /// `500Mi`), on each local disk of the node (loop, RAM and zram devices excepted). The node
    /// agent sets it on the pod's cgroup (or on the cgroup it puts a `gpuslice run` command in):
    /// cgroup v1 `blkio.throttle.{read,write}_bps_device` or cgroup v2 `io.max`, whichever the
    /// node has. A node with neither says so in its GpuNode's `IoLimited` condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))").message("bandwidthPerSlice must be a positive quantity such as 500Mi"))]
    pub bandwidth_per_slice: Option<Size>,
    /// A node-local cache directory for datasets, shared read-only by the pool's workloads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_cache: Option<LocalCache>,
}

/// The folder on every node that holds the pools' dataset caches, each in a folder of its own
/// (`io.localCache.path`); the chart mounts it into the agent's pod.
pub const CACHE_ROOT: &str = "/var/lib/gpuslice/cache";

/// The folder a cache path names under [`CACHE_ROOT`] (`/var/lib/gpuslice/cache/NAME` → `NAME`),
/// or why the path is refused: the agent is root on the node and removes files it did not write
/// in the cache's folder, so a pool may not point it anywhere else.
pub fn cache_folder(path: &str) -> Result<&str, String> {
    let name = path
        .strip_prefix(CACHE_ROOT)
        .and_then(|rest| rest.strip_prefix('/'))
        .unwrap_or_default();
    let valid = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if valid {
        Ok(name)
    } else {
        Err(format!(
            "io.localCache.path {path:?} must be a folder directly under {CACHE_ROOT} (for example \
             {CACHE_ROOT}/datasets): the node agent removes files in it"
        ))
    }
}

/// A node-local dataset cache: a read-through cache of dataset files on the node's local disk,
/// shared by the slices of the node. A workload asks the node agent for a source (a file path,
/// such as a network file system's mount, or an `http://` URL; `gpuslice cache fetch SOURCE`, or
/// the `cache` request on the agent's socket) and gets a read-only local file with the same bytes,
/// fetched once however many ask. Files are stored by content (SHA-256); the least recently used
/// go when the cache passes `size`; the cache survives agent restarts. Pods of the pool find it
/// read-only at `/run/gpuslice/cache`. Only what `sources` allows is fetched: the agent runs as
/// root, so it reads a file only under a listed directory, never through a symbolic link, only a
/// regular file the asking user could read itself, and no larger than the cache.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct LocalCache {
    /// The cache's folder on the node: a folder of its own directly under
    /// `/var/lib/gpuslice/cache` (for example `/var/lib/gpuslice/cache/datasets`), which the chart
    /// mounts into the agent; put a fast local disk there. Nowhere else: the agent is root on the
    /// node and removes files it did not write in the cache's folder.
    #[schemars(length(max = 128))]
    #[x_kube(validation = Rule::new("self.matches('^/var/lib/gpuslice/cache/[A-Za-z0-9][A-Za-z0-9._-]*$')").message("path must be a folder directly under /var/lib/gpuslice/cache, such as /var/lib/gpuslice/cache/datasets"))]
    pub path: String,
    /// The most the cached files may take (for example `500Gi`); half of the file system the
    /// path is on when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))").message("size must be a positive quantity such as 500Gi"))]
    pub size: Option<Size>,
    /// What workloads may have cached: absolute directories on the node (a file anywhere under
    /// one, for example `/mnt/datasets`) and `http://` URL prefixes naming a host (for example
    /// `http://datasets.internal:8080/`). A source matching none is refused, saying which to
    /// add here. Empty: nothing can be fetched.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), inner(length(max = 256)))]
    #[x_kube(validation = Rule::new("self.all(s, s.startsWith('/') ? !s.contains('/..') : s.matches('^http://[^/]+/'))").message("each source must be an absolute directory without `..`, or an http:// URL prefix with a host and a path, such as http://datasets.internal:8080/"))]
    pub sources: Vec<String>,
}

/// Fault isolation: what the node agent does about XID errors (NVML events) on the pool's GPUs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FaultIsolation {
    /// Act on XID errors by gpuslice's XID table. An error a workload caused in its own context
    /// (for example 13, 31, 43, 94) quarantines only its slice: the slice's DRA device gets the
    /// `gpuslice.io/xid` NoSchedule taint and its pod an Event, its neighbours keep running, and
    /// the slice comes back when that workload releases it. An error of the GPU itself (for
    /// example 48, 79, 95) drains every workload on the GPU through its CheckpointPolicy and
    /// taints all its devices until the GPU is reset and annotated (`gpuslice.io/gpu-reset`).
    /// When false, XIDs are only counted. The standalone agent does the same for `gpuslice run`
    /// workloads (its log says what it did; root lifts a GPU's quarantine with `gpuslice
    /// gpu-reset`).
    #[serde(default)]
    pub enabled: bool,
}

/// What the operator observed of the pool.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuPoolStatus {
    /// `Ready`, `Progressing` and `Degraded`, each with a reason and a message saying what to change.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Name of the window in force, or `default` when no window is open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_window: Option<String>,
    /// When the layout next changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_transition: Option<Time>,
    /// Number of nodes the pool selects.
    #[serde(default)]
    pub nodes: u32,
    /// Number of GPUs in the pool.
    #[serde(default)]
    pub gpus: u32,
    /// Slices in the pool and how many are in use.
    #[serde(default)]
    pub slices: SliceCounts,
    /// Nodes of the pool whose NVIDIA driver is older than `spec.driver` or the shim needs:
    /// their software slices are not offered until the driver is upgraded.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub driver_outdated: u32,
    /// Each namespace's recent use of the pool, which `FairShare` and `PriorityFair` scheduling
    /// order by; written by the admission queue (about every 10 s) so that a restarted or new
    /// leader carries on from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fair_share: Option<FairShareStatus>,
    /// The last compaction round: what it moves (or moved) and which GPUs it frees. Written by
    /// the admission queue, which carries the moves out through the preemption path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compaction: Option<CompactionStatus>,
    /// Where the elastic set in force stands: GPUs per shape, the last decision and why, and
    /// the forecast learned so far. Absent while no elastic set is in force.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elastic: Option<ElasticStatus>,
}

/// The elastic set at work on a pool.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ElasticStatus {
    /// GPUs given each shape now (shape name → GPUs); GPUs whose layout is none of the set's
    /// yet are not counted.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub shapes: BTreeMap<String, u32>,
    /// GPUs staged to be re-cut to another shape.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub recutting: u32,
    /// The decision of the last pass, in words: what it re-cuts and for whom, or why nothing
    /// changes.
    #[serde(default)]
    pub decision: String,
    /// What holds further re-cuts back: GPUs within `minDwell`, `maxInFlight`, work that may
    /// not be drained.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waiting_for: Vec<String>,
    /// The last decision that re-cut GPUs (also said in an `ElasticRecut` Event).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_recut: Option<ElasticRecut>,
    /// Demand per policy learned per hour of the week from this pool's history; a restarted
    /// operator carries on from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forecast: Option<ElasticForecast>,
}

/// A decision that re-cut GPUs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ElasticRecut {
    pub at: Time,
    /// What was re-cut and for whom.
    pub reason: String,
}

/// The forecast of an elastic pool: per policy, the peak demand (pods running plus waiting)
/// expected in each hour of the week, the newest week counting half.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ElasticForecast {
    /// Policy → 168 values, Monday 00:00 UTC first; `null` for an hour never observed.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub policies: BTreeMap<String, Vec<Option<f64>>>,
    /// The hour of the week being observed now (0–167).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hour: Option<u32>,
    /// Each policy's peak so far in that hour, folded into `policies` when the hour ends.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub peaks: BTreeMap<String, f64>,
}

/// A workload a compaction round moves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CompactionMove {
    /// The ResourceClaim (`namespace/name`) whose pod moves.
    pub resource_claim: String,
    /// The GPU it leaves, `node/gpuN`.
    pub from: String,
    /// Where the plan found room for it, `node/gpuN` (the queue places the replacement pod by
    /// its own engine, on any GPU but the ones being emptied).
    pub to: String,
}

/// One compaction round of a pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CompactionStatus {
    /// When the round was planned.
    pub started_at: Time,
    /// What started it: `window` (the compaction window, fragmentation over the threshold) or
    /// `manual` (the annotation `gpuslice.io/compact-now`, which `gpuslice compact` sets).
    pub trigger: String,
    /// The value of the pool's `gpuslice.io/compact-now` annotation this round took up (a new
    /// value asks for another round).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<String>,
    /// GPUs the round empties, `node/gpuN`; their devices are tainted `gpuslice.io/compacting`
    /// until the round ends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub freeing: Vec<String>,
    /// The workloads it moves.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub moves: Vec<CompactionMove>,
    /// GPUs that could not be emptied, and why (a workload that may not move, no room).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kept: Vec<String>,
    /// When the round ended: the GPUs are empty and the moved workloads run again elsewhere
    /// (or nothing was over the threshold). Unset while it is under way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Namespaces' decayed use of a pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FairShareStatus {
    /// When the figures were taken.
    pub at: Time,
    /// Use per namespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["namespace"]))]
    pub namespaces: Vec<NamespaceUsage>,
}

/// One namespace's use of a pool.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NamespaceUsage {
    /// The namespace.
    pub namespace: String,
    /// Slice-seconds used, each second counting less as it ages (halved every
    /// `spec.scheduling.halfLife`).
    pub slice_seconds: i64,
    /// Slices its pods hold now.
    #[serde(default)]
    pub holding: u32,
    /// Its weight (`spec.scheduling.weights`, 1 when not named).
    #[serde(default)]
    pub weight: u32,
}

/// Slice totals of a pool.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SliceCounts {
    /// Slices (MIG instances, software slices or whole GPUs) in the pool.
    #[serde(default)]
    pub total: u32,
    /// Slices held by a workload.
    #[serde(default)]
    pub allocated: u32,
    /// Slices no workload holds (`total - allocated`).
    #[serde(default)]
    pub free: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_is_a_folder_directly_under_the_cache_root_and_nowhere_else() {
        assert_eq!(
            cache_folder("/var/lib/gpuslice/cache/datasets"),
            Ok("datasets")
        );
        assert_eq!(
            cache_folder("/var/lib/gpuslice/cache/nvme-0.a_b"),
            Ok("nvme-0.a_b")
        );
        for path in [
            "/",
            "/tmp",
            "/etc",
            "/var/lib/gpuslice/cache",
            "/var/lib/gpuslice/cache/",
            "/var/lib/gpuslice/cache/..",
            "/var/lib/gpuslice/cache/../../../etc",
            "/var/lib/gpuslice/cache/a/b",
            "/var/lib/gpuslice/cachex",
            "/var/lib/gpuslice/cache/.hidden",
            "var/lib/gpuslice/cache/datasets",
        ] {
            let refused = cache_folder(path).unwrap_err();
            assert!(
                refused.contains("/var/lib/gpuslice/cache"),
                "{path}: {refused}"
            );
        }
    }
}
