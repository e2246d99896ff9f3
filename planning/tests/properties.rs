//! Properties of the MIG solver and the transition planner, checked against brute force.

use std::collections::BTreeMap;

use gpuslice_api::Placement;
use gpuslice_planning::catalog::{GpuModel, models};
use gpuslice_planning::mig::{self, mask};
use gpuslice_planning::transition::{
    Blocker, Desired, GpuState, Instance, Op, apply, plan, satisfies,
};
use proptest::prelude::*;

fn mig_model(i: usize) -> &'static GpuModel {
    &models()[i % models().len()]
}

/// Random profile counts for a model (often infeasible, on purpose).
fn counts_for(model: &'static GpuModel) -> impl Strategy<Value = BTreeMap<String, u32>> {
    let profiles = model.mig.as_ref().unwrap().profiles.clone();
    prop::collection::vec(0u32..=3, profiles.len()).prop_map(move |ns| {
        profiles
            .iter()
            .zip(ns)
            .filter(|(_, n)| *n > 0)
            .map(|(p, n)| (p.name.clone(), n))
            .collect()
    })
}

fn model_and_counts() -> impl Strategy<Value = (&'static GpuModel, BTreeMap<String, u32>)> {
    (0..models().len()).prop_flat_map(|i| {
        let m = mig_model(i);
        counts_for(m).prop_map(move |c| (m, c))
    })
}

/// Brute force: every instance at every allowed start, no pruning, no ordering tricks.
fn oracle_feasible(model: &GpuModel, counts: &BTreeMap<String, u32>) -> bool {
    let g = model.mig.as_ref().unwrap();
    let mut instances = Vec::new();
    for (name, &n) in counts {
        let Some(p) = model.profile(name) else {
            return false;
        };
        if n > p.max_count {
            return false;
        }
        instances.extend(std::iter::repeat_n(p, n as usize));
    }
    let compute: u32 = instances.iter().map(|p| p.compute_slices).sum();
    let media = instances.iter().filter(|p| p.media).count();
    if compute > g.compute_slices || media > 1 {
        return false;
    }
    fn go(instances: &[&gpuslice_planning::catalog::MigProfile], used: u32, total: u32) -> bool {
        let Some((first, rest)) = instances.split_first() else {
            return true;
        };
        first.placements.iter().any(|&start| {
            let m = mask(Placement {
                start,
                size: first.memory_slices,
            });
            start + first.memory_slices <= total && used & m == 0 && go(rest, used | m, total)
        })
    }
    go(&instances, 0, g.memory_slices)
}

fn check_valid(
    model: &GpuModel,
    counts: &BTreeMap<String, u32>,
    placed: &[mig::PlacedInstance],
) -> Result<(), TestCaseError> {
    let g = model.mig.as_ref().unwrap();
    let mut used = 0u32;
    let mut have: BTreeMap<String, u32> = BTreeMap::new();
    let mut compute = 0;
    for i in placed {
        let p = model.profile(&i.profile).unwrap();
        prop_assert!(
            p.placements.contains(&i.placement.start),
            "{} at {} not allowed",
            p.name,
            i.placement.start
        );
        prop_assert_eq!(i.placement.size, p.memory_slices);
        prop_assert!(i.placement.start + i.placement.size <= g.memory_slices);
        let m = mask(i.placement);
        prop_assert_eq!(used & m, 0, "overlap at {:?}", i);
        used |= m;
        compute += p.compute_slices;
        *have.entry(p.name.clone()).or_default() += 1;
    }
    prop_assert!(compute <= g.compute_slices);
    let want: BTreeMap<String, u32> = counts
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, v)| (k.clone(), *v))
        .collect();
    prop_assert_eq!(have, want);
    Ok(())
}

/// Drops instances (the largest profile first) until the counts fit the model.
fn feasible(model: &GpuModel, mut counts: BTreeMap<String, u32>) -> BTreeMap<String, u32> {
    while mig::solve_counts(model, &counts).is_err() {
        let largest = counts
            .iter()
            .filter(|(_, n)| **n > 0)
            .max_by_key(|(p, _)| model.profile(p).map(|p| p.memory_slices))
            .map(|(p, _)| p.clone());
        match largest {
            Some(p) => *counts.get_mut(&p).unwrap() -= 1,
            None => break,
        }
        counts.retain(|_, n| *n > 0);
    }
    counts
}

