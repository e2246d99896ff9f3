//! What monitoring tools ask beyond what the agent needs: versions, handles by UUID and PCI bus
//! id, identity, utilisation, temperature, power, clocks, modes, ECC counts, BAR1, process lists.
//!
//! Utilisation comes from the GPU timeline the CUDA emulator records: NVML's GPU utilisation is
//! the "percent of time over the past sample period during which one or more kernels was
//! executing" (the period is 1/6 s to 1 s by product); here the period is the last second. The
//! emulator models no memory traffic, so a running kernel is taken to keep device memory busy as
//! well: memory utilisation equals GPU utilisation, the most the kernels that ran could cause.
//! Temperature, power, energy and clocks are linear in the same load, between the board's idle
//! and full-load figures ([`crate::board`]).

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong};
use std::path::Path;

use gpuslice_emulator::timeline::{Timeline, now_ns, timeline_path};
use gpuslice_emulator::{Gpu, NvmlError, device_key};
use gpuslice_planning::catalog;
use nvml_wrapper_sys::bindings::{
    nvmlBAR1Memory_t, nvmlBrandType_enum_NVML_BRAND_NVIDIA, nvmlBrandType_t,
    nvmlClockType_enum_NVML_CLOCK_GRAPHICS as CLOCK_GRAPHICS,
    nvmlClockType_enum_NVML_CLOCK_MEM as CLOCK_MEM, nvmlClockType_enum_NVML_CLOCK_SM as CLOCK_SM,
    nvmlClockType_enum_NVML_CLOCK_VIDEO as CLOCK_VIDEO, nvmlClockType_t,
    nvmlComputeMode_enum_NVML_COMPUTEMODE_DEFAULT, nvmlComputeMode_t, nvmlDevice_t,
    nvmlDeviceArchitecture_t, nvmlEccCounterType_t, nvmlEnableState_enum_NVML_FEATURE_DISABLED,
    nvmlEnableState_enum_NVML_FEATURE_ENABLED, nvmlEnableState_t,
    nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_CORRECTED as CORRECTED,
    nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_UNCORRECTED as UNCORRECTED,
    nvmlMemoryErrorType_t, nvmlPStates_enum_NVML_PSTATE_0, nvmlPciInfo_t, nvmlProcessInfo_t,
    nvmlProcessUtilizationSample_t, nvmlPstates_t, nvmlReturn_t,
    nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU, nvmlTemperatureSensors_t, nvmlUtilization_t,
};

use crate::board::{Board, board};
use crate::{
    INVALID_ARGUMENT, MIG_DEVICE_BIT, NOT_FOUND, NOT_SUPPORTED, UNKNOWN, device_handle,
    device_index, gpu_instance_handle, guard, mig_device_parts, put, put_list, put_str, read,
    store,
};

/// The sample period utilisation is measured over.
const SAMPLE_NS: u64 = 1_000_000_000;
/// GPU temperature idle and under full load: the range `nvidia-smi` shows on data-centre boards
/// in a cooled chassis (well below their ~90 °C slowdown thresholds).
const IDLE_CELSIUS: f64 = 30.0;
const LOADED_CELSIUS: f64 = 70.0;
/// NVIDIA's PCI vendor id.
const NVIDIA_VENDOR: u32 = 0x10de;
/// XIDs of uncorrectable memory errors: 48 (double-bit ECC), 94 and 95 (contained and
/// uncontained ECC errors, which replace 48 from Ampere on).
const UNCORRECTED_XIDS: [u64; 3] = [48, 94, 95];

