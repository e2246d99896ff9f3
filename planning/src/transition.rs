//! Transition plans: from a GPU's current state to a desired layout, as an ordered list of
//! operations that keeps every instance already in a usable place and never destroys a busy one.
//!
//! When reaching the target needs a busy instance (or busy software slices, or the processes of an
//! exclusive GPU) to go, the plan is *blocked* and names them; the agent drains them per the
//! CheckpointPolicy and plans again.

use std::collections::BTreeMap;

use gpuslice_api::quantity::{bytes_of, format_bytes};
use gpuslice_api::{GpuInventory, Layout, LayoutKind, Placement, SoftwareLayout};
use serde::Serialize;

use crate::catalog::GpuModel;
use crate::mig::{self, MigError};

/// A MIG instance on a GPU now.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Instance {
    pub profile: String,
    pub placement: Placement,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Has processes, or MPS slices held by a workload: never destroyed by a plan.
    pub busy: bool,
    /// Its MPS slices (layout `mig.mps`); 0 when the instance is one slice.
    #[serde(skip_serializing_if = "is_zero")]
    pub mps_slices: u32,
    /// Ids of its MPS slices held by a workload.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub busy_slices: Vec<String>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A software slice table: `slices` slices of `memory` bytes and `compute` percent each, taking
/// turns on the GPU or, with `mps`, running side by side through CUDA MPS.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SliceTable {
    pub slices: u32,
    pub memory: u64,
    pub compute: u32,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub mps: bool,
}

impl SliceTable {
    fn of(layout: &SoftwareLayout, mps: bool) -> Result<SliceTable, DesiredError> {
        Ok(SliceTable {
            slices: layout.slices,
            memory: layout
                .memory
                .bytes()
                .map_err(|_| DesiredError::Memory(layout.memory.0.clone()))?,
            compute: layout.compute,
            mps,
        })
    }
}

impl std::fmt::Display for SliceTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} × {} / {}% compute{}",
            self.slices,
            format_bytes(self.memory),
            self.compute,
            if self.mps { " (MPS)" } else { "" }
        )
    }
}

/// What a GPU looks like now.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct GpuState {
    pub mig_enabled: bool,
    pub instances: Vec<Instance>,
    /// The software slice table, when one is configured.
    pub slices: Option<SliceTable>,
    /// Ids of software slices (MPS slices of instances too) held by a workload.
    pub busy_slices: Vec<String>,
    /// Processes on the whole GPU (exclusive use, outside MIG and slices).
    pub busy_gpu: bool,
}

impl GpuState {
    /// The state an inventory entry describes. A slice table whose slices differ in size is
    /// recorded by its first slice; any change rewrites it whole.
    pub fn from_inventory(gpu: &GpuInventory) -> Self {
        let mig = gpu.mig.as_ref();
        let slices = gpu.slices.first().map(|first| SliceTable {
            slices: gpu.slices.len() as u32,
            memory: bytes_of(&first.memory.0).unwrap_or(0),
            compute: first.compute,
            mps: first.mps,
        });
        GpuState {
            mig_enabled: mig.is_some_and(|m| m.enabled),
            instances: mig
                .map(|m| {
                    m.instances
                        .iter()
                        .map(|i| {
                            let busy_slices: Vec<String> = i
                                .slices
                                .iter()
                                .filter(|s| !s.processes.is_empty())
                                .map(|s| s.id.clone())
                                .collect();
                            Instance {
                                profile: i.profile.clone(),
                                placement: i.placement,
                                uuid: i.uuid.clone(),
                                busy: !i.processes.is_empty() || !busy_slices.is_empty(),
                                mps_slices: i.slices.len() as u32,
                                busy_slices,
                            }
                        })
                        .collect()
                })
                .unwrap_or_default(),
            slices,
            busy_slices: gpu
                .slices
                .iter()
                .chain(
                    mig.iter()
                        .flat_map(|m| &m.instances)
                        .flat_map(|i| &i.slices),
                )
                .filter(|s| !s.processes.is_empty())
                .map(|s| s.id.clone())
                .collect(),
            busy_gpu: !gpu.processes.is_empty(),
        }
    }
}

/// The memory (whole MiB) and share of the instance's SMs (percent) of each of `slices` MPS
/// slices of a MIG instance of `memory` bytes.
pub fn mps_slice_of_instance(memory: u64, slices: u32) -> (u64, u32) {
    let n = slices.max(1);
    ((memory / u64::from(n)) >> 20 << 20, 100 / n)
}

