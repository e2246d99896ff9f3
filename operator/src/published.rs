//! The operator's view of the ResourceSlices our agents publish: only what it reads, read
//! straight from the API server's JSON. At 1,000 nodes × 32 devices the whole `ResourceSlice`
//! objects (two `BTreeMap`s per device) were about half of the operator's memory.

use std::borrow::Cow;

use gpuslice_api::dra;
use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use serde::de::IgnoredAny;

/// A `resource.k8s.io/v1` ResourceSlice of driver `gpuslice.io`, as far as the operator reads it.
#[derive(Clone, Debug, Deserialize)]
pub struct PublishedSlice {
    pub metadata: ObjectMeta,
    pub spec: SliceSpec,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SliceSpec {
    #[serde(default)]
    pub node_name: Option<String>,
    pub pool: SlicePool,
    #[serde(default)]
    pub devices: Vec<PublishedDevice>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct SlicePool {
    pub name: String,
}

/// One device: its name, the attributes and capacities the operator reads, whether it is tainted.
#[derive(Clone, Debug, Deserialize)]
pub struct PublishedDevice {
    pub name: String,
    #[serde(default)]
    attributes: Attributes,
    #[serde(default)]
    capacity: Capacities,
    /// Only whether there are any is read.
    #[serde(default)]
    taints: Vec<IgnoredAny>,
}

/// The attributes named in `gpuslice_api::dra::attribute` that the operator reads (a test checks
/// the names agree); the others are skipped while parsing.
#[derive(Clone, Debug, Default, Deserialize)]
struct Attributes {
    pool: Option<Attribute>,
    kind: Option<Attribute>,
    #[serde(rename = "gpuIndex")]
    gpu_index: Option<Attribute>,
    #[serde(rename = "nvlinkDomain")]
    nvlink_domain: Option<Attribute>,
}

#[derive(Clone, Debug, Deserialize)]
struct Attribute {
    #[serde(default)]
    string: Option<String>,
    #[serde(default)]
    int: Option<i64>,
}

/// The capacities named in `gpuslice_api::dra::capacity`.
#[derive(Clone, Debug, Default, Deserialize)]
struct Capacities {
    memory: Option<Capacity>,
    compute: Option<Capacity>,
}

#[derive(Clone, Debug, Deserialize)]
struct Capacity {
    value: Quantity,
}

impl PublishedDevice {
    /// The GpuPool the device belongs to.
    pub fn pool(&self) -> Option<&str> {
        self.attributes.pool.as_ref()?.string.as_deref()
    }

    /// A software slice, taking turns or through MPS.
    pub fn is_software(&self) -> bool {
        self.attributes
            .kind
            .as_ref()
            .and_then(|k| k.string.as_deref())
            .is_some_and(|k| k == dra::kind::SOFTWARE || k == dra::kind::MPS)
    }

    /// A MIG instance.
    pub fn is_mig(&self) -> bool {
        self.attributes
            .kind
            .as_ref()
            .and_then(|k| k.string.as_deref())
            .is_some_and(|k| k == dra::kind::MIG)
    }

    /// The NVLink domain of its GPU; none for a GPU without NVLink peers.
    pub fn nvlink_domain(&self) -> Option<&str> {
        self.attributes.nvlink_domain.as_ref()?.string.as_deref()
    }

    pub fn gpu_index(&self) -> Option<i64> {
        self.attributes.gpu_index.as_ref()?.int
    }

    /// Bytes; 0 when not published or not a quantity.
    pub fn memory_bytes(&self) -> u64 {
        capacity_value(self.capacity.memory.as_ref())
    }

    /// Percent of the GPU; 0 when not published.
    pub fn compute(&self) -> u64 {
        capacity_value(self.capacity.compute.as_ref())
    }

    pub fn is_tainted(&self) -> bool {
        !self.taints.is_empty()
    }
}

fn capacity_value(capacity: Option<&Capacity>) -> u64 {
    capacity
        .and_then(|c| gpuslice_api::bytes_of(&c.value.0).ok())
        .unwrap_or(0)
}

impl kube::Resource for PublishedSlice {
    type DynamicType = ();
    type Scope = kube::core::ClusterResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        <ResourceSlice as k8s_openapi::Resource>::KIND.into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        <ResourceSlice as k8s_openapi::Resource>::GROUP.into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        <ResourceSlice as k8s_openapi::Resource>::VERSION.into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        <ResourceSlice as k8s_openapi::Resource>::URL_PATH_SEGMENT.into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_published_slice_reads_what_the_agent_writes() {
        let json = serde_json::json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "node-1-gpuslice.io-abcde"},
            "spec": {
                "driver": dra::DRIVER,
                "nodeName": "node-1",
                "pool": {"name": "node-1", "generation": 3, "resourceSliceCount": 1},
                "devices": [
                    {
                        "name": "gpu-1-s2",
                        "attributes": {
                            dra::attribute::POOL: {"string": "shared-a100"},
                            dra::attribute::KIND: {"string": dra::kind::SOFTWARE},
                            dra::attribute::GPU_INDEX: {"int": 1},
                            dra::attribute::NVLINK_DOMAIN: {"string": "GPU-0b1c"},
                            "model": {"string": "NVIDIA A100-SXM4-80GB"}
                        },
                        "capacity": {
                            dra::capacity::MEMORY: {"value": "20Gi"},
                            dra::capacity::COMPUTE: {"value": "25"}
                        },
                        "taints": [{"key": "gpuslice.io/recut", "effect": "NoSchedule"}]
                    },
                    {"name": "gpu-0"}
                ]
            }
        });
        let slice: PublishedSlice = serde_json::from_value(json).expect("a ResourceSlice");
        assert_eq!(slice.spec.node_name.as_deref(), Some("node-1"));
        assert_eq!(slice.spec.pool.name, "node-1");
        let [soft, whole] = &slice.spec.devices[..] else {
            panic!("two devices, got {:?}", slice.spec.devices)
        };
        assert_eq!(soft.name, "gpu-1-s2");
        assert_eq!(soft.pool(), Some("shared-a100"));
        assert!(soft.is_software());
        assert_eq!(soft.gpu_index(), Some(1));
        assert_eq!(soft.nvlink_domain(), Some("GPU-0b1c"));
        assert_eq!(soft.memory_bytes(), 20 << 30);
        assert_eq!(soft.compute(), 25);
        assert!(soft.is_tainted());
        assert_eq!(
            (
                whole.pool(),
                whole.is_software(),
                whole.gpu_index(),
                whole.nvlink_domain()
            ),
            (None, false, None, None)
        );
        assert!(!whole.is_tainted());
    }
}
