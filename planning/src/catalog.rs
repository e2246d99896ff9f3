//! The GPU models gpuslice knows, with their MIG geometry, compiled into the binary.
//!
//! Sources: NVIDIA's MIG user guide (supported profiles and placements per product,
//! docs.nvidia.com/datacenter/tesla/mig-user-guide), `nvidia-smi mig -lgip` / `-lgipp` output as
//! published in that guide and NVIDIA's forums, and the NVML header (`nvml.h`:
//! `NVML_GPU_INSTANCE_PROFILE_*` indices). Memory sizes are what NVML reports for each profile
//! (GiB rounded to 1/4 in the guide, here in MiB). The H200 figures are those of the product brief;
//! the A30, H100 PCIe and H100 NVL per-profile memory and SM counts are approximate and are
//! replaced by what NVML reports when the agent runs on the GPU.

use std::sync::LazyLock;

/// A GPU model and, when it has MIG, its partition geometry.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuModel {
    /// The name NVML reports (`nvmlDeviceGetName`), used as the model key in YAML.
    pub name: &'static str,
    /// Other names accepted for the model (other NVML spellings and short aliases).
    pub aliases: &'static [&'static str],
    /// Usable memory NVML reports for the whole GPU, in MiB.
    pub memory_mib: u64,
    /// Streaming multiprocessors of the whole GPU.
    pub sms: u32,
    /// MIG geometry, `None` for models without MIG.
    pub mig: Option<MigGeometry>,
}

/// How a MIG-capable GPU divides.
#[derive(Debug, Clone, PartialEq)]
pub struct MigGeometry {
    /// Memory slices (8 on A100/H100/H200, 4 on A30).
    pub memory_slices: u32,
    /// Compute slices (7 on A100/H100/H200, 4 on A30).
    pub compute_slices: u32,
    /// GPU-instance profiles.
    pub profiles: Vec<MigProfile>,
}

/// One GPU-instance profile.
#[derive(Debug, Clone, PartialEq)]
pub struct MigProfile {
    /// Name as `nvidia-smi` prints it, for example `3g.71gb`.
    pub name: String,
    /// NVML profile index (`NVML_GPU_INSTANCE_PROFILE_*`): only what
    /// `nvmlDeviceGetGpuInstanceProfileInfo` takes, which answers with the `id`.
    pub nvml_index: u32,
    /// Profile id as `nvidia-smi mig -lgip` prints it: what every other MIG call takes as
    /// `profileId` and what `nvmlGpuInstanceGetInfo` reports.
    pub id: u32,
    /// Compute slices the instance takes.
    pub compute_slices: u32,
    /// Memory slices the instance takes (the size of each placement).
    pub memory_slices: u32,
    /// Memory of the instance in MiB.
    pub memory_mib: u64,
    /// Streaming multiprocessors of the instance.
    pub sms: u32,
    /// First memory slices at which the instance may be placed.
    pub placements: Vec<u32>,
    /// Most instances of this profile on one GPU.
    pub max_count: u32,
    /// Whether the profile carries the media engines (`+me`); at most one such instance fits.
    pub media: bool,
}

/// A model the catalog does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("GPU model {0:?} is not in the catalog (known: {known})", known = known_names().join(", "))]
pub struct UnknownModel(pub String);

/// All models in the catalog.
pub fn models() -> &'static [GpuModel] {
    &CATALOG
}

/// Looks a model up by its NVML name or an alias, ignoring case.
pub fn model(name: &str) -> Result<&'static GpuModel, UnknownModel> {
    let wanted = name.trim();
    CATALOG
        .iter()
        .find(|m| {
            m.name.eq_ignore_ascii_case(wanted)
                || m.aliases.iter().any(|a| a.eq_ignore_ascii_case(wanted))
        })
        .ok_or_else(|| UnknownModel(name.to_string()))
}

fn known_names() -> Vec<&'static str> {
    CATALOG.iter().map(|m| m.name).collect()
}

impl GpuModel {
    /// Usable memory of the whole GPU in bytes.
    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib << 20
    }

    /// A profile of this model by name, ignoring case.
    pub fn profile(&self, name: &str) -> Option<&MigProfile> {
        self.mig
            .as_ref()?
            .profiles
            .iter()
            .find(|p| p.name.eq_ignore_ascii_case(name))
    }
}

impl MigGeometry {
    /// The profile NVML knows by this id: what `nvmlDeviceGetGpuInstanceProfileInfo` returns as
    /// `id`, what every other MIG call takes as `profileId`, and what `nvmlGpuInstanceGetInfo`
    /// reports. Not the `NVML_GPU_INSTANCE_PROFILE_*` index (on an A100, 1g is id 19, index 0).
    pub fn profile_by_id(&self, id: u32) -> Option<&MigProfile> {
        self.profiles.iter().find(|p| p.id == id)
    }

