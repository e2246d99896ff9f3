//! gpuslice in Argo CD: the health checks of our kinds (`argocd/health/gpuslice.io/<Kind>`),
//! rendered into `argocd-cm` by the chart, evaluated by Argo CD itself (built by
//! `tests/argocd/build.sh`) on a status fixture for every condition combination the operator and
//! the agent write; and the example GitOps folder's sync waves.

use std::path::Path;
use std::process::Command;

use gpuslice_testcluster::built_tool;

const KINDS: [&str; 3] = ["GpuPool", "GpuSlicePolicy", "GpuNode"];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[derive(serde::Deserialize)]
struct HealthTests {
    tests: Vec<HealthTest>,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct HealthTest {
    health_status: Health,
    input_path: String,
}

#[derive(serde::Deserialize, Debug, PartialEq)]
struct Health {
    status: String,
    message: String,
}

#[test]
fn argo_cd_shows_the_health_the_operator_reports_for_each_of_our_kinds() {
    let Some(argocd) = built_tool("GPUSLICE_ARGOCD_DIR", "argocd", "argocd") else {
        return;
    };
    let Some(helm) = built_tool("GPUSLICE_HELM", "helm", "") else {
        return;
    };
    // argocd-cm as a platform team gets it from the chart.
    let rendered = Command::new(&helm)
        .args(["template", "gpuslice"])
        .arg(root().join("charts/gpuslice"))
        .args([
            "--set",
            "argocd.healthChecks.enabled=true",
            "--show-only",
            "templates/argocd-health.yaml",
        ])
        .output()
        .unwrap();
    assert!(
        rendered.status.success(),
        "{}",
        String::from_utf8_lossy(&rendered.stderr)
    );
    let cm: serde_yaml::Value = serde_yaml::from_slice(&rendered.stdout).unwrap();
    let data = cm["data"].as_mapping().unwrap();
    assert_eq!(data.len(), KINDS.len(), "{data:?}");
    let dir = tempfile::tempdir().unwrap();
    let cm_path = dir.path().join("argocd-cm.yaml");
    std::fs::write(&cm_path, &rendered.stdout).unwrap();

    let mut failures = Vec::new();
    let mut checked = 0;
    for kind in KINDS {
        let here = root().join("argocd/health/gpuslice.io").join(kind);
        let lua = std::fs::read_to_string(here.join("health.lua")).unwrap();
        assert_eq!(
            data[format!("resource.customizations.health.gpuslice.io_{kind}").as_str()]
                .as_str()
                .map(str::trim_end),
            Some(lua.trim_end()),
            "the chart renders argocd/health/gpuslice.io/{kind}/health.lua as it is"
        );
        let tests: HealthTests =
            serde_yaml::from_str(&std::fs::read_to_string(here.join("health_test.yaml")).unwrap())
                .unwrap();
        let mut fixtures: Vec<String> = std::fs::read_dir(here.join("testdata"))
            .unwrap()
            .map(|e| format!("testdata/{}", e.unwrap().file_name().to_string_lossy()))
            .collect();
        fixtures.sort();
        let mut tested: Vec<String> = tests.tests.iter().map(|t| t.input_path.clone()).collect();
        tested.sort();
        assert_eq!(
            fixtures, tested,
            "{kind}: every fixture has its expected health"
        );
        for t in &tests.tests {
            let out = Command::new(&argocd)
                .args(["admin", "settings", "resource-overrides", "health"])
                .arg(here.join(&t.input_path))
                .arg("--argocd-cm-path")
                .arg(&cm_path)
                .env("HOME", dir.path())
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            let field = |name: &str| {
                stdout
                    .lines()
                    .find_map(|l| l.strip_prefix(name))
                    .unwrap_or_default()
                    .trim()
                    .to_string()
            };
            let got = Health {
                status: field("STATUS:"),
                message: field("MESSAGE:"),
            };
            checked += 1;
            if !out.status.success() || got != t.health_status {
                failures.push(format!(
                    "{kind} {}: expected {:?}, Argo CD says {got:?} (exit {}; {})",
                    t.input_path,
                    t.health_status,
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                        .lines()
                        .last()
                        .unwrap_or_default()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(checked >= 20, "only {checked} fixtures");
}