/// Nanoseconds of `[from, to)` during which kernels ran on the device with ledger key `key`.
fn busy_ns(state: &Path, key: u32, from: u64, to: u64) -> Result<u64, nvmlReturn_t> {
    let path = timeline_path(state, key);
    if !path.exists() {
        // No kernel ever ran there.
        return Ok(0);
    }
    let timeline = Timeline::open(&path).map_err(|e| {
        eprintln!("gpuslice NVML emulator: {e}");
        UNKNOWN
    })?;
    // Kernels taking turns never overlap, and MPS clients' kernels overlap on SMs of their own,
    // so their overlaps with the span, weighted by their SM shares, add up.
    Ok(timeline
        .intervals()
        .iter()
        .map(|k| k.used_within(from, to))
        .sum())
}

/// The fraction (0 to 1) of `[from, to)` a whole GPU was busy: its own timeline, or in MIG mode
/// its GPU instances' timelines, each weighted by its share of the GPU's compute slices.
fn load(state: &Path, gpu: &Gpu, from: u64, to: u64) -> Result<f64, nvmlReturn_t> {
    let span = to.saturating_sub(from).max(1) as f64;
    let geometry = catalog::model(&gpu.model).ok().and_then(|m| m.mig.as_ref());
    let busy = match geometry {
        Some(geometry) if gpu.mig_enabled => {
            let mut weighted = 0.0;
            for instance in &gpu.instances {
                let slices = geometry
                    .profile_by_id(instance.profile_id)
                    .map_or(0, |p| p.compute_slices);
                let busy = busy_ns(state, device_key(gpu.index, Some(instance.id)), from, to)?;
                weighted += busy as f64 * f64::from(slices) / f64::from(geometry.compute_slices);
            }
            weighted
        }
        _ => busy_ns(state, device_key(gpu.index, None), from, to)? as f64,
    };
    Ok((busy / span).clamp(0.0, 1.0))
}

/// The whole GPU a handle names, for a board-level query. MIG device handles get NOT_SUPPORTED,
/// as on real hardware: temperature, power, clocks and utilisation belong to the physical GPU.
fn whole_gpu(device: nvmlDevice_t) -> Result<Gpu, nvmlReturn_t> {
    if mig_device_parts(device).is_some() {
        return Err(NOT_SUPPORTED);
    }
    let i = device_index(device)?;
    read(|m| m.gpu(i).cloned())
}

/// The board facts of a whole GPU; NOT_SUPPORTED for models the emulator has no facts for.
fn board_of(device: nvmlDevice_t) -> Result<(Gpu, &'static Board), nvmlReturn_t> {
    let gpu = whole_gpu(device)?;
    let b = board(&gpu.model).ok_or(NOT_SUPPORTED)?;
    Ok((gpu, b))
}

/// How busy the GPU was over the last sample period.
fn recent_load(gpu: &Gpu) -> Result<f64, nvmlReturn_t> {
    let now = now_ns();
    load(store()?.path(), gpu, now.saturating_sub(SAMPLE_NS), now)
}

/// `idle + (full - idle) × load`, rounded.
fn between(idle: u32, full: u32, load: f64) -> u32 {
    (f64::from(idle) + f64::from(full.saturating_sub(idle)) * load).round() as u32
}

/// The graphics (= SM) clock at this load: the GPU boosts as work arrives.
fn graphics_mhz(b: &Board, load: f64) -> u32 {
    between(b.idle_graphics_mhz, b.max_graphics_mhz, load)
}

fn clock_of(b: &Board, clock: nvmlClockType_t, graphics: u32) -> Result<c_uint, nvmlReturn_t> {
    match clock {
        CLOCK_GRAPHICS | CLOCK_SM => Ok(graphics),
        CLOCK_MEM => Ok(b.memory_mhz),
        // The video clock follows the graphics clock's fraction of its maximum.
        CLOCK_VIDEO => Ok((u64::from(b.max_video_mhz) * u64::from(graphics)
            / u64::from(b.max_graphics_mhz)) as c_uint),
        _ => Err(INVALID_ARGUMENT),
    }
}

