//! The devices this process sees, and the exports that initialise the driver and describe them.

use std::ffi::{c_char, c_int, c_uint};

use gpuslice_emulator::device_key;

use crate::driver::{guard, init, put, with};
use crate::{CUDA_ERROR_INVALID_VALUE, CUdevice, CUresult};

/// The driver version reported (12.8).
pub(crate) const DRIVER_VERSION: c_int = 12080;

pub(crate) struct Device {
    pub(crate) key: u32,
    pub(crate) name: String,
    pub(crate) uuid: [u8; 16],
    pub(crate) total: u64,
}

fn uuid_bytes(text: &str) -> [u8; 16] {
    let hex: String = text
        .trim_start_matches("GPU-")
        .trim_start_matches("MIG-")
        .chars()
        .filter(char::is_ascii_hexdigit)
        .collect();
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = hex
            .get(i * 2..i * 2 + 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .unwrap_or(0);
    }
    out
}

/// The devices this process sees: `CUDA_VISIBLE_DEVICES` entries (indices, `GPU-`/`MIG-` UUIDs)
/// in order, or every GPU (each MIG instance of a GPU in MIG mode) when unset.
pub(crate) fn discover(machine: &gpuslice_emulator::Machine) -> Vec<Device> {
    let whole = |g: &gpuslice_emulator::Gpu| Device {
        key: device_key(g.index, None),
        name: g.model.clone(),
        uuid: uuid_bytes(&g.uuid),
        total: g.memory_total,
    };
    let instance = |g: &gpuslice_emulator::Gpu, i: &gpuslice_emulator::GpuInstance| {
        let model = gpuslice_planning::catalog::model(&g.model).ok();
        let profile = model
            .and_then(|m| m.mig.as_ref())
            .and_then(|mig| mig.profile_by_id(i.profile_id));
        Device {
            key: device_key(g.index, Some(i.id)),
            name: format!(
                "{} MIG {}",
                g.model,
                profile.map_or("?", |p| p.name.as_str())
            ),
            uuid: uuid_bytes(&i.uuid),
            total: profile.map_or(0, |p| p.memory_bytes()),
        }
    };
    let all = || -> Vec<Device> {
        machine
            .gpus
            .iter()
            .flat_map(|g| {
                if g.mig_enabled {
                    g.instances.iter().map(|i| instance(g, i)).collect()
                } else {
                    vec![whole(g)]
                }
            })
            .collect()
    };
    let Ok(visible) = std::env::var("CUDA_VISIBLE_DEVICES") else {
        return all();
    };
    let mut out = Vec::new();
    for entry in visible.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        // As the driver does, stop at the first entry that names nothing.
        let found = if let Ok(n) = entry.parse::<usize>() {
            machine.gpus.get(n).filter(|g| !g.mig_enabled).map(whole)
        } else if entry.starts_with("MIG-") {
            machine.gpus.iter().find_map(|g| {
                g.instances
                    .iter()
                    .find(|i| i.uuid == entry)
                    .map(|i| instance(g, i))
            })
        } else {
            machine
                .gpus
                .iter()
                .find(|g| g.uuid == entry && !g.mig_enabled)
                .map(whole)
        };
        match found {
            Some(d) => out.push(d),
            None => break,
        }
    }
    out
}

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(_flags: c_uint) -> CUresult {
    guard(init)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    guard(|| put(version, DRIVER_VERSION))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    guard(|| put(count, with(|d| Ok(d.devices.len() as c_int))?))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    guard(|| {
        with(|d| d.device(ordinal).map(|_| ()))?;
        put(device, ordinal)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, device: CUdevice) -> CUresult {
    guard(|| {
        let text = with(|d| Ok(d.device(device)?.name.clone()))?;
        let len = usize::try_from(len).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        if name.is_null() || len == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let bytes = &text.as_bytes()[..text.len().min(len - 1)];
        // SAFETY: the caller's buffer holds `len` bytes; we write at most len - 1 plus a NUL.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), name.cast::<u8>(), bytes.len());
            name.add(bytes.len()).write(0);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: CUdevice) -> CUresult {
    guard(|| put(bytes, with(|d| Ok(d.device(device)?.total as usize))?))
}

fn device_uuid(uuid: *mut [u8; 16], device: CUdevice) -> CUresult {
    guard(|| put(uuid, with(|d| Ok(d.device(device)?.uuid))?))
}

// Exports never call each other: a preloaded shim would interpose on such calls and count twice.

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], device: CUdevice) -> CUresult {
    device_uuid(uuid, device)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], device: CUdevice) -> CUresult {
    device_uuid(uuid, device)
}

/// A few attributes programs ask for; others read 0.
#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attribute: c_int,
    device: CUdevice,
) -> CUresult {
    guard(|| {
        with(|d| d.device(device).map(|_| ()))?;
        let v = match attribute {
            1 => 1024, // MAX_THREADS_PER_BLOCK
            16 => 132, // MULTIPROCESSOR_COUNT
            75 => 9,   // COMPUTE_CAPABILITY_MAJOR
            76 => 0,   // COMPUTE_CAPABILITY_MINOR
            _ => 0,
        };
        put(value, v)
    })
}
