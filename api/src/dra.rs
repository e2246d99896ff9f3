//! The names gpuslice uses in Dynamic Resource Allocation (`resource.k8s.io/v1`), shared by the
//! agent (which publishes a node's slices as devices) and the operator (which writes a
//! DeviceClass per `GpuSlicePolicy` whose CEL selector reads those attributes).

/// The DRA driver name: ResourceSlices, device attributes and opaque configs use it.
pub const DRIVER: &str = "gpuslice.io";

/// The `kind` of the opaque parameters a DeviceClass hands the driver.
pub const PARAMETERS_KIND: &str = "SliceParameters";

/// What a policy's DeviceClass tells the driver, as opaque config (`kind: SliceParameters`):
/// written by the operator, read by the kubelet plugin when it prepares a claim. Read leniently
/// (every field may be absent): a claim may carry a config of its own for the driver.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ClassParameters {
    pub api_version: String,
    pub kind: String,
    /// The `GpuSlicePolicy`.
    pub policy: String,
    /// Its pool.
    pub pool: String,
    /// Its `memory`, as written.
    pub memory: String,
    /// The cap the plugin gives the workload's slice: the policy's memory plus the pool's
    /// headroom.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_limit_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compute: Option<ClassCompute>,
    /// The CheckpointPolicy that drains its workloads: the policy's own, else its pool's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_policy: Option<String>,
}

/// A policy's compute share in its class's parameters, in percent of a GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClassCompute {
    pub limit: u32,
    pub guarantee: u32,
}

/// Device attributes (in the driver's domain: `device.attributes["gpuslice.io"].<name>`).
pub mod attribute {
    /// The `GpuPool` the slice's GPU belongs to (string).
    pub const POOL: &str = "pool";
    /// The pool's time window in force when the slice was cut; empty outside windows (string).
    pub const WINDOW: &str = "window";
    /// `software`, `mig` or `gpu` (a whole GPU) (string).
    pub const KIND: &str = "kind";
    /// The GPU model as NVML names it, e.g. `NVIDIA H200` (string).
    pub const MODEL: &str = "model";
    /// The UUID of the physical GPU the slice is on (string).
    pub const GPU_UUID: &str = "gpuUUID";
    /// The index of that GPU on the node (int).
    pub const GPU_INDEX: &str = "gpuIndex";
    /// The MIG profile of a MIG slice, e.g. `1g.18gb` (string; MIG slices only).
    pub const MIG_PROFILE: &str = "migProfile";
    /// The slice id the agent uses on the node (`gpu0-s1`, `gpu0-mig4-1g.18gb`, `gpu1`) (string).
    pub const SLICE: &str = "slice";
    /// The GPUs joined by NVLink that the slice's GPU belongs to, named by the UUID of the
    /// lowest-indexed of them (string; absent on a GPU without NVLink peers). Slices with the same
    /// value can exchange data over NVLink: a claim's `matchAttribute` constraint on it keeps its
    /// devices on one NVLink domain.
    pub const NVLINK_DOMAIN: &str = "nvlinkDomain";
}

/// Device capacities (`device.capacity["gpuslice.io"].<name>`).
pub mod capacity {
    /// GPU memory a workload on the slice may use (bytes).
    pub const MEMORY: &str = "memory";
    /// The slice's share of its GPU's compute, in percent (MIG and whole GPUs: 100 of their own).
    pub const COMPUTE: &str = "compute";
}

/// The value of [`attribute::KIND`] for each kind of slice.
pub mod kind {
    pub const SOFTWARE: &str = "software";
    /// A software slice of a GPU shared through CUDA MPS.
    pub const MPS: &str = "mps";
    pub const MIG: &str = "mig";
    pub const GPU: &str = "gpu";
}

/// The device taint key on slices a window change will re-cut soon: new pods do not land there.
pub const RECUT_TAINT: &str = "gpuslice.io/recut";
/// The device taint of a slice or GPU taken out of service after an XID error (value: the XID);
/// NoSchedule: what runs there keeps running (a GPU's workloads are drained by the agent).
pub const XID_TAINT: &str = "gpuslice.io/xid";
/// The device taint (NoSchedule, value: the `gpuslice run` process's pid) on a slice a command
/// on the node holds through the agent's socket: no pod is placed on it meanwhile.
pub const HELD_LOCALLY_TAINT: &str = "gpuslice.io/held-locally";
/// The device taint (NoSchedule, value `true`) on the devices of a GPU that compaction is
/// emptying, until the workloads moved off it run elsewhere.
pub const COMPACTING_TAINT: &str = "gpuslice.io/compacting";
/// The GpuPool annotation that asks for a compaction now, outside the pool's compaction window:
/// each new value asks for one round (`gpuslice compact` writes the time); the round records
/// the value it took up in `status.compaction.request`.
pub const COMPACT_NOW_ANNOTATION: &str = "gpuslice.io/compact-now";
/// The GpuNode annotation that says GPUs were reset (`1`, `0,3` or `all`): the agent lifts
/// their XID quarantines and removes the annotation.
pub const GPU_RESET_ANNOTATION: &str = "gpuslice.io/gpu-reset";

/// The label on every object the operator and agents write for DRA, naming the writer.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";

/// The label on a DeviceClass naming the `GpuSlicePolicy` it was written for.
pub const POLICY_CLASS_LABEL: &str = "gpuslice.io/policy";

/// The DeviceClass of a policy: `<policy>.gpuslice.io`.
pub fn device_class_name(policy: &str) -> String {
    format!("{policy}.{DRIVER}")
}

/// The extended resource a pod may request to get a slice of a policy: `gpuslice.io/<policy>`.
pub fn extended_resource_name(policy: &str) -> String {
    format!("{DRIVER}/{policy}")
}

/// The device name of a slice: its id as a DNS label (lowercase letters, digits and `-`; MIG
/// profiles' `.` and `+` become `-`), e.g. `gpu0-mig4-1g-18gb`.
pub fn device_name(slice_id: &str) -> String {
    let name: String = slice_id
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' => c,
            'A'..='Z' => c.to_ascii_lowercase(),
            _ => '-',
        })
        .collect();
    let name = name.trim_matches('-');
    name.chars().take(63).collect::<String>()
}

/// The name of the `n`-th ResourceSlice a node's agent publishes.
pub fn resource_slice_name(node: &str, n: usize) -> String {
    format!("{node}-{DRIVER}-{n}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_ids_become_dns_labels() {
        assert_eq!(device_name("gpu0-s3"), "gpu0-s3");
        assert_eq!(device_name("gpu1-mig4-1g.18gb"), "gpu1-mig4-1g-18gb");
        assert_eq!(device_name("gpu1-mig0-1g.18gb+me"), "gpu1-mig0-1g-18gb-me");
        assert_eq!(device_name("gpu7"), "gpu7");
        let long = format!("gpu0-{}", "x".repeat(100));
        assert_eq!(device_name(&long).len(), 63);
    }

    #[test]
    fn a_policy_has_one_class_and_one_extended_resource() {
        assert_eq!(device_class_name("llm-7b"), "llm-7b.gpuslice.io");
        assert_eq!(extended_resource_name("llm-7b"), "gpuslice.io/llm-7b");
    }
}