/// Reads a NUL-terminated string argument.
fn get_str<'a>(input: *const c_char) -> Result<&'a str, nvmlReturn_t> {
    if input.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: NVML's API requires a non-null string argument to be NUL-terminated; it is only
    // read during the call.
    let text = unsafe { CStr::from_ptr(input) };
    text.to_str().map_err(|_| INVALID_ARGUMENT)
}

/// A GPU's PCI address: up to 16 GPUs per domain, on buses 0x10 apart by 0x0e, function 0.
fn pci_address(index: u32) -> (u32, u32) {
    (index / 16, 0x10 + 0x0e * (index % 16))
}

/// Parses `domain:bus:device.function` (domain optional), hex, as NVML accepts bus ids.
fn parse_bus_id(text: &str) -> Option<(u32, u32, u32, u32)> {
    let hex = |s: &str| u32::from_str_radix(s, 16).ok();
    let parts: Vec<&str> = text.trim().split(':').collect();
    let (domain, bus, rest) = match parts[..] {
        [domain, bus, rest] => (hex(domain)?, hex(bus)?, rest),
        [bus, rest] => (0, hex(bus)?, rest),
        _ => return None,
    };
    let (device, function) = rest.split_once('.')?;
    Some((domain, bus, hex(device)?, hex(function)?))
}

/// Copies `text` into a fixed C string field, NUL-padded.
fn c_field<const N: usize>(text: &str) -> [c_char; N] {
    let mut field = [0; N];
    for (slot, byte) in field.iter_mut().zip(text.bytes().take(N - 1)) {
        *slot = byte as c_char;
    }
    field
}

/// A 13-digit serial number, stable for a GPU's UUID (FNV-1a of it).
fn serial(uuid: &str) -> String {
    let hash = uuid.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("1{:012}", hash % 1_000_000_000_000)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    // NVML's version: the CUDA major version, then the driver version.
    guard(|| {
        let driver = read(|m| Ok(m.driver()))?;
        let major = driver.cuda.split('.').next().unwrap_or("0");
        put_str(version, length, &format!("{major}.{}", driver.version))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) -> nvmlReturn_t {
    nvmlSystemGetCudaDriverVersion_v2(version)
}

/// The machine's CUDA version (`12.8`) as NVML gives it (`12080`).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> nvmlReturn_t {
    guard(|| {
        let cuda = read(|m| Ok(m.driver().cuda))?;
        let mut parts = cuda.split('.').map(|p| p.parse::<c_int>().unwrap_or(0));
        let major = parts.next().unwrap_or(0);
        let minor = parts.next().unwrap_or(0);
        put(version, major * 1000 + minor * 10)
    })
}

/// The process's name as `nvidia-smi` lists it: its first argument (else its command name).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlSystemGetProcessName(
    pid: c_uint,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        store()?;
        let argv0 = std::fs::read(format!("/proc/{pid}/cmdline"))
            .ok()
            .and_then(|c| {
                let first = c.split(|&b| b == 0).next()?.to_vec();
                (!first.is_empty()).then(|| String::from_utf8_lossy(&first).into_owned())
            });
        let text = argv0
            .or_else(|| std::fs::read_to_string(format!("/proc/{pid}/comm")).ok())
            .ok_or(NOT_FOUND)?;
        put_str(name, length, text.trim_end())
    })
}

