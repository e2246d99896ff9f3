//! The device model: GPUs of catalog models, MIG mode, GPU and compute instances with
//! placements and UUIDs, processes holding memory, XID events, and injected faults. Every
//! operation follows NVML's documented semantics and return codes, so the NVML emulator is a thin
//! C shell over it and tests can use it directly.

use gpuslice_api::{GpuInventory, MigInstance, MigState, NodeInventory, Placement};
use gpuslice_planning::catalog::{self, GpuModel, MigProfile};
use serde::{Deserialize, Serialize};

/// NVML return codes the model produces (values from `nvml.h`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NvmlError {
    InvalidArgument = 2,
    NotSupported = 3,
    NoPermission = 4,
    NotFound = 6,
    InUse = 19,
    InsufficientResources = 23,
    Unknown = 999,
}

impl NvmlError {
    /// The `nvmlReturn_t` value.
    pub fn code(self) -> u32 {
        self as u32
    }
}

impl std::fmt::Display for NvmlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            NvmlError::InvalidArgument => "NVML_ERROR_INVALID_ARGUMENT",
            NvmlError::NotSupported => "NVML_ERROR_NOT_SUPPORTED",
            NvmlError::NoPermission => "NVML_ERROR_NO_PERMISSION",
            NvmlError::NotFound => "NVML_ERROR_NOT_FOUND",
            NvmlError::InUse => "NVML_ERROR_IN_USE",
            NvmlError::InsufficientResources => "NVML_ERROR_INSUFFICIENT_RESOURCES",
            NvmlError::Unknown => "NVML_ERROR_UNKNOWN",
        };
        f.write_str(name)
    }
}

impl std::error::Error for NvmlError {}

/// What an injected fault does at the mutating call it is armed for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum FaultAction {
    /// The call fails with this error and changes nothing.
    Fail(NvmlError),
    /// The calling process dies before the call takes effect.
    KillBefore,
    /// The call takes effect and is saved, then the calling process dies before it returns.
    KillAfter,
}

/// A fault armed for the `at`-th mutating call (1-based, counted across all processes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fault {
    pub at: u64,
    pub action: FaultAction,
}

/// A compute instance inside a GPU instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComputeInstance {
    pub id: u32,
    /// Compute-instance profile id (what `nvmlGpuInstanceGetComputeInstanceProfileInfo`
    /// answers; NVIDIA's drivers give each the id of its `NVML_COMPUTE_INSTANCE_PROFILE_*` index).
    pub profile_id: u32,
    /// Compute slices it takes of its GPU instance.
    pub slices: u32,
}

/// A GPU instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInstance {
    pub id: u32,
    /// The profile id (`nvidia-smi mig -lgip`'s ID, 19 for 1g on an A100): what NVML's MIG calls
    /// take and report, never the `NVML_GPU_INSTANCE_PROFILE_*` index.
    pub profile_id: u32,
    pub placement: Placement,
    /// The MIG device UUID (`MIG-…`).
    pub uuid: String,
    pub compute_instances: Vec<ComputeInstance>,
}

/// A process holding GPU memory, on the whole GPU or on one GPU instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Process {
    pub pid: u32,
    pub memory: u64,
    /// The GPU instance the process runs in, `None` for the whole GPU.
    pub gpu_instance: Option<u32>,
    /// A real process on this machine (started by a test or the CUDA emulator): it leaves the
    /// GPU when it exits, as the driver frees a dead process's memory. Seeded processes stay.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub real: bool,
    /// Its context is an MPS client's: NVML lists it among the MPS processes as well
    /// (`nvidia-smi` shows it as `M+C`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mps: bool,
}

/// One emulated GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    pub index: u32,
    /// The device node's minor number (`/dev/nvidia<minor>`), which need not be the index.
    pub minor: u32,
    pub uuid: String,
    /// Model name as NVML reports it.
    pub model: String,
    pub memory_total: u64,
    pub mig_enabled: bool,
    pub instances: Vec<GpuInstance>,
    pub processes: Vec<Process>,
    /// XID errors reported so far, oldest first.
    pub xid_events: Vec<Xid>,
    next_instance_id: u32,
}

