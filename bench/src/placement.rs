//! `gpuslice bench placement`: replays the Alibaba GPU-sharing traces (cluster-trace-gpu-v2023,
//! the FGD paper's "openb" data) under each placement policy, the way the paper's simulator
//! does, and prints the unallocated GPU share at 100% and 130% arrived load, median over seeds.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuslice_planning::placement::fragment::mix_of;
use gpuslice_planning::placement::replay::replay;
use gpuslice_planning::placement::{GpuAsk, Node, Request, policies};

/// Why the trace cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{path}: {source}")]
    Csv { path: String, source: csv::Error },
    #[error("{0}: no openb_pod_list_*.csv files (the folder of cluster-trace-gpu-v2023 CSVs)")]
    NoTraces(String),
    #[error(
        "{0}: the trace lacks pods of a class the elastic replay needs (a share of at most 250 milli-GPUs, at most 500, and more)"
    )]
    Thin(String),
}

#[derive(serde::Deserialize)]
struct NodeRow {
    sn: String,
    cpu_milli: u64,
    memory_mib: u64,
    gpu: u32,
    model: String,
}

#[derive(serde::Deserialize)]
struct PodRow {
    cpu_milli: u64,
    memory_mib: u64,
    num_gpu: u32,
    gpu_milli: u32,
    #[serde(default)]
    gpu_spec: String,
}

fn read<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Vec<T>, BenchError> {
    let err = |source| BenchError::Csv {
        path: path.display().to_string(),
        source,
    };
    csv::Reader::from_path(path)
        .map_err(err)?
        .deserialize()
        .collect::<Result<_, _>>()
        .map_err(err)
}

/// The cluster of `openb_node_list_gpu_node.csv`.
pub fn cluster(folder: &Path) -> Result<Vec<Node>, BenchError> {
    let rows: Vec<NodeRow> = read(&folder.join("openb_node_list_gpu_node.csv"))?;
    Ok(rows
        .into_iter()
        .map(|r| Node::empty(&r.sn, &r.model, r.cpu_milli, r.memory_mib, r.gpu))
        .collect())
}

/// The pods of one trace file as requests.
pub fn pods(path: &Path) -> Result<Vec<Request>, BenchError> {
    let rows: Vec<PodRow> = read(path)?;
    Ok(rows
        .into_iter()
        .map(|r| Request {
            cpu_milli: r.cpu_milli,
            memory_mib: r.memory_mib,
            gpu: match (r.num_gpu, r.gpu_milli) {
                (0, _) => GpuAsk::None,
                (1, m) if m < 1000 => GpuAsk::Share(m),
                (n, _) => GpuAsk::Whole(n),
            },
            models: r
                .gpu_spec
                .split('|')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
        })
        .collect())
}

/// The trace files of a folder, `default` first.
pub fn traces(folder: &Path) -> Result<Vec<PathBuf>, BenchError> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(folder)
        .map_err(|e| BenchError::Csv {
            path: folder.display().to_string(),
            source: e.into(),
        })?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("openb_pod_list_") && n.ends_with(".csv"))
        })
        .collect();
    out.sort_by_key(|p| (!p.ends_with("openb_pod_list_default.csv"), p.clone()));
    if out.is_empty() {
        return Err(BenchError::NoTraces(folder.display().to_string()));
    }
    Ok(out)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

/// One trace's results: per policy, median unallocated % at 100% and 130%, and the slowest
/// replay of our policy.
pub struct TraceResult {
    pub trace: String,
    pub rows: Vec<(String, f64, f64)>,
    pub ours_slowest: Duration,
}

/// A trace's name in the tables (`default` for `openb_pod_list_default.csv`).
pub fn trace_name(path: &Path) -> String {
    path.file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or_default()
        .trim_start_matches("openb_pod_list_")
        .to_string()
}

/// Replays one trace under every policy for `seeds` seeds.
pub fn run_trace(nodes: &[Node], path: &Path, seeds: u64) -> Result<TraceResult, BenchError> {
    Ok(run_pods(nodes, &trace_name(path), &pods(path)?, seeds))
}

