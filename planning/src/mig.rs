//! MIG layout solver: a multiset of profiles → explicit, non-overlapping placements.
//!
//! The search space is tiny (at most 7 instances over 8 memory slices), so the solver searches it
//! exhaustively and deterministically: larger profiles first, each instance at its lowest free
//! allowed start, identical profiles in increasing start order.

use std::collections::BTreeMap;

use gpuslice_api::{MigLayout, MigPreset, Placement};

use crate::catalog::{GpuModel, MigProfile};

/// One instance of a solved layout.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PlacedInstance {
    pub profile: String,
    pub placement: Placement,
}

/// Why a MIG layout cannot be built on a model.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MigError {
    #[error("{model} does not support MIG")]
    NotMigCapable { model: String },
    #[error("{model} has no MIG profile {profile:?} (it has: {known})")]
    UnknownProfile {
        model: String,
        profile: String,
        known: String,
    },
    #[error("{count} × {profile} requested, but at most {max} fit on one {model}")]
    TooMany {
        model: String,
        profile: String,
        count: u32,
        max: u32,
    },
    #[error("the profiles need {needed} compute slices, but {model} has {available}")]
    ComputeBudget {
        model: String,
        needed: u32,
        available: u32,
    },
    #[error("the profiles need {needed} memory slices, but {model} has {available}")]
    MemoryBudget {
        model: String,
        needed: u32,
        available: u32,
    },
    #[error("at most one media-engine (+me) instance fits on a GPU, {count} requested")]
    MediaEngines { count: u32 },
    #[error(
        "no arrangement of {layout} fits {model}: the allowed placements collide ({placements})"
    )]
    NoPlacement {
        model: String,
        layout: String,
        placements: String,
    },
    #[error("set either profiles or preset")]
    Empty,
}

/// The profile counts a MIG layout asks for on a model (a preset expanded).
pub fn requested_profiles(
    model: &GpuModel,
    layout: &MigLayout,
) -> Result<BTreeMap<String, u32>, MigError> {
    let geometry = model.mig.as_ref().ok_or_else(|| MigError::NotMigCapable {
        model: model.name.to_string(),
    })?;
    if let Some(preset) = layout.preset {
        let smallest = geometry
            .profiles
            .iter()
            .find(|p| p.nvml_index == 0)
            .expect("every MIG model has a 1-slice profile");
        let plain = |compute: u32, memory: u32| {
            geometry
                .profiles
                .iter()
                .find(|p| p.compute_slices == compute && p.memory_slices == memory && !p.media)
        };
        let mut out = BTreeMap::new();
        match preset {
            MigPreset::All1g => {
                out.insert(smallest.name.clone(), smallest.max_count);
            }
            MigPreset::Whole => {
                let whole = geometry
                    .profiles
                    .iter()
                    .find(|p| p.compute_slices == geometry.compute_slices)
                    .expect("every MIG model has a full-GPU profile");
                out.insert(whole.name.clone(), 1);
            }
            MigPreset::Balanced => {
                // 3g + 2g + 2×1g on 8-slice models, 2g + 2×1g on the A30's four slices.
                let larger: &[(u32, u32)] = if geometry.memory_slices == 8 {
                    &[(3, 4), (2, 2)]
                } else {
                    &[(2, 2)]
                };
                for p in larger.iter().filter_map(|&(c, m)| plain(c, m)) {
                    out.insert(p.name.clone(), 1);
                }
                out.insert(smallest.name.clone(), 2);
            }
        }
        return Ok(out);
    }
    if layout.profiles.is_empty() {
        return Err(MigError::Empty);
    }
    Ok(layout.profiles.clone())
}

/// Solves a MIG layout on a model: explicit placements, or why none exists.
pub fn solve(model: &GpuModel, layout: &MigLayout) -> Result<Vec<PlacedInstance>, MigError> {
    let counts = requested_profiles(model, layout)?;
    solve_counts(model, &counts)
}