impl GpuState {
    /// MPS slices per MIG instance (layout `mig.mps`): `Some(n)` when every instance has `n`,
    /// `Some(0)` when only some have slices, `None` when none has.
    pub fn instance_mps(&self) -> Option<u32> {
        let mut counts = self.instances.iter().map(|i| i.mps_slices);
        let first = counts.next()?;
        match (first, counts.all(|n| n == first)) {
            (0, true) => None,
            (n, true) => Some(n),
            _ => Some(0),
        }
    }
}

/// The layout a GPU should have, resolved for its model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Desired {
    /// Profile name → count.
    Mig(BTreeMap<String, u32>),
    /// MIG instances (profile name → count), each shared through CUDA MPS by `slices` slices.
    MigMps {
        profiles: BTreeMap<String, u32>,
        slices: u32,
    },
    Software(SliceTable),
    Exclusive,
}

impl std::fmt::Display for Desired {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Desired::Mig(counts) => {
                let parts: Vec<String> = counts.iter().map(|(p, n)| format!("{n} × {p}")).collect();
                write!(f, "MIG {}", parts.join(" + "))
            }
            Desired::MigMps { profiles, slices } => {
                write!(
                    f,
                    "{}, each instance in {slices} MPS slices",
                    Desired::Mig(profiles.clone())
                )
            }
            Desired::Software(t) if t.mps => write!(f, "{t}"),
            Desired::Software(t) => write!(f, "software {t}"),
            Desired::Exclusive => f.write_str("exclusive"),
        }
    }
}

/// Why a layout cannot be resolved for a GPU.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DesiredError {
    #[error(transparent)]
    Mig(#[from] MigError),
    #[error("model {0:?} is not in the catalog, so its MIG profiles are unknown")]
    UnknownMigModel(String),
    #[error("slice memory {0:?} is not a size")]
    Memory(String),
    #[error("the layout sets none or several of mig, software, mps, exclusive")]
    NoKind,
}

impl Desired {
    /// Resolves a pool layout for a GPU of `model` (`None` when the catalog does not know it).
    pub fn of(
        layout: &Layout,
        model: Option<&GpuModel>,
        model_name: &str,
    ) -> Result<Desired, DesiredError> {
        match layout.kind().ok_or(DesiredError::NoKind)? {
            LayoutKind::Mig(m) => {
                let model =
                    model.ok_or_else(|| DesiredError::UnknownMigModel(model_name.to_string()))?;
                let counts = mig::requested_profiles(model, m)?;
                // Canonical profile names, and a layout that fits at all.
                mig::solve_counts(model, &counts)?;
                let canonical = counts
                    .into_iter()
                    .filter(|(_, n)| *n > 0)
                    .map(|(p, n)| (model.profile(&p).map_or(p, |pr| pr.name.clone()), n))
                    .collect();
                Ok(match &m.mps {
                    Some(mps) => Desired::MigMps {
                        profiles: canonical,
                        slices: mps.slices,
                    },
                    None => Desired::Mig(canonical),
                })
            }
            LayoutKind::Software(s) => Ok(Desired::Software(SliceTable::of(s, false)?)),
            LayoutKind::Mps(s) => Ok(Desired::Software(SliceTable::of(s, true)?)),
            LayoutKind::Exclusive => Ok(Desired::Exclusive),
        }
    }
}

/// One step of a transition, in the order the agent runs them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "op", rename_all = "camelCase")]
pub enum Op {
    /// Turn MIG mode on (needs an idle GPU).
    EnableMig,
    /// Turn MIG mode off (needs no instances).
    DisableMig,
    DestroyInstance {
        profile: String,
        placement: Placement,
        #[serde(skip_serializing_if = "Option::is_none")]
        uuid: Option<String>,
    },
    CreateInstance {
        profile: String,
        placement: Placement,
    },
    /// Write the software slice table.
    WriteSlices { table: SliceTable },
    /// Remove the software slice table.
    ClearSlices,
    /// Write the MPS slice table of every instance the GPU has once the operations before ran:
    /// `slices` slices each, of an equal share of the instance's memory and SMs.
    WriteInstanceSlices { slices: u32 },
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let slices = |p: &Placement| slice_range(*p);
        match self {
            Op::EnableMig => f.write_str("enable MIG mode"),
            Op::DisableMig => f.write_str("disable MIG mode"),
            Op::DestroyInstance {
                profile,
                placement,
                uuid,
            } => {
                write!(f, "destroy {profile} at {}", slices(placement))?;
                if let Some(u) = uuid {
                    write!(f, " ({u})")?;
                }
                Ok(())
            }
            Op::CreateInstance { profile, placement } => {
                write!(f, "create {profile} at {}", slices(placement))
            }
            Op::WriteSlices { table } => write!(f, "write slice table: {table}"),
            Op::ClearSlices => f.write_str("remove the software slice table"),
            Op::WriteInstanceSlices { slices } => {
                write!(f, "write MPS slice tables: each instance in {slices}")
            }
        }
    }
}

