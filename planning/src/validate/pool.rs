//! Checks of each GpuPool: its layouts against the catalog models it selects, its elastic
//! shapes, windows and CheckpointPolicy reference.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use gpuslice_api::pool::Elastic;
use gpuslice_api::quantity::format_bytes;
use gpuslice_api::{CheckpointPolicy, GpuPool, Layout, LayoutKind};

use super::{Findings, Located};
use crate::catalog::{self, GpuModel};
use crate::windows::{Recurrence, first_overlap};
use crate::{elastic, mig};

/// The client processes an MPS server serves on one GPU (Volta and newer, NVIDIA's MPS docs).
const MPS_CLIENTS: u32 = 48;

/// The pool's layouts with their field paths and display names.
pub(super) fn layouts(pool: &GpuPool) -> Vec<(String, String, &Layout)> {
    let mut out = vec![(
        "spec.layout".to_string(),
        "the default layout".to_string(),
        &pool.spec.layout,
    )];
    for (i, w) in pool.spec.windows.iter().enumerate() {
        out.push((
            format!("spec.windows[{i}].layout"),
            format!("window {:?}", w.name),
            &w.layout,
        ));
    }
    out
}

/// The pool's elastic sets (its own and its windows') with their field paths.
fn elastic_sets(pool: &GpuPool) -> Vec<(String, &Elastic)> {
    let windows = pool.spec.windows.iter().enumerate();
    pool.spec
        .elastic
        .iter()
        .map(|e| ("spec.elastic".to_string(), e))
        .chain(windows.filter_map(|(i, w)| {
            let set = w.elastic.as_ref()?;
            Some((format!("spec.windows[{i}].elastic"), set))
        }))
        .collect()
}

/// The models an elastic shape is tried on: those selected, or every model in the catalog.
fn elastic_candidates(pool: &GpuPool) -> (Vec<&'static GpuModel>, bool) {
    let named = selected_models(pool).known;
    if named.is_empty() {
        (catalog::models().iter().collect(), false)
    } else {
        (named, true)
    }
}

/// Each shape of each elastic set must fit a GPU of the pool.
fn check_elastic(pool: &Located<GpuPool>, out: &mut Findings) {
    let (candidates, named) = elastic_candidates(&pool.object);
    for (path, set) in elastic_sets(&pool.object) {
        for (k, shape) in set.shapes.iter().enumerate() {
            let held: Vec<&str> = candidates
                .iter()
                .filter(|m| {
                    elastic::slots(&shape.layout, Some(m), m.name, m.memory_bytes()).is_some()
                })
                .map(|m| m.name)
                .collect();
            let at = format!("{path}.shapes[{k}].layout");
            let tried: Vec<&str> = candidates.iter().map(|m| m.name).collect();
            if held.is_empty() {
                out.error(pool.doc, &at, format!(
                    "elastic shape {:?} fits no GPU of the pool ({}): its slices do not fit the GPU's memory or its MIG profiles do not exist there; change the layout or remove the shape",
                    shape.name,
                    if named { tried.join(", ") } else { "no model in the catalog".to_string() }
                ));
            } else if named && held.len() < candidates.len() {
                out.warn(
                    pool.doc,
                    &at,
                    format!(
                        "elastic shape {:?} fits only {}: the pool's other GPUs never take it",
                        shape.name,
                        held.join(", ")
                    ),
                );
            }
        }
    }
}

/// The names of the elastic shapes of `pool` that hold `need` bytes at `compute` percent on
/// some GPU of the pool, and the names of all its shapes.
pub(super) fn elastic_fits(pool: &GpuPool, need: u64, compute: u32) -> (Vec<String>, Vec<String>) {
    let (candidates, _) = elastic_candidates(pool);
    let mut fits = Vec::new();
    let mut all = Vec::new();
    for (_, set) in elastic_sets(pool) {
        for shape in &set.shapes {
            all.push(shape.name.clone());
            let holds = candidates.iter().any(|m| {
                elastic::slots(&shape.layout, Some(m), m.name, m.memory_bytes())
                    .is_some_and(|slots| slots.iter().any(|s| s.holds(need, compute)))
            });
            if holds {
                fits.push(shape.name.clone());
            }
        }
    }
    (fits, all)
}

