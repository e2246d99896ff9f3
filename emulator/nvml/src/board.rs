//! What a monitoring tool reads about a board that the planning catalog does not hold: PCI
//! device id, architecture, power range, clocks, BAR1 size. One row per catalog model (and the
//! A100 PCIe 40GB, which the catalog folds into the SXM4 40GB entry, but which is another board).
//!
//! Sources: NVIDIA's product datasheets (A100, A30, H100, H200: maximum power and boost clocks),
//! the PCI ID repository (pci-ids.ucw.cz, vendor 10de: device ids), `nvidia-smi -q` output as
//! published for these boards (memory clocks, BAR1 size, power-limit range, idle draw and clocks).
//! Idle draw and idle clocks vary from board to board; the figures are typical, not exact.

use gpuslice_planning::catalog;
use nvml_wrapper_sys::bindings::{
    NVML_DEVICE_ARCH_AMPERE, NVML_DEVICE_ARCH_HOPPER, NVML_DEVICE_ARCH_PASCAL,
};

pub struct Board {
    /// The NVML name (or catalog name) the row is for.
    name: &'static str,
    /// PCI device id; the vendor is NVIDIA's 0x10de.
    pub pci_device: u32,
    /// `NVML_DEVICE_ARCH_*`.
    pub architecture: u32,
    pub compute_capability: (i32, i32),
    /// Default (and maximum) power limit: the board's TDP, milliwatts.
    pub max_power_mw: u32,
    /// Lowest power limit an administrator can set, milliwatts.
    pub min_power_mw: u32,
    /// Draw with no kernel running, milliwatts.
    pub idle_power_mw: u32,
    /// Graphics (= SM) clock at idle and at full boost, MHz.
    pub idle_graphics_mhz: u32,
    pub max_graphics_mhz: u32,
    /// HBM clock, MHz: data-centre boards do not lower it at idle.
    pub memory_mhz: u32,
    pub max_video_mhz: u32,
    pub bar1_mib: u64,
    /// NVLink links to the board's NVSwitches (SXM boards of an HGX baseboard: every GPU
    /// reaches every other); 0 on PCIe cards (NVLink bridges between pairs are not modelled).
    pub nvlinks: u32,
}

const PASCAL: (u32, (i32, i32)) = (NVML_DEVICE_ARCH_PASCAL, (6, 0));
const AMPERE: (u32, (i32, i32)) = (NVML_DEVICE_ARCH_AMPERE, (8, 0));
const HOPPER: (u32, (i32, i32)) = (NVML_DEVICE_ARCH_HOPPER, (9, 0));

#[allow(clippy::too_many_arguments)] // one table row
const fn row(
    name: &'static str,
    pci_device: u32,
    (architecture, compute_capability): (u32, (i32, i32)),
    (min_w, idle_w, max_w): (u32, u32, u32),
    (idle_graphics_mhz, max_graphics_mhz): (u32, u32),
    memory_mhz: u32,
    max_video_mhz: u32,
    bar1_mib: u64,
    nvlinks: u32,
) -> Board {
    Board {
        name,
        pci_device,
        architecture,
        compute_capability,
        max_power_mw: max_w * 1000,
        min_power_mw: min_w * 1000,
        idle_power_mw: idle_w * 1000,
        idle_graphics_mhz,
        max_graphics_mhz,
        memory_mhz,
        max_video_mhz,
        bar1_mib,
        nvlinks,
    }
}

// name, PCI device, architecture, (min limit, idle, TDP) W, (idle, max) graphics MHz,
// memory MHz, max video MHz, BAR1 MiB, NVLink links (A100 SXM4: 12 third-generation links;
// H100/H200 SXM5: 18 fourth-generation links, per NVIDIA's datasheets). The P100 (Pascal, no
// MIG, not in the planning catalog) is the pre-Volta GPU on which MPS cannot share SMs.
#[rustfmt::skip]
const BOARDS: &[Board] = &[
    row("Tesla P100-PCIE-16GB",  0x15f8, PASCAL, (125, 30, 250), (544, 1328), 715, 1328, 16384, 0),
    row("NVIDIA A100-SXM4-40GB", 0x20b0, AMPERE, (100, 50, 400), (210, 1410), 1215, 1290, 65536, 12),
    row("NVIDIA A100-PCIE-40GB", 0x20f1, AMPERE, (150, 35, 250), (210, 1410), 1215, 1290, 65536, 0),
    row("NVIDIA A100-SXM4-80GB", 0x20b2, AMPERE, (100, 60, 400), (210, 1410), 1593, 1290, 131072, 12),
    row("NVIDIA A100 80GB PCIe", 0x20b5, AMPERE, (150, 40, 300), (210, 1410), 1512, 1290, 131072, 0),
    row("NVIDIA A30",            0x20b7, AMPERE, (100, 30, 165), (210, 1440), 1215, 1305, 32768, 0),
    row("NVIDIA H100 80GB HBM3", 0x2330, HOPPER, (200, 70, 700), (345, 1980), 2619, 1755, 131072, 18),
    row("NVIDIA H100 PCIe",      0x2331, HOPPER, (200, 50, 350), (345, 1755), 1593, 1755, 131072, 0),
    row("NVIDIA H100 NVL",       0x2321, HOPPER, (200, 60, 400), (345, 1785), 2619, 1755, 131072, 0),
    row("NVIDIA H200",           0x2335, HOPPER, (200, 75, 700), (345, 1980), 3201, 1755, 262144, 18),
];

/// The board of a GPU NVML names `model`: its own row, else its catalog entry's.
pub fn board(model: &str) -> Option<&'static Board> {
    let find = |name: &str| BOARDS.iter().find(|b| b.name.eq_ignore_ascii_case(name));
    find(model.trim()).or_else(|| find(catalog::model(model).ok()?.name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_catalog_model_has_a_board_and_aliases_find_theirs() {
        for name in [
            "NVIDIA A100-SXM4-40GB",
            "NVIDIA A100-SXM4-80GB",
            "NVIDIA A100 80GB PCIe",
            "NVIDIA A30",
            "NVIDIA H100 80GB HBM3",
            "NVIDIA H100 PCIe",
            "NVIDIA H100 NVL",
            "NVIDIA H200",
        ] {
            assert!(catalog::model(name).is_ok(), "{name} is in the catalog");
            assert_eq!(board(name).map(|b| b.name), Some(name));
        }
        assert_eq!(board("H100").unwrap().max_power_mw, 700_000);
        assert_eq!(
            board("NVIDIA A100-PCIE-40GB").unwrap().max_power_mw,
            250_000
        );
        assert!(board("Tesla T4").is_none());
        for b in BOARDS {
            assert!(b.min_power_mw < b.max_power_mw && b.idle_power_mw < b.max_power_mw);
            assert!(b.idle_graphics_mhz < b.max_graphics_mhz);
        }
    }
}