/// An XID error a GPU reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Xid {
    /// The XID code.
    pub code: u64,
    /// The GPU instance it happened in (MIG); `None` for the whole GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_instance: Option<u32>,
}

/// The driver version the emulator reports unless seeded with another.
pub const DRIVER_VERSION: &str = "575.57.08";
/// The CUDA version that driver supports, as the CUDA emulator reports it.
pub const CUDA_VERSION: &str = "12.8";

/// The emulated machine: what every process that opens the same state sees.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Machine {
    /// The NVIDIA driver (`None`: [`DRIVER_VERSION`] and [`CUDA_VERSION`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<gpuslice_api::DriverVersions>,
    pub gpus: Vec<Gpu>,
    pub faults: Vec<Fault>,
    /// Mutating calls made so far.
    pub mutations: u64,
    /// Counter for UUIDs handed out, so every instance ever created has a new one.
    uuid_counter: u64,
    /// The machine's part of every UUID it hands out (from its node's name), so that two
    /// emulated nodes never share one.
    #[serde(default)]
    uuid_node: u32,
}

/// Why a seed cannot build a machine.
#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    #[error("GPU {index}: {message}")]
    Gpu { index: u32, message: String },
}

/// A UUID of the shape NVIDIA's have (`GPU-…`, `MIG-…`): the machine's part, then a counter.
fn uuid(prefix: &str, node: u32, n: u64) -> String {
    format!("{prefix}-{node:08x}-0000-4000-8000-{n:012x}")
}

