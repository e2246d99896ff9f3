//! MIG instance changes through NVML's raw bindings (`Nvml::lib()`), which the safe API does not
//! wrap: GPU and compute instance profiles, creating an instance at a placement with its one
//! full compute instance, finding and destroying one.

use gpuslice_api::Placement;
use gpuslice_planning::catalog::{self, GpuModel};
use gpuslice_planning::transition::Op;
use nvml_wrapper_sys::bindings::{
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    NVML_GPU_INSTANCE_PROFILE_COUNT, nvmlComputeInstance_t, nvmlComputeInstanceProfileInfo_t,
    nvmlDevice_t, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t,
    nvmlGpuInstanceProfileInfo_t, nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED,
};

use super::{NvmlError, NvmlGpus, check, not_offered};

impl NvmlGpus {
    /// What NVML says of GPU-instance profile `index` (`NVML_GPU_INSTANCE_PROFILE_*`) on this
    /// GPU, above all its `id`, which every other MIG call takes; `None` when the GPU does not
    /// offer the profile.
    fn gpu_instance_profile(
        &self,
        gpu: u32,
        device: nvmlDevice_t,
        index: u32,
    ) -> Result<Option<nvmlGpuInstanceProfileInfo_t>, NvmlError> {
        let call = "nvmlDeviceGetGpuInstanceProfileInfo";
        let info = self
            .nvml
            .lib()
            .nvmlDeviceGetGpuInstanceProfileInfo
            .as_ref()
            .map_err(|_| NvmlError::Missing { gpu, call })?;
        // SAFETY: an all-zero nvmlGpuInstanceProfileInfo_t is valid (integers only).
        let mut out: nvmlGpuInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `device` is a live handle; `out` is a valid out-pointer.
        match unsafe { info(device, index, &mut out) } {
            rc if not_offered(rc) => Ok(None),
            rc => check(gpu, call, rc).map(|()| Some(out)),
        }
    }

