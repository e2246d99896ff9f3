//! What the agent publishes for Dynamic Resource Allocation (pure; `cluster.rs` writes it): every
//! slice in force on a GPU the node's `GpuNode.spec` assigns to a pool becomes one device of the
//! driver `gpuslice.io`, with the attributes a DeviceClass selects on (pool, window, kind, model,
//! GPU UUID, MIG profile) and its capacities (memory, compute). Devices go into ResourceSlices of
//! one resource pool named after the node, owned by the Node; the pool's generation goes up
//! whenever a device changes, so the scheduler never mixes two layouts.

use chrono::{DateTime, Utc};
use gpuslice_api::dra::{self, attribute, capacity, kind};
use gpuslice_api::k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, DeviceCapacity, DeviceTaint, ResourcePool, ResourceSlice,
    ResourceSliceSpec,
};
use gpuslice_api::k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use gpuslice_api::k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use gpuslice_api::quantity::format_bytes;
use gpuslice_api::{GpuAssignment, NodeInventory};
use gpuslice_contract::SliceKind;

use crate::gpu::slices::{self, SliceConfig};

/// The most devices one ResourceSlice may hold (`resource.k8s.io/v1` validation).
pub const DEVICES_PER_SLICE: usize = 128;

/// The Node that owns the ResourceSlices: deleting it deletes them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRef {
    pub name: String,
    pub uid: String,
}

fn string(value: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(value.to_string()),
        ..DeviceAttribute::default()
    }
}

fn capacity_of(value: String) -> DeviceCapacity {
    DeviceCapacity {
        value: Quantity(value),
        ..DeviceCapacity::default()
    }
}

/// The NVLink domain of GPU `index`: the UUID (else `gpu<index>`) of the lowest-indexed GPU it is
/// joined with through NVLink, directly or through others; `None` without NVLink peers.
fn nvlink_domain(inventory: &NodeInventory, index: u32) -> Option<String> {
    let peers = |i: u32| {
        inventory
            .gpus
            .iter()
            .find(|g| g.index == i)
            .map_or(&[][..], |g| g.nvlink_peers.as_slice())
    };
    if peers(index).is_empty() {
        return None;
    }
    let mut joined = std::collections::BTreeSet::from([index]);
    let mut next = vec![index];
    while let Some(i) = next.pop() {
        for &p in peers(i) {
            if joined.insert(p) {
                next.push(p);
            }
        }
    }
    let lowest = *joined.first()?;
    let uuid = inventory
        .gpus
        .iter()
        .find(|g| g.index == lowest)
        .and_then(|g| g.uuid.clone());
    Some(uuid.unwrap_or_else(|| format!("gpu{lowest}")))
}