/// `slice 3` or `slices 4-7`.
fn slice_range(p: Placement) -> String {
    if p.size <= 1 {
        format!("slice {}", p.start)
    } else {
        format!("slices {}-{}", p.start, p.start + p.size - 1)
    }
}

/// Something busy that stands in the way of a transition.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum Blocker {
    Instance {
        profile: String,
        placement: Placement,
        #[serde(skip_serializing_if = "Option::is_none")]
        uuid: Option<String>,
    },
    Slices {
        ids: Vec<String>,
    },
    /// Processes using the whole GPU.
    Gpu,
}

impl std::fmt::Display for Blocker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Blocker::Instance {
                profile,
                placement,
                uuid,
            } => {
                write!(f, "busy {profile} at {}", slice_range(*placement))?;
                if let Some(u) = uuid {
                    write!(f, " ({u})")?;
                }
                Ok(())
            }
            Blocker::Slices { ids } => write!(f, "busy software slices {}", ids.join(", ")),
            Blocker::Gpu => f.write_str("processes using the whole GPU"),
        }
    }
}

/// A transition: the operations that reach the desired layout once `blocked_by` is empty.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Plan {
    pub ops: Vec<Op>,
    /// Instances that stay as they are.
    pub kept: Vec<Instance>,
    /// Busy things the plan would have to take; the agent must drain them first.
    pub blocked_by: Vec<Blocker>,
}

impl Plan {
    pub fn is_blocked(&self) -> bool {
        !self.blocked_by.is_empty()
    }
}

/// Plans the transition of one GPU. `model` is needed for MIG targets.
pub fn plan(
    model: Option<&GpuModel>,
    current: &GpuState,
    desired: &Desired,
) -> Result<Plan, DesiredError> {
    let mut plan = Plan::default();
    match desired {
        Desired::Mig(counts) => {
            to_mig(model, current, counts, &mut plan)?;
            if current.instance_mps().is_some() {
                block_slices(current, &mut plan);
                plan.ops.push(Op::ClearSlices);
            }
        }
        Desired::MigMps { profiles, slices } => {
            to_mig(model, current, profiles, &mut plan)?;
            let instances_change = plan
                .ops
                .iter()
                .any(|o| matches!(o, Op::CreateInstance { .. } | Op::DestroyInstance { .. }));
            if current.instance_mps() != Some(*slices) || instances_change {
                // Instances that stay and are cut otherwise: what runs on them goes first (a
                // workload on a whole instance, or on MPS slices of another size).
                let mut blocked = Vec::new();
                for i in kept(current, &plan).filter(|i| i.mps_slices != *slices) {
                    if i.mps_slices == 0 && i.busy {
                        blocked.push(instance_blocker(i));
                    } else if !i.busy_slices.is_empty() {
                        blocked.push(Blocker::Slices {
                            ids: i.busy_slices.clone(),
                        });
                    }
                }
                plan.blocked_by.extend(blocked);
                plan.ops.push(Op::WriteInstanceSlices { slices: *slices });
            }
        }
        Desired::Software(table) => {
            leave_mig(current, &mut plan);
            if current.mig_enabled || current.slices != Some(*table) {
                block_slices(current, &mut plan);
                if current.slices.is_none() && current.busy_gpu {
                    plan.blocked_by.push(Blocker::Gpu);
                }
                plan.ops.push(Op::WriteSlices { table: *table });
            }
        }
        Desired::Exclusive => {
            leave_mig(current, &mut plan);
            if current.slices.is_some() {
                block_slices(current, &mut plan);
                plan.ops.push(Op::ClearSlices);
            }
        }
    }
    Ok(plan)
}

