//! MIG through NVML, as `nvml.h` and NVIDIA's MIG user guide define it, so that NVIDIA's own
//! clients (nvidia-ml-py, go-nvml and the tools built on them, mig-parted among them) drive the
//! emulator as they drive a GPU:
//!
//! - profile info takes an `NVML_GPU_INSTANCE_PROFILE_*` index and answers with the profile's
//!   `id` (19 for 1g on an A100/H100/H200); every other call takes that id, and
//!   `nvmlGpuInstanceGetInfo` reports it. Compute-instance profiles likewise (their ids are their
//!   indices on NVIDIA's drivers);
//! - the versioned calls (`…ProfileInfoV`) check the struct's version and fill v2 or v3;
//! - lists of instances take a buffer the caller sized from the profile's instance count and a
//!   count that is output only (go-nvml passes 0); placements take a null buffer to ask the count;
//! - a MIG device is a compute instance: GPU instances without one have no MIG device handle;
//! - destroying a GPU instance that still has compute instances is `NVML_ERROR_IN_USE`, creating
//!   past the GPU's room `NVML_ERROR_INSUFFICIENT_RESOURCES`, MIG calls on a GPU with MIG off
//!   `NVML_ERROR_NOT_SUPPORTED`, an id the GPU does not offer `NVML_ERROR_INVALID_ARGUMENT`.
//!
//! Each GPU instance here has at most one MIG device: its first compute instance.

use std::ffi::{c_char, c_uint};

use gpuslice_emulator::model::compute_profile;
use gpuslice_emulator::{GpuInstance, Machine, NvmlError};
use gpuslice_planning::catalog::{self, MigProfile};
use nvml_wrapper_sys::bindings::{
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    NVML_GPU_INSTANCE_PROFILE_COUNT, nvmlComputeInstance_t, nvmlComputeInstanceInfo_t,
    nvmlComputeInstancePlacement_t, nvmlComputeInstanceProfileInfo_t,
    nvmlComputeInstanceProfileInfo_v2_t, nvmlComputeInstanceProfileInfo_v3_t, nvmlDevice_t,
    nvmlGpuInstance_t, nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t,
    nvmlGpuInstanceProfileInfo_t, nvmlGpuInstanceProfileInfo_v2_t, nvmlGpuInstanceProfileInfo_v3_t,
    nvmlReturn_t,
};

use crate::{
    INVALID_ARGUMENT, MIG_DEVICE_BIT, NOT_FOUND, SUCCESS, device_handle, device_index, get,
    gpu_instance_handle, gpu_instance_parts, guard, mig_device_parts, mutate, put, read,
};

/// `NVML_ERROR_ARGUMENT_VERSION_MISMATCH`: a versioned struct of a version the call lacks.
pub(crate) const VERSION_MISMATCH: nvmlReturn_t = 25;

/// `NVML_STRUCT_VERSION(name, version)`: the struct's size with the version in the top byte.
const fn struct_version<T>(version: u32) -> c_uint {
    std::mem::size_of::<T>() as c_uint | (version << 24)
}

/// The profile of GPU instance profile id `id` on GPU `index`.
pub(crate) fn profile(m: &Machine, index: u32, id: u32) -> Result<&'static MigProfile, NvmlError> {
    let gpu = m.gpu(index)?;
    catalog::model(&gpu.model)
        .ok()
        .and_then(|model| model.mig.as_ref())
        .and_then(|g| g.profile_by_id(id))
        .ok_or(NvmlError::NotSupported)
}

/// The profile behind an `NVML_GPU_INSTANCE_PROFILE_*` index on a whole GPU: an index past the
/// last is an invalid argument, one the GPU does not offer is not supported.
fn profile_of_index(
    device: nvmlDevice_t,
    index: c_uint,
) -> Result<&'static MigProfile, nvmlReturn_t> {
    if index >= NVML_GPU_INSTANCE_PROFILE_COUNT {
        return Err(INVALID_ARGUMENT);
    }
    let i = device_index(device)?;
    read(|m| {
        catalog::model(&m.gpu(i)?.model)
            .ok()
            .and_then(|model| model.mig.as_ref())
            .and_then(|g| g.profile_by_index(index))
            .ok_or(NvmlError::NotSupported)
    })
}