    /// The profile behind an `NVML_GPU_INSTANCE_PROFILE_*` index: only what
    /// `nvmlDeviceGetGpuInstanceProfileInfo` takes.
    pub fn profile_by_index(&self, index: u32) -> Option<&MigProfile> {
        self.profiles.iter().find(|p| p.nvml_index == index)
    }
}

/// `NVML_COMPUTE_INSTANCE_PROFILE_*`: the compute-instance profile index of `slices` compute
/// slices (1, 2, 3, 4, 7, 8, 6 slices are indices 0 to 6), `None` for other counts.
pub fn compute_profile_index(slices: u32) -> Option<u32> {
    COMPUTE_PROFILE_SLICES
        .iter()
        .position(|&s| s == slices)
        .map(|i| i as u32)
}

/// The compute slices of an `NVML_COMPUTE_INSTANCE_PROFILE_*` index (`1_SLICE_REV1`, index 7,
/// is a one-slice profile too).
pub fn compute_profile_slices(index: u32) -> Option<u32> {
    match index {
        7 => Some(1),
        i => COMPUTE_PROFILE_SLICES.get(i as usize).copied(),
    }
}

const COMPUTE_PROFILE_SLICES: [u32; 7] = [1, 2, 3, 4, 7, 8, 6];

impl MigProfile {
    /// Memory of the instance in bytes.
    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib << 20
    }
}

const MIB_PER_GIB: f64 = 1024.0;

fn gib(g: f64) -> u64 {
    (g * MIB_PER_GIB).round() as u64
}

/// Profiles of the 8-memory-slice family (A100, H100, H200), in the order
/// 1g, 1g+me, 1g with double memory, 2g, 3g, 4g, 7g.
fn eight_slice(names: [&str; 6], memory_gib: [f64; 6], sms: [u32; 6]) -> MigGeometry {
    let [n1, n1d, n2, n3, n4, n7] = names;
    let [m1, m1d, m2, m3, m4, m7] = memory_gib;
    let [s1, s1d, s2, s3, s4, s7] = sms;
    let p = |name: String,
             nvml_index,
             id,
             compute_slices,
             memory_slices,
             mem,
             sms,
             placements: &[u32],
             max_count,
             media| MigProfile {
        name,
        nvml_index,
        id,
        compute_slices,
        memory_slices,
        memory_mib: gib(mem),
        sms,
        placements: placements.to_vec(),
        max_count,
        media,
    };
    MigGeometry {
        memory_slices: 8,
        compute_slices: 7,
        profiles: vec![
            p(
                n1.to_string(),
                0,
                19,
                1,
                1,
                m1,
                s1,
                &[0, 1, 2, 3, 4, 5, 6],
                7,
                false,
            ),
            p(
                format!("{n1}+me"),
                7,
                20,
                1,
                1,
                m1,
                s1,
                &[0, 1, 2, 3, 4, 5, 6],
                1,
                true,
            ),
            p(
                n1d.to_string(),
                9,
                15,
                1,
                2,
                m1d,
                s1d,
                &[0, 2, 4, 6],
                4,
                false,
            ),
            p(n2.to_string(), 1, 14, 2, 2, m2, s2, &[0, 2, 4], 3, false),
            p(n3.to_string(), 2, 9, 3, 4, m3, s3, &[0, 4], 2, false),
            p(n4.to_string(), 3, 5, 4, 4, m4, s4, &[0], 1, false),
            p(n7.to_string(), 4, 0, 7, 8, m7, s7, &[0], 1, false),
        ],
    }
}

fn a30() -> MigGeometry {
    let p = |name: &str, nvml_index, id, slices, mem, sms, placements: &[u32], max_count, media| {
        MigProfile {
            name: name.to_string(),
            nvml_index,
            id,
            compute_slices: slices,
            memory_slices: slices,
            memory_mib: gib(mem),
            sms,
            placements: placements.to_vec(),
            max_count,
            media,
        }
    };
    MigGeometry {
        memory_slices: 4,
        compute_slices: 4,
        profiles: vec![
            p("1g.6gb", 0, 14, 1, 5.75, 14, &[0, 1, 2, 3], 4, false),
            p("1g.6gb+me", 7, 21, 1, 5.75, 14, &[0, 1, 2, 3], 1, true),
            p("2g.12gb", 1, 5, 2, 11.75, 28, &[0, 2], 2, false),
            p("2g.12gb+me", 8, 6, 2, 11.75, 28, &[0, 2], 1, true),
            p("4g.24gb", 3, 0, 4, 23.5, 56, &[0], 1, false),
        ],
    }
}