/// The MIG part of a MIG target: MIG mode on and the instances `counts` asks for.
fn to_mig(
    model: Option<&GpuModel>,
    current: &GpuState,
    counts: &BTreeMap<String, u32>,
    plan: &mut Plan,
) -> Result<(), DesiredError> {
    let model = model.ok_or_else(|| DesiredError::UnknownMigModel(String::new()))?;
    let wanted = mig::resolve_counts(model, counts)?;
    if !current.mig_enabled {
        leave_software(current, plan);
        plan.ops.push(Op::EnableMig);
        create(plan, mig::place_around(&wanted, 0));
    } else {
        reshape_mig(model, current, &wanted, plan);
    }
    Ok(())
}

/// The instances of `current` that `plan` does not destroy.
fn kept<'a>(current: &'a GpuState, plan: &'a Plan) -> impl Iterator<Item = &'a Instance> {
    current.instances.iter().filter(|i| {
        !plan.ops.iter().any(
            |o| matches!(o, Op::DestroyInstance { placement, .. } if *placement == i.placement),
        )
    })
}

fn instance_blocker(i: &Instance) -> Blocker {
    Blocker::Instance {
        profile: i.profile.clone(),
        placement: i.placement,
        uuid: i.uuid.clone(),
    }
}

fn block_slices(current: &GpuState, plan: &mut Plan) {
    if !current.busy_slices.is_empty() {
        plan.blocked_by.push(Blocker::Slices {
            ids: current.busy_slices.clone(),
        });
    }
}

/// From a non-MIG GPU towards MIG: the slice table and whole-GPU processes must go.
fn leave_software(current: &GpuState, plan: &mut Plan) {
    if current.slices.is_some() {
        block_slices(current, plan);
        plan.ops.push(Op::ClearSlices);
    } else if current.busy_gpu {
        plan.blocked_by.push(Blocker::Gpu);
    }
}

/// From MIG towards a non-MIG layout: every instance goes, then MIG mode.
fn leave_mig(current: &GpuState, plan: &mut Plan) {
    if !current.mig_enabled {
        return;
    }
    for i in &current.instances {
        destroy(plan, i);
    }
    plan.ops.push(Op::DisableMig);
    if current.instance_mps().is_some() {
        // The instances' MPS slice table goes with them.
        plan.ops.push(Op::ClearSlices);
    }
}

fn destroy(plan: &mut Plan, i: &Instance) {
    if i.busy {
        plan.blocked_by.push(instance_blocker(i));
    }
    plan.ops.push(Op::DestroyInstance {
        profile: i.profile.clone(),
        placement: i.placement,
        uuid: i.uuid.clone(),
    });
}

fn create(plan: &mut Plan, placed: Option<Vec<mig::PlacedInstance>>) {
    for p in placed.into_iter().flatten() {
        plan.ops.push(Op::CreateInstance {
            profile: p.profile,
            placement: p.placement,
        });
    }
}