/// The profile behind a `profileId` on a whole GPU, which must be in MIG mode.
fn profile_of_id(
    device: nvmlDevice_t,
    id: c_uint,
) -> Result<(u32, &'static MigProfile), nvmlReturn_t> {
    let i = device_index(device)?;
    let profile = read(|m| {
        let gpu = m.gpu(i)?;
        let model = catalog::model(&gpu.model)
            .ok()
            .and_then(|model| model.mig.as_ref())
            .ok_or(NvmlError::NotSupported)?;
        if !gpu.mig_enabled {
            return Err(NvmlError::NotSupported);
        }
        model.profile_by_id(id).ok_or(NvmlError::InvalidArgument)
    })?;
    Ok((i, profile))
}

/// A versioned profile-info struct from the v1 answer: its version, the fields every version
/// has, the named ones `v1` also has, the name, and any of its own.
macro_rules! versioned {
    ($ty:ident, $version:expr, $v1:expr, $name:expr, [$($field:ident),*] $(, $own:ident: $value:expr)*) => {
        $ty {
            version: $version,
            id: $v1.id,
            sliceCount: $v1.sliceCount,
            instanceCount: $v1.instanceCount,
            multiprocessorCount: $v1.multiprocessorCount,
            $($field: $v1.$field,)*
            name: c_name(&$name),
            $($own: $value,)*
        }
    };
}

/// `name` as a C string in a fixed buffer, cut to fit with its NUL.
fn c_name<const N: usize>(name: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (slot, byte) in out.iter_mut().zip(name.bytes().take(N - 1)) {
        *slot = byte as c_char;
    }
    out
}

/// The profile info NVML gives for a GPU-instance profile (v1 layout).
fn gpu_instance_profile_info(p: &MigProfile) -> nvmlGpuInstanceProfileInfo_t {
    nvmlGpuInstanceProfileInfo_t {
        id: p.id,
        isP2pSupported: 0,
        sliceCount: p.compute_slices,
        instanceCount: p.max_count,
        multiprocessorCount: p.sms,
        copyEngineCount: p.compute_slices,
        decoderCount: if p.media { 1 } else { 0 },
        encoderCount: 0,
        jpegCount: if p.media { 1 } else { 0 },
        ofaCount: if p.media { 1 } else { 0 },
        memorySizeMB: p.memory_mib,
    }
}

/// Fills a caller buffer NVML says is large enough (its size comes from the profile's instance
/// count, not from `count`, which is output only); a null buffer is only fine for no items.
fn put_all<T: Copy>(out: *mut T, count: *mut c_uint, items: &[T]) -> Result<(), nvmlReturn_t> {
    if out.is_null() && !items.is_empty() {
        return Err(INVALID_ARGUMENT);
    }
    for (i, item) in items.iter().enumerate() {
        // SAFETY: NVML's contract: the buffer has room for the profile's instance count, which
        // bounds the items listed.
        unsafe { out.add(i).write(*item) };
    }
    put(count, items.len() as c_uint)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    is_mig: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| put(is_mig, c_uint::from(mig_device_parts(device).is_some())))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let i = device_index(device)?;
        let name = read(|m| Ok(m.gpu(i)?.model.clone()))?;
        let slices = catalog::model(&name)
            .ok()
            .and_then(|model| model.mig.as_ref())
            .map_or(0, |mig| mig.compute_slices);
        put(count, slices)
    })
}

/// The GPU instances that are MIG devices (have a compute instance), by id.
fn mig_device_instances(m: &Machine, index: u32) -> Result<Vec<u32>, NvmlError> {
    let gpu = m.gpu(index)?;
    if !gpu.mig_enabled {
        return Err(NvmlError::NotSupported);
    }
    let mut ids: Vec<u32> = gpu
        .instances
        .iter()
        .filter(|x| !x.compute_instances.is_empty())
        .map(|x| x.id)
        .collect();
    ids.sort_unstable();
    Ok(ids)
}

