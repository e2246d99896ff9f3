//! The elastic benchmark's smoke run on a small pool (eight GPUs of each model): the elastic
//! decision, fed the replay's own demand and forecast, must wait less than the best static layout
//! chosen in hindsight and than day/night windows, and re-cut within its bounds. The full table is
//! `gpuslice bench elastic --data <folder>`.

#[test]
fn elastic_layouts_wait_less_than_the_best_static_layout_and_re_cut_within_bounds() {
    let Some(dir) = gpuslice_testcluster::trace_data("openb_pod_list_default.csv") else {
        return;
    };
    let plan = gpuslice_bench::elastic::Plan {
        seed: 3,
        gpus_per_model: 8,
        load: 0.75,
        swing: 1.0,
    };
    let c = gpuslice_bench::elastic::compare(&dir, &plan).unwrap();
    let summary = format!("{c:#?}");
    assert!(c.pods > 1000, "{summary}");
    let forecast = &c.elastic_forecast;
    assert!(
        gpuslice_bench::elastic::wait_cut(&c) >= 0.25,
        "elastic + forecast must wait at least 25% less than the best static layout: {summary}"
    );
    assert!(forecast.mean_wait < c.windows.mean_wait, "{summary}");
    assert!(forecast.recuts_per_gpu_day <= 2.0, "{summary}");
    assert_eq!(c.best_static.recuts_per_gpu_day, 0.0, "{summary}");
    assert_eq!(c.best_static.lost_gpu_hours, 0.0, "{summary}");
    // Windows never drain; only the elastic decision may, for pods that wait.
    assert_eq!(c.windows.lost_gpu_hours, 0.0, "{summary}");
}
