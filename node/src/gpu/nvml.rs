//! GPUs through NVML: discovery with nvml-wrapper, XID events, telemetry and per-process reads;
//! MIG instance changes in [`mig`].

mod mig;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::path::Path;

use gpuslice_api::k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use gpuslice_api::quantity::format_bytes;
use gpuslice_api::{GpuInventory, GpuProcess, MigInstance, MigState, NodeInventory};
use gpuslice_planning::catalog::{self, GpuModel};
use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE,
    nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT, nvmlReturn_enum_NVML_ERROR_NOT_FOUND,
    nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED, nvmlReturn_enum_NVML_SUCCESS, nvmlReturn_t,
};

/// An NVML list query (`call(buffer, count)`, `count` the room in, the entries out) in one call
/// while the list fits a buffer of [`LIST_ROOM`] entries, which the watchdog's reads every second
/// almost always do, and once more with the size NVML asked for otherwise. (nvml-wrapper always
/// asks for the size first: twice the calls.) NOT_FOUND is an empty list.
fn list_in_one_call<T>(
    mut call: impl FnMut(*mut T, &mut std::ffi::c_uint) -> nvmlReturn_t,
) -> Result<Vec<T>, nvmlReturn_t> {
    let mut room = LIST_ROOM;
    for _ in 0..2 {
        let mut buffer: Vec<T> = Vec::with_capacity(room);
        let mut count = room as std::ffi::c_uint;
        let rc = call(buffer.as_mut_ptr(), &mut count);
        if rc == nvmlReturn_enum_NVML_SUCCESS {
            // SAFETY: NVML wrote `count` entries (at most the room it was given).
            unsafe { buffer.set_len((count as usize).min(room)) };
            return Ok(buffer);
        } else if rc == nvmlReturn_enum_NVML_ERROR_NOT_FOUND {
            return Ok(Vec::new());
        } else if rc == nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE {
            room = count as usize + 8;
        } else {
            return Err(rc);
        }
    }
    Err(nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE)
}

/// Entries a list query has room for on its first try.
const LIST_ROOM: usize = 64;

/// Why an NVML call failed, naming the call and the GPU.
#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    #[error("loading NVML{}: {source}", path.as_ref().map(|p| format!(" from {p}")).unwrap_or_default())]
    Load {
        path: Option<String>,
        source: nvml_wrapper::error::NvmlError,
    },
    #[error("GPU {gpu}: {call}: {source}")]
    Call {
        gpu: u32,
        call: &'static str,
        source: nvml_wrapper::error::NvmlError,
    },
    #[error("GPU {gpu}: the NVML library lacks {call}")]
    Missing { gpu: u32, call: &'static str },
    #[error("GPU {gpu}: {message}")]
    Model { gpu: u32, message: String },
}

/// What monitoring reads of one GPU; `None` where NVML gave no answer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuTelemetry {
    pub index: u32,
    /// Percent of the last sample period a kernel ran (not given in MIG mode).
    pub utilization_percent: Option<u32>,
    pub memory_used_bytes: Option<u64>,
    pub temperature_celsius: Option<u32>,
    pub power_milliwatts: Option<u32>,
    /// Memory (used, total) of each MIG device, by its UUID.
    pub mig_memory_bytes: BTreeMap<String, (u64, u64)>,
}

/// The GPUs of this machine, through NVML.
pub struct NvmlGpus {
    nvml: Nvml,
    /// Each GPU's NVLink peers, read once: the wiring of a board does not change while the
    /// driver is loaded.
    nvlink: std::sync::OnceLock<Vec<Vec<u32>>>,
}

/// Whether a profile-info call says the profile is not there: not supported on this GPU, or an
/// index past the ones this driver knows.
fn not_offered(rc: nvmlReturn_t) -> bool {
    rc == nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
        || rc == nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
}

/// A raw call's return code as nvml-wrapper's error, so raw and safe calls read alike.
fn check(gpu: u32, call: &'static str, code: nvmlReturn_t) -> Result<(), NvmlError> {
    nvml_wrapper::error::nvml_try(code).map_err(|source| NvmlError::Call { gpu, call, source })
}