/// The `index`-th MIG device of a GPU, in GPU-instance order; NOT_FOUND past the last.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig_device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    guard(|| {
        let i = device_index(device)?;
        let gi = read(|m| {
            mig_device_instances(m, i)?
                .get(index as usize)
                .copied()
                .ok_or(NvmlError::NotFound)
        })?;
        put(
            mig_device,
            (gpu_instance_handle(i, gi) as usize | MIG_DEVICE_BIT) as nvmlDevice_t,
        )
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig_device: nvmlDevice_t,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    guard(|| {
        let (i, _) = mig_device_parts(mig_device).ok_or(INVALID_ARGUMENT)?;
        put(device, device_handle(i))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetGpuInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| put(id, mig_device_parts(device).ok_or(INVALID_ARGUMENT)?.1))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let (i, gi) = mig_device_parts(device).ok_or(INVALID_ARGUMENT)?;
        let ci = read(|m| {
            instance(m, i, gi)?
                .compute_instances
                .first()
                .map(|c| c.id)
                .ok_or(NvmlError::NotFound)
        })?;
        put(id, ci)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let i = device_index(device)?;
        let mode = read(|m| {
            let gpu = m.gpu(i)?;
            catalog::model(&gpu.model)
                .ok()
                .and_then(|model| model.mig.as_ref())
                .ok_or(NvmlError::NotSupported)?;
            Ok(c_uint::from(gpu.mig_enabled))
        })?;
        put(current, mode)?;
        put(pending, mode)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceSetMigMode(
    device: nvmlDevice_t,
    mode: c_uint,
    activation: *mut nvmlReturn_t,
) -> nvmlReturn_t {
    guard(|| {
        let i = device_index(device)?;
        let result = mutate(|m| m.set_mig_mode(i, mode != 0));
        if !activation.is_null() {
            put(activation, result.err().unwrap_or(SUCCESS))?;
        }
        result
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: nvmlDevice_t,
    profile_index: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    guard(|| {
        let p = profile_of_index(device, profile_index)?;
        put(info, gpu_instance_profile_info(p))
    })
}

/// The versioned profile info nvidia-ml-py asks by default: v2 (with the profile's name, as
/// `nvidia-smi` prints it after "MIG ") or v3 (capabilities instead of the P2P flag).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    device: nvmlDevice_t,
    profile_index: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    guard(|| {
        let version = get(info.cast::<c_uint>().cast_const())?;
        let p = profile_of_index(device, profile_index)?;
        let v1 = gpu_instance_profile_info(p);
        let name = format!("MIG {}", p.name);
        if version == struct_version::<nvmlGpuInstanceProfileInfo_v2_t>(2) {
            put(
                info,
                versioned!(nvmlGpuInstanceProfileInfo_v2_t, version, v1, name,
                    [copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount, memorySizeMB],
                    isP2pSupported: v1.isP2pSupported),
            )
        } else if version == struct_version::<nvmlGpuInstanceProfileInfo_v3_t>(3) {
            put(
                info.cast::<nvmlGpuInstanceProfileInfo_v3_t>(),
                versioned!(nvmlGpuInstanceProfileInfo_v3_t, version, v1, name,
                    [copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount, memorySizeMB],
                    capabilities: 0),
            )
        } else {
            Err(VERSION_MISMATCH)
        }
    })
}

/// Placements of a profile id, whether MIG mode is on or not (as `nvml.h` says): with a null
/// buffer, only their count.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let i = device_index(device)?;
        let p = read(|m| {
            catalog::model(&m.gpu(i)?.model)
                .ok()
                .and_then(|model| model.mig.as_ref())
                .ok_or(NvmlError::NotSupported)?
                .profile_by_id(profile_id)
                .ok_or(NvmlError::InvalidArgument)
        })?;
        if placements.is_null() {
            return put(count, p.placements.len() as c_uint);
        }
        let all: Vec<nvmlGpuInstancePlacement_t> = p
            .placements
            .iter()
            .map(|&start| nvmlGpuInstancePlacement_t {
                start,
                size: p.memory_slices,
            })
            .collect();
        put_all(placements, count, &all)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetGpuInstanceRemainingCapacity(
    device: nvmlDevice_t,
    profile_id: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let (i, _) = profile_of_id(device, profile_id)?;
        put(count, read(|m| m.remaining_capacity(i, profile_id))?)
    })
}