/// A whole GPU by its `GPU-…` UUID, or a MIG device by its `MIG-…` UUID.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    guard(|| {
        let wanted = get_str(uuid)?;
        let handle = read(|m| {
            for gpu in &m.gpus {
                if gpu.uuid == wanted {
                    return Ok(device_handle(gpu.index));
                }
                if let Some(instance) = gpu.instances.iter().find(|x| x.uuid == wanted) {
                    let gi = gpu_instance_handle(gpu.index, instance.id) as usize;
                    return Ok((gi | MIG_DEVICE_BIT) as nvmlDevice_t);
                }
            }
            Err(NvmlError::NotFound)
        })?;
        put(device, handle)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    bus_id: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    guard(|| {
        let (domain, bus, dev, function) =
            parse_bus_id(get_str(bus_id)?).ok_or(INVALID_ARGUMENT)?;
        let index = read(|m| {
            m.gpus
                .iter()
                .map(|g| g.index)
                .find(|&i| {
                    let (d, b) = pci_address(i);
                    (domain, bus, dev, function) == (d, b, 0, 0)
                })
                .ok_or(NvmlError::NotFound)
        })?;
        put(device, device_handle(index))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    guard(|| {
        let gpu = whole_gpu(device)?;
        let (domain, bus) = pci_address(gpu.index);
        // A model without board facts has no known device id: 0, NVIDIA's vendor id only.
        let device_id = board(&gpu.model).map_or(0, |b| b.pci_device);
        put(
            pci,
            nvmlPciInfo_t {
                busIdLegacy: c_field(&format!("{domain:04X}:{bus:02X}:00.0")),
                domain,
                bus,
                device: 0,
                pciDeviceId: (device_id << 16) | NVIDIA_VENDOR,
                // The OEM's subsystem is not modelled: NVIDIA's vendor id, device 0.
                pciSubSystemId: NVIDIA_VENDOR,
                busId: c_field(&format!("{domain:08X}:{bus:02X}:00.0")),
            },
        )
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetSerial(
    device: nvmlDevice_t,
    text: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guard(|| put_str(text, length, &serial(&whole_gpu(device)?.uuid)))
}

/// The N of `/dev/nvidiaN`: the GPU's minor number (the index unless the seed says otherwise).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minor: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| put(minor, whole_gpu(device)?.minor))
}

/// Current drivers brand data-centre boards plain "NVIDIA".
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetBrand(
    device: nvmlDevice_t,
    brand: *mut nvmlBrandType_t,
) -> nvmlReturn_t {
    guard(|| {
        whole_gpu(device)?;
        put(brand, nvmlBrandType_enum_NVML_BRAND_NVIDIA)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetArchitecture(
    device: nvmlDevice_t,
    arch: *mut nvmlDeviceArchitecture_t,
) -> nvmlReturn_t {
    guard(|| put(arch, board_of(device)?.1.architecture))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    guard(|| {
        let (m, n) = board_of(device)?.1.compute_capability;
        put(major, m)?;
        put(minor, n)
    })
}

/// The VBIOS family real boards of the architecture carry (92.00 on GA100, 96.00 on GH100); the
/// build fields are zero, as an emulated board has no firmware build.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetVbiosVersion(
    device: nvmlDevice_t,
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let family = match board_of(device)?.1.compute_capability {
            (6, _) => "86",
            (8, _) => "92",
            _ => "96",
        };
        put_str(version, length, &format!("{family}.00.00.00.00"))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetComputeMode(
    device: nvmlDevice_t,
    mode: *mut nvmlComputeMode_t,
) -> nvmlReturn_t {
    guard(|| {
        whole_gpu(device)?;
        put(mode, nvmlComputeMode_enum_NVML_COMPUTEMODE_DEFAULT)
    })
}

/// On: Kubernetes GPU nodes run the persistence daemon (the GPU operator's driver container does).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetPersistenceMode(
    device: nvmlDevice_t,
    mode: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    guard(|| {
        whole_gpu(device)?;
        put(mode, nvmlEnableState_enum_NVML_FEATURE_ENABLED)
    })
}

/// Off: data-centre boards drive no display.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetDisplayMode(
    device: nvmlDevice_t,
    mode: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    guard(|| {
        whole_gpu(device)?;
        put(mode, nvmlEnableState_enum_NVML_FEATURE_DISABLED)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetDisplayActive(
    device: nvmlDevice_t,
    active: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    guard(|| {
        whole_gpu(device)?;
        put(active, nvmlEnableState_enum_NVML_FEATURE_DISABLED)
    })
}

/// On, current and pending: the HBM boards of the table ship with ECC enabled.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetEccMode(
    device: nvmlDevice_t,
    current: *mut nvmlEnableState_t,
    pending: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    guard(|| {
        board_of(device)?;
        put(current, nvmlEnableState_enum_NVML_FEATURE_ENABLED)?;
        put(pending, nvmlEnableState_enum_NVML_FEATURE_ENABLED)
    })
}

/// Uncorrected errors are the GPU's uncorrectable-memory XIDs so far (the emulated machine's
/// life is both the volatile and the aggregate period); corrected errors raise no XID, so none
/// are known.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetTotalEccErrors(
    device: nvmlDevice_t,
    error_type: nvmlMemoryErrorType_t,
    counter_type: nvmlEccCounterType_t,
    count: *mut c_ulonglong,
) -> nvmlReturn_t {
    guard(|| {
        let (gpu, _) = board_of(device)?;
        if counter_type > 1 {
            return Err(INVALID_ARGUMENT);
        }
        let errors = match error_type {
            CORRECTED => 0,
            UNCORRECTED => gpu
                .xid_events
                .iter()
                .filter(|x| UNCORRECTED_XIDS.contains(&x.code))
                .count() as c_ulonglong,
            _ => return Err(INVALID_ARGUMENT),
        };
        put(count, errors)
    })
}

/// Always P0: data-centre boards with persistence mode on stay in P0, idle or busy.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetPerformanceState(
    device: nvmlDevice_t,
    state: *mut nvmlPstates_t,
) -> nvmlReturn_t {
    guard(|| {
        whole_gpu(device)?;
        put(state, nvmlPStates_enum_NVML_PSTATE_0)
    })
}

/// NOT_SUPPORTED on a GPU in MIG mode, as real NVML answers (`nvidia-smi` shows N/A there).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    guard(|| {
        let gpu = whole_gpu(device)?;
        if gpu.mig_enabled {
            return Err(NOT_SUPPORTED);
        }
        let percent = (recent_load(&gpu)? * 100.0).round() as c_uint;
        put(
            utilization,
            nvmlUtilization_t {
                gpu: percent,
                memory: percent,
            },
        )
    })
}

/// Per-process utilisation: one sample per process that ran kernels on the GPU during the last
/// sample period, stamped now (CPU time in µs, as NVML's), its SM utilisation the share of the
/// period its kernels ran (memory utilisation the same, as for the whole GPU). A
/// `lastSeenTimeStamp` at or after now leaves nothing new: NOT_FOUND, as when no process ran.
/// `utilization` NULL asks for the count (INSUFFICIENT_SIZE with the count set). MIG mode:
/// NOT_SUPPORTED, as on real boards.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    utilization: *mut nvmlProcessUtilizationSample_t,
    process_samples_count: *mut c_uint,
    last_seen_time_stamp: c_ulonglong,
) -> nvmlReturn_t {
    guard(|| {
        let gpu = whole_gpu(device)?;
        if gpu.mig_enabled {
            return Err(NOT_SUPPORTED);
        }
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let now = now_ns();
        let from = now.saturating_sub(SAMPLE_NS);
        let path = timeline_path(store()?.path(), device_key(gpu.index, None));
        let mut per_pid: std::collections::BTreeMap<u32, u64> = Default::default();
        if stamp > last_seen_time_stamp && path.exists() {
            let timeline = Timeline::open(&path).map_err(|e| {
                eprintln!("gpuslice NVML emulator: {e}");
                UNKNOWN
            })?;
            for k in timeline.intervals() {
                let ran = k.used_within(from, now);
                if ran > 0 {
                    *per_pid.entry(k.pid).or_default() += ran;
                }
            }
        }
        if per_pid.is_empty() {
            return Err(NOT_FOUND);
        }
        let samples: Vec<nvmlProcessUtilizationSample_t> = per_pid
            .into_iter()
            .map(|(pid, ran)| {
                let percent = (ran.saturating_mul(100) / SAMPLE_NS).min(100) as c_uint;
                nvmlProcessUtilizationSample_t {
                    pid,
                    timeStamp: stamp,
                    smUtil: percent,
                    memUtil: percent,
                    encUtil: 0,
                    decUtil: 0,
                }
            })
            .collect();
        put_list(utilization, process_samples_count, &samples)
    })
}