/// Replays `pods` (named `trace` in the table) under every policy for `seeds` seeds.
pub fn run_pods(nodes: &[Node], trace: &str, pods: &[Request], seeds: u64) -> TraceResult {
    let trace_mix = mix_of(pods);
    let names: Vec<String> = policies::all(0, trace_mix.clone())
        .iter()
        .map(|p| p.name().to_string())
        .collect();
    let mut at100 = vec![Vec::new(); names.len()];
    let mut at130 = vec![Vec::new(); names.len()];
    let mut ours_slowest = Duration::ZERO;
    for seed in 0..seeds {
        for (i, mut policy) in policies::all(seed, trace_mix.clone())
            .into_iter()
            .enumerate()
        {
            let start = Instant::now();
            let r = replay(nodes, pods, seed, policy.as_mut(), &[100.0, 130.0]);
            if i == names.len() - 1 {
                ours_slowest = ours_slowest.max(start.elapsed());
            }
            at100[i].push(r.unallocated[0]);
            at130[i].push(r.unallocated[1]);
        }
    }
    TraceResult {
        trace: trace.to_string(),
        rows: names
            .into_iter()
            .zip(at100.into_iter().zip(at130))
            .map(|(n, (a, b))| (n, median(a), median(b)))
            .collect(),
        ours_slowest,
    }
}

/// Sets of allowed GPU models (`|`-separated, as in `gpu_spec`) and their weights: what the
/// constrained pods of a variant name.
pub struct ModelMix {
    pub name: String,
    pub specs: Vec<(String, f64)>,
}

/// The model mixes of the constrained variants, on `nodes`' models: the V100 pair of the
/// issue; scarce models alone and in pairs; one model each, drawn by its share of the GPUs;
/// and neighbouring generations paired.
pub fn model_mixes(nodes: &[Node]) -> Vec<ModelMix> {
    let spec = |pairs: &[(&str, f64)]| {
        pairs
            .iter()
            .map(|(s, w)| (s.to_string(), *w))
            .collect::<Vec<_>>()
    };
    let mut gpus_per_model: std::collections::BTreeMap<String, f64> = Default::default();
    for n in nodes {
        *gpus_per_model.entry(n.model.clone()).or_default() += n.gpus.len() as f64;
    }
    vec![
        ModelMix {
            name: "v100".into(),
            specs: spec(&[("V100M16|V100M32", 1.0)]),
        },
        ModelMix {
            name: "scarce".into(),
            specs: spec(&[
                ("V100M32", 1.0),
                ("G3", 1.0),
                ("V100M16|V100M32", 1.0),
                ("P100", 1.0),
                ("A10|T4", 1.0),
            ]),
        },
        ModelMix {
            name: "bymodel".into(),
            specs: gpus_per_model.into_iter().collect(),
        },
        ModelMix {
            name: "pairs".into(),
            specs: spec(&[("G2|G3", 1.0), ("T4|P100", 1.0), ("V100M16|V100M32", 1.0)]),
        },
    ]
}

/// Shares of GPU pods that name models, in the constrained variants.
pub const CONSTRAINED_SHARES: [f64; 4] = [0.05, 0.10, 0.20, 0.30];

/// A constrained variant of `pods`, built like the FGD paper's "gpuspec" traces: each pod that
/// asks for GPUs names, with probability `share`, a spec drawn from `mix` by weight among those
/// with a node that can hold it (a model with as many GPUs on one node); `seed` makes it
/// reproducible. Pods without GPUs, and those no spec can hold, stay unconstrained.
pub fn constrained(
    pods: &[Request],
    nodes: &[Node],
    share: f64,
    mix: &ModelMix,
    seed: u64,
) -> Vec<Request> {
    use rand::{Rng as _, SeedableRng as _};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let most_gpus = |model: &str| {
        nodes
            .iter()
            .filter(|n| n.model == model)
            .map(|n| n.gpus.len() as u64)
            .max()
            .unwrap_or(0)
    };
    pods.iter()
        .map(|pod| {
            let mut pod = pod.clone();
            let gpus = match pod.gpu {
                GpuAsk::Share(_) => 1,
                GpuAsk::Whole(n) => u64::from(n),
                GpuAsk::None | GpuAsk::Mig(_) => return pod,
            };
            if !rng.random_bool(share) {
                return pod;
            }
            let fitting: Vec<&(String, f64)> = mix
                .specs
                .iter()
                .filter(|(spec, _)| spec.split('|').any(|m| most_gpus(m) >= gpus))
                .collect();
            let total: f64 = fitting.iter().map(|(_, w)| w).sum();
            let mut draw = rng.random::<f64>() * total;
            for (spec, weight) in fitting {
                draw -= weight;
                if draw <= 0.0 {
                    pod.models = spec.split('|').map(str::to_string).collect();
                    break;
                }
            }
            pod
        })
        .collect()
}