fn create_gpu_instance(
    device: nvmlDevice_t,
    profile_id: c_uint,
    start: Option<u32>,
    instance: *mut nvmlGpuInstance_t,
) -> Result<(), nvmlReturn_t> {
    let (i, _) = profile_of_id(device, profile_id)?;
    if instance.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    let id = mutate(|m| m.create_gpu_instance(i, profile_id, start))?;
    put(instance, gpu_instance_handle(i, id))
}

/// Creates an instance where the driver finds room (here: the profile's first placement that
/// fits; NVML does not say which).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceCreateGpuInstance(
    device: nvmlDevice_t,
    profile_id: c_uint,
    instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    guard(|| create_gpu_instance(device, profile_id, None, instance))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placement: *const nvmlGpuInstancePlacement_t,
    instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    guard(|| {
        let at = get(placement)?;
        let (_, p) = profile_of_id(device, profile_id)?;
        if at.size != p.memory_slices {
            return Err(INVALID_ARGUMENT);
        }
        create_gpu_instance(device, profile_id, Some(at.start), instance)
    })
}

/// The instances of a profile id, into a buffer sized by the profile's instance count.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetGpuInstances(
    device: nvmlDevice_t,
    profile_id: c_uint,
    instances: *mut nvmlGpuInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let (i, _) = profile_of_id(device, profile_id)?;
        let mut ids = read(|m| {
            Ok(m.gpu(i)?
                .instances
                .iter()
                .filter(|g| g.profile_id == profile_id)
                .map(|g| g.id)
                .collect::<Vec<_>>())
        })?;
        ids.sort_unstable();
        let handles: Vec<nvmlGpuInstance_t> = ids
            .into_iter()
            .map(|id| gpu_instance_handle(i, id))
            .collect();
        put_all(instances, count, &handles)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: nvmlDevice_t,
    id: c_uint,
    instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    guard(|| {
        let i = device_index(device)?;
        read(|m| {
            if !m.gpu(i)?.mig_enabled {
                return Err(NvmlError::NotSupported);
            }
            instance_of(m, i, id).map(|_| ())
        })?;
        put(instance, gpu_instance_handle(i, id))
    })
}

fn instance_of(m: &Machine, index: u32, id: u32) -> Result<&GpuInstance, NvmlError> {
    m.gpu(index)?
        .instances
        .iter()
        .find(|g| g.id == id)
        .ok_or(NvmlError::NotFound)
}