/// 0 %: the emulator runs no video work. The sampling period is the utilisation's.
fn no_codec_work(
    device: nvmlDevice_t,
    utilization: *mut c_uint,
    period_us: *mut c_uint,
) -> Result<(), nvmlReturn_t> {
    whole_gpu(device)?;
    put(utilization, 0)?;
    put(period_us, (SAMPLE_NS / 1000) as c_uint)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetEncoderUtilization(
    device: nvmlDevice_t,
    utilization: *mut c_uint,
    period_us: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| no_codec_work(device, utilization, period_us))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetDecoderUtilization(
    device: nvmlDevice_t,
    utilization: *mut c_uint,
    period_us: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| no_codec_work(device, utilization, period_us))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetTemperature(
    device: nvmlDevice_t,
    sensor: nvmlTemperatureSensors_t,
    celsius: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let gpu = whole_gpu(device)?;
        if sensor != nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU {
            return Err(INVALID_ARGUMENT);
        }
        let load = recent_load(&gpu)?;
        put(
            celsius,
            (IDLE_CELSIUS + (LOADED_CELSIUS - IDLE_CELSIUS) * load).round() as c_uint,
        )
    })
}

/// Milliwatts: idle draw plus the load's share of the way to the board's TDP.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetPowerUsage(
    device: nvmlDevice_t,
    milliwatts: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let (gpu, b) = board_of(device)?;
        put(
            milliwatts,
            between(b.idle_power_mw, b.max_power_mw, recent_load(&gpu)?),
        )
    })
}

