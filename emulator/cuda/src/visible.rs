//! The devices this process sees, from the emulated machine and `CUDA_VISIBLE_DEVICES`.

use gpuslice_emulator::device_key;

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