/// The GPU models a pool's selector names: those in the catalog, and (by index) those not.
pub(super) struct SelectedModels {
    pub(super) known: Vec<&'static GpuModel>,
    unknown: Vec<(usize, String)>,
}

pub(super) fn selected_models(pool: &GpuPool) -> SelectedModels {
    let mut selected = SelectedModels {
        known: Vec::new(),
        unknown: Vec::new(),
    };
    for (i, name) in pool
        .spec
        .gpu_selector
        .iter()
        .flat_map(|s| s.models.iter())
        .enumerate()
    {
        match catalog::model(name) {
            Ok(m) => selected.known.push(m),
            Err(_) => selected.unknown.push((i, name.clone())),
        }
    }
    selected
}

/// The models a MIG layout must fit: those selected, or every MIG model when none is named.
pub(super) fn mig_candidates(models: &[&'static GpuModel]) -> Vec<&'static GpuModel> {
    if models.is_empty() {
        catalog::models()
            .iter()
            .filter(|m| m.mig.is_some())
            .collect()
    } else {
        models.to_vec()
    }
}

pub(super) fn check_pool(
    pool: &Located<GpuPool>,
    checkpoints: &BTreeMap<&str, &CheckpointPolicy>,
    now: DateTime<Utc>,
    out: &mut Findings,
) {
    let doc = pool.doc;
    let spec = &pool.object.spec;
    let SelectedModels {
        known: models,
        unknown,
    } = selected_models(&pool.object);
    let any_mig = layouts(&pool.object)
        .iter()
        .any(|(_, _, l)| l.mig.is_some());
    let any_mps = layouts(&pool.object)
        .iter()
        .any(|(_, _, l)| l.mps.is_some());
    for (i, name) in &unknown {
        let path = format!("spec.gpuSelector.models[{i}]");
        if any_mig {
            out.error(doc, &path, format!("{name:?} is not a MIG-capable model in the catalog, but the pool uses a MIG layout; use one of: {}", mig_model_names()));
        } else {
            out.warn(doc, &path, format!("{name:?} is not in the GPU catalog: memory checks are skipped (fine for GPUs without MIG; check the spelling against nvidia-smi --query-gpu=name)"));
        }
        if any_mps {
            out.warn(doc, &path, format!("{name:?} is not in the GPU catalog, and the pool uses an mps layout: MPS compute shares need a Volta or newer GPU (compute capability 7.0); the agent refuses the layout on an older one"));
        }
    }
    let headroom = pool.object.spec.headroom_bytes();
    for (path, what, layout) in layouts(&pool.object) {
        match layout.kind() {
            Some(kind @ (LayoutKind::Software(s) | LayoutKind::Mps(s))) => {
                let field = if matches!(kind, LayoutKind::Mps(_)) {
                    "mps"
                } else {
                    "software"
                };
                if field == "mps" && s.slices > MPS_CLIENTS {
                    out.warn(doc, &format!("{path}.mps.slices"), format!(
                        "{} MPS slices: an MPS server serves at most {MPS_CLIENTS} client processes per GPU (Volta and newer), so some workloads would wait for a place; use at most {MPS_CLIENTS} slices",
                        s.slices
                    ));
                }
                let Ok(memory) = s.memory.bytes() else {
                    continue;
                };
                if memory <= headroom {
                    out.error(doc, &format!("{path}.{field}.memory"), format!(
                        "slice memory {} leaves nothing once memoryHeadroom {} is kept back; raise memory or lower memoryHeadroom",
                        format_bytes(memory), format_bytes(headroom)
                    ));
                }
                for m in &models {
                    let total = memory.saturating_mul(u64::from(s.slices));
                    if total > m.memory_bytes() {
                        out.error(doc, &format!("{path}.{field}"), format!(
                            "{} slices × {} = {} exceed the {} of a {}; use fewer or smaller slices",
                            s.slices, format_bytes(memory), format_bytes(total), format_bytes(m.memory_bytes()), m.name
                        ));
                    }
                }
            }
            Some(LayoutKind::Mig(layout)) => {
                let candidates = mig_candidates(&models);
                let results: Vec<_> = candidates
                    .iter()
                    .map(|m| (m, mig::solve(m, layout)))
                    .collect();
                if models.is_empty() {
                    // No model named: the layout must work on at least one MIG model.
                    if results.iter().all(|(_, r)| r.is_err()) {
                        let why = results
                            .iter()
                            .filter_map(|(_, r)| r.as_ref().err())
                            .find(|e| !matches!(e, mig::MigError::UnknownProfile { .. }));
                        let message = match why {
                            Some(e) => format!("{what} fits no MIG-capable GPU: {e}"),
                            None => format!(
                                "{what} names profiles no GPU model has together; set gpuSelector.models and use that model's profile names"
                            ),
                        };
                        out.error(doc, &format!("{path}.mig"), message);
                    }
                } else {
                    for (m, r) in results {
                        if let Err(e) = r {
                            out.error(
                                doc,
                                &format!("{path}.mig"),
                                format!("{what} does not fit a {}: {e}", m.name),
                            );
                        }
                    }
                }
            }
            Some(LayoutKind::Exclusive) | None => {}
        }
    }
    check_windows(pool, now, out);
    check_elastic(pool, out);
    check_checkpoint_reference(doc, spec.checkpoint_policy.as_deref(), checkpoints, out);
    if let Some(Err(e)) = spec
        .compaction
        .as_ref()
        .and_then(|c| c.window.as_ref())
        .map(Recurrence::of_daily)
    {
        let path = match e {
            crate::windows::WindowError::UnknownTimeZone(_) => "spec.compaction.window.timeZone",
            _ => "spec.compaction.window",
        };
        out.error(doc, path, e.to_string());
    }
}

pub(super) fn check_checkpoint_reference(
    doc: usize,
    name: Option<&str>,
    checkpoints: &BTreeMap<&str, &CheckpointPolicy>,
    out: &mut Findings,
) {
    if let Some(name) = name
        && !checkpoints.contains_key(name)
    {
        out.error(
            doc,
            "spec.checkpointPolicy",
            format!("CheckpointPolicy {name:?} is not defined in this repository"),
        );
    }
}

fn mig_model_names() -> String {
    catalog::models()
        .iter()
        .filter(|m| m.mig.is_some())
        .map(|m| m.name)
        .collect::<Vec<_>>()
        .join(", ")
}

fn check_windows(pool: &Located<GpuPool>, now: DateTime<Utc>, out: &mut Findings) {
    let windows = &pool.object.spec.windows;
    let mut parsed = Vec::new();
    for (i, w) in windows.iter().enumerate() {
        match Recurrence::of_window(w) {
            Ok(r) => parsed.push((i, r)),
            Err(e @ crate::windows::WindowError::UnknownTimeZone(_)) => out.error(
                pool.doc,
                &format!("spec.windows[{i}].timeZone"),
                e.to_string(),
            ),
            Err(e) => out.error(pool.doc, &format!("spec.windows[{i}]"), e.to_string()),
        }
    }
    for (a, (i, ra)) in parsed.iter().enumerate() {
        for (j, rb) in parsed.iter().skip(a + 1) {
            // A year covers every weekday and both daylight-saving changes.
            if let Some(at) = first_overlap(ra, rb, now, 371) {
                out.error(pool.doc, &format!("spec.windows[{j}]"), format!(
                    "window {:?} overlaps window {:?} (both open at {}); windows of one pool must not overlap",
                    windows[*j].name, windows[*i].name, at.format("%a %Y-%m-%d %H:%M UTC")
                ));
            }
        }
    }
}
