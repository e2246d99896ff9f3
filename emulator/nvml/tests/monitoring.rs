//! What monitoring tools read, through the real nvml-wrapper on the built library: versions,
//! handles by UUID and PCI bus id, identity, utilisation from kernels on the GPU timeline,
//! temperature, power and clocks that follow it, memory from CUDA allocations, MIG devices.

use std::ffi::OsStr;

use gpuslice_emulator::shm::{Ledger, Process};
use gpuslice_emulator::timeline::{Timeline, now_ns, timeline_path};
use gpuslice_emulator::{Machine, Store, cuda_ledger_path, device_key};
use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{
    Brand, Clock, ComputeMode, EccCounter, MemoryError, PerformanceState, TemperatureSensor,
};
use nvml_wrapper::enums::device::DeviceArchitecture;
use nvml_wrapper::error::NvmlError;

const MS: u64 = 1_000_000;
const GIB: u64 = 1 << 30;

#[test]
fn monitoring_calls_follow_the_timeline_and_the_ledgers() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state.json");
    let node: gpuslice_api::NodeInventory = serde_yaml::from_str(
        "name: n
gpus:
- {index: 0, model: NVIDIA H200, uuid: GPU-aaaa}
- {index: 1, model: NVIDIA A100-SXM4-80GB, processes: [{pid: 4242, memory: 10Gi}]}
- index: 2
  model: NVIDIA H200
  mig: {enabled: true, instances: [{profile: 3g.71gb, placement: {start: 4, size: 4}, uuid: MIG-bbbb}]}
- {index: 3, model: Tesla T4, memory: 15Gi}
",
    )
    .unwrap();
    let mut machine = Machine::from_inventory(&node).unwrap();
    machine.inject_xid(1, 48).unwrap();
    machine.inject_xid(1, 79).unwrap();
    let store = Store::create(&state, &machine).unwrap();
    // SAFETY: this test binary has a single test, so no other thread reads the environment.
    unsafe { std::env::set_var("GPUSLICE_EMULATOR_STATE", &state) };
    let lib = gpuslice_emulator::built_library("libnvidia_ml.so");
    let nvml = Nvml::builder()
        .lib_path(OsStr::new(lib.as_os_str()))
        .init()
        .unwrap();

    assert_eq!(nvml.sys_nvml_version().unwrap(), "12.575.57.08");
    assert_eq!(nvml.sys_cuda_driver_version().unwrap(), 12080);

    // Handles by UUID and by PCI bus id find the GPU that reports them.
    let gpu0 = nvml.device_by_uuid("GPU-aaaa").unwrap();
    assert_eq!(gpu0.index().unwrap(), 0);
    assert!(matches!(
        nvml.device_by_uuid("GPU-nope"),
        Err(NvmlError::NotFound)
    ));
    let mut bus_ids = std::collections::HashSet::new();
    for i in 0..4 {
        let pci = nvml.device_by_index(i).unwrap().pci_info().unwrap();
        assert_eq!(
            nvml.device_by_pci_bus_id(pci.bus_id.clone())
                .unwrap()
                .index()
                .unwrap(),
            i
        );
        bus_ids.insert(pci.bus_id);
    }
    assert_eq!(bus_ids.len(), 4, "{bus_ids:?}");
    let pci = gpu0.pci_info().unwrap();
    assert_eq!(pci.pci_device_id, 0x2335_10de, "H200's PCI device id");
    assert_eq!(pci.bus_id, format!("00000000:{:02X}:00.0", pci.bus));
    assert!(matches!(
        nvml.device_by_pci_bus_id("0000:ff:00.0"),
        Err(NvmlError::NotFound)
    ));

    // Identity and modes.
    let serial = gpu0.serial().unwrap();
    assert_eq!(serial.len(), 13);
    assert_ne!(serial, nvml.device_by_index(1).unwrap().serial().unwrap());
    assert_eq!(gpu0.minor_number().unwrap(), 0);
    assert_eq!(gpu0.brand().unwrap(), Brand::Nvidia);
    assert_eq!(gpu0.architecture().unwrap(), DeviceArchitecture::Hopper);
    let cc = gpu0.cuda_compute_capability().unwrap();
    assert_eq!((cc.major, cc.minor), (9, 0));
    assert_eq!(gpu0.vbios_version().unwrap(), "96.00.00.00.00");
    assert_eq!(gpu0.compute_mode().unwrap(), ComputeMode::Default);
    assert!(gpu0.is_ecc_enabled().unwrap().currently_enabled);
    assert_eq!(gpu0.performance_state().unwrap(), PerformanceState::Zero);
    assert_eq!(gpu0.bar1_memory_info().unwrap().total, 256 << 30);
    assert!(gpu0.running_graphics_processes().unwrap().is_empty());
    assert!(matches!(gpu0.fan_speed(0), Err(NvmlError::NotSupported)));
    let a100 = nvml.device_by_index(1).unwrap();
    assert_eq!(a100.architecture().unwrap(), DeviceArchitecture::Ampere);
    assert_eq!(a100.power_management_limit().unwrap(), 400_000);
    // One uncorrectable-memory XID (48) of the two the GPU reported.
    assert_eq!(
        a100.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            .unwrap(),
        1
    );
    assert_eq!(
        a100.total_ecc_errors(MemoryError::Corrected, EccCounter::Aggregate)
            .unwrap(),
        0
    );

    // Idle: no kernel ever ran.
    let idle = gpu0.utilization_rates().unwrap();
    assert_eq!((idle.gpu, idle.memory), (0, 0));
    assert_eq!(gpu0.temperature(TemperatureSensor::Gpu).unwrap(), 30);
    assert_eq!(gpu0.power_usage().unwrap(), 75_000);
    assert_eq!(gpu0.power_management_limit().unwrap(), 700_000);
    assert_eq!(gpu0.enforced_power_limit().unwrap(), 700_000);
    assert_eq!(gpu0.power_management_limit_default().unwrap(), 700_000);
    let limits = gpu0.power_management_limit_constraints().unwrap();
    assert_eq!((limits.min_limit, limits.max_limit), (200_000, 700_000));
    assert_eq!(gpu0.clock_info(Clock::Graphics).unwrap(), 345);
    assert_eq!(gpu0.clock_info(Clock::Memory).unwrap(), 3201);
    assert_eq!(gpu0.max_clock_info(Clock::SM).unwrap(), 1980);
    let energy_idle = gpu0.total_energy_consumption().unwrap();

    // Kernels as the CUDA emulator records them: 400 ms of the last second busy.
    let pid = std::process::id();
    let timeline = Timeline::open(&timeline_path(&state, device_key(0, None))).unwrap();
    let now = now_ns();
    timeline.run(pid, now - 700 * MS, 250 * MS);
    timeline.run(pid, now - 450 * MS, 150 * MS);
    let busy = gpu0.utilization_rates().unwrap();
    assert!((39..=41).contains(&busy.gpu), "{busy:?}");
    assert_eq!(busy.memory, busy.gpu);
    let celsius = gpu0.temperature(TemperatureSensor::Gpu).unwrap();
    assert!((45..=47).contains(&celsius), "{celsius}");
    let power = gpu0.power_usage().unwrap();
    assert!(
        (320_000..=330_000).contains(&power),
        "75 W + 40% of 625 W: {power}"
    );
    let graphics = gpu0.clock_info(Clock::Graphics).unwrap();
    assert!((990..=1010).contains(&graphics), "{graphics}");
    assert_eq!(gpu0.clock_info(Clock::SM).unwrap(), graphics);
    // 400 ms of 625 W above idle: 250 J more than idle draw alone.
    let extra = gpu0.total_energy_consumption().unwrap() - energy_idle;
    assert!((250_000..300_000).contains(&extra), "{extra} mJ");
    // Another GPU's kernels are not this one's.
    assert_eq!(a100.utilization_rates().unwrap().gpu, 0);

    // Memory: what CUDA allocations hold, by process.
    let ledger = Ledger::open(&cuda_ledger_path(&state)).unwrap();
    let row = ledger
        .row_for(Process::current(), device_key(0, None))
        .unwrap();
    let total = gpu0.memory_info().unwrap().total;
    assert!(ledger.try_charge(row, 3 * GIB, total));
    assert_eq!(gpu0.memory_info().unwrap().used, 3 * GIB);
    let procs = gpu0.running_compute_processes().unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(procs[0].pid, pid);
    assert_eq!(
        procs[0].used_gpu_memory,
        nvml_wrapper::enums::device::UsedGpuMemory::Used(3 * GIB)
    );
    assert!(!nvml.sys_process_name(pid, 256).unwrap().is_empty());

    // A MIG device: the instance's memory and processes; board-level queries are not its own.
    let gpu2 = nvml.device_by_index(2).unwrap();
    let mig = nvml.device_by_uuid("MIG-bbbb").unwrap();
    assert_eq!(
        gpu2.mig_device_by_index(0).unwrap().uuid().unwrap(),
        "MIG-bbbb"
    );
    assert_eq!(mig.name().unwrap(), "NVIDIA H200 MIG 3g.71gb");
    let mig_row = ledger
        .row_for(Process::current(), device_key(2, Some(1)))
        .unwrap();
    assert!(ledger.try_charge(mig_row, GIB, 69 * GIB));
    let memory = mig.memory_info().unwrap();
    assert_eq!((memory.total, memory.used), ((69 * GIB) + (GIB / 2), GIB));
    assert_eq!(mig.running_compute_processes().unwrap()[0].pid, pid);
    assert_eq!(gpu2.memory_info().unwrap().used, GIB);
    for result in [
        mig.utilization_rates().map(|_| ()),
        mig.temperature(TemperatureSensor::Gpu).map(|_| ()),
        mig.power_usage().map(|_| ()),
        // A GPU in MIG mode has no utilisation of its own.
        gpu2.utilization_rates().map(|_| ()),
    ] {
        assert!(matches!(result, Err(NvmlError::NotSupported)), "{result:?}");
    }
    // The instance's kernels (3 of the 7 compute slices, busy 700 ms of the last second) warm
    // the whole GPU: 30% of the way from idle.
    assert_eq!(gpu2.power_usage().unwrap(), 75_000);
    let mig_timeline = Timeline::open(&timeline_path(&state, device_key(2, Some(1)))).unwrap();
    mig_timeline.run(pid, now_ns() - 800 * MS, 700 * MS);
    let power = gpu2.power_usage().unwrap();
    assert!((260_000..=265_000).contains(&power), "{power}");

    // A model without board facts: what needs them is NOT_SUPPORTED; the rest answers.
    let t4 = nvml.device_by_index(3).unwrap();
    assert!(matches!(t4.power_usage(), Err(NvmlError::NotSupported)));
    assert!(matches!(
        t4.clock_info(Clock::Graphics),
        Err(NvmlError::NotSupported)
    ));
    assert_eq!(t4.utilization_rates().unwrap().gpu, 0);
    assert_eq!(t4.temperature(TemperatureSensor::Gpu).unwrap(), 30);
    assert_eq!(t4.pci_info().unwrap().pci_device_id, 0x10de);

    // XID critical errors as NVML events: a set registered on two GPUs gets the errors injected
    // after it registered (not the two from before), each once, in order, with its GPU; a MIG
    // device handle cannot register; an empty wait times out.
    use nvml_wrapper::bitmasks::event::EventTypes;
    use nvml_wrapper::enums::event::XidError;
    let gpu1 = nvml.device_by_index(1).unwrap();
    assert!(
        gpu1.supported_event_types()
            .unwrap()
            .contains(EventTypes::CRITICAL_XID_ERROR)
    );
    let set = nvml.create_event_set().unwrap();
    let set = gpu0
        .register_events(EventTypes::CRITICAL_XID_ERROR, set)
        .unwrap();
    let set = gpu1
        .register_events(EventTypes::CRITICAL_XID_ERROR, set)
        .unwrap();
    assert!(matches!(set.wait(50), Err(NvmlError::Timeout)));
    store.mutate(|m| m.inject_xid(1, 94)).unwrap().unwrap();
    store.mutate(|m| m.inject_xid(0, 31)).unwrap().unwrap();
    store.mutate(|m| m.inject_xid(1, 95)).unwrap().unwrap();
    let mut seen = Vec::new();
    while let Ok(event) = set.wait(200) {
        assert!(event.event_type.contains(EventTypes::CRITICAL_XID_ERROR));
        let Some(XidError::Value(xid)) = event.event_data else {
            panic!("an XID event without its code: {:?}", event.event_data);
        };
        seen.push((event.device.index().unwrap(), xid));
    }
    seen.sort();
    assert_eq!(seen, [(0, 31), (1, 94), (1, 95)]);
    assert!(matches!(
        mig.register_events(
            EventTypes::CRITICAL_XID_ERROR,
            nvml.create_event_set().unwrap()
        )
        .map(|_| ())
        .map_err(|e| e.error),
        Err(NvmlError::NotSupported)
    ));
}