/// Millijoules since the emulated GPU came up, with the clock that times kernels (boot): idle
/// draw all along plus the extra draw of every kernel that ran.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetTotalEnergyConsumption(
    device: nvmlDevice_t,
    millijoules: *mut c_ulonglong,
) -> nvmlReturn_t {
    guard(|| {
        let (gpu, b) = board_of(device)?;
        let now = now_ns();
        let busy = load(store()?.path(), &gpu, 0, now)?;
        let seconds = now as f64 / 1e9;
        let extra = f64::from(b.max_power_mw - b.idle_power_mw) * busy;
        put(
            millijoules,
            ((f64::from(b.idle_power_mw) + extra) * seconds) as c_ulonglong,
        )
    })
}

/// The limits are the board's defaults: the emulator has no way to set them.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetPowerManagementLimit(
    device: nvmlDevice_t,
    limit: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| put(limit, board_of(device)?.1.max_power_mw))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetPowerManagementDefaultLimit(
    device: nvmlDevice_t,
    limit: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| put(limit, board_of(device)?.1.max_power_mw))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetEnforcedPowerLimit(
    device: nvmlDevice_t,
    limit: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| put(limit, board_of(device)?.1.max_power_mw))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetPowerManagementLimitConstraints(
    device: nvmlDevice_t,
    min: *mut c_uint,
    max: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let (_, b) = board_of(device)?;
        put(min, b.min_power_mw)?;
        put(max, b.max_power_mw)
    })
}