/// The machine's part of its UUIDs: FNV-1a of the node's name.
fn node_part(name: &str) -> u32 {
    name.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

impl Machine {
    /// A machine as a [`NodeInventory`] describes it: GPUs of their models, MIG instances in their
    /// placements, processes. GPUs without a UUID get one.
    pub fn from_inventory(node: &NodeInventory) -> Result<Machine, SeedError> {
        let mut m = Machine {
            driver: node.driver.clone(),
            uuid_node: node_part(&node.name),
            ..Machine::default()
        };
        for g in &node.gpus {
            let err = |message: String| SeedError::Gpu {
                index: g.index,
                message,
            };
            let memory_total = match &g.memory {
                Some(q) => gpuslice_api::bytes_of(&q.0).map_err(|e| err(e.to_string()))?,
                None => catalog::model(&g.model)
                    .map_err(|e| err(e.to_string()))?
                    .memory_bytes(),
            };
            m.uuid_counter += 1;
            let mut gpu = Gpu {
                index: g.index,
                minor: g.minor.unwrap_or(g.index),
                uuid: g
                    .uuid
                    .clone()
                    .unwrap_or_else(|| uuid("GPU", m.uuid_node, m.uuid_counter)),
                model: g.model.clone(),
                memory_total,
                mig_enabled: false,
                instances: Vec::new(),
                processes: g.processes.iter().map(|p| process(p, None)).collect(),
                xid_events: Vec::new(),
                next_instance_id: 1,
            };
            if let Some(mig) = &g.mig {
                let model = catalog::model(&g.model)
                    .ok()
                    .filter(|m| m.mig.is_some())
                    .ok_or_else(|| err(format!("{} has no MIG", g.model)))?;
                gpu.mig_enabled = mig.enabled;
                for inst in &mig.instances {
                    let profile = model.profile(&inst.profile).ok_or_else(|| {
                        err(format!("{} has no profile {}", g.model, inst.profile))
                    })?;
                    m.uuid_counter += 1;
                    let id = gpu
                        .place(
                            model,
                            profile,
                            inst.placement.start,
                            uuid("MIG", m.uuid_node, m.uuid_counter),
                        )
                        .map_err(|e| {
                            err(format!("{} at {}: {e}", inst.profile, inst.placement.start))
                        })?;
                    // A seeded instance is a MIG device: its full compute instance exists.
                    let instance = gpu.instance_mut(id).expect("just created");
                    instance
                        .compute_instances
                        .push(full_compute_instance(profile));
                    if let Some(u) = &inst.uuid {
                        instance.uuid = u.clone();
                    }
                    gpu.processes
                        .extend(inst.processes.iter().map(|p| process(p, Some(id))));
                }
            }
            m.gpus.push(gpu);
        }
        Ok(m)
    }

    /// The machine as an inventory (what the agent reports).
    pub fn inventory(&self, name: &str) -> NodeInventory {
        NodeInventory {
            name: name.to_string(),
            driver: Some(self.driver()),
            gpus: self
                .gpus
                .iter()
                .map(|g| {
                    let model = catalog::model(&g.model).ok();
                    let procs = |gi: Option<u32>| {
                        g.processes
                            .iter()
                            .filter(|p| p.gpu_instance == gi)
                            .map(|p| gpuslice_api::GpuProcess {
                                pid: p.pid,
                                memory: Some(quantity(p.memory)),
                                name: None,
                            })
                            .collect::<Vec<_>>()
                    };
                    GpuInventory {
                        index: g.index,
                        minor: Some(g.minor),
                        uuid: Some(g.uuid.clone()),
                        model: g.model.clone(),
                        memory: Some(quantity(g.memory_total)),
                        compute_capability: None,
                        mig: (g.mig_enabled || !g.instances.is_empty()).then(|| MigState {
                            enabled: g.mig_enabled,
                            instances: g
                                .instances
                                .iter()
                                .map(|i| MigInstance {
                                    profile: model
                                        .and_then(|m| m.mig.as_ref()?.profile_by_id(i.profile_id))
                                        .map_or_else(
                                            || format!("profile-{}", i.profile_id),
                                            |p| p.name.clone(),
                                        ),
                                    placement: i.placement,
                                    uuid: Some(i.uuid.clone()),
                                    processes: procs(Some(i.id)),
                                    slices: Vec::new(),
                                })
                                .collect(),
                        }),
                        slices: Vec::new(),
                        processes: procs(None),
                        // Topology is the NVML library's (from its board facts).
                        nvlink_peers: Vec::new(),
                    }
                })
                .collect(),
            ..NodeInventory::default()
        }
    }

    pub fn gpu(&self, index: u32) -> Result<&Gpu, NvmlError> {
        self.gpus
            .iter()
            .find(|g| g.index == index)
            .ok_or(NvmlError::InvalidArgument)
    }

    fn gpu_mut(&mut self, index: u32) -> Result<&mut Gpu, NvmlError> {
        self.gpus
            .iter_mut()
            .find(|g| g.index == index)
            .ok_or(NvmlError::InvalidArgument)
    }

    /// Counts a mutating call and returns the fault armed for it, if any.
    fn next_mutation(&mut self) -> Option<FaultAction> {
        self.mutations += 1;
        let at = self.mutations;
        self.faults
            .iter()
            .position(|f| f.at == at)
            .map(|i| self.faults.remove(i).action)
    }

    /// Runs a mutating call under fault injection. `Kill*` faults are returned to the caller (the
    /// store), which saves the state as the fault says and then ends the process.
    pub fn mutate<T>(
        &mut self,
        call: impl FnOnce(&mut Machine) -> Result<T, NvmlError>,
    ) -> Mutation<T> {
        match self.next_mutation() {
            Some(FaultAction::Fail(e)) => Mutation::Done(Err(e)),
            Some(FaultAction::KillBefore) => Mutation::Die { applied: false },
            Some(FaultAction::KillAfter) => {
                let _ = call(self);
                Mutation::Die { applied: true }
            }
            None => Mutation::Done(call(self)),
        }
    }

    /// `nvmlDeviceSetMigMode`: needs a MIG-capable GPU with no processes and, to disable, no instances.
    pub fn set_mig_mode(&mut self, index: u32, enabled: bool) -> Result<(), NvmlError> {
        let gpu = self.gpu_mut(index)?;
        mig_model(&gpu.model)?;
        if !gpu.processes.is_empty() || (!enabled && !gpu.instances.is_empty()) {
            return Err(NvmlError::InUse);
        }
        gpu.mig_enabled = enabled;
        Ok(())
    }

    /// `nvmlDeviceCreateGpuInstanceWithPlacement` (`start`), or `nvmlDeviceCreateGpuInstance`
    /// (`None`: the first placement, in the profile's order, where the instance fits; NVML does not
    /// say which it takes).
    pub fn create_gpu_instance(
        &mut self,
        index: u32,
        profile_id: u32,
        start: Option<u32>,
    ) -> Result<u32, NvmlError> {
        self.uuid_counter += 1;
        let uuid = uuid("MIG", self.uuid_node, self.uuid_counter);
        let gpu = self.gpu_mut(index)?;
        let model = mig_model(&gpu.model)?;
        if !gpu.mig_enabled {
            return Err(NvmlError::NotSupported);
        }
        let profile = profile_by_id(model, profile_id)?;
        let start = match start {
            Some(start) => start,
            None => *profile
                .placements
                .iter()
                .find(|&&start| gpu.fits(model, profile, start).is_ok())
                .ok_or(NvmlError::InsufficientResources)?,
        };
        gpu.place(model, profile, start, uuid)
    }

    /// `nvmlDeviceGetGpuInstanceRemainingCapacity`: how many more instances of the profile could
    /// be created now, one after another, each where it first fits.
    pub fn remaining_capacity(&self, index: u32, profile_id: u32) -> Result<u32, NvmlError> {
        let gpu = self.gpu(index)?;
        let model = mig_model(&gpu.model)?;
        if !gpu.mig_enabled {
            return Err(NvmlError::NotSupported);
        }
        let profile = profile_by_id(model, profile_id)?;
        let mut scratch = gpu.clone();
        let mut n = 0;
        while let Some(&start) = profile
            .placements
            .iter()
            .find(|&&start| scratch.fits(model, profile, start).is_ok())
        {
            scratch.place(model, profile, start, String::new())?;
            n += 1;
        }
        Ok(n)
    }

    /// `nvmlGpuInstanceDestroy`: refused while compute instances or processes use the instance.
    pub fn destroy_gpu_instance(&mut self, index: u32, id: u32) -> Result<(), NvmlError> {
        let gpu = self.gpu_mut(index)?;
        let inst = gpu.instance_mut(id).ok_or(NvmlError::NotFound)?;
        if !inst.compute_instances.is_empty()
            || gpu.processes.iter().any(|p| p.gpu_instance == Some(id))
        {
            return Err(NvmlError::InUse);
        }
        gpu.instances.retain(|i| i.id != id);
        Ok(())
    }

    /// `nvmlGpuInstanceCreateComputeInstance`: a compute instance of `profile_id` (see
    /// [`compute_profile`]) in the compute slices the instance's others leave free.
    pub fn create_compute_instance(
        &mut self,
        index: u32,
        gi: u32,
        profile_id: u32,
    ) -> Result<u32, NvmlError> {
        let gpu = self.gpu_mut(index)?;
        let model = mig_model(&gpu.model)?;
        let inst = gpu.instance_mut(gi).ok_or(NvmlError::NotFound)?;
        let profile = profile_by_id(model, inst.profile_id)?;
        let slices = compute_profile(profile, profile_id)?;
        let used: u32 = inst.compute_instances.iter().map(|c| c.slices).sum();
        if used + slices > profile.compute_slices {
            return Err(NvmlError::InsufficientResources);
        }
        let id = (0..)
            .find(|id| inst.compute_instances.iter().all(|c| c.id != *id))
            .unwrap_or(0);
        inst.compute_instances.push(ComputeInstance {
            id,
            profile_id,
            slices,
        });
        Ok(id)
    }

    /// `nvmlComputeInstanceDestroy`: refused while processes use the GPU instance.
    pub fn destroy_compute_instance(
        &mut self,
        index: u32,
        gi: u32,
        ci: u32,
    ) -> Result<(), NvmlError> {
        let gpu = self.gpu_mut(index)?;
        if gpu.processes.iter().any(|p| p.gpu_instance == Some(gi)) {
            return Err(NvmlError::InUse);
        }
        let inst = gpu.instance_mut(gi).ok_or(NvmlError::NotFound)?;
        let before = inst.compute_instances.len();
        inst.compute_instances.retain(|c| c.id != ci);
        if inst.compute_instances.len() == before {
            return Err(NvmlError::NotFound);
        }
        Ok(())
    }

    /// A process starts using memory on a GPU (or one of its instances). Not an NVML call: what
    /// the CUDA emulator and tests do.
    pub fn attach_process(
        &mut self,
        index: u32,
        pid: u32,
        memory: u64,
        gpu_instance: Option<u32>,
    ) -> Result<(), NvmlError> {
        let gpu = self.gpu_mut(index)?;
        if let Some(gi) = gpu_instance {
            gpu.instance_mut(gi).ok_or(NvmlError::NotFound)?;
        }
        gpu.processes.push(Process {
            pid,
            memory,
            gpu_instance,
            real: false,
            mps: false,
        });
        Ok(())
    }

    /// A real process on this machine starts using memory; it is listed until it exits.
    pub fn attach_real_process(
        &mut self,
        index: u32,
        pid: u32,
        memory: u64,
        gpu_instance: Option<u32>,
    ) -> Result<(), NvmlError> {
        self.attach_process(index, pid, memory, gpu_instance)?;
        if let Some(p) = self.gpu_mut(index)?.processes.last_mut() {
            p.real = true;
        }
        Ok(())
    }

    /// Marks process `pid` on GPU `index` (and GPU instance) as an MPS client there.
    pub fn mark_mps_client(&mut self, index: u32, pid: u32, gpu_instance: Option<u32>) {
        if let Ok(gpu) = self.gpu_mut(index) {
            gpu.processes
                .iter_mut()
                .filter(|p| p.pid == pid && p.gpu_instance == gpu_instance)
                .for_each(|p| p.mps = true);
        }
    }

    /// Drops real processes that are no longer alive.
    pub fn reap(&mut self, alive: impl Fn(u32) -> bool) {
        for g in &mut self.gpus {
            g.processes.retain(|p| !p.real || alive(p.pid));
        }
    }

    /// Every process with this pid leaves every GPU (it exited).
    pub fn detach_process(&mut self, pid: u32) {
        for g in &mut self.gpus {
            g.processes.retain(|p| p.pid != pid);
        }
    }

    /// The driver it reports.
    pub fn driver(&self) -> gpuslice_api::DriverVersions {
        self.driver
            .clone()
            .unwrap_or_else(|| gpuslice_api::DriverVersions {
                version: DRIVER_VERSION.into(),
                cuda: CUDA_VERSION.into(),
            })
    }

    /// A GPU reports an XID error on the whole GPU.
    pub fn inject_xid(&mut self, index: u32, xid: u64) -> Result<(), NvmlError> {
        self.inject_xid_in(index, xid, None)
    }

    /// A GPU reports an XID error, in one of its GPU instances (MIG) when `gpu_instance` is set.
    pub fn inject_xid_in(
        &mut self,
        index: u32,
        xid: u64,
        gpu_instance: Option<u32>,
    ) -> Result<(), NvmlError> {
        let gpu = self.gpu_mut(index)?;
        if let Some(id) = gpu_instance
            && !gpu.instances.iter().any(|i| i.id == id)
        {
            return Err(NvmlError::NotFound);
        }
        gpu.xid_events.push(Xid {
            code: xid,
            gpu_instance,
        });
        Ok(())
    }
}

/// The outcome of a mutating call under fault injection.
#[derive(Debug, PartialEq, Eq)]
pub enum Mutation<T> {
    Done(Result<T, NvmlError>),
    /// The process must die now; `applied` says whether the call took effect.
    Die {
        applied: bool,
    },
}

fn process(p: &gpuslice_api::GpuProcess, gpu_instance: Option<u32>) -> Process {
    let memory = p
        .memory
        .as_ref()
        .and_then(|q| gpuslice_api::bytes_of(&q.0).ok())
        .unwrap_or(0);
    Process {
        pid: p.pid,
        memory,
        gpu_instance,
        real: false,
        mps: false,
    }
}

fn quantity(bytes: u64) -> gpuslice_api::k8s_openapi::apimachinery::pkg::api::resource::Quantity {
    gpuslice_api::k8s_openapi::apimachinery::pkg::api::resource::Quantity(
        gpuslice_api::quantity::format_bytes(bytes),
    )
}

fn mig_model(name: &str) -> Result<&'static GpuModel, NvmlError> {
    catalog::model(name)
        .ok()
        .filter(|m| m.mig.is_some())
        .ok_or(NvmlError::NotSupported)
}