fn instance(m: &Machine, index: u32, id: u32) -> Result<GpuInstance, NvmlError> {
    instance_of(m, index, id).cloned()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlGpuInstanceGetInfo(
    instance_handle: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    guard(|| {
        let (i, id) = gpu_instance_parts(instance_handle)?;
        let gi = read(|m| instance(m, i, id))?;
        put(
            info,
            nvmlGpuInstanceInfo_t {
                device: device_handle(i),
                id,
                profileId: gi.profile_id,
                placement: nvmlGpuInstancePlacement_t {
                    start: gi.placement.start,
                    size: gi.placement.size,
                },
            },
        )
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlGpuInstanceDestroy(instance_handle: nvmlGpuInstance_t) -> nvmlReturn_t {
    guard(|| {
        let (i, id) = gpu_instance_parts(instance_handle)?;
        mutate(|m| m.destroy_gpu_instance(i, id))
    })
}

/// The GPU instance's profile and the compute slices of compute profile index `index` in it.
fn compute_profile_of_index(
    instance_handle: nvmlGpuInstance_t,
    index: c_uint,
    engines: c_uint,
) -> Result<(&'static MigProfile, u32), nvmlReturn_t> {
    if index >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT
        || engines != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    {
        return Err(INVALID_ARGUMENT);
    }
    let (i, id) = gpu_instance_parts(instance_handle)?;
    read(|m| {
        let gi = profile(m, i, instance_of(m, i, id)?.profile_id)?;
        Ok((gi, compute_profile(gi, index)?))
    })
}

fn compute_instance_profile_info(
    gi: &MigProfile,
    index: u32,
    slices: u32,
) -> nvmlComputeInstanceProfileInfo_t {
    nvmlComputeInstanceProfileInfo_t {
        // NVIDIA's drivers give compute profiles the ids of their indices.
        id: index,
        sliceCount: slices,
        instanceCount: gi.compute_slices / slices,
        multiprocessorCount: gi.sms * slices / gi.compute_slices,
        sharedCopyEngineCount: gi.compute_slices,
        sharedDecoderCount: if gi.media { 1 } else { 0 },
        sharedEncoderCount: 0,
        sharedJpegCount: if gi.media { 1 } else { 0 },
        sharedOfaCount: if gi.media { 1 } else { 0 },
    }
}

/// The compute profile's name as `nvidia-smi mig -lcip` prints it: `MIG 1c.3g.71gb`, or the
/// GPU instance's own name for the profile that spans it.
fn compute_profile_name(gi: &MigProfile, slices: u32) -> String {
    if slices == gi.compute_slices {
        format!("MIG {}", gi.name)
    } else {
        format!("MIG {slices}c.{}", gi.name)
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    instance_handle: nvmlGpuInstance_t,
    profile_index: c_uint,
    engines: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_t,
) -> nvmlReturn_t {
    guard(|| {
        let (gi, slices) = compute_profile_of_index(instance_handle, profile_index, engines)?;
        put(
            info,
            compute_instance_profile_info(gi, profile_index, slices),
        )
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    instance_handle: nvmlGpuInstance_t,
    profile_index: c_uint,
    engines: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    guard(|| {
        let version = get(info.cast::<c_uint>().cast_const())?;
        let (gi, slices) = compute_profile_of_index(instance_handle, profile_index, engines)?;
        let v1 = compute_instance_profile_info(gi, profile_index, slices);
        let name = compute_profile_name(gi, slices);
        if version == struct_version::<nvmlComputeInstanceProfileInfo_v2_t>(2) {
            put(
                info,
                versioned!(
                    nvmlComputeInstanceProfileInfo_v2_t,
                    version,
                    v1,
                    name,
                    [
                        sharedCopyEngineCount,
                        sharedDecoderCount,
                        sharedEncoderCount,
                        sharedJpegCount,
                        sharedOfaCount
                    ]
                ),
            )
        } else if version == struct_version::<nvmlComputeInstanceProfileInfo_v3_t>(3) {
            put(
                info.cast::<nvmlComputeInstanceProfileInfo_v3_t>(),
                versioned!(nvmlComputeInstanceProfileInfo_v3_t, version, v1, name,
                    [sharedCopyEngineCount, sharedDecoderCount, sharedEncoderCount,
                     sharedJpegCount, sharedOfaCount],
                    capabilities: 0),
            )
        } else {
            Err(VERSION_MISMATCH)
        }
    })
}

/// The compute slices of compute profile id `profile_id` in a GPU instance.
fn compute_slices_of_id(
    instance_handle: nvmlGpuInstance_t,
    profile_id: c_uint,
) -> Result<(u32, u32, GpuInstance, u32), nvmlReturn_t> {
    let (i, id) = gpu_instance_parts(instance_handle)?;
    read(|m| {
        let inst = instance(m, i, id)?;
        let gi = profile(m, i, inst.profile_id)?;
        let slices = compute_profile(gi, profile_id).map_err(|_| NvmlError::InvalidArgument)?;
        Ok((i, id, inst, slices))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
    instance_handle: nvmlGpuInstance_t,
    profile_id: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let (i, _, inst, slices) = compute_slices_of_id(instance_handle, profile_id)?;
        let total = read(|m| profile(m, i, inst.profile_id))?.compute_slices;
        let used: u32 = inst.compute_instances.iter().map(|c| c.slices).sum();
        put(count, total.saturating_sub(used) / slices)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    instance_handle: nvmlGpuInstance_t,
    profile_id: c_uint,
    compute: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    guard(|| {
        let (i, id, _, _) = compute_slices_of_id(instance_handle, profile_id)?;
        if compute.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let ci = mutate(|m| m.create_compute_instance(i, id, profile_id))?;
        put(compute, compute_instance_handle(i, id, ci))
    })
}

/// The compute instances of a profile id, into a buffer sized by the profile's instance count.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlGpuInstanceGetComputeInstances(
    instance_handle: nvmlGpuInstance_t,
    profile_id: c_uint,
    computes: *mut nvmlComputeInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let (i, id, inst, _) = compute_slices_of_id(instance_handle, profile_id)?;
        let handles: Vec<nvmlComputeInstance_t> = inst
            .compute_instances
            .iter()
            .filter(|c| c.profile_id == profile_id)
            .map(|c| compute_instance_handle(i, id, c.id))
            .collect();
        put_all(computes, count, &handles)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlGpuInstanceGetComputeInstanceById(
    instance_handle: nvmlGpuInstance_t,
    id: c_uint,
    compute: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    guard(|| {
        let (i, gi) = gpu_instance_parts(instance_handle)?;
        read(|m| {
            instance_of(m, i, gi)?
                .compute_instances
                .iter()
                .find(|c| c.id == id)
                .map(|_| ())
                .ok_or(NvmlError::NotFound)
        })?;
        put(compute, compute_instance_handle(i, gi, id))
    })
}

fn compute_instance_handle(index: u32, gi: u32, ci: u32) -> nvmlComputeInstance_t {
    (gpu_instance_handle(index, gi) as usize | ((ci as usize + 1) << 48)) as nvmlComputeInstance_t
}

fn compute_instance_parts(handle: nvmlComputeInstance_t) -> Result<(u32, u32, u32), nvmlReturn_t> {
    let raw = handle as usize;
    let ci = ((raw >> 48) & 0x7fff)
        .checked_sub(1)
        .ok_or(INVALID_ARGUMENT)? as u32;
    let (i, gi) = gpu_instance_parts(handle as nvmlGpuInstance_t)?;
    Ok((i, gi, ci))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlComputeInstanceGetInfo_v2(
    compute: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    guard(|| {
        let (i, gi, ci) = compute_instance_parts(compute)?;
        let inst = read(|m| instance(m, i, gi))?;
        // Compute instances sit one after another in their GPU instance's slices.
        let mut start = 0;
        let mut found = None;
        for c in &inst.compute_instances {
            if c.id == ci {
                found = Some(c.clone());
                break;
            }
            start += c.slices;
        }
        let c = found.ok_or(NOT_FOUND)?;
        put(
            info,
            nvmlComputeInstanceInfo_t {
                device: device_handle(i),
                gpuInstance: gpu_instance_handle(i, gi),
                id: ci,
                profileId: c.profile_id,
                placement: nvmlComputeInstancePlacement_t {
                    start,
                    size: c.slices,
                },
            },
        )
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlComputeInstanceDestroy(compute: nvmlComputeInstance_t) -> nvmlReturn_t {
    guard(|| {
        let (i, gi, ci) = compute_instance_parts(compute)?;
        mutate(|m| m.destroy_compute_instance(i, gi, ci))
    })
}