/// The devices of this node: one per slice in force on a GPU the spec assigns, smallest first
/// (the scheduler tries devices in the order they are published, so a request lands on the
/// smallest slice that fits it). `offer` says, per slice, whether it is offered (`None`: not
/// published, as a software slice on a driver that is too old) and with which taints (re-cut,
/// fault quarantine).
pub fn devices(
    inventory: &NodeInventory,
    assignments: &[GpuAssignment],
    offer: &dyn Fn(&GpuAssignment, &SliceConfig) -> Option<Vec<DeviceTaint>>,
) -> Vec<Device> {
    let mut out: Vec<(u64, u32, String, Device)> = Vec::new();
    for slice in slices::configs(inventory) {
        let Some(assignment) = assignments.iter().find(|a| a.index == slice.gpu) else {
            continue;
        };
        let Some(gpu) = inventory.gpus.iter().find(|g| g.index == slice.gpu) else {
            continue;
        };
        // A spec written for another GPU is not applied; its slices are not the pool's.
        if let (Some(want), Some(have)) = (&assignment.uuid, &gpu.uuid)
            && want != have
        {
            continue;
        }
        let Some(taints) = offer(assignment, &slice) else {
            continue;
        };
        let mut attributes = std::collections::BTreeMap::from([
            (
                attribute::POOL.to_string(),
                string(&assignment.assigned.pool),
            ),
            (
                attribute::WINDOW.to_string(),
                string(assignment.assigned.window.as_deref().unwrap_or("")),
            ),
            (
                attribute::KIND.to_string(),
                string(match slice.kind {
                    SliceKind::Software => kind::SOFTWARE,
                    SliceKind::Mps => kind::MPS,
                    SliceKind::Mig => kind::MIG,
                    SliceKind::Exclusive => kind::GPU,
                }),
            ),
            (attribute::MODEL.to_string(), string(&gpu.model)),
            (
                attribute::GPU_UUID.to_string(),
                string(gpu.uuid.as_deref().unwrap_or("")),
            ),
            (
                attribute::GPU_INDEX.to_string(),
                DeviceAttribute {
                    int: Some(i64::from(gpu.index)),
                    ..DeviceAttribute::default()
                },
            ),
            (attribute::SLICE.to_string(), string(&slice.id)),
        ]);
        if let Some(domain) = nvlink_domain(inventory, gpu.index) {
            attributes.insert(attribute::NVLINK_DOMAIN.to_string(), string(&domain));
        }
        // A MIG instance, or an MPS slice of one, names its profile.
        if matches!(slice.kind, SliceKind::Mig | SliceKind::Mps)
            && let Some(instance) = gpu.mig.as_ref().and_then(|m| {
                m.instances
                    .iter()
                    .find(|i| i.uuid.as_deref() == Some(slice.device_uuid.as_str()))
            })
        {
            attributes.insert(
                attribute::MIG_PROFILE.to_string(),
                string(&instance.profile),
            );
        }
        let device = Device {
            name: dra::device_name(&slice.id),
            attributes: Some(attributes),
            capacity: Some(std::collections::BTreeMap::from([
                (
                    capacity::MEMORY.to_string(),
                    capacity_of(format_bytes(slice.memory_bytes)),
                ),
                (
                    capacity::COMPUTE.to_string(),
                    capacity_of(slice.compute_percent.to_string()),
                ),
            ])),
            taints: (!taints.is_empty()).then_some(taints),
            ..Device::default()
        };
        out.push((slice.memory_bytes, slice.compute_percent, slice.id, device));
    }
    out.sort_by(|a, b| (a.0, a.1, &a.2).cmp(&(b.0, b.1, &b.2)));
    out.into_iter().map(|(_, _, _, d)| d).collect()
}

/// The re-cut taint of a GPU whose layout changes at `recut_at`, from `lookahead` before it
/// until the spec stops saying so (the operator writes the new layout after the boundary; a
/// slice stays closed to new pods until then).
pub fn recut_taint(
    recut_at: Option<DateTime<Utc>>,
    lookahead: chrono::Duration,
    now: DateTime<Utc>,
) -> Option<DeviceTaint> {
    let at = recut_at?;
    (now + lookahead >= at).then(|| DeviceTaint {
        key: dra::RECUT_TAINT.to_string(),
        // A label value: the boundary as 20261202T210000Z.
        value: Some(at.format("%Y%m%dT%H%M%SZ").to_string()),
        effect: "NoSchedule".to_string(),
        time_added: None,
    })
}

/// The taint of a GPU that compaction is emptying (the GpuNode's `spec.compacting`).
pub fn compacting_taint() -> DeviceTaint {
    DeviceTaint {
        key: dra::COMPACTING_TAINT.to_string(),
        value: Some("true".to_string()),
        effect: "NoSchedule".to_string(),
        time_added: None,
    }
}

/// The taint of a slice a `gpuslice run` command (process `pid`) holds.
pub fn held_locally_taint(pid: u32) -> DeviceTaint {
    DeviceTaint {
        key: dra::HELD_LOCALLY_TAINT.to_string(),
        value: Some(pid.to_string()),
        effect: "NoSchedule".to_string(),
        time_added: None,
    }
}

/// The re-cut taint of a GPU whose new layout is waiting for busy slices to be freed.
pub fn pending_recut_taint() -> DeviceTaint {
    DeviceTaint {
        key: dra::RECUT_TAINT.to_string(),
        value: Some("pending".to_string()),
        effect: "NoSchedule".to_string(),
        time_added: None,
    }
}

