//! Matching a policy's request to a slice: the smallest slice that holds the request plus the
//! pool's headroom, and whether the guarantees placed on one GPU can all be honoured.

use crate::catalog::GpuModel;
use crate::transition::{Desired, mps_slice_of_instance};

/// The slice a request lands on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SliceChoice {
    /// A software slice of the layout (`memory` bytes, `compute` %).
    Software { memory: u64, compute: u32 },
    /// A MIG instance of this profile.
    Mig { profile: String, memory: u64 },
    /// An MPS slice (`memory` bytes, `compute` % of the instance's SMs) of an instance of this
    /// profile.
    MigMps {
        profile: String,
        memory: u64,
        compute: u32,
    },
    /// A whole GPU.
    Whole { memory: u64 },
}

impl SliceChoice {
    pub fn memory(&self) -> u64 {
        match self {
            SliceChoice::Software { memory, .. }
            | SliceChoice::Mig { memory, .. }
            | SliceChoice::MigMps { memory, .. }
            | SliceChoice::Whole { memory } => *memory,
        }
    }
}

/// The smallest slice of `layout` that holds `request + headroom` bytes, with at least
/// `compute_limit` percent for software slices. Among MIG profiles of equal memory the one with
/// fewer compute slices wins. `gpu_memory` is the whole GPU's memory for exclusive layouts.
pub fn smallest_fitting(
    layout: &Desired,
    model: Option<&GpuModel>,
    gpu_memory: Option<u64>,
    request: u64,
    headroom: u64,
    compute_limit: Option<u32>,
) -> Option<SliceChoice> {
    let need = request.saturating_add(headroom);
    match layout {
        Desired::Software(t) => (t.memory >= need && compute_limit.is_none_or(|c| c <= t.compute))
            .then_some(SliceChoice::Software {
                memory: t.memory,
                compute: t.compute,
            }),
        Desired::Mig(counts) => {
            let model = model?;
            counts
                .keys()
                .filter_map(|name| model.profile(name))
                .filter(|p| p.memory_bytes() >= need)
                .min_by_key(|p| (p.memory_bytes(), p.compute_slices, p.name.clone()))
                .map(|p| SliceChoice::Mig {
                    profile: p.name.clone(),
                    memory: p.memory_bytes(),
                })
        }
        Desired::MigMps { profiles, slices } => {
            let model = model?;
            profiles
                .keys()
                .filter_map(|name| model.profile(name))
                .map(|p| (p, mps_slice_of_instance(p.memory_bytes(), *slices)))
                .filter(|(_, (memory, _))| *memory >= need)
                .min_by_key(|(p, (memory, _))| (*memory, p.compute_slices, p.name.clone()))
                .map(|(p, (memory, compute))| SliceChoice::MigMps {
                    profile: p.name.clone(),
                    memory,
                    compute,
                })
        }
        Desired::Exclusive => {
            let memory = gpu_memory.or_else(|| model.map(GpuModel::memory_bytes))?;
            (memory >= need).then_some(SliceChoice::Whole { memory })
        }
    }
}

/// How many slices of `layout` hold `request + headroom` bytes (and `compute_limit` on software
/// slices): what one GPU offers a policy whose pods take several.
pub fn fitting_slices(
    layout: &Desired,
    model: Option<&GpuModel>,
    gpu_memory: Option<u64>,
    request: u64,
    headroom: u64,
    compute_limit: Option<u32>,
) -> u32 {
    match layout {
        Desired::Software(t) => {
            if smallest_fitting(layout, model, gpu_memory, request, headroom, compute_limit)
                .is_some()
            {
                t.slices
            } else {
                0
            }
        }
        Desired::Mig(counts) => {
            let Some(model) = model else {
                return 0;
            };
            let need = request.saturating_add(headroom);
            counts
                .iter()
                .filter(|(name, _)| {
                    model
                        .profile(name)
                        .is_some_and(|p| p.memory_bytes() >= need)
                })
                .map(|(_, n)| *n)
                .sum()
        }
        Desired::MigMps { profiles, slices } => {
            let Some(model) = model else {
                return 0;
            };
            let need = request.saturating_add(headroom);
            profiles
                .iter()
                .filter(|(name, _)| {
                    model
                        .profile(name)
                        .is_some_and(|p| mps_slice_of_instance(p.memory_bytes(), *slices).0 >= need)
                })
                .map(|(_, n)| n * slices)
                .sum()
        }
        Desired::Exclusive => u32::from(
            smallest_fitting(layout, model, gpu_memory, request, headroom, compute_limit).is_some(),
        ),
    }
}