/// The profile of a `profileId`: an id the GPU does not have is an invalid argument, as NVML
/// answers `nvmlDeviceCreateGpuInstance` and `nvmlDeviceGetGpuInstances`.
fn profile_by_id(model: &GpuModel, id: u32) -> Result<&MigProfile, NvmlError> {
    model
        .mig
        .as_ref()
        .and_then(|g| g.profile_by_id(id))
        .ok_or(NvmlError::InvalidArgument)
}

/// The compute slices of compute-instance profile `profile_id` in an instance of `gi`: the
/// driver's ids are the `NVML_COMPUTE_INSTANCE_PROFILE_*` indices. As `nvidia-smi mig -lcip`
/// lists them, an instance offers 1 and 2 slices, its own size, and 3 and 4 in a 7-slice one;
/// others are not supported there.
pub fn compute_profile(gi: &MigProfile, profile_id: u32) -> Result<u32, NvmlError> {
    if profile_id >= 8 {
        return Err(NvmlError::InvalidArgument);
    }
    let slices = catalog::compute_profile_slices(profile_id).ok_or(NvmlError::InvalidArgument)?;
    let offered = slices == gi.compute_slices
        || (slices <= 2 && slices < gi.compute_slices)
        || (gi.compute_slices == 7 && matches!(slices, 3 | 4));
    if profile_id == 7 || !offered {
        return Err(NvmlError::NotSupported);
    }
    Ok(slices)
}