/// The ResourceSlices that publish `devices` as generation `generation` of the node's pool.
/// No devices, no slices (the pool disappears).
pub fn resource_slices(
    node: &NodeRef,
    manager: &str,
    devices: &[Device],
    generation: i64,
) -> Vec<ResourceSlice> {
    let chunks: Vec<&[Device]> = devices.chunks(DEVICES_PER_SLICE).collect();
    chunks
        .iter()
        .enumerate()
        .map(|(n, chunk)| ResourceSlice {
            metadata: ObjectMeta {
                name: Some(dra::resource_slice_name(&node.name, n)),
                labels: Some(std::collections::BTreeMap::from([(
                    dra::MANAGED_BY_LABEL.to_string(),
                    manager.to_string(),
                )])),
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".to_string(),
                    kind: "Node".to_string(),
                    name: node.name.clone(),
                    uid: node.uid.clone(),
                    controller: Some(true),
                    block_owner_deletion: None,
                }]),
                ..ObjectMeta::default()
            },
            spec: ResourceSliceSpec {
                driver: dra::DRIVER.to_string(),
                node_name: Some(node.name.clone()),
                pool: ResourcePool {
                    name: node.name.clone(),
                    generation,
                    resource_slice_count: chunks.len() as i64,
                },
                devices: Some(chunk.to_vec()),
                ..ResourceSliceSpec::default()
            },
        })
        .collect()
}

/// `wanted` as an update of `stored` (the same ResourceSlice as the API server has it): at its
/// resourceVersion, so that a change made meanwhile is a conflict rather than lost, and keeping
/// the labels, annotations and finalizers others put on it (ours win where keys meet).
pub fn as_update_of(stored: &ResourceSlice, mut wanted: ResourceSlice) -> ResourceSlice {
    let theirs = &stored.metadata;
    let ours = &mut wanted.metadata;
    ours.resource_version = theirs.resource_version.clone();
    for (mine, others) in [
        (&mut ours.labels, &theirs.labels),
        (&mut ours.annotations, &theirs.annotations),
    ] {
        if let Some(others) = others {
            let merged = mine.get_or_insert_with(Default::default);
            for (key, value) in others {
                merged.entry(key.clone()).or_insert_with(|| value.clone());
            }
        }
    }
    ours.finalizers = theirs.finalizers.clone();
    wanted
}