/// A current GPU: a feasible layout, placed, with some instances busy.
fn current_state() -> impl Strategy<Value = (&'static GpuModel, GpuState)> {
    model_and_counts()
        .prop_map(|(m, c)| (m, feasible(m, c)))
        .prop_flat_map(|(m, c)| {
            let placed = mig::solve_counts(m, &c).unwrap();
            let n = placed.len();
            (
                Just(m),
                Just(placed),
                prop::collection::vec(any::<bool>(), n),
            )
        })
        .prop_map(|(m, placed, busy)| {
            let instances = placed
                .into_iter()
                .zip(busy)
                .map(|(p, busy)| Instance {
                    profile: p.profile,
                    placement: p.placement,
                    uuid: None,
                    busy,
                    mps_slices: 0,
                    busy_slices: Vec::new(),
                })
                .collect();
            (
                m,
                GpuState {
                    mig_enabled: true,
                    instances,
                    ..GpuState::default()
                },
            )
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn solver_output_is_valid_and_found_whenever_brute_force_finds_one((model, counts) in model_and_counts()) {
        let solved = mig::solve_counts(model, &counts);
        prop_assert_eq!(solved.is_ok(), oracle_feasible(model, &counts), "{:?} on {}: {:?}", counts, model.name, solved);
        if let Ok(placed) = solved {
            check_valid(model, &counts, &placed)?;
            // Deterministic.
            prop_assert_eq!(mig::solve_counts(model, &counts).unwrap(), placed);
        }
    }

    #[test]
    fn transitions_reach_the_target_keep_what_fits_and_never_destroy_busy_work(
        (model, current) in current_state(),
        target in any::<prop::sample::Index>(),
    ) {
        // A feasible target on the same model.
        let g = model.mig.as_ref().unwrap();
        let options: Vec<BTreeMap<String, u32>> = (0..64u32)
            .map(|seed| g.profiles.iter().enumerate().filter(|(k, _)| (seed >> (k % 6)) & 1 == 1).map(|(_, p)| (p.name.clone(), 1 + (seed % 2))).collect())
            .filter(|c: &BTreeMap<String, u32>| !c.is_empty() && mig::solve_counts(model, c).is_ok())
            .collect();
        prop_assume!(!options.is_empty());
        let desired = Desired::Mig(options[target.index(options.len())].clone());
        let p = plan(Some(model), &current, &desired).unwrap();

        // Applying the plan yields exactly the desired layout.
        let after = apply(&current, &p.ops);
        prop_assert!(satisfies(Some(model), &after, &desired), "{:?} -> {:?}: {:?}", current, desired, p);

        // Busy instances are destroyed only when the plan is blocked and names them.
        for op in &p.ops {
            if let Op::DestroyInstance { placement, .. } = op {
                let inst = current.instances.iter().find(|i| i.placement == *placement).unwrap();
                if inst.busy {
                    let named = p.blocked_by.iter().any(|b| matches!(b, Blocker::Instance { placement: bp, .. } if bp == placement));
                    prop_assert!(named, "busy {:?} destroyed without blocking", inst);
                }
            }
        }

        // Nothing is destroyed and recreated in the same place.
        for op in &p.ops {
            if let Op::CreateInstance { profile, placement } = op {
                let recreated = p.ops.iter().any(|o| matches!(o, Op::DestroyInstance { profile: dp, placement: pp, .. } if dp == profile && pp == placement));
                prop_assert!(!recreated, "{} at {:?} destroyed and recreated", profile, placement);
            }
        }

        // An unblocked plan keeps every busy instance and, with them, as many instances as any
        // arrangement allows (brute force over subsets).
        if !p.is_blocked() {
            let busy: u32 = current.instances.iter().enumerate().filter(|(_, i)| i.busy).fold(0, |m, (k, _)| m | (1 << k));
            let Desired::Mig(want) = &desired else { unreachable!() };
            let best = (0u32..(1 << current.instances.len()))
                .filter(|bits| bits & busy == busy)
                .filter(|bits| {
                    let kept: Vec<&Instance> = current.instances.iter().enumerate().filter(|(k, _)| bits & (1 << k) != 0).map(|(_, i)| i).collect();
                    let mut rest = want.clone();
                    for i in &kept {
                        match rest.get_mut(&i.profile) {
                            Some(n) if *n > 0 => *n -= 1,
                            _ => return false,
                        }
                    }
                    let occupied = kept.iter().fold(0, |m, i| m | mask(i.placement));
                    let wanted: Vec<_> = rest.iter().filter(|(_, n)| **n > 0).map(|(name, n)| (model.profile(name).unwrap(), *n)).collect();
                    mig::place_around(&wanted, occupied).is_some()
                })
                .map(u32::count_ones)
                .max()
                .unwrap_or(0);
            prop_assert_eq!(p.kept.len() as u32, best, "{:?}", p);
        }
    }
}
