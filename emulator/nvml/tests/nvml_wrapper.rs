//! The emulated `libnvidia-ml` under the real nvml-wrapper: discovery, memory, MIG mode, GPU and
//! compute instances through the raw bindings (as the agent does), processes, and NVML's errors.

use std::ffi::OsStr;

use gpuslice_emulator::{Machine, Store};
use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings::{
    NVML_GPU_INSTANCE_PROFILE_3_SLICE, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t,
    nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_t,
};

#[test]
fn nvml_wrapper_drives_the_emulated_h200s() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state.json");
    let node: gpuslice_api::NodeInventory = serde_yaml::from_str(
        "name: n\ngpus:\n- {index: 0, model: NVIDIA H200, uuid: GPU-aaaa}\n- {index: 1, model: NVIDIA H200, processes: [{pid: 4242, memory: 10Gi}]}\n",
    )
    .unwrap();
    let store = Store::create(&state, &Machine::from_inventory(&node).unwrap()).unwrap();
    // SAFETY: this test binary has a single test, so no other thread reads the environment.
    unsafe { std::env::set_var("GPUSLICE_EMULATOR_STATE", &state) };

    let lib = gpuslice_emulator::built_library("libnvidia_ml.so");
    let nvml = Nvml::builder()
        .lib_path(OsStr::new(lib.as_os_str()))
        .init()
        .expect("the emulator initialises");
    assert_eq!(nvml.device_count().unwrap(), 2);
    let gpu0 = nvml.device_by_index(0).unwrap();
    assert_eq!(gpu0.name().unwrap(), "NVIDIA H200");
    assert_eq!(gpu0.uuid().unwrap(), "GPU-aaaa");
    assert_eq!(gpu0.memory_info().unwrap().total, 143771 << 20);

    let gpu1 = nvml.device_by_index(1).unwrap();
    let procs = gpu1.running_compute_processes().unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(procs[0].pid, 4242);
    assert_eq!(gpu1.memory_info().unwrap().used, 10 << 30);
    // A busy GPU cannot change MIG mode.
    assert!(matches!(gpu1.set_mig_mode(true), Err(NvmlError::InUse)));

    gpu0.set_mig_mode(true).unwrap();
    assert!(gpu0.mig_mode().unwrap().current == 1);

    // GPU instances through the raw bindings, as nvml-wrapper does not wrap them.
    let raw = nvml.lib();
    // SAFETY: the handle belongs to a live Device of this Nvml.
    let device = unsafe { gpu0.handle() };
    let create = raw
        .nvmlDeviceCreateGpuInstanceWithPlacement
        .as_ref()
        .unwrap();
    let placements = raw
        .nvmlDeviceGetGpuInstancePossiblePlacements_v2
        .as_ref()
        .unwrap();
    // The 3g profile's index answers with its id, which the other calls take.
    // SAFETY: an all-zero profile info is valid (integers only).
    let mut profile: nvmlGpuInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid device handle and out-pointer.
    let rc = unsafe {
        raw.nvmlDeviceGetGpuInstanceProfileInfo.as_ref().unwrap()(
            device,
            NVML_GPU_INSTANCE_PROFILE_3_SLICE,
            &mut profile,
        )
    };
    assert_eq!((rc, profile.id, profile.sliceCount), (0, 9, 3));
    let three_g = profile.id;
    let mut list = [nvmlGpuInstancePlacement_t { start: 0, size: 0 }; 8];
    let mut count = 0;
    // SAFETY: list has room for every placement of the profile; the count is output only.
    assert_eq!(
        unsafe { placements(device, three_g, list.as_mut_ptr(), &mut count) },
        0
    );
    assert_eq!(
        &list[..count as usize]
            .iter()
            .map(|p| (p.start, p.size))
            .collect::<Vec<_>>(),
        &[(0, 4), (4, 4)]
    );

    let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
    let at = nvmlGpuInstancePlacement_t { start: 4, size: 4 };
    // SAFETY: valid device handle, placement and out-pointer.
    assert_eq!(unsafe { create(device, three_g, &at, &mut gi) }, 0);
    // The same placement again: NVML_ERROR_INSUFFICIENT_RESOURCES.
    let mut other: nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: as above.
    assert_eq!(unsafe { create(device, three_g, &at, &mut other) }, 23);
    // The index is no id: NVML_GPU_INSTANCE_PROFILE_3_SLICE names no profile there.
    let at0 = nvmlGpuInstancePlacement_t { start: 0, size: 4 };
    // SAFETY: as above.
    assert_eq!(unsafe { create(device, 2, &at0, &mut other) }, 2);

    let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: gi was returned by the create call; info is a valid out-pointer.
    assert_eq!(
        unsafe { raw.nvmlGpuInstanceGetInfo.as_ref().unwrap()(gi, &mut info) },
        0
    );
    assert_eq!(
        (info.profileId, info.placement.start, info.placement.size),
        (9, 4, 4)
    );

    // Another process (here: this test through the state file) sees the instance.
    let seen = store.snapshot().unwrap();
    assert_eq!(seen.gpu(0).unwrap().instances.len(), 1);

    // A compute instance makes the GPU instance busy until it is destroyed (compute profile id
    // 2: three slices, the whole 3g instance).
    let mut ci = std::ptr::null_mut();
    // SAFETY: valid handles and out-pointer.
    assert_eq!(
        unsafe { raw.nvmlGpuInstanceCreateComputeInstance.as_ref().unwrap()(gi, 2, &mut ci) },
        0
    );
    // SAFETY: gi is a live GPU instance handle.
    assert_eq!(
        unsafe { raw.nvmlGpuInstanceDestroy.as_ref().unwrap()(gi) },
        19,
        "IN_USE while a compute instance exists"
    );
    // SAFETY: ci is a live compute instance handle.
    assert_eq!(
        unsafe { raw.nvmlComputeInstanceDestroy.as_ref().unwrap()(ci) },
        0
    );
    // SAFETY: gi is a live GPU instance handle.
    assert_eq!(
        unsafe { raw.nvmlGpuInstanceDestroy.as_ref().unwrap()(gi) },
        0
    );
    assert!(
        store
            .snapshot()
            .unwrap()
            .gpu(0)
            .unwrap()
            .instances
            .is_empty()
    );
}
