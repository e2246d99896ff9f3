//! How the machine's GPUs reach each other: NVLink (through the baseboard's NVSwitches, on SXM
//! boards) and PCIe.
//!
//! The model, after NVIDIA's HGX/DGX baseboards and two-socket PCIe servers: GPUs `2k` and
//! `2k + 1` share a PCIe switch (`nvidia-smi topo -m`: PXB, NVML's `MULTIPLE`); the first half of
//! the GPUs hangs off one CPU socket and the second half off the other (`NODE` within a half,
//! `SYSTEM` across). Every GPU of an SXM board ([`crate::board::Board::nvlinks`] links) reaches
//! every other over NVLink; PCIe cards have no NVLink (bridges between pairs are not modelled),
//! so an 8-GPU H100 box is an NVLink board and a two-card A100 PCIe box is PCIe only.

use std::ffi::c_uint;

use gpuslice_emulator::Gpu;
use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEnableState_enum_NVML_FEATURE_ENABLED, nvmlEnableState_t,
    nvmlGpuLevel_enum_NVML_TOPOLOGY_INTERNAL as INTERNAL,
    nvmlGpuLevel_enum_NVML_TOPOLOGY_MULTIPLE as MULTIPLE,
    nvmlGpuLevel_enum_NVML_TOPOLOGY_NODE as NODE, nvmlGpuLevel_enum_NVML_TOPOLOGY_SYSTEM as SYSTEM,
    nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_ATOMICS as P2P_ATOMICS,
    nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_NVLINK as P2P_NVLINK,
    nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_PROP as P2P_PROP,
    nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_READ as P2P_READ,
    nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_WRITE as P2P_WRITE, nvmlGpuP2PCapsIndex_t,
    nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED as P2P_CHIPSET_NOT_SUPPORTED,
    nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_NOT_SUPPORTED as P2P_NOT_SUPPORTED,
    nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_OK as P2P_OK, nvmlGpuP2PStatus_t, nvmlGpuTopologyLevel_t,
    nvmlReturn_t,
};

use crate::board::board;
use crate::{INVALID_ARGUMENT, NOT_SUPPORTED, guard, mig_device_parts, put, read};

/// NVML's `NVML_NVLINK_MAX_LINKS`: link indices run below it.
const MAX_LINKS: c_uint = 18;

/// The two whole GPUs a pair of handles names, and how many GPUs the machine has.
fn pair(a: nvmlDevice_t, b: nvmlDevice_t) -> Result<(Gpu, Gpu, u32), nvmlReturn_t> {
    // Topology belongs to physical GPUs, as on real hardware.
    if mig_device_parts(a).is_some() || mig_device_parts(b).is_some() {
        return Err(NOT_SUPPORTED);
    }
    let (a, b) = (crate::device_index(a)?, crate::device_index(b)?);
    read(|m| Ok((m.gpu(a)?.clone(), m.gpu(b)?.clone(), m.gpus.len() as u32)))
}

/// The NVLink links of a GPU's board (0: none).
fn nvlinks(gpu: &Gpu) -> u32 {
    board(&gpu.model).map_or(0, |b| b.nvlinks)
}

/// The closest common ancestor of GPUs `a` and `b` on a machine of `count` GPUs.
fn level(a: u32, b: u32, count: u32) -> nvmlGpuTopologyLevel_t {
    let half = count.div_ceil(2).max(1);
    if a == b {
        INTERNAL
    } else if a / 2 == b / 2 {
        MULTIPLE
    } else if a / half == b / half {
        NODE
    } else {
        SYSTEM
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    path_info: *mut nvmlGpuTopologyLevel_t,
) -> nvmlReturn_t {
    guard(|| {
        let (a, b, count) = pair(device1, device2)?;
        put(path_info, level(a.index, b.index, count))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetP2PStatus(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    p2p_index: nvmlGpuP2PCapsIndex_t,
    status: *mut nvmlGpuP2PStatus_t,
) -> nvmlReturn_t {
    guard(|| {
        let (a, b, count) = pair(device1, device2)?;
        let nvlink = a.index != b.index && nvlinks(&a) > 0 && nvlinks(&b) > 0;
        // Over PCIe, peers under one CPU socket reach each other; across sockets the chipset
        // does not carry peer traffic. Atomics need NVLink.
        let pcie = a.index != b.index && level(a.index, b.index, count) <= NODE;
        let ok = match p2p_index {
            P2P_NVLINK => nvlink,
            P2P_READ | P2P_WRITE | P2P_PROP => nvlink || pcie,
            P2P_ATOMICS => nvlink,
            _ => return Err(INVALID_ARGUMENT),
        };
        let answer = match (ok, p2p_index) {
            (true, _) => P2P_OK,
            (false, P2P_NVLINK | P2P_ATOMICS) => P2P_NOT_SUPPORTED,
            (false, _) => P2P_CHIPSET_NOT_SUPPORTED,
        };
        put(status, answer)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    is_active: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    guard(|| {
        let (gpu, _, _) = pair(device, device)?;
        let links = nvlinks(&gpu);
        if links == 0 {
            return Err(NOT_SUPPORTED);
        }
        if link >= MAX_LINKS.min(links) {
            return Err(INVALID_ARGUMENT);
        }
        put(is_active, nvmlEnableState_enum_NVML_FEATURE_ENABLED)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_eight_gpu_board_pairs_gpus_on_switches_and_splits_them_by_socket() {
        assert_eq!(level(3, 3, 8), INTERNAL);
        assert_eq!(level(2, 3, 8), MULTIPLE);
        assert_eq!(level(0, 3, 8), NODE);
        assert_eq!(level(3, 4, 8), SYSTEM);
        // Two cards: one switch.
        assert_eq!(level(0, 1, 2), MULTIPLE);
        assert_eq!(level(0, 2, 4), SYSTEM);
    }
}