static CATALOG: LazyLock<Vec<GpuModel>> = LazyLock::new(|| {
    let a100_40 = || {
        eight_slice(
            [
                "1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb",
            ],
            [4.75, 9.75, 9.75, 19.62, 19.62, 39.5],
            [14, 14, 28, 42, 56, 98],
        )
    };
    let a100_80 = || {
        eight_slice(
            [
                "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb",
            ],
            [9.5, 19.5, 19.5, 39.25, 39.25, 78.75],
            [14, 14, 28, 42, 56, 98],
        )
    };
    let h100_80 = |sms7| {
        eight_slice(
            [
                "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb",
            ],
            [9.75, 19.62, 19.62, 39.5, 39.5, 79.25],
            [16, 26, 32, 60, 64, sms7],
        )
    };
    vec![
        GpuModel {
            name: "NVIDIA A100-SXM4-40GB",
            aliases: &["NVIDIA A100-PCIE-40GB", "A100-40GB", "A100"],
            memory_mib: 40960,
            sms: 108,
            mig: Some(a100_40()),
        },
        GpuModel {
            name: "NVIDIA A100-SXM4-80GB",
            aliases: &["A100-80GB", "A100-SXM4-80GB"],
            memory_mib: 81920,
            sms: 108,
            mig: Some(a100_80()),
        },
        GpuModel {
            name: "NVIDIA A100 80GB PCIe",
            aliases: &["A100-80GB-PCIE", "NVIDIA A100-PCIE-80GB"],
            memory_mib: 81920,
            sms: 108,
            mig: Some(a100_80()),
        },
        GpuModel {
            name: "NVIDIA A30",
            aliases: &["A30", "A30-24GB"],
            memory_mib: 24576,
            sms: 56,
            mig: Some(a30()),
        },
        GpuModel {
            name: "NVIDIA H100 80GB HBM3",
            aliases: &[
                "H100",
                "H100-80GB",
                "H100-SXM5-80GB",
                "NVIDIA H100-SXM5-80GB",
            ],
            memory_mib: 81559,
            sms: 132,
            mig: Some(h100_80(132)),
        },
        GpuModel {
            name: "NVIDIA H100 PCIe",
            aliases: &["H100-PCIE", "H100-PCIE-80GB"],
            memory_mib: 81559,
            sms: 114,
            mig: Some(h100_80(114)),
        },
        GpuModel {
            name: "NVIDIA H100 NVL",
            aliases: &["H100-NVL", "H100-NVL-94GB"],
            memory_mib: 95830,
            sms: 132,
            mig: Some(eight_slice(
                [
                    "1g.12gb", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb",
                ],
                [10.75, 21.75, 21.75, 46.0, 46.0, 93.0],
                [16, 26, 32, 60, 64, 132],
            )),
        },
        GpuModel {
            name: "NVIDIA H200",
            aliases: &["H200", "H200-141GB", "NVIDIA H200 141GB HBM3e"],
            memory_mib: 143771,
            sms: 132,
            mig: Some(eight_slice(
                [
                    "1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb",
                ],
                [16.0, 32.25, 32.25, 69.5, 69.5, 139.75],
                [16, 26, 32, 60, 64, 132],
            )),
        },
    ]
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_by_nvml_name_and_alias() {
        assert_eq!(model("NVIDIA H200").unwrap().memory_mib, 143771);
        assert_eq!(model("h200").unwrap().name, "NVIDIA H200");
        assert_eq!(model("NVIDIA A100-SXM4-80GB").unwrap().memory_mib, 81920);
        let err = model("NVIDIA T4").unwrap_err();
        assert!(
            err.to_string()
                .contains("\"NVIDIA T4\" is not in the catalog"),
            "{err}"
        );
    }

    #[test]
    fn h200_profiles_match_the_brief() {
        let h200 = model("NVIDIA H200").unwrap();
        let expect = [
            ("1g.18gb", 19, 16.0, 16),
            ("1g.35gb", 15, 32.25, 26),
            ("2g.35gb", 14, 32.25, 32),
            ("3g.71gb", 9, 69.5, 60),
            ("4g.71gb", 5, 69.5, 64),
            ("7g.141gb", 0, 139.75, 132),
        ];
        for (name, id, gib_, sms) in expect {
            let p = h200.profile(name).unwrap();
            assert_eq!((p.id, p.memory_mib, p.sms), (id, gib(gib_), sms), "{name}");
        }
    }

    /// One row per catalog model: memory, slices, smallest and whole profiles.
    #[test]
    fn table_of_every_model() {
        let table = [
            (
                "NVIDIA A100-SXM4-40GB",
                40960,
                8,
                "1g.5gb",
                7,
                "7g.40gb",
                98,
            ),
            (
                "NVIDIA A100-SXM4-80GB",
                81920,
                8,
                "1g.10gb",
                7,
                "7g.80gb",
                98,
            ),
            (
                "NVIDIA A100 80GB PCIe",
                81920,
                8,
                "1g.10gb",
                7,
                "7g.80gb",
                98,
            ),
            ("NVIDIA A30", 24576, 4, "1g.6gb", 4, "4g.24gb", 56),
            (
                "NVIDIA H100 80GB HBM3",
                81559,
                8,
                "1g.10gb",
                7,
                "7g.80gb",
                132,
            ),
            ("NVIDIA H100 PCIe", 81559, 8, "1g.10gb", 7, "7g.80gb", 114),
            ("NVIDIA H100 NVL", 95830, 8, "1g.12gb", 7, "7g.94gb", 132),
            ("NVIDIA H200", 143771, 8, "1g.18gb", 7, "7g.141gb", 132),
        ];
        assert_eq!(table.len(), models().len());
        for (name, memory, slices, smallest, max_small, whole, whole_sms) in table {
            let m = model(name).unwrap();
            let g = m.mig.as_ref().unwrap();
            assert_eq!((m.memory_mib, g.memory_slices), (memory, slices), "{name}");
            let small = g.profiles.iter().find(|p| p.nvml_index == 0).unwrap();
            assert_eq!(
                (small.name.as_str(), small.max_count),
                (smallest, max_small),
                "{name}"
            );
            let full = g
                .profiles
                .iter()
                .find(|p| p.compute_slices == g.compute_slices)
                .unwrap();
            assert_eq!(
                (full.name.as_str(), full.sms, full.memory_slices),
                (whole, whole_sms, slices),
                "{name}"
            );
            assert!(
                full.memory_mib < m.memory_mib,
                "{name}: MIG keeps some memory back"
            );
        }
    }

    #[test]
    fn every_mig_model_is_self_consistent() {
        for m in models() {
            let g = m.mig.as_ref().unwrap();
            for p in &g.profiles {
                assert!(p.memory_mib <= m.memory_mib, "{} {}", m.name, p.name);
                assert!(
                    p.compute_slices <= g.compute_slices,
                    "{} {}",
                    m.name,
                    p.name
                );
                for start in &p.placements {
                    assert!(
                        start + p.memory_slices <= g.memory_slices,
                        "{} {} at {start}",
                        m.name,
                        p.name
                    );
                    assert_eq!(
                        start % p.memory_slices.min(4),
                        0,
                        "{} {} aligned",
                        m.name,
                        p.name
                    );
                }
                assert!(
                    p.max_count as usize <= p.placements.len(),
                    "{} {}",
                    m.name,
                    p.name
                );
            }
        }
    }

    /// The profile ids of the MIG user guide's tables (`nvidia-smi mig -lgip`), which NVML's
    /// MIG calls take, against the `NVML_GPU_INSTANCE_PROFILE_*` indices only profile info takes.
    #[test]
    fn profile_ids_are_the_mig_guides_and_differ_from_indices() {
        let ids = |name: &str| -> Vec<(String, u32, u32)> {
            let mut v: Vec<_> = model(name)
                .unwrap()
                .mig
                .as_ref()
                .unwrap()
                .profiles
                .iter()
                .map(|p| (p.name.clone(), p.nvml_index, p.id))
                .collect();
            v.sort_by_key(|x| x.2);
            v
        };
        let row = |n: &str, index, id| (n.to_string(), index, id);
        assert_eq!(
            ids("NVIDIA A100-SXM4-40GB"),
            [
                row("7g.40gb", 4, 0),
                row("4g.20gb", 3, 5),
                row("3g.20gb", 2, 9),
                row("2g.10gb", 1, 14),
                row("1g.10gb", 9, 15),
                row("1g.5gb", 0, 19),
                row("1g.5gb+me", 7, 20),
            ]
        );
        assert_eq!(
            ids("NVIDIA A30"),
            [
                row("4g.24gb", 3, 0),
                row("2g.12gb", 1, 5),
                row("2g.12gb+me", 8, 6),
                row("1g.6gb", 0, 14),
                row("1g.6gb+me", 7, 21),
            ]
        );
        for m in models() {
            let g = m.mig.as_ref().unwrap();
            for p in &g.profiles {
                assert_eq!(g.profile_by_id(p.id), Some(p), "{} {}", m.name, p.name);
                assert_eq!(g.profile_by_index(p.nvml_index), Some(p), "{}", m.name);
            }
            let small = g.profile_by_index(0).unwrap();
            assert_ne!(small.id, 0, "{}: 1g is not profile id 0", m.name);
        }
        assert_eq!(compute_profile_index(7), Some(4));
        assert_eq!(compute_profile_slices(4), Some(7));
        assert_eq!(compute_profile_index(5), None);
    }
}