/// Whether compute guarantees (percent) placed together on one GPU can all be honoured.
pub fn guarantees_fit(guarantees: impl IntoIterator<Item = u32>) -> bool {
    guarantees.into_iter().map(u64::from).sum::<u64>() <= 100
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::model;
    use crate::transition::SliceTable;

    const GI: u64 = 1 << 30;

    #[test]
    fn eighteen_gib_lands_on_a_twenty_gib_slice_with_one_gib_headroom() {
        let day = Desired::Software(SliceTable {
            slices: 4,
            memory: 20 * GI,
            compute: 25,
            mps: false,
        });
        assert_eq!(
            smallest_fitting(&day, None, None, 18 * GI, GI, Some(25)),
            Some(SliceChoice::Software {
                memory: 20 * GI,
                compute: 25
            })
        );
        assert_eq!(
            smallest_fitting(&day, None, None, 19 * GI + 1, GI, None),
            None,
            "headroom counts"
        );
        assert_eq!(
            smallest_fitting(&day, None, None, 8 * GI, 0, Some(30)),
            None,
            "a cap above the slice share"
        );
    }

    /// An H200 cut 3g + 2g + 2 × 1g.
    fn mixed_h200() -> Desired {
        Desired::Mig(
            [("3g.71gb", 1), ("2g.35gb", 1), ("1g.18gb", 2)]
                .map(|(p, n)| (p.to_string(), n))
                .into(),
        )
    }

    #[test]
    fn a_gpu_offers_each_of_its_slices_that_holds_the_request() {
        let h200 = model("NVIDIA H200").unwrap();
        let mig = mixed_h200();
        assert_eq!(fitting_slices(&mig, Some(h200), None, 10 * GI, 0, None), 4);
        assert_eq!(fitting_slices(&mig, Some(h200), None, 30 * GI, 0, None), 2);
        assert_eq!(fitting_slices(&mig, Some(h200), None, 100 * GI, 0, None), 0);
        let quarters = Desired::Software(SliceTable {
            slices: 4,
            memory: 20 * GI,
            compute: 25,
            mps: false,
        });
        assert_eq!(fitting_slices(&quarters, None, None, 18 * GI, GI, None), 4);
        assert_eq!(
            fitting_slices(&quarters, None, None, 18 * GI, 3 * GI, None),
            0
        );
        let whole = Desired::Exclusive;
        assert_eq!(
            fitting_slices(&whole, Some(h200), None, 100 * GI, 0, None),
            1
        );
        assert_eq!(
            fitting_slices(&whole, Some(h200), None, 200 * GI, 0, None),
            0
        );
    }

    #[test]
    fn mig_picks_the_smallest_instance_that_holds_the_request() {
        let h200 = model("NVIDIA H200").unwrap();
        let layout = mixed_h200();
        let pick = |gib| {
            smallest_fitting(&layout, Some(h200), None, gib * GI, GI, None).map(|c| match c {
                SliceChoice::Mig { profile, .. } => profile,
                other => panic!("{other:?}"),
            })
        };
        assert_eq!(pick(12).as_deref(), Some("1g.18gb"));
        assert_eq!(pick(18).as_deref(), Some("2g.35gb"));
        assert_eq!(pick(40).as_deref(), Some("3g.71gb"));
        assert_eq!(pick(80), None);
        // With the double-memory 1g in the layout, 18 GiB takes it rather than the 2g.
        let with_1g35 = Desired::Mig(
            [("1g.35gb", 1), ("2g.35gb", 1)]
                .map(|(p, n)| (p.to_string(), n))
                .into(),
        );
        let choice = smallest_fitting(&with_1g35, Some(h200), None, 18 * GI, GI, None).unwrap();
        assert_eq!(
            choice,
            SliceChoice::Mig {
                profile: "1g.35gb".into(),
                memory: h200.profile("1g.35gb").unwrap().memory_bytes()
            }
        );
    }

    #[test]
    fn guarantees_on_a_gpu_sum_to_at_most_100() {
        assert!(guarantees_fit([20, 20, 20, 40]));
        assert!(!guarantees_fit([50, 30, 30]));
        assert!(guarantees_fit([]));
    }
}