/// FGD as the paper's own simulator measured it, unallocated GPU % at 100% / 130% arrived, median
/// of its 10 seeds: from the artifact's `experiments/analysis/expected_results/
/// analysis_allo_discrete.csv` (hkust-adsl/kubernetes-scheduler-simulator), 100 − allocated %.
/// The artifact has these traces of the folder (and others the folder lacks).
const PAPER_FGD: &[(&str, f64, f64)] = &[
    ("default", 4.77, 4.60),
    ("cpu050", 5.00, 4.80),
    ("cpu100", 4.79, 4.66),
    ("cpu200", 5.18, 4.92),
    ("cpu250", 6.80, 6.59),
    ("gpushare100", 13.36, 13.09),
    ("gpushare40", 6.05, 5.86),
    ("gpushare60", 8.70, 8.59),
    ("gpushare80", 10.91, 10.69),
];

/// The table, and whether every target held: ours below our FGD — and below the paper's FGD
/// where it is published — at 100% on every trace, ≤ 4.0% on default, and one replay (130%, one
/// seed) under 5 s.
pub fn render(results: &[TraceResult], seeds: u64) -> (String, bool) {
    let mut out = String::new();
    let names: Vec<&str> = results
        .first()
        .map(|r| r.rows.iter().map(|(n, _, _)| n.as_str()).collect())
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "unallocated GPU % (median of {seeds} seed{}), at 100% / 130% arrived",
        if seeds == 1 { "" } else { "s" }
    );
    let _ = write!(out, "{:<12}", "trace");
    for n in &names {
        let _ = write!(out, " {n:>15}");
    }
    let _ = writeln!(out, " {:>15} {:>9}  result", "FGD (paper)", "ours s");
    let mut all_ok = true;
    for r in results {
        let _ = write!(out, "{:<12}", r.trace);
        for (_, a, b) in &r.rows {
            let _ = write!(out, " {:>7.2} / {:>5.2}", a, b);
        }
        let paper = PAPER_FGD.iter().find(|(t, _, _)| *t == r.trace);
        match paper {
            Some((_, a, b)) => {
                let _ = write!(out, " {:>7.2} / {:>5.2}", a, b);
            }
            None => {
                let _ = write!(out, " {:>15}", "-");
            }
        }
        let fgd = r.rows.iter().find(|(n, _, _)| n == "FGD").map(|x| x.1);
        let ours = r.rows.last().map(|x| x.1);
        let beats = matches!((ours, fgd), (Some(o), Some(f)) if o < f)
            && paper.is_none_or(|(_, a, _)| ours.is_some_and(|o| o < *a));
        let target = r.trace != "default" || ours.is_some_and(|o| o <= 4.0);
        let fast = r.ours_slowest < Duration::from_secs(5);
        let ok = beats && target && fast;
        all_ok &= ok;
        let _ = writeln!(
            out,
            " {:>9.2}  {}",
            r.ours_slowest.as_secs_f64(),
            if ok { "PASS" } else { "FAIL" }
        );
    }
    let _ = writeln!(
        out,
        "result: PASS when ours is below FGD at 100% (ours and the paper's, where published; ≤ 4.0% on default) and one replay to 130% takes under 5 s"
    );
    (out, all_ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(trace: &str, fgd: f64, ours: f64) -> TraceResult {
        TraceResult {
            trace: trace.to_string(),
            rows: vec![
                ("FGD".to_string(), fgd, fgd),
                ("gpuslice".to_string(), ours, ours),
            ],
            ours_slowest: Duration::from_secs(1),
        }
    }

    #[test]
    fn ours_must_beat_the_papers_fgd_too_where_it_is_published() {
        // Below our FGD but above the paper's 5.18 on cpu200: a failure.
        let (table, ok) = render(&[result("cpu200", 6.7, 5.5)], 10);
        assert!(!ok, "{table}");
        assert!(table.contains("5.18 /  4.92"), "{table}");
        // A trace the paper did not run is judged against our FGD alone.
        let (table, ok) = render(&[result("cpu300", 13.55, 13.2)], 10);
        assert!(ok, "{table}");
        // Default also needs the 4.0% target.
        assert!(!render(&[result("default", 4.5, 4.2)], 10).1);
        assert!(render(&[result("default", 5.5, 3.8)], 10).1);
    }
}
