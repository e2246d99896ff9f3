//! `gpuslice bench elastic`: two weeks of arrivals and departures replayed event by event on a
//! pool of A100, H100 and H200 GPUs, under four ways of shaping it: the best static layout
//! (chosen in hindsight among every split of the GPUs between the shapes), day and night
//! windows, and the elastic decision ([`gpuslice_planning::elastic::decide`], the operator's)
//! without and with its forecast. The first week warms the forecast up; the table measures the
//! second.
//!
//! The workload: the Alibaba trace's pods give the sizes (`gpu_milli`, `num_gpu`) and run times
//! (`deletion_time - creation_time`, between 2 minutes and 12 hours); the trace's own arrival
//! times are spread over 149 days, so arrivals are drawn anew with a diurnal mix: notebooks
//! (a share of at most a quarter GPU) and inference (at most half) by day, training (more than
//! half a GPU, or several whole GPUs) at night and at weekends.

mod replay;
mod timing;
mod workload;

use std::fmt::Write as _;
use std::path::Path;

use gpuslice_planning::elastic::{Forecast, Rules};

use crate::placement::BenchError;

pub use replay::Outcome;
use replay::{Shaper, model_slots, replay, shapes};
pub use timing::{decision_time, shaping_time};
pub use workload::Plan;
use workload::{DAY, GPU_SHARE, HOUR, MODELS, Pod, WEEK, arrivals, sizes};

/// Every split of `n` GPUs between three shapes, in steps of `step`.
fn splits(n: u32, step: u32) -> Vec<[u32; 3]> {
    let mut all = Vec::new();
    for a in (0..=n).step_by(step as usize) {
        for b in (0..=n - a).step_by(step as usize) {
            all.push([a, b, n - a - b]);
        }
    }
    all
}

/// One shape per GPU: each model's GPUs split the same way.
fn per_gpu(split: [u32; 3], models: usize) -> Vec<usize> {
    (0..models)
        .flat_map(|_| {
            split
                .iter()
                .enumerate()
                .flat_map(|(s, &n)| std::iter::repeat_n(s, n as usize))
        })
        .collect()
}

/// The split a team would declare for some hours from last week's demand: GPUs in proportion
/// to each class's GPU-seconds asked in those hours.
fn split_for(pods: &[Pod], per_model: u32, hours: impl Fn(f64) -> bool) -> [u32; 3] {
    let mut asked = [0.0f64; 3];
    for p in pods.iter().filter(|p| p.arrival < WEEK && hours(p.arrival)) {
        asked[p.class] += p.work * f64::from(p.gpus) * GPU_SHARE[p.class];
    }
    let total: f64 = asked.iter().sum::<f64>().max(1.0);
    let mut split = asked.map(|a| (a / total * f64::from(per_model)).round() as u32);
    let sum: u32 = split.iter().sum();
    // Rounding may miss by one either way; the largest share absorbs it.
    let largest = (0..3)
        .max_by(|&a, &b| asked[a].total_cmp(&asked[b]))
        .unwrap_or(2);
    split[largest] = (split[largest] + per_model).saturating_sub(sum);
    split
}

/// The four ways of shaping the pool on the same arrivals, and the decision's time at scale.
#[derive(Clone, Debug)]
pub struct Comparison {
    pub pool_gpus: u32,
    pub pods: usize,
    pub best_static: Outcome,
    pub windows: Outcome,
    pub elastic: Outcome,
    pub elastic_forecast: Outcome,
    /// The decision's time on 1,000 nodes × 8 GPUs, seconds.
    pub decision_seconds: f64,
    /// The operator's whole elastic step on 1,000 nodes × 8 GPUs, seconds.
    pub shaping_seconds: f64,
}

/// Replays the arrivals `plan` makes from the trace in `data` under each way of shaping.
pub fn compare(data: &Path, plan: &Plan) -> Result<Comparison, BenchError> {
    let sizes = sizes(&data.join("openb_pod_list_default.csv"))?;
    let per_model = plan.gpus_per_model.max(1);
    let pool_gpus = per_model * MODELS.len() as u32;
    let pods = arrivals(&sizes, pool_gpus, plan);
    let (shapes, layouts) = shapes();
    let layouts = model_slots(&layouts);
    let models = MODELS.len();
    let run =
        |name: &str, shaper: Shaper| replay(name, &pods, per_model, shaper, &shapes, &layouts);

    let step = (per_model / 8).max(1);
    let mut best: Option<(Outcome, [u32; 3])> = None;
    for split in splits(per_model, step) {
        let o = run("static", Shaper::Static(per_gpu(split, models)));
        if best.as_ref().is_none_or(|(b, _)| o.mean_wait < b.mean_wait) {
            best = Some((o, split));
        }
    }
    let (mut best_static, split) = best.expect("at least one split");
    best_static.name = format!("best static {}/{}/{}", split[0], split[1], split[2]);
    let by_day = |t: f64| (8.0..20.0).contains(&((t % DAY) / HOUR));
    let day = split_for(&pods, per_model, by_day);
    let night = split_for(&pods, per_model, |t| !by_day(t));
    let windows = run(
        &format!(
            "windows {}/{}/{} · {}/{}/{}",
            day[0], day[1], day[2], night[0], night[1], night[2]
        ),
        Shaper::Windows {
            day: per_gpu(day, models),
            night: per_gpu(night, models),
        },
    );
    let rules = Rules {
        min_dwell: 1800.0,
        max_in_flight: (pool_gpus / 10).max(1),
        drain: true,
        min_gain: 1.0,
    };
    let elastic = |forecast: Option<Forecast>, name: &str| {
        run(
            name,
            Shaper::Elastic {
                forecast,
                rules: rules.clone(),
            },
        )
    };
    Ok(Comparison {
        pool_gpus,
        pods: pods.len(),
        best_static,
        windows,
        elastic: elastic(None, "elastic"),
        elastic_forecast: elastic(Some(Forecast::default()), "elastic + forecast"),
        decision_seconds: decision_time(&layouts, &shapes),
        shaping_seconds: shaping_time(),
    })
}