/// Checks profile counts against a model (names, count limits, slice budgets) and resolves the
/// names to the model's profiles.
pub fn resolve_counts<'m>(
    model: &'m GpuModel,
    counts: &BTreeMap<String, u32>,
) -> Result<Vec<(&'m MigProfile, u32)>, MigError> {
    let name = model.name.to_string();
    let geometry = model.mig.as_ref().ok_or_else(|| MigError::NotMigCapable {
        model: name.clone(),
    })?;
    let mut wanted: Vec<(&MigProfile, u32)> = Vec::new();
    for (profile, &count) in counts {
        let p = model
            .profile(profile)
            .ok_or_else(|| MigError::UnknownProfile {
                model: name.clone(),
                profile: profile.clone(),
                known: geometry
                    .profiles
                    .iter()
                    .map(|p| p.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
        if count > p.max_count {
            return Err(MigError::TooMany {
                model: name,
                profile: p.name.clone(),
                count,
                max: p.max_count,
            });
        }
        if count > 0 {
            wanted.push((p, count));
        }
    }
    let sum = |f: fn(&MigProfile) -> u32| wanted.iter().map(|(p, n)| f(p) * n).sum::<u32>();
    let compute = sum(|p| p.compute_slices);
    if compute > geometry.compute_slices {
        return Err(MigError::ComputeBudget {
            model: name,
            needed: compute,
            available: geometry.compute_slices,
        });
    }
    let memory = sum(|p| p.memory_slices);
    if memory > geometry.memory_slices {
        return Err(MigError::MemoryBudget {
            model: name,
            needed: memory,
            available: geometry.memory_slices,
        });
    }
    let media = wanted
        .iter()
        .filter(|(p, _)| p.media)
        .map(|(_, n)| n)
        .sum::<u32>();
    if media > 1 {
        return Err(MigError::MediaEngines { count: media });
    }
    Ok(wanted)
}

/// Solves explicit profile counts on a model.
pub fn solve_counts(
    model: &GpuModel,
    counts: &BTreeMap<String, u32>,
) -> Result<Vec<PlacedInstance>, MigError> {
    let wanted = resolve_counts(model, counts)?;
    let name = model.name.to_string();
    if let Some(out) = place_around(&wanted, 0) {
        Ok(out)
    } else {
        Err(MigError::NoPlacement {
            model: name,
            layout: wanted
                .iter()
                .map(|(p, n)| format!("{n}×{}", p.name))
                .collect::<Vec<_>>()
                .join(" + "),
            placements: wanted
                .iter()
                .map(|(p, _)| {
                    format!(
                        "{} at {}",
                        p.name,
                        p.placements
                            .iter()
                            .map(|s| format!("{s}-{}", s + p.memory_slices - 1))
                            .collect::<Vec<_>>()
                            .join("/")
                    )
                })
                .collect::<Vec<_>>()
                .join("; "),
        })
    }
}

/// Places profile counts in the memory slices left free by `occupied` (a bit mask), or `None`.
/// Counts and budgets are the caller's to check.
pub fn place_around(wanted: &[(&MigProfile, u32)], occupied: u32) -> Option<Vec<PlacedInstance>> {
    let mut wanted = wanted.to_vec();
    // Larger first: they have the fewest placements, so dead ends show early.
    wanted.sort_by(|(a, _), (b, _)| {
        b.memory_slices
            .cmp(&a.memory_slices)
            .then(a.name.cmp(&b.name))
    });
    let instances: Vec<&MigProfile> = wanted
        .iter()
        .flat_map(|(p, n)| std::iter::repeat_n(*p, *n as usize))
        .collect();
    let mut chosen = Vec::with_capacity(instances.len());
    if !place(&instances, 0, occupied, &mut chosen) {
        return None;
    }
    let mut out: Vec<PlacedInstance> = instances
        .iter()
        .zip(&chosen)
        .map(|(p, &start)| PlacedInstance {
            profile: p.name.clone(),
            placement: Placement {
                start,
                size: p.memory_slices,
            },
        })
        .collect();
    out.sort_by_key(|i| (i.placement.start, i.profile.clone()));
    Some(out)
}

/// The bit mask of the memory slices a placement covers.
pub fn mask(placement: Placement) -> u32 {
    if placement.size >= 32 || placement.start >= 32 {
        return u32::MAX;
    }
    ((1u32 << placement.size) - 1) << placement.start
}

/// Depth-first search over placements; `used` is a bit mask of occupied memory slices.
fn place(instances: &[&MigProfile], i: usize, used: u32, chosen: &mut Vec<u32>) -> bool {
    let Some(profile) = instances.get(i) else {
        return true;
    };
    // Identical instances take increasing starts, so each arrangement is tried once.
    let min_start = match (i.checked_sub(1).map(|j| instances[j]), chosen.last()) {
        (Some(prev), Some(&last)) if prev.name == profile.name => last + 1,
        _ => 0,
    };
    for &start in profile.placements.iter().filter(|&&s| s >= min_start) {
        let m = mask(Placement {
            start,
            size: profile.memory_slices,
        });
        if used & m == 0 {
            chosen.push(start);
            if place(instances, i + 1, used | m, chosen) {
                return true;
            }
            chosen.pop();
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{model, models};

    fn counts(pairs: &[(&str, u32)]) -> BTreeMap<String, u32> {
        pairs.iter().map(|(p, n)| (p.to_string(), *n)).collect()
    }

    #[test]
    fn h200_balanced_mix_gets_explicit_placements() {
        let h200 = model("NVIDIA H200").unwrap();
        let out = solve_counts(
            h200,
            &counts(&[("3g.71gb", 1), ("2g.35gb", 1), ("1g.18gb", 2)]),
        )
        .unwrap();
        let got: Vec<(&str, u32)> = out
            .iter()
            .map(|i| (i.profile.as_str(), i.placement.start))
            .collect();
        // 1g may not start at slice 7, so the 3g moves to 4-7 and the rest packs 0-3.
        assert_eq!(
            got,
            vec![
                ("2g.35gb", 0),
                ("1g.18gb", 2),
                ("1g.18gb", 3),
                ("3g.71gb", 4)
            ]
        );
        let mut used = 0u32;
        for i in &out {
            let p = h200.profile(&i.profile).unwrap();
            assert!(p.placements.contains(&i.placement.start), "{i:?}");
            let mask = ((1 << i.placement.size) - 1) << i.placement.start;
            assert_eq!(used & mask, 0, "overlap at {i:?}");
            used |= mask;
        }
    }

    #[test]
    fn four_g_plus_three_g_fits_but_two_four_g_do_not() {
        let a100 = model("NVIDIA A100-SXM4-80GB").unwrap();
        assert!(solve_counts(a100, &counts(&[("4g.40gb", 1), ("3g.40gb", 1)])).is_ok());
        assert!(matches!(
            solve_counts(a100, &counts(&[("4g.40gb", 2)])),
            Err(MigError::TooMany { .. })
        ));
        assert!(matches!(
            solve_counts(a100, &counts(&[("7g.80gb", 1), ("1g.10gb", 1)])),
            Err(MigError::ComputeBudget { .. })
        ));
        let err = solve_counts(
            a100,
            &counts(&[("3g.40gb", 1), ("2g.20gb", 1), ("4g.40gb", 1)]),
        )
        .unwrap_err();
        assert!(matches!(err, MigError::ComputeBudget { .. }), "{err}");
    }

    #[test]
    fn collisions_are_explained() {
        // On the catalog's models the slice budgets catch every impossible layout first, so
        // collisions show on a geometry read from NVML that allows fewer placements.
        let mut narrow = model("H100").unwrap().clone();
        let geometry = narrow.mig.as_mut().unwrap();
        geometry
            .profiles
            .iter_mut()
            .find(|p| p.name == "3g.40gb")
            .unwrap()
            .placements = vec![0];
        let err = solve_counts(&narrow, &counts(&[("3g.40gb", 1), ("4g.40gb", 1)])).unwrap_err();
        assert!(matches!(err, MigError::NoPlacement { .. }), "{err}");
        assert!(
            err.to_string().contains("3g.40gb at 0-3; 4g.40gb at 0-3"),
            "{err}"
        );
    }

    #[test]
    fn presets_expand_per_model() {
        for m in models() {
            for preset in [MigPreset::All1g, MigPreset::Balanced, MigPreset::Whole] {
                let layout = MigLayout {
                    profiles: BTreeMap::new(),
                    preset: Some(preset),
                    mps: None,
                };
                let out =
                    solve(m, &layout).unwrap_or_else(|e| panic!("{} {preset:?}: {e}", m.name));
                assert!(!out.is_empty());
            }
        }
        let a30 = model("A30").unwrap();
        let all = solve(
            a30,
            &MigLayout {
                profiles: BTreeMap::new(),
                preset: Some(MigPreset::All1g),
                mps: None,
            },
        )
        .unwrap();
        assert_eq!(all.len(), 4);
    }
}