/// MIG to MIG: keep the best subset of the instances that already have a wanted profile (fewest
/// busy instances destroyed, then most kept), place the rest around them.
fn reshape_mig(
    model: &GpuModel,
    current: &GpuState,
    wanted: &[(&crate::catalog::MigProfile, u32)],
    plan: &mut Plan,
) {
    // Each candidate (an instance whose profile is wanted) as (instance, index into `wanted`).
    // At most 16 are considered; GPUs have at most 7 instances.
    let candidates: Vec<(&Instance, usize)> = current
        .instances
        .iter()
        .filter_map(|i| {
            let p = model.profile(&i.profile)?;
            wanted
                .iter()
                .position(|(w, _)| w.name == p.name)
                .map(|k| (i, k))
        })
        .take(16)
        .collect();
    let mut subsets: Vec<(usize, usize, u32)> = (0u32..(1 << candidates.len()))
        .filter_map(|bits| {
            let mut used = 0u32;
            let mut per_profile = [0u32; 16];
            for (k, (inst, w)) in candidates.iter().enumerate() {
                if bits & (1 << k) == 0 {
                    continue;
                }
                let m = mig::mask(inst.placement);
                if used & m != 0 {
                    return None;
                }
                used |= m;
                per_profile[*w % 16] += 1;
                if per_profile[*w % 16] > wanted[*w].1 {
                    return None;
                }
            }
            let busy_dropped = candidates
                .iter()
                .enumerate()
                .filter(|(k, (i, _))| i.busy && bits & (1 << k) == 0)
                .count();
            Some((
                busy_dropped,
                candidates.len() - bits.count_ones() as usize,
                bits,
            ))
        })
        .collect();
    subsets.sort_unstable();
    for (_, _, bits) in subsets {
        let kept = |k: usize| bits & (1 << k) != 0;
        let occupied = candidates
            .iter()
            .enumerate()
            .filter(|(k, _)| kept(*k))
            .fold(0, |m, (_, (i, _))| m | mig::mask(i.placement));
        let remaining: Vec<(&crate::catalog::MigProfile, u32)> = wanted
            .iter()
            .enumerate()
            .map(|(w, (p, n))| {
                (
                    *p,
                    n - candidates
                        .iter()
                        .enumerate()
                        .filter(|(k, (_, cw))| kept(*k) && *cw == w)
                        .count() as u32,
                )
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        if let Some(placed) = mig::place_around(&remaining, occupied) {
            let stays = |i: &Instance| {
                candidates
                    .iter()
                    .enumerate()
                    .any(|(k, (c, _))| kept(k) && std::ptr::eq(*c, i))
            };
            let mut going: Vec<&Instance> =
                current.instances.iter().filter(|i| !stays(i)).collect();
            going.sort_by_key(|i| (i.busy, i.placement));
            for i in going {
                destroy(plan, i);
            }
            create(plan, Some(placed));
            plan.kept = current
                .instances
                .iter()
                .filter(|i| stays(i))
                .cloned()
                .collect();
            plan.kept.sort();
            return;
        }
    }
    // Unreachable for a layout that solves on an empty GPU (the empty subset), kept for safety:
    // destroy everything and place from scratch.
    for i in &current.instances {
        destroy(plan, i);
    }
    create(plan, mig::place_around(wanted, 0));
}

/// The state after running a plan's operations (what the agent's re-read should show).
pub fn apply(current: &GpuState, ops: &[Op]) -> GpuState {
    let mut s = current.clone();
    for op in ops {
        match op {
            Op::EnableMig => s.mig_enabled = true,
            Op::DisableMig => s.mig_enabled = false,
            Op::DestroyInstance { placement, .. } => {
                s.instances.retain(|i| i.placement != *placement)
            }
            Op::CreateInstance { profile, placement } => s.instances.push(Instance {
                profile: profile.clone(),
                placement: *placement,
                uuid: None,
                busy: false,
                mps_slices: 0,
                busy_slices: Vec::new(),
            }),
            Op::WriteSlices { table } => {
                s.slices = Some(*table);
                s.busy_slices.clear();
            }
            Op::ClearSlices => {
                s.slices = None;
                s.busy_slices.clear();
                for i in &mut s.instances {
                    i.mps_slices = 0;
                    i.busy_slices.clear();
                }
            }
            Op::WriteInstanceSlices { slices } => {
                for i in &mut s.instances {
                    i.mps_slices = *slices;
                    i.busy_slices.clear();
                }
            }
        }
    }
    s
}

/// Whether a GPU state has exactly the desired layout.
pub fn satisfies(model: Option<&GpuModel>, state: &GpuState, desired: &Desired) -> bool {
    match desired {
        Desired::Mig(counts) => {
            let mut have: BTreeMap<String, u32> = BTreeMap::new();
            for i in &state.instances {
                let name = model
                    .and_then(|m| m.profile(&i.profile))
                    .map_or_else(|| i.profile.clone(), |p| p.name.clone());
                *have.entry(name).or_default() += 1;
            }
            let overlap_free = state.instances.iter().try_fold(0u32, |used, i| {
                let m = mig::mask(i.placement);
                (used & m == 0).then_some(used | m)
            });
            state.mig_enabled
                && state.slices.is_none()
                && state.instance_mps().is_none()
                && &have == counts
                && overlap_free.is_some()
        }
        Desired::MigMps { profiles, slices } => {
            // The instances as plain MIG would have them, and each cut into `slices`.
            let mut as_mig = state.clone();
            as_mig.instances.iter_mut().for_each(|i| i.mps_slices = 0);
            satisfies(model, &as_mig, &Desired::Mig(profiles.clone()))
                && state.instance_mps() == Some(*slices)
        }
        Desired::Software(t) => {
            !state.mig_enabled && state.instances.is_empty() && state.slices == Some(*t)
        }
        Desired::Exclusive => {
            !state.mig_enabled && state.instances.is_empty() && state.slices.is_none()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::model;

    fn inst(profile: &str, start: u32, size: u32, busy: bool) -> Instance {
        Instance {
            profile: profile.into(),
            placement: Placement { start, size },
            uuid: None,
            busy,
            mps_slices: 0,
            busy_slices: Vec::new(),
        }
    }

    fn mig_state(instances: Vec<Instance>) -> GpuState {
        GpuState {
            mig_enabled: true,
            instances,
            ..GpuState::default()
        }
    }

    fn counts(pairs: &[(&str, u32)]) -> Desired {
        Desired::Mig(pairs.iter().map(|(p, n)| (p.to_string(), *n)).collect())
    }

    #[test]
    fn matching_instances_are_kept_and_only_the_difference_changes() {
        let h200 = model("NVIDIA H200").unwrap();
        // Now: 3g at 4-7 (busy), 1g at 0, 1g at 1, 1g at 2, 1g at 3. Want: 3g + 2g + 2 × 1g.
        let now = mig_state(vec![
            inst("3g.71gb", 4, 4, true),
            inst("1g.18gb", 0, 1, false),
            inst("1g.18gb", 1, 1, false),
            inst("1g.18gb", 2, 1, false),
            inst("1g.18gb", 3, 1, false),
        ]);
        let want = counts(&[("3g.71gb", 1), ("2g.35gb", 1), ("1g.18gb", 2)]);
        let p = plan(Some(h200), &now, &want).unwrap();
        assert!(!p.is_blocked(), "{p:?}");
        assert_eq!(
            p.ops,
            vec![
                Op::DestroyInstance {
                    profile: "1g.18gb".into(),
                    placement: Placement { start: 2, size: 1 },
                    uuid: None
                },
                Op::DestroyInstance {
                    profile: "1g.18gb".into(),
                    placement: Placement { start: 3, size: 1 },
                    uuid: None
                },
                Op::CreateInstance {
                    profile: "2g.35gb".into(),
                    placement: Placement { start: 2, size: 2 }
                },
            ]
        );
        assert!(satisfies(Some(h200), &apply(&now, &p.ops), &want));
    }

    /// MPS inside MIG instances: the instances are cut as for MIG, then each instance's MPS
    /// slice table is written; the same layout again changes nothing; other slice counts wait
    /// for busy slices; back to plain MIG the table goes.
    #[test]
    fn mps_slices_are_written_into_the_instances_once_they_exist() {
        let a100 = model("A100-80GB").unwrap();
        let want = Desired::MigMps {
            profiles: [("3g.40gb".to_string(), 2)].into(),
            slices: 2,
        };
        let p = plan(Some(a100), &GpuState::default(), &want).unwrap();
        assert_eq!(p.ops.first(), Some(&Op::EnableMig));
        assert_eq!(
            p.ops.last(),
            Some(&Op::WriteInstanceSlices { slices: 2 }),
            "{p:?}"
        );
        let cut = apply(&GpuState::default(), &p.ops);
        assert!(satisfies(Some(a100), &cut, &want));
        assert!(
            !satisfies(
                Some(a100),
                &cut,
                &Desired::Mig([("3g.40gb".to_string(), 2)].into())
            ),
            "plain MIG is not MPS in MIG"
        );
        assert_eq!(plan(Some(a100), &cut, &want).unwrap().ops, Vec::<Op>::new());

        let mut busy = cut.clone();
        busy.busy_slices = vec!["gpu0-mig0-3g.40gb-s1".into()];
        let first = busy
            .instances
            .iter_mut()
            .find(|i| i.placement.start == 0)
            .unwrap();
        first.busy = true;
        first.busy_slices = vec!["gpu0-mig0-3g.40gb-s1".into()];
        let thirds = Desired::MigMps {
            profiles: [("3g.40gb".to_string(), 2)].into(),
            slices: 3,
        };
        let p = plan(Some(a100), &busy, &thirds).unwrap();
        assert_eq!(
            p.blocked_by,
            vec![Blocker::Slices {
                ids: vec!["gpu0-mig0-3g.40gb-s1".into()]
            }]
        );
        assert_eq!(p.ops, vec![Op::WriteInstanceSlices { slices: 3 }]);
        let plain = plan(
            Some(a100),
            &busy,
            &Desired::Mig([("3g.40gb".to_string(), 2)].into()),
        )
        .unwrap();
        assert!(plain.is_blocked());
        assert_eq!(plain.ops, vec![Op::ClearSlices]);
        // To another MIG layout the busy instance stays, and so must its slices' size.
        let bigger = plan(
            Some(a100),
            &busy,
            &Desired::MigMps {
                profiles: [("3g.40gb".to_string(), 1), ("2g.20gb".to_string(), 1)].into(),
                slices: 2,
            },
        )
        .unwrap();
        assert!(!bigger.is_blocked(), "{bigger:?}");
        assert!(
            !bigger.ops.iter().any(|o| matches!(
                o,
                Op::DestroyInstance { placement, .. } if placement.start == 0
            )),
            "the busy instance is kept: {bigger:?}"
        );
        // A workload on a whole instance blocks cutting that instance into MPS slices.
        let whole = mig_state(vec![
            inst("3g.40gb", 0, 4, true),
            inst("3g.40gb", 4, 4, false),
        ]);
        let p = plan(Some(a100), &whole, &want).unwrap();
        assert_eq!(
            p.blocked_by,
            vec![Blocker::Instance {
                profile: "3g.40gb".into(),
                placement: Placement { start: 0, size: 4 },
                uuid: None
            }]
        );
        // An instance of 40 GiB in halves: 20 GiB and half of its SMs each.
        assert_eq!(mps_slice_of_instance(40 << 30, 2), (20 << 30, 50));
        assert_eq!(mps_slice_of_instance(40 << 30, 3).1, 33);
    }

    #[test]
    fn a_busy_instance_in_the_way_blocks_and_is_named() {
        let h100 = model("H100").unwrap();
        let now = mig_state(vec![
            inst("3g.40gb", 0, 4, true),
            inst("3g.40gb", 4, 4, false),
        ]);
        let p = plan(Some(h100), &now, &counts(&[("7g.80gb", 1)])).unwrap();
        assert_eq!(
            p.blocked_by,
            vec![Blocker::Instance {
                profile: "3g.40gb".into(),
                placement: Placement { start: 0, size: 4 },
                uuid: None
            }]
        );
        // The plan still says what will happen once the instance is drained.
        assert_eq!(p.ops.len(), 3);
    }

    #[test]
    fn a_layout_already_in_place_needs_nothing() {
        let a100 = model("A100-80GB").unwrap();
        let now = mig_state(vec![
            inst("4g.40gb", 0, 4, true),
            inst("3g.40gb", 4, 4, true),
        ]);
        let p = plan(Some(a100), &now, &counts(&[("3g.40gb", 1), ("4g.40gb", 1)])).unwrap();
        assert_eq!(p.ops, vec![]);
        assert_eq!(p.kept.len(), 2);
    }

    #[test]
    fn software_to_mig_and_back() {
        let a30 = model("A30").unwrap();
        let table = SliceTable {
            slices: 2,
            memory: 12 << 30,
            compute: 50,
            mps: false,
        };
        let soft = GpuState {
            slices: Some(table),
            ..GpuState::default()
        };
        let p = plan(Some(a30), &soft, &counts(&[("2g.12gb", 2)])).unwrap();
        assert_eq!(p.ops[..2], [Op::ClearSlices, Op::EnableMig]);
        let migged = apply(&soft, &p.ops);
        assert!(satisfies(Some(a30), &migged, &counts(&[("2g.12gb", 2)])));
        let back = plan(Some(a30), &migged, &Desired::Software(table)).unwrap();
        assert_eq!(back.ops.last(), Some(&Op::WriteSlices { table }));
        assert!(back.ops.contains(&Op::DisableMig));
        assert!(satisfies(
            Some(a30),
            &apply(&migged, &back.ops),
            &Desired::Software(table)
        ));
    }

    #[test]
    fn busy_software_slices_block_a_reslice_but_not_an_identical_table() {
        let table = SliceTable {
            slices: 4,
            memory: 20 << 30,
            compute: 25,
            mps: false,
        };
        let now = GpuState {
            slices: Some(table),
            busy_slices: vec!["s1".into()],
            ..GpuState::default()
        };
        assert_eq!(
            plan(None, &now, &Desired::Software(table)).unwrap(),
            Plan::default()
        );
        let night = SliceTable {
            slices: 2,
            memory: 40 << 30,
            compute: 50,
            mps: false,
        };
        let p = plan(None, &now, &Desired::Software(night)).unwrap();
        assert_eq!(
            p.blocked_by,
            vec![Blocker::Slices {
                ids: vec!["s1".into()]
            }]
        );
    }
}