/// How much lower elastic + forecast's mean wait is than the best static layout's (0–1).
pub fn wait_cut(c: &Comparison) -> f64 {
    1.0 - c.elastic_forecast.mean_wait / c.best_static.mean_wait.max(1e-9)
}

/// Runs the comparison; the table and whether every target holds.
pub fn run(data: &Path, plan: Plan) -> Result<(String, bool), BenchError> {
    let c = compare(data, &plan)?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "elastic layouts: {} GPUs ({} each of A100 80GB, H100 80GB, H200), shapes 4x20Gi/2x40Gi/whole, \
         {} pods over two weeks (seed {}, load {}, swing {}), the second week measured",
        c.pool_gpus,
        plan.gpus_per_model.max(1),
        c.pods,
        plan.seed,
        plan.load,
        plan.swing
    );
    let _ = writeln!(
        out,
        "| layout | mean wait s | p95 wait s | allocated % | re-cuts / GPU / day | GPU-h lost to drains |\n|---|---:|---:|---:|---:|---:|"
    );
    for o in [&c.best_static, &c.windows, &c.elastic, &c.elastic_forecast] {
        let _ = writeln!(
            out,
            "| {} | {:.0} | {:.0} | {:.1} | {:.2} | {:.1} |",
            o.name,
            o.mean_wait,
            o.p95_wait,
            o.allocated * 100.0,
            o.recuts_per_gpu_day,
            o.lost_gpu_hours
        );
    }
    let cut = wait_cut(&c);
    let recuts = c.elastic_forecast.recuts_per_gpu_day;
    let checks = [
        (
            "elastic + forecast: mean wait below the best static layout's",
            format!("{:.0}% lower", cut * 100.0),
            "≥ 25% lower",
            cut >= 0.25,
        ),
        (
            "elastic + forecast: re-cuts per GPU per day",
            format!("{recuts:.2}"),
            "≤ 2",
            recuts <= 2.0,
        ),
        (
            "the decision for 1,000 nodes × 8 GPUs",
            format!("{:.1} ms", c.decision_seconds * 1000.0),
            "< 100 ms",
            c.decision_seconds < 0.1,
        ),
        (
            "the operator's elastic step (GPUs read, decision, re-plans) for 1,000 nodes × 8 GPUs",
            format!("{:.1} ms", c.shaping_seconds * 1000.0),
            "< 100 ms",
            c.shaping_seconds < 0.1,
        ),
    ];
    let _ = writeln!(
        out,
        "\n| target | measured | goal | result |\n|---|---:|---:|---|"
    );
    let mut ok = true;
    for (what, measured, goal, pass) in checks {
        ok &= pass;
        let _ = writeln!(
            out,
            "| {what} | {measured} | {goal} | {} |",
            if pass { "PASS" } else { "FAIL" }
        );
    }
    Ok((out, ok))
}

#[cfg(test)]
mod tests {
    use super::workload::{START, profile};
    use super::*;
    use chrono::DateTime;

    #[test]
    fn every_split_adds_up_to_the_models_gpus() {
        let all = splits(16, 2);
        assert_eq!(all.len(), 45);
        assert!(all.iter().all(|s| s.iter().sum::<u32>() == 16));
    }

    #[test]
    fn notebooks_are_busy_by_day_and_training_by_night() {
        let monday = |h: f64| h * HOUR;
        assert_eq!(profile(0, monday(10.0)), 1.0);
        assert!(profile(0, monday(23.0)) < 0.2);
        assert!(profile(2, monday(10.0)) < 0.2);
        assert_eq!(profile(2, monday(23.0)), 1.0);
        assert_eq!(hour(START), 0, "the replay starts on a Monday at midnight");
    }

    fn hour(timestamp: i64) -> usize {
        gpuslice_planning::elastic::hour_of_week(DateTime::from_timestamp(timestamp, 0).unwrap())
    }
}
