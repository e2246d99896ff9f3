//! `crds/` is generated from the API types: it must not drift, and `gpuslice crds --check` must
//! notice when it does.

use std::path::Path;
use std::process::Command;

use gpuslice_api::Kind;

const BIN: &str = env!("CARGO_BIN_EXE_gpuslice");

/// Both copies: `crds/`, and the chart's (which helm installs before its templates).
#[test]
fn crds_folder_matches_the_types() {
    for dir in ["crds", "charts/gpuslice/crds"] {
        crds_in(&Path::new(env!("CARGO_MANIFEST_DIR")).join(dir));
    }
}

fn crds_in(dir: &Path) {
    for kind in Kind::ALL {
        let file = dir.join(gpuslice_api::crd::file_name(kind));
        let on_disk =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        assert!(
            on_disk == gpuslice_api::crd::crd_yaml(kind),
            "{} differs from the {kind} type: run `cargo run -- crds` and \
             `cargo run -- crds --dir charts/gpuslice/crds`, and commit both",
            file.display()
        );
    }
    let entries = std::fs::read_dir(dir).unwrap().count();
    assert_eq!(
        entries,
        Kind::ALL.len(),
        "{} holds exactly one file per kind",
        dir.display()
    );
}

#[test]
fn check_mode_fails_on_drift_and_passes_after_regeneration() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("crds");
    let run = |args: &[&str]| {
        Command::new(BIN)
            .args(args)
            .arg("--dir")
            .arg(&dir)
            .output()
            .unwrap()
    };

    assert!(
        !run(&["crds", "--check"]).status.success(),
        "an empty folder is drift"
    );
    assert!(run(&["crds"]).status.success());
    assert!(run(&["crds", "--check"]).status.success());

    let pool = dir.join("gpupools.gpuslice.io.yaml");
    let edited = std::fs::read_to_string(&pool)
        .unwrap()
        .replace("slices × compute must be at most 100", "anything goes");
    std::fs::write(&pool, edited).unwrap();
    let out = run(&["crds", "--check"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("gpupools.gpuslice.io.yaml differs"));
}

/// The Helm chart installs exactly the generated CRDs.
#[test]
fn chart_crds_are_the_generated_ones() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for kind in gpuslice_api::Kind::ALL {
        let name = gpuslice_api::crd::file_name(kind);
        let chart = std::fs::read_to_string(root.join("charts/gpuslice/crds").join(&name))
            .unwrap_or_else(|e| panic!("charts/gpuslice/crds/{name}: {e}"));
        assert!(
            chart == gpuslice_api::crd::crd_yaml(kind),
            "charts/gpuslice/crds/{name} is stale: run `cargo run -- crds --dir charts/gpuslice/crds`"
        );
    }
}

/// The chart holds each Argo CD health script (helm warns about symbolic links in a chart);
/// `argocd/health/`, where Argo CD's layout tests it, links to it: one script, tested and shipped.
#[test]
fn the_charts_health_scripts_are_the_tested_ones() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tested = root.join("argocd/health/gpuslice.io");
    let shipped = root.join("charts/gpuslice/files/argocd-health");
    let kinds = |dir: &Path| -> Vec<String> {
        let mut all: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        all.sort();
        all
    };
    assert_eq!(kinds(&tested), kinds(&shipped));
    for kind in kinds(&tested) {
        let script = |dir: &Path| dir.join(&kind).join("health.lua").canonicalize().unwrap();
        assert!(
            script(&tested) == script(&shipped),
            "argocd/health/gpuslice.io/{kind}/health.lua is not a link to \
             charts/gpuslice/files/argocd-health/{kind}/health.lua"
        );
    }
}