/// The compute instance that spans a GPU instance, as `nvidia-smi mig -cgi … -C` creates it.
fn full_compute_instance(profile: &MigProfile) -> ComputeInstance {
    ComputeInstance {
        id: 0,
        profile_id: catalog::compute_profile_index(profile.compute_slices).unwrap_or(0),
        slices: profile.compute_slices,
    }
}

impl Gpu {
    fn instance_mut(&mut self, id: u32) -> Option<&mut GpuInstance> {
        self.instances.iter_mut().find(|i| i.id == id)
    }

    /// Creates an instance of `profile` at `start`, enforcing allowed placements, overlaps, the
    /// profile's count limit and the compute-slice budget.
    fn place(
        &mut self,
        model: &GpuModel,
        profile: &MigProfile,
        start: u32,
        uuid: String,
    ) -> Result<u32, NvmlError> {
        self.fits(model, profile, start)?;
        let id = self.next_instance_id;
        self.next_instance_id += 1;
        self.instances.push(GpuInstance {
            id,
            profile_id: profile.id,
            placement: Placement {
                start,
                size: profile.memory_slices,
            },
            uuid,
            compute_instances: Vec::new(),
        });
        Ok(id)
    }

    /// Whether an instance of `profile` may be created at `start` now: an allowed placement, no
    /// overlap, under the profile's count limit and the compute-slice budget, and at most one
    /// instance with the media engines.
    fn fits(&self, model: &GpuModel, profile: &MigProfile, start: u32) -> Result<(), NvmlError> {
        let geometry = model.mig.as_ref().ok_or(NvmlError::NotSupported)?;
        if !profile.placements.contains(&start) {
            return Err(NvmlError::InvalidArgument);
        }
        let want = gpuslice_planning::mig::mask(Placement {
            start,
            size: profile.memory_slices,
        });
        let used = self
            .instances
            .iter()
            .fold(0, |m, i| m | gpuslice_planning::mig::mask(i.placement));
        let same = self
            .instances
            .iter()
            .filter(|i| i.profile_id == profile.id)
            .count() as u32;
        let others: Vec<&MigProfile> = self
            .instances
            .iter()
            .filter_map(|i| geometry.profile_by_id(i.profile_id))
            .collect();
        let compute: u32 = others.iter().map(|p| p.compute_slices).sum();
        let media = profile.media && others.iter().any(|p| p.media);
        if used & want != 0
            || same >= profile.max_count
            || compute + profile.compute_slices > geometry.compute_slices
            || media
        {
            return Err(NvmlError::InsufficientResources);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_emulated_nodes_never_share_a_uuid() {
        let machine = |name: &str| {
            let node: NodeInventory = serde_yaml::from_str(&format!(
                "name: {name}\ngpus:\n- {{index: 0, model: NVIDIA A100-SXM4-40GB}}\n- {{index: 1, model: NVIDIA A100-SXM4-40GB}}\n"
            ))
            .unwrap();
            let mut m = Machine::from_inventory(&node).unwrap();
            m.set_mig_mode(0, true).unwrap();
            let profile = catalog::model("NVIDIA A100-SXM4-40GB")
                .unwrap()
                .mig
                .as_ref()
                .unwrap()
                .profiles[0]
                .id;
            m.create_gpu_instance(0, profile, None).unwrap();
            let mut uuids: Vec<String> = m.gpus.iter().map(|g| g.uuid.clone()).collect();
            uuids.extend(m.gpus[0].instances.iter().map(|i| i.uuid.clone()));
            uuids
        };
        let (a, b) = (machine("gpu-a"), machine("gpu-b"));
        assert_eq!(a.len(), 3);
        assert!(a.iter().all(|u| !b.contains(u)), "{a:?} {b:?}");
        assert_eq!(a, machine("gpu-a"), "the same node gets the same UUIDs");
        let distinct: std::collections::BTreeSet<&String> = a.iter().collect();
        assert_eq!(distinct.len(), 3);
    }

    fn h200() -> Machine {
        let node: NodeInventory = serde_yaml::from_str(
            "name: n\ngpus:\n- {index: 0, model: NVIDIA H200}\n- {index: 1, model: NVIDIA H200}\n",
        )
        .unwrap();
        Machine::from_inventory(&node).unwrap()
    }

    #[test]
    fn mig_instances_follow_nvml_semantics() {
        let mut m = h200();
        // Profile ids as NVML takes them (H200: 3g is 9, 2g 14, 1g 19).
        // MIG off: creating an instance is not supported.
        assert_eq!(
            m.create_gpu_instance(0, 9, Some(0)),
            Err(NvmlError::NotSupported)
        );
        m.set_mig_mode(0, true).unwrap();
        // An index is not an id: 2 (NVML_GPU_INSTANCE_PROFILE_3_SLICE) names no profile.
        assert_eq!(
            m.create_gpu_instance(0, 2, Some(4)),
            Err(NvmlError::InvalidArgument)
        );
        let three_g = m.create_gpu_instance(0, 9, Some(4)).unwrap();
        assert_eq!(m.gpu(0).unwrap().instances[0].profile_id, 9);
        // Occupied placement, disallowed placement, count limit.
        assert_eq!(
            m.create_gpu_instance(0, 14, Some(4)),
            Err(NvmlError::InsufficientResources)
        );
        assert_eq!(
            m.create_gpu_instance(0, 9, Some(2)),
            Err(NvmlError::InvalidArgument)
        );
        assert_eq!(m.remaining_capacity(0, 19), Ok(4));
        assert_eq!(m.remaining_capacity(0, 9), Ok(1));
        // Without a placement: the first that fits.
        let other = m.create_gpu_instance(0, 9, None).unwrap();
        assert_eq!(m.gpu(0).unwrap().instances[1].placement.start, 0);
        assert_eq!(m.remaining_capacity(0, 19), Ok(0));
        assert_eq!(
            m.create_gpu_instance(0, 19, None),
            Err(NvmlError::InsufficientResources)
        );
        // Compute instances share their GPU instance's compute slices (profile id 2: 3 slices).
        m.create_compute_instance(0, other, 0).unwrap();
        m.create_compute_instance(0, other, 1).unwrap();
        assert_eq!(
            m.create_compute_instance(0, other, 0),
            Err(NvmlError::InsufficientResources)
        );
        assert_eq!(
            m.create_compute_instance(0, other, 4),
            Err(NvmlError::NotSupported),
            "7 slices in a 3g instance"
        );
        // Busy instance: compute instance or process → IN_USE.
        m.create_compute_instance(0, three_g, 2).unwrap();
        assert_eq!(m.destroy_gpu_instance(0, three_g), Err(NvmlError::InUse));
        m.attach_process(0, 42, 1 << 30, Some(three_g)).unwrap();
        assert_eq!(
            m.destroy_compute_instance(0, three_g, 0),
            Err(NvmlError::InUse)
        );
        assert_eq!(m.set_mig_mode(0, false), Err(NvmlError::InUse));
        m.detach_process(42);
        m.destroy_compute_instance(0, three_g, 0).unwrap();
        m.destroy_gpu_instance(0, three_g).unwrap();
        assert_eq!(m.destroy_gpu_instance(0, three_g), Err(NvmlError::NotFound));
    }

    #[test]
    fn every_instance_gets_a_new_uuid_and_the_inventory_round_trips() {
        let mut m = h200();
        m.set_mig_mode(1, true).unwrap();
        let a = m.create_gpu_instance(1, 0, Some(0)).unwrap();
        let first = m.gpu(1).unwrap().instances[0].uuid.clone();
        m.destroy_gpu_instance(1, a).unwrap();
        m.create_gpu_instance(1, 0, Some(0)).unwrap();
        assert_ne!(m.gpu(1).unwrap().instances[0].uuid, first);
        let inv = m.inventory("n");
        assert_eq!(
            inv.gpus[1].mig.as_ref().unwrap().instances[0].profile,
            "7g.141gb"
        );
        let again = Machine::from_inventory(&inv).unwrap();
        assert_eq!(again.inventory("n"), inv);
    }

    #[test]
    fn faults_fire_at_their_mutation() {
        let mut m = h200();
        m.faults.push(Fault {
            at: 2,
            action: FaultAction::Fail(NvmlError::Unknown),
        });
        m.faults.push(Fault {
            at: 3,
            action: FaultAction::KillAfter,
        });
        assert_eq!(
            m.mutate(|m| m.set_mig_mode(0, true)),
            Mutation::Done(Ok(()))
        );
        assert_eq!(
            m.mutate(|m| m.create_gpu_instance(0, 0, Some(0))),
            Mutation::Done(Err(NvmlError::Unknown))
        );
        assert!(
            m.gpu(0).unwrap().instances.is_empty(),
            "a failed call changes nothing"
        );
        assert_eq!(
            m.mutate(|m| m.create_gpu_instance(0, 0, Some(0))),
            Mutation::Die { applied: true }
        );
        assert_eq!(m.gpu(0).unwrap().instances.len(), 1);
        assert!(m.faults.is_empty());
    }

    #[test]
    fn one_instance_with_media_engines_per_gpu() {
        let mut m = h200();
        m.set_mig_mode(0, true).unwrap();
        // 1g.18gb+me is id 20.
        m.create_gpu_instance(0, 20, None).unwrap();
        assert_eq!(m.remaining_capacity(0, 20), Ok(0));
        assert_eq!(
            m.create_gpu_instance(0, 20, None),
            Err(NvmlError::InsufficientResources)
        );
        assert_eq!(m.remaining_capacity(0, 19), Ok(6));
    }

    #[test]
    fn mig_mode_needs_a_mig_model_and_an_idle_gpu() {
        let node: NodeInventory = serde_yaml::from_str("name: n\ngpus:\n- {index: 0, model: Tesla T4, memory: 15Gi, processes: [{pid: 7}]}\n- {index: 1, model: H100, processes: [{pid: 8}]}\n").unwrap();
        let mut m = Machine::from_inventory(&node).unwrap();
        assert_eq!(m.set_mig_mode(0, true), Err(NvmlError::NotSupported));
        assert_eq!(m.set_mig_mode(1, true), Err(NvmlError::InUse));
        assert_eq!(m.gpu(0).unwrap().memory_total, 15 << 30);
    }
}