/// NOT_SUPPORTED: every board of the table is passively cooled (SXM modules and passive PCIe
/// cards are cooled by the chassis), and NVML reports no fan for them (`nvidia-smi`: N/A).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetFanSpeed(device: nvmlDevice_t, speed: *mut c_uint) -> nvmlReturn_t {
    guard(|| {
        whole_gpu(device)?;
        if speed.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        Err(NOT_SUPPORTED)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetFanSpeed_v2(
    device: nvmlDevice_t,
    _fan: c_uint,
    speed: *mut c_uint,
) -> nvmlReturn_t {
    nvmlDeviceGetFanSpeed(device, speed)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetClockInfo(
    device: nvmlDevice_t,
    clock: nvmlClockType_t,
    mhz: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let (gpu, b) = board_of(device)?;
        let graphics = graphics_mhz(b, recent_load(&gpu)?);
        put(mhz, clock_of(b, clock, graphics)?)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetMaxClockInfo(
    device: nvmlDevice_t,
    clock: nvmlClockType_t,
    mhz: *mut c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let (_, b) = board_of(device)?;
        put(mhz, clock_of(b, clock, b.max_graphics_mhz)?)
    })
}

/// The board's BAR1 aperture; none of it used: emulated processes map no device memory into it.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetBAR1MemoryInfo(
    device: nvmlDevice_t,
    bar1: *mut nvmlBAR1Memory_t,
) -> nvmlReturn_t {
    guard(|| {
        let total = board_of(device)?.1.bar1_mib << 20;
        put(
            bar1,
            nvmlBAR1Memory_t {
                bar1Total: total,
                bar1Free: total,
                bar1Used: 0,
            },
        )
    })
}

/// Empty: only compute contexts (the CUDA emulator's) run on emulated GPUs.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    guard(|| {
        crate::gpu_and_instance(device)?;
        put_list(infos, count, &[])
    })
}

/// The processes with an MPS client's context on the device; they are among its compute
/// processes too (`nvidia-smi` shows them as `M+C`), the MPS server only there (`C`). Volta or
/// newer only, as NVML documents: NOT_SUPPORTED before.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    guard(|| {
        // A MIG device's is its GPU's.
        let (i, _) = crate::gpu_and_instance(device)?;
        let model = read(|m| Ok(m.gpu(i)?.model.clone()))?;
        if board(&model).is_none_or(|b| b.compute_capability.0 < 7) {
            return Err(NOT_SUPPORTED);
        }
        let clients = crate::process_infos(device, |p| p.mps)?;
        put_list(infos, count, &clients)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_parse_in_nvml_forms_and_addresses_are_unique() {
        assert_eq!(parse_bus_id("00000000:1E:00.0"), Some((0, 0x1e, 0, 0)));
        assert_eq!(parse_bus_id("0001:10:00.0"), Some((1, 0x10, 0, 0)));
        assert_eq!(parse_bus_id("2c:00.1"), Some((0, 0x2c, 0, 1)));
        assert_eq!(parse_bus_id("1e:00"), None);
        assert_eq!(parse_bus_id("x:1e:00.0"), None);
        let all: std::collections::HashSet<_> = (0..64).map(pci_address).collect();
        assert_eq!(all.len(), 64);
        assert!(all.iter().all(|&(_, bus)| bus < 0x100));
    }

    #[test]
    fn serials_are_13_digits_and_differ_by_uuid() {
        let a = serial("GPU-aaaa");
        assert_eq!(a.len(), 13);
        assert!(a.bytes().all(|b| b.is_ascii_digit()));
        assert_eq!(a, serial("GPU-aaaa"));
        assert_ne!(a, serial("GPU-aaab"));
    }

    #[test]
    fn load_scales_between_idle_and_full() {
        let h200 = board("NVIDIA H200").unwrap();
        assert_eq!(between(h200.idle_power_mw, h200.max_power_mw, 0.0), 75_000);
        assert_eq!(between(h200.idle_power_mw, h200.max_power_mw, 1.0), 700_000);
        assert_eq!(graphics_mhz(h200, 0.5), 1163);
        assert_eq!(clock_of(h200, 3, h200.max_graphics_mhz), Ok(1755));
        assert_eq!(clock_of(h200, 9, 0), Err(INVALID_ARGUMENT));
    }
}