impl NvmlGpus {
    /// Loads NVML: the system's `libnvidia-ml.so.1`, or the library at `path` (an emulator).
    pub fn open(path: Option<&Path>) -> Result<NvmlGpus, NvmlError> {
        let nvml = match path {
            Some(p) => Nvml::builder().lib_path(OsStr::new(p.as_os_str())).init(),
            None => Nvml::init(),
        }
        .map_err(|source| NvmlError::Load {
            path: path.map(|p| p.display().to_string()),
            source,
        })?;
        Ok(NvmlGpus {
            nvml,
            nvlink: std::sync::OnceLock::new(),
        })
    }

    fn device(&self, gpu: u32) -> Result<nvml_wrapper::Device<'_>, NvmlError> {
        self.nvml
            .device_by_index(gpu)
            .map_err(|source| NvmlError::Call {
                gpu,
                call: "nvmlDeviceGetHandleByIndex",
                source,
            })
    }

    fn handle(&self, gpu: u32) -> Result<nvmlDevice_t, NvmlError> {
        let device = self.device(gpu)?;
        // SAFETY: the handle is only used while `self.nvml` is alive, which outlives this call's users.
        Ok(unsafe { device.handle() })
    }

    /// Reads every GPU: model, UUID, memory, MIG mode, GPU instances with their placements, and
    /// the processes on the GPU and on each instance.
    pub fn inventory(&self, node: &str) -> Result<NodeInventory, NvmlError> {
        let count = self.nvml.device_count().map_err(|source| NvmlError::Call {
            gpu: 0,
            call: "nvmlDeviceGetCount",
            source,
        })?;
        let mut gpus = Vec::new();
        for index in 0..count {
            gpus.push(self.read_gpu(index)?);
        }
        let peers = self
            .nvlink
            .get_or_init(|| (0..count).map(|i| self.nvlink_peers(i, count)).collect());
        for gpu in &mut gpus {
            gpu.nvlink_peers = peers.get(gpu.index as usize).cloned().unwrap_or_default();
        }
        Ok(NodeInventory {
            name: node.to_string(),
            driver: self.driver(),
            gpus,
            ..NodeInventory::default()
        })
    }

    /// The driver and the CUDA version it supports; `None` when NVML does not say (the
    /// driver pre-check then fails closed).
    fn driver(&self) -> Option<gpuslice_api::DriverVersions> {
        let version = self.nvml.sys_driver_version();
        let cuda = self.nvml.sys_cuda_driver_version();
        match (version, cuda) {
            (Ok(version), Ok(cuda)) => Some(gpuslice_api::DriverVersions {
                version,
                cuda: gpuslice_planning::driver::cuda_version(cuda),
            }),
            (version, cuda) => {
                tracing::warn!(
                    "reading the driver version: {:?} / {:?}",
                    version.err(),
                    cuda.err()
                );
                None
            }
        }
    }

    fn read_gpu(&self, index: u32) -> Result<GpuInventory, NvmlError> {
        let call = |call: &'static str| {
            move |source| NvmlError::Call {
                gpu: index,
                call,
                source,
            }
        };
        let device = self.device(index)?;
        let model = device.name().map_err(call("nvmlDeviceGetName"))?;
        let uuid = device.uuid().map_err(call("nvmlDeviceGetUUID"))?;
        // The device node is /dev/nvidia<minor>; NVML's index is only the enumeration order.
        let minor = device
            .minor_number()
            .inspect_err(|e| tracing::warn!(gpu = index, "nvmlDeviceGetMinorNumber: {e}"))
            .ok();
        let memory = device
            .memory_info()
            .map_err(call("nvmlDeviceGetMemoryInfo"))?
            .total;
        let mut processes = device
            .running_compute_processes()
            .map_err(call("nvmlDeviceGetComputeRunningProcesses"))?;
        // MPS clients, should a driver list one only there (GPUs before Volta have no list).
        for client in device.mps_running_compute_processes().unwrap_or_default() {
            if !processes.iter().any(|p| p.pid == client.pid) {
                processes.push(client);
            }
        }
        let mig_enabled = match device.mig_mode() {
            Ok(mode) => Some(mode.current == 1),
            Err(nvml_wrapper::error::NvmlError::NotSupported) => None,
            Err(e) => return Err(call("nvmlDeviceGetMigMode")(e)),
        };
        let to_process = |p: &nvml_wrapper::struct_wrappers::device::ProcessInfo| GpuProcess {
            pid: p.pid,
            memory: match p.used_gpu_memory {
                UsedGpuMemory::Used(bytes) => Some(Quantity(format_bytes(bytes))),
                UsedGpuMemory::Unavailable => None,
            },
            name: None,
        };
        let mig = match mig_enabled {
            Some(enabled) => {
                let uuids = self.mig_device_uuids(&device);
                let mut instances = Vec::new();
                for (id, profile, placement) in self.gpu_instances(index)? {
                    instances.push(MigInstance {
                        profile: profile_name(catalog::model(&model).ok(), profile),
                        placement,
                        uuid: uuids.get(&id).cloned(),
                        processes: processes
                            .iter()
                            .filter(|p| p.gpu_instance_id == Some(id))
                            .map(to_process)
                            .collect(),
                        // The agent's slice tables say (read with them).
                        slices: Vec::new(),
                    });
                }
                instances.sort_by_key(|i| i.placement);
                Some(MigState { enabled, instances })
            }
            None => None,
        };
        let compute_capability = device
            .cuda_compute_capability()
            .ok()
            .map(|c| format!("{}.{}", c.major, c.minor));
        Ok(GpuInventory {
            index,
            minor,
            uuid: Some(uuid),
            model,
            memory: Some(Quantity(format_bytes(memory))),
            compute_capability,
            mig,
            slices: Vec::new(),
            processes: processes
                .iter()
                .filter(|p| p.gpu_instance_id.is_none())
                .map(to_process)
                .collect(),
            // Filled in once every GPU is read.
            nvlink_peers: Vec::new(),
        })
    }

    /// The GPUs (of `count`) that GPU `index` reaches over NVLink: NVML's peer-to-peer status
    /// for the NVLink capability. A driver that cannot say (no NVLink, an old driver) leaves it
    /// empty: multi-GPU placement then sees no NVLink, which is the safe answer.
    fn nvlink_peers(&self, index: u32, count: u32) -> Vec<u32> {
        let Ok(device) = self.device(index) else {
            return Vec::new();
        };
        (0..count)
            .filter(|&other| other != index)
            .filter(|&other| {
                self.device(other).is_ok_and(|peer| {
                    device
                        .p2p_status(
                            &peer,
                            nvml_wrapper::enum_wrappers::device::P2pCapabilitiesIndex::NvLink,
                        )
                        .is_ok_and(|s| s == nvml_wrapper::enum_wrappers::device::P2pStatus::Ok)
                })
            })
            .collect()
    }

    /// The MIG device UUID of each GPU instance, by instance id. Best effort: a driver that cannot
    /// say leaves the UUIDs out, which only costs the report its detail.
    fn mig_device_uuids(&self, device: &nvml_wrapper::Device<'_>) -> BTreeMap<u32, String> {
        self.mig_devices(device)
            .into_iter()
            .filter_map(|(id, mig)| Some((id, mig.uuid().ok()?)))
            .collect()
    }

    /// Each MIG device of a GPU with its GPU instance id (none when the driver cannot say).
    fn mig_devices<'a>(
        &'a self,
        device: &nvml_wrapper::Device<'a>,
    ) -> Vec<(u32, nvml_wrapper::Device<'a>)> {
        let Ok(gpu_instance_id) = self.nvml.lib().nvmlDeviceGetGpuInstanceId.as_ref() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for slot in 0..device.mig_device_count().unwrap_or(0) {
            let Ok(mig) = device.mig_device_by_index(slot) else {
                continue;
            };
            let mut id = 0;
            // SAFETY: `mig` is a live MIG device handle from NVML; `id` is a valid out-pointer.
            if unsafe { gpu_instance_id(mig.handle(), &mut id) } == 0 {
                out.push((id, mig));
            }
        }
        out
    }

    /// Watches every GPU that reports XID critical errors, on a thread of its own, until the
    /// process ends: `seen` gets each, in the order NVML gives them, with the GPU instance it
    /// names (MIG) resolved to its placement and the GPU's PCI address (to find the kernel's
    /// record of it, which names the process). Fails when no GPU can be watched; a wait that
    /// fails is retried.
    pub fn watch_xids(
        self,
        seen: impl Fn(crate::protections::faults::XidSeen) + Send + 'static,
    ) -> Result<std::thread::JoinHandle<()>, NvmlError> {
        use nvml_wrapper::bitmasks::event::EventTypes;
        let call = |call: &'static str| {
            move |source| NvmlError::Call {
                gpu: 0,
                call,
                source,
            }
        };
        // Registered here, so that an error is the caller's to report.
        let count = self
            .nvml
            .device_count()
            .map_err(call("nvmlDeviceGetCount"))?;
        let mut watched = Vec::new();
        for index in 0..count {
            let device = self.device(index)?;
            if device
                .supported_event_types()
                .is_ok_and(|t| t.contains(EventTypes::CRITICAL_XID_ERROR))
            {
                let bus = device
                    .pci_info()
                    .ok()
                    .and_then(|p| crate::protections::faults::PciAddress::parse(&p.bus_id));
                // The handle as a number: compared with events' devices, never dereferenced.
                watched.push((index, self.handle(index)? as usize, bus));
            }
        }
        if watched.is_empty() {
            return Err(NvmlError::Model {
                gpu: 0,
                message: "no GPU reports XID errors through NVML events".into(),
            });
        }
        let wait =
            *self
                .nvml
                .lib()
                .nvmlEventSetWait_v2
                .as_ref()
                .map_err(|_| NvmlError::Missing {
                    gpu: 0,
                    call: "nvmlEventSetWait_v2",
                })?;
        Ok(std::thread::spawn(move || {
            let register = || -> Result<nvml_wrapper::EventSet<'_>, NvmlError> {
                let mut set = self
                    .nvml
                    .create_event_set()
                    .map_err(call("nvmlEventSetCreate"))?;
                for &(index, _, _) in &watched {
                    set = self
                        .device(index)?
                        .register_events(EventTypes::CRITICAL_XID_ERROR, set)
                        .map_err(|e| NvmlError::Call {
                            gpu: index,
                            call: "nvmlDeviceRegisterEvents",
                            source: e.error,
                        })?;
                }
                Ok(set)
            };
            loop {
                let set = match register() {
                    Ok(set) => set,
                    Err(e) => {
                        tracing::warn!("watching XID errors: {e}");
                        std::thread::sleep(std::time::Duration::from_secs(10));
                        continue;
                    }
                };
                loop {
                    // The wrapper's event drops the GPU instance a MIG error names; read it raw.
                    // SAFETY: an all-zero nvmlEventData_t is valid (a null handle and integers).
                    let mut data: nvml_wrapper_sys::bindings::nvmlEventData_t =
                        unsafe { std::mem::zeroed() };
                    // SAFETY: the set is live for this loop; `data` is a valid out-pointer.
                    let rc = unsafe { wait(set.handle(), &mut data, 1000) };
                    if rc == nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_ERROR_TIMEOUT {
                        continue;
                    }
                    if let Err(e) = check(0, "nvmlEventSetWait_v2", rc) {
                        tracing::warn!("waiting for XID errors: {e}");
                        break;
                    }
                    let Some(&(gpu, _, bus)) = watched.iter().find(|w| w.1 == data.device as usize)
                    else {
                        continue;
                    };
                    // NVML says "no instance" with all bits set.
                    let instance = (data.gpuInstanceId != u32::MAX)
                        .then(|| {
                            self.gpu_instances(gpu)
                                .ok()?
                                .into_iter()
                                .find(|(id, _, _)| *id == data.gpuInstanceId)
                                .map(|(_, _, placement)| placement)
                        })
                        .flatten();
                    tracing::warn!(gpu, xid = data.eventData, ?instance, "XID error");
                    seen(crate::protections::faults::XidSeen {
                        gpu,
                        code: data.eventData,
                        instance,
                        bus,
                    });
                }
            }
        }))
    }

    /// What monitoring reads of every GPU. Never fails: a figure NVML does not give (utilisation
    /// on a GPU in MIG mode, power on some boards, a GPU that stopped answering) is left out.
    pub fn telemetry(&self) -> Vec<GpuTelemetry> {
        let count = self.nvml.device_count().unwrap_or(0);
        (0..count)
            .filter_map(|index| {
                let device = self.nvml.device_by_index(index).ok()?;
                let memory = device.memory_info().ok();
                Some(GpuTelemetry {
                    index,
                    utilization_percent: device.utilization_rates().ok().map(|u| u.gpu),
                    memory_used_bytes: memory.map(|m| m.used),
                    temperature_celsius: device
                        .temperature(nvml_wrapper::enum_wrappers::device::TemperatureSensor::Gpu)
                        .ok(),
                    power_milliwatts: device.power_usage().ok(),
                    mig_memory_bytes: self
                        .mig_devices(&device)
                        .into_iter()
                        .filter_map(|(_, mig)| {
                            let memory = mig.memory_info().ok()?;
                            Some((mig.uuid().ok()?, (memory.used, memory.total)))
                        })
                        .collect(),
                })
            })
            .collect()
    }

    /// Each process's SM use (%) on `gpus` where the GPU reports it
    /// (`nvmlDeviceGetProcessUtilization`), the mean of its samples since `since` (per GPU, the
    /// CPU timestamp in µs of the newest sample read before; updated). GPUs that do not report
    /// it (MIG mode, older boards) are left out, as is a read that fails.
    pub fn process_utilization(
        &self,
        gpus: &BTreeSet<u32>,
        since: &mut BTreeMap<u32, u64>,
    ) -> Vec<ProcessUse> {
        let Ok(call) = self.nvml.lib().nvmlDeviceGetProcessUtilization.as_ref() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for &gpu in gpus {
            let Ok(device) = self.handle(gpu) else {
                continue;
            };
            let last = since.get(&gpu).copied().unwrap_or(0);
            // SAFETY: `device` is live; `buffer` has room for `count` samples, as NVML is told.
            let samples =
                list_in_one_call(|buffer, count| unsafe { call(device, buffer, count, last) });
            let Ok(samples) = samples else {
                continue;
            };
            let mut per_pid: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
            for s in &samples {
                let (sum, n) = per_pid.entry(s.pid).or_default();
                *sum += u64::from(s.smUtil);
                *n += 1;
            }
            if let Some(newest) = samples.iter().map(|s| s.timeStamp).max() {
                since.insert(gpu, newest);
            }
            out.extend(per_pid.into_iter().map(|(pid, (sum, n))| ProcessUse {
                gpu,
                pid,
                sm_percent: u32::try_from(sum / n.max(1)).unwrap_or(u32::MAX),
            }));
        }
        out
    }

    /// The device memory of every compute process on every GPU, MPS clients included, as the
    /// driver reports it (a GPU that does not answer is left out; a process whose figure is not
    /// available holds 0).
    pub fn compute_processes(&self) -> Vec<ProcessMemory> {
        let lib = self.nvml.lib();
        let (Ok(compute), mps) = (
            lib.nvmlDeviceGetComputeRunningProcesses_v3.as_ref(),
            lib.nvmlDeviceGetMPSComputeRunningProcesses_v3.as_ref().ok(),
        ) else {
            return Vec::new();
        };
        let count = self.nvml.device_count().unwrap_or(0);
        let mut out: Vec<ProcessMemory> = Vec::new();
        for gpu in 0..count {
            let Ok(device) = self.handle(gpu) else {
                continue;
            };
            // SAFETY: `device` is live; `buffer` has room for `count` entries, as NVML is told.
            let Ok(mut processes) =
                list_in_one_call(|buffer, count| unsafe { compute(device, count, buffer) })
            else {
                continue;
            };
            // MPS clients, should a driver list one only there (no list before Volta).
            if let Some(mps) = mps
                // SAFETY: as above.
                && let Ok(clients) =
                    list_in_one_call(|buffer, count| unsafe { mps(device, count, buffer) })
            {
                for client in clients {
                    if !processes.iter().any(|p| p.pid == client.pid) {
                        processes.push(client);
                    }
                }
            }
            out.extend(processes.into_iter().map(|p| ProcessMemory {
                gpu,
                pid: p.pid,
                // NVML_VALUE_NOT_AVAILABLE (all ones) where the driver may not say.
                bytes: if p.usedGpuMemory == u64::MAX {
                    0
                } else {
                    p.usedGpuMemory
                },
            }));
        }
        out
    }
}

/// A profile's name from the catalog by its NVML profile id, or `profile-<id>` for models it
/// does not know.
fn profile_name(model: Option<&GpuModel>, id: u32) -> String {
    model
        .and_then(|m| m.mig.as_ref())
        .and_then(|g| g.profile_by_id(id))
        .map_or_else(|| format!("profile-{id}"), |p| p.name.clone())
}

/// One process's device memory on a GPU, as the driver reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessMemory {
    pub gpu: u32,
    pub pid: u32,
    pub bytes: u64,
}

/// A process's share of a GPU's SM time, as the driver measured it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessUse {
    pub gpu: u32,
    pub pid: u32,
    pub sm_percent: u32,
}