/// The generation to publish `devices` with, given the node's ResourceSlices now: `None` when
/// they already say exactly that (nothing to write), else one above the highest seen.
pub fn next_generation(existing: &[ResourceSlice], devices: &[Device]) -> Option<i64> {
    let highest = existing.iter().map(|s| s.spec.pool.generation).max();
    let mut current: Vec<&ResourceSlice> = existing
        .iter()
        .filter(|s| Some(s.spec.pool.generation) == highest)
        .collect();
    current.sort_by_key(|s| s.metadata.name.clone());
    let complete = current
        .first()
        .is_some_and(|s| s.spec.pool.resource_slice_count == current.len() as i64)
        && current.len() == existing.len();
    let published: Vec<&Device> = current
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .collect();
    let same = complete
        && published.len() == devices.len()
        && published.iter().zip(devices).all(|(a, b)| *a == b);
    match (same, highest) {
        (true, _) => None,
        (false, Some(h)) => Some(h + 1),
        (false, None) if devices.is_empty() => None,
        (false, None) => Some(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> NodeInventory {
        serde_yaml::from_str(
            r#"
name: n1
gpus:
- index: 0
  uuid: GPU-0
  model: NVIDIA H200
  slices:
  - {id: gpu0-s0, memory: 20Gi, compute: 25}
  - {id: gpu0-s1, memory: 20Gi, compute: 25}
- index: 1
  uuid: GPU-1
  model: NVIDIA H200
  mig:
    enabled: true
    instances:
    - {profile: 3g.71gb, placement: {start: 4, size: 4}, uuid: MIG-a}
    - {profile: 1g.18gb, placement: {start: 0, size: 1}, uuid: MIG-b}
- index: 2
  uuid: GPU-2
  model: NVIDIA H200
"#,
        )
        .unwrap()
    }

    fn assignment(index: u32, pool: &str) -> GpuAssignment {
        serde_yaml::from_str(&format!(
            "{{index: {index}, pool: {pool}, window: day, layout: {{kind: Exclusive}}}}"
        ))
        .unwrap()
    }

    fn me() -> NodeRef {
        NodeRef {
            name: "n1".into(),
            uid: "u1".into(),
        }
    }

    fn attr<'a>(d: &'a Device, name: &str) -> &'a DeviceAttribute {
        &d.attributes.as_ref().unwrap()[name]
    }

    #[test]
    fn slices_of_assigned_gpus_become_devices_smallest_first() {
        let got = devices(
            &node(),
            &[assignment(0, "infer"), assignment(1, "train")],
            &|_, _| Some(Vec::new()),
        );
        let names: Vec<&str> = got.iter().map(|d| d.name.as_str()).collect();
        // GPU 2 is in no pool: not published. The 1g instance (about 16.5 GiB) is smaller than
        // the 20 GiB software slices.
        assert_eq!(
            names,
            [
                "gpu1-mig0-1g-18gb",
                "gpu0-s0",
                "gpu0-s1",
                "gpu1-mig4-3g-71gb"
            ]
        );
        let mig = &got[0];
        assert_eq!(attr(mig, "pool").string.as_deref(), Some("train"));
        assert_eq!(attr(mig, "kind").string.as_deref(), Some("mig"));
        assert_eq!(attr(mig, "migProfile").string.as_deref(), Some("1g.18gb"));
        assert_eq!(attr(mig, "gpuUUID").string.as_deref(), Some("GPU-1"));
        assert_eq!(
            attr(mig, "slice").string.as_deref(),
            Some("gpu1-mig0-1g.18gb")
        );
        let software = &got[1];
        assert_eq!(attr(software, "kind").string.as_deref(), Some("software"));
        assert_eq!(attr(software, "window").string.as_deref(), Some("day"));
        let capacity = software.capacity.as_ref().unwrap();
        assert_eq!(capacity["memory"].value.0, "20Gi");
        assert_eq!(capacity["compute"].value.0, "25");
    }

    /// A MIG instance cut into MPS slices is published as those slices: kind `mps`, on the
    /// instance (its profile), each with its memory and share of the instance; the instance
    /// itself is not offered whole.
    #[test]
    fn mps_slices_of_a_mig_instance_are_its_devices() {
        let mut inventory = node();
        let three_g = &mut inventory.gpus[1].mig.as_mut().unwrap().instances[0];
        three_g.slices = serde_yaml::from_str(
            "[{id: gpu1-mig4-3g.71gb-s0, memory: 35Gi, compute: 50, mps: true},
              {id: gpu1-mig4-3g.71gb-s1, memory: 35Gi, compute: 50, mps: true}]",
        )
        .unwrap();
        let got = devices(&inventory, &[assignment(1, "infer")], &|_, _| {
            Some(Vec::new())
        });
        let names: Vec<&str> = got.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "gpu1-mig0-1g-18gb",
                "gpu1-mig4-3g-71gb-s0",
                "gpu1-mig4-3g-71gb-s1"
            ]
        );
        let mps = &got[1];
        assert_eq!(attr(mps, "kind").string.as_deref(), Some("mps"));
        assert_eq!(attr(mps, "migProfile").string.as_deref(), Some("3g.71gb"));
        let capacity = mps.capacity.as_ref().unwrap();
        assert_eq!(capacity["memory"].value.0, "35Gi");
        assert_eq!(capacity["compute"].value.0, "50");
    }

    #[test]
    fn gpus_joined_by_nvlink_directly_or_through_others_share_a_domain() {
        let mut inventory = node();
        // GPU 1 reaches 2 and 2 reaches 1 (a bridge); GPU 0 has no NVLink.
        inventory.gpus[1].nvlink_peers = vec![2];
        inventory.gpus[2].nvlink_peers = vec![1];
        assert_eq!(nvlink_domain(&inventory, 0), None);
        assert_eq!(nvlink_domain(&inventory, 2).as_deref(), Some("GPU-1"));
        assert_eq!(nvlink_domain(&inventory, 1).as_deref(), Some("GPU-1"));
        let published = devices(&inventory, &[assignment(2, "infer")], &|_, _| {
            Some(Vec::new())
        });
        let domain = &published[0].attributes.as_ref().unwrap()[attribute::NVLINK_DOMAIN];
        assert_eq!(domain.string.as_deref(), Some("GPU-1"));
    }

    #[test]
    fn a_spec_for_another_gpu_publishes_nothing() {
        let mut a = assignment(0, "infer");
        a.uuid = Some("GPU-other".into());
        assert!(devices(&node(), &[a], &|_, _| Some(Vec::new())).is_empty());
    }

    #[test]
    fn the_generation_goes_up_only_when_a_device_changes() {
        let me = me();
        let first = devices(&node(), &[assignment(0, "infer")], &|_, _| Some(Vec::new()));
        assert_eq!(next_generation(&[], &first), Some(1));
        let published = resource_slices(&me, "m", &first, 1);
        assert_eq!(next_generation(&published, &first), None, "unchanged");
        let tainted = devices(&node(), &[assignment(0, "infer")], &|_, _| {
            Some(
                recut_taint(
                    Some("2026-12-02T21:00:00Z".parse().unwrap()),
                    chrono::Duration::minutes(5),
                    "2026-12-02T20:56:00Z".parse().unwrap(),
                )
                .into_iter()
                .collect(),
            )
        });
        assert_eq!(next_generation(&published, &tainted), Some(2));
        assert_eq!(next_generation(&published, &[]), Some(2), "all gone");
        assert_eq!(next_generation(&[], &[]), None);
    }

    #[test]
    fn a_slice_not_offered_is_not_published_and_the_others_are() {
        // As for a driver too old for the shim: software slices hidden, MIG instances offered.
        let got = devices(
            &node(),
            &[assignment(0, "infer"), assignment(1, "train")],
            &|_, s| (s.kind != SliceKind::Software).then(Vec::new),
        );
        let names: Vec<&str> = got.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpu1-mig0-1g-18gb", "gpu1-mig4-3g-71gb"]);
    }

    #[test]
    fn many_devices_span_several_slices_of_one_pool() {
        let me = me();
        let one = devices(&node(), &[assignment(0, "infer")], &|_, _| Some(Vec::new())).remove(0);
        let many: Vec<Device> = (0..300)
            .map(|i| Device {
                name: format!("d{i}"),
                ..one.clone()
            })
            .collect();
        let slices = resource_slices(&me, "m", &many, 7);
        assert_eq!(slices.len(), 3);
        assert!(slices.iter().all(|s| s.spec.pool.resource_slice_count == 3
            && s.spec.pool.generation == 7
            && s.spec.pool.name == "n1"));
        assert_eq!(next_generation(&slices, &many), None);
        assert_eq!(next_generation(&slices[..2], &many), Some(8), "one missing");
    }

    #[test]
    fn an_update_keeps_what_others_put_on_the_slice_at_its_resource_version() {
        let me = me();
        let first = devices(&node(), &[assignment(0, "infer")], &|_, _| Some(Vec::new()));
        let mut stored = resource_slices(&me, "m", &first, 1).remove(0);
        stored.metadata.resource_version = Some("41".into());
        stored.metadata.finalizers = Some(vec!["example.com/audit".into()]);
        let labels = stored.metadata.labels.get_or_insert_with(Default::default);
        labels.insert("team".into(), "ml".into());
        labels.insert(dra::MANAGED_BY_LABEL.into(), "someone-else".into());
        stored.metadata.annotations = Some([("note".to_string(), "x".to_string())].into());
        let wanted = resource_slices(&me, "m", &first[..1], 2).remove(0);
        let update = as_update_of(&stored, wanted.clone());
        assert_eq!(update.metadata.resource_version.as_deref(), Some("41"));
        let labels = update.metadata.labels.as_ref().unwrap();
        assert_eq!(labels["team"], "ml");
        assert_eq!(labels[dra::MANAGED_BY_LABEL], "m", "ours win");
        assert_eq!(update.metadata.annotations.as_ref().unwrap()["note"], "x");
        assert_eq!(
            update.metadata.finalizers,
            Some(vec!["example.com/audit".to_string()])
        );
        assert_eq!(update.spec, wanted.spec, "the spec is ours, whole");
    }

    #[test]
    fn the_recut_taint_starts_a_lookahead_before_the_boundary() {
        let at: DateTime<Utc> = "2026-12-02T21:00:00Z".parse().unwrap();
        let ahead = chrono::Duration::minutes(5);
        let t = |s: &str| recut_taint(Some(at), ahead, s.parse().unwrap());
        assert!(t("2026-12-02T20:54:59Z").is_none());
        let taint = t("2026-12-02T20:55:00Z").unwrap();
        assert_eq!(taint.key, "gpuslice.io/recut");
        assert_eq!(taint.effect, "NoSchedule");
        assert_eq!(taint.value.as_deref(), Some("20261202T210000Z"));
        assert!(
            t("2026-12-02T21:00:30Z").is_some(),
            "past it, until the spec moves on"
        );
        assert!(recut_taint(None, ahead, at).is_none());
    }
}