    /// Every GPU instance with its handle: for each profile the GPU offers, the instances of its
    /// id, in a buffer of the profile's instance count (NVML's contract for the call).
    fn gpu_instance_handles(
        &self,
        gpu: u32,
    ) -> Result<Vec<(nvmlGpuInstance_t, nvmlGpuInstanceInfo_t)>, NvmlError> {
        let lib = self.nvml.lib();
        let list = lib
            .nvmlDeviceGetGpuInstances
            .as_ref()
            .map_err(|_| NvmlError::Missing {
                gpu,
                call: "nvmlDeviceGetGpuInstances",
            })?;
        let info = lib
            .nvmlGpuInstanceGetInfo
            .as_ref()
            .map_err(|_| NvmlError::Missing {
                gpu,
                call: "nvmlGpuInstanceGetInfo",
            })?;
        let device = self.handle(gpu)?;
        let mut out = Vec::new();
        for index in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
            let Some(profile) = self.gpu_instance_profile(gpu, device, index)? else {
                continue;
            };
            let mut handles = vec![std::ptr::null_mut(); profile.instanceCount.max(1) as usize];
            let mut count = handles.len() as u32;
            // SAFETY: `handles` has room for the profile's instance count; `device` is live.
            let rc = unsafe { list(device, profile.id, handles.as_mut_ptr(), &mut count) };
            if rc == nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED {
                // MIG mode is off: no instances.
                return Ok(Vec::new());
            }
            check(gpu, "nvmlDeviceGetGpuInstances", rc)?;
            for &h in &handles[..(count as usize).min(handles.len())] {
                // SAFETY: an all-zero nvmlGpuInstanceInfo_t is valid (integers and a null pointer).
                let mut i: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
                // SAFETY: `h` came from NVML just now; `i` is a valid out-pointer.
                check(gpu, "nvmlGpuInstanceGetInfo", unsafe { info(h, &mut i) })?;
                out.push((h, i));
            }
        }
        Ok(out)
    }

    /// Every GPU instance: (id, profile id, placement).
    pub(super) fn gpu_instances(&self, gpu: u32) -> Result<Vec<(u32, u32, Placement)>, NvmlError> {
        Ok(self
            .gpu_instance_handles(gpu)?
            .into_iter()
            .map(|(_, i)| {
                (
                    i.id,
                    i.profileId,
                    Placement {
                        start: i.placement.start,
                        size: i.placement.size,
                    },
                )
            })
            .collect())
    }

    /// Runs one operation of a transition plan on a GPU. Slice-table operations are not NVML's
    /// and are done by the caller.
    pub fn apply(&self, gpu: u32, op: &Op) -> Result<(), NvmlError> {
        let call = |call: &'static str| move |source| NvmlError::Call { gpu, call, source };
        match op {
            Op::EnableMig | Op::DisableMig => {
                self.device(gpu)?
                    .set_mig_mode(matches!(op, Op::EnableMig))
                    .map_err(call("nvmlDeviceSetMigMode"))?;
                Ok(())
            }
            Op::CreateInstance { profile, placement } => self.create(gpu, profile, *placement),
            Op::DestroyInstance { placement, .. } => self.destroy(gpu, *placement),
            Op::WriteSlices { .. } | Op::ClearSlices | Op::WriteInstanceSlices { .. } => Ok(()),
        }
    }

    fn model(&self, gpu: u32) -> Result<&'static GpuModel, NvmlError> {
        let name = self.device(gpu)?.name().map_err(|source| NvmlError::Call {
            gpu,
            call: "nvmlDeviceGetName",
            source,
        })?;
        catalog::model(&name).map_err(|e| NvmlError::Model {
            gpu,
            message: e.to_string(),
        })
    }

    fn create(&self, gpu: u32, profile: &str, placement: Placement) -> Result<(), NvmlError> {
        let model = self.model(gpu)?;
        let p = model.profile(profile).ok_or_else(|| NvmlError::Model {
            gpu,
            message: format!("{} has no profile {profile}", model.name),
        })?;
        let lib = self.nvml.lib();
        let create = lib
            .nvmlDeviceCreateGpuInstanceWithPlacement
            .as_ref()
            .map_err(|_| NvmlError::Missing {
                gpu,
                call: "nvmlDeviceCreateGpuInstanceWithPlacement",
            })?;

        let device = self.handle(gpu)?;
        // NVML names profiles by the id its profile info gives, not by the index asked with.
        let info = self
            .gpu_instance_profile(gpu, device, p.nvml_index)?
            .ok_or_else(|| NvmlError::Model {
                gpu,
                message: format!(
                    "NVML does not offer profile {profile} (NVML_GPU_INSTANCE_PROFILE index {}) on this {}",
                    p.nvml_index, model.name
                ),
            })?;
        if info.id != p.id || info.sliceCount != p.compute_slices {
            tracing::warn!(
                gpu,
                profile,
                nvml_id = info.id,
                catalog_id = p.id,
                "NVML describes the profile otherwise than the catalog; going by NVML"
            );
        }
        let at = nvmlGpuInstancePlacement_t {
            start: placement.start,
            size: placement.size,
        };
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: live device handle, valid placement and out-pointer.
        check(gpu, "nvmlDeviceCreateGpuInstanceWithPlacement", unsafe {
            create(device, info.id, &at, &mut gi)
        })?;
        // One compute instance spanning the GPU instance, so workloads can use it.
        self.create_full_compute_instance(gpu, gi, p.compute_slices)
    }

    /// What NVML says of compute-instance profile `index` (`NVML_COMPUTE_INSTANCE_PROFILE_*`,
    /// shared engines) in a GPU instance; `None` when the instance does not offer it.
    fn compute_instance_profile(
        &self,
        gpu: u32,
        gi: nvmlGpuInstance_t,
        index: u32,
    ) -> Result<Option<nvmlComputeInstanceProfileInfo_t>, NvmlError> {
        let call = "nvmlGpuInstanceGetComputeInstanceProfileInfo";
        let info = self
            .nvml
            .lib()
            .nvmlGpuInstanceGetComputeInstanceProfileInfo
            .as_ref()
            .map_err(|_| NvmlError::Missing { gpu, call })?;
        // SAFETY: an all-zero nvmlComputeInstanceProfileInfo_t is valid (integers only).
        let mut out: nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `gi` is a live handle from NVML; `out` is a valid out-pointer.
        let rc = unsafe {
            info(
                gi,
                index,
                NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                &mut out,
            )
        };
        match rc {
            rc if not_offered(rc) => Ok(None),
            rc => check(gpu, call, rc).map(|()| Some(out)),
        }
    }

    /// Creates the compute instance that spans a GPU instance of `slices` compute slices, by the
    /// profile id NVML gives for the full compute profile.
    fn create_full_compute_instance(
        &self,
        gpu: u32,
        gi: nvmlGpuInstance_t,
        slices: u32,
    ) -> Result<(), NvmlError> {
        let create_ci = self
            .nvml
            .lib()
            .nvmlGpuInstanceCreateComputeInstance
            .as_ref()
            .map_err(|_| NvmlError::Missing {
                gpu,
                call: "nvmlGpuInstanceCreateComputeInstance",
            })?;
        let no_profile = || NvmlError::Model {
            gpu,
            message: format!("NVML offers no compute-instance profile of {slices} slices"),
        };
        let index = catalog::compute_profile_index(slices).ok_or_else(no_profile)?;
        let info = self
            .compute_instance_profile(gpu, gi, index)?
            .ok_or_else(no_profile)?;
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: `gi` is a live handle from NVML; `ci` is a valid out-pointer.
        check(gpu, "nvmlGpuInstanceCreateComputeInstance", unsafe {
            create_ci(gi, info.id, &mut ci)
        })
    }

    /// The compute instances of a GPU instance, of every profile.
    fn compute_instances(
        &self,
        gpu: u32,
        gi: nvmlGpuInstance_t,
    ) -> Result<Vec<nvmlComputeInstance_t>, NvmlError> {
        let list_ci = self
            .nvml
            .lib()
            .nvmlGpuInstanceGetComputeInstances
            .as_ref()
            .map_err(|_| NvmlError::Missing {
                gpu,
                call: "nvmlGpuInstanceGetComputeInstances",
            })?;
        let mut out = Vec::new();
        for index in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
            let Some(profile) = self.compute_instance_profile(gpu, gi, index)? else {
                continue;
            };
            let mut cis = vec![std::ptr::null_mut(); profile.instanceCount.max(1) as usize];
            let mut count = cis.len() as u32;
            // SAFETY: `cis` has room for the profile's instance count; `gi` is a live handle.
            let rc = unsafe { list_ci(gi, profile.id, cis.as_mut_ptr(), &mut count) };
            check(gpu, "nvmlGpuInstanceGetComputeInstances", rc)?;
            out.extend_from_slice(&cis[..(count as usize).min(cis.len())]);
        }
        Ok(out)
    }

    /// Gives every GPU instance without a compute instance its full one: what a run that died
    /// between creating the two leaves behind. Returns the placements completed.
    pub fn complete_instances(&self, gpu: u32) -> Result<Vec<Placement>, NvmlError> {
        let model = self.model(gpu).ok();
        let mut done = Vec::new();
        for (gi, info) in self.gpu_instance_handles(gpu)? {
            if !self.compute_instances(gpu, gi)?.is_empty() {
                continue;
            }
            let Some(profile) = model
                .and_then(|m| m.mig.as_ref())
                .and_then(|g| g.profile_by_id(info.profileId))
            else {
                continue;
            };
            self.create_full_compute_instance(gpu, gi, profile.compute_slices)?;
            done.push(Placement {
                start: info.placement.start,
                size: info.placement.size,
            });
        }
        Ok(done)
    }

    fn destroy(&self, gpu: u32, placement: Placement) -> Result<(), NvmlError> {
        let lib = self.nvml.lib();
        let destroy_ci =
            lib.nvmlComputeInstanceDestroy
                .as_ref()
                .map_err(|_| NvmlError::Missing {
                    gpu,
                    call: "nvmlComputeInstanceDestroy",
                })?;
        let destroy_gi = lib
            .nvmlGpuInstanceDestroy
            .as_ref()
            .map_err(|_| NvmlError::Missing {
                gpu,
                call: "nvmlGpuInstanceDestroy",
            })?;
        let Some((gi, _)) = self.gpu_instance_handles(gpu)?.into_iter().find(|(_, i)| {
            i.placement.start == placement.start && i.placement.size == placement.size
        }) else {
            // Already gone (an earlier run died after destroying it): nothing to do.
            return Ok(());
        };
        for ci in self.compute_instances(gpu, gi)? {
            // SAFETY: `ci` came from NVML just now.
            check(gpu, "nvmlComputeInstanceDestroy", unsafe { destroy_ci(ci) })?;
        }
        // SAFETY: `gi` is a live handle with no compute instances left.
        check(gpu, "nvmlGpuInstanceDestroy", unsafe { destroy_gi(gi) })
    }
}
