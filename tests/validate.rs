//! `gpuslice validate` on the examples (must pass) and on a corpus of broken documents (each
//! must fail with the expected field and reason, at a real line), from folders and from Git.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_gpuslice");

fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn validate(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("validate")
        .args(args)
        .output()
        .expect("gpuslice runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Fields the examples declare that no code acts on yet: each is a warning, file:line, field.
const INERT: &str = "declared but not enforced yet";

#[test]
fn the_examples_pass_warning_only_about_fields_not_enforced_yet() {
    let out = validate(&[repo_path("examples/gitops").to_str().unwrap()]);
    let text = stdout(&out);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = text.lines().last().unwrap_or_default();
    assert!(summary.starts_with("ok: 0 errors, "), "{text}");
    assert!(text.contains("10 gpuslice objects, 2 workloads"), "{text}");
    let warnings: Vec<&str> = text.lines().filter(|l| l.contains("warning:")).collect();
    assert!(warnings.iter().all(|w| w.contains(INERT)), "{warnings:#?}");
    // The chart's admission policy enforces it.
    assert!(
        !warnings.iter().any(|w| w.contains("namespaceSelector")),
        "{warnings:#?}"
    );
    // Fault isolation, I/O limits, the dataset cache, compaction and checkpoint storage on a
    // claim work: no longer warnings.
    assert!(
        !warnings.iter().any(|w| w.contains("spec.faultIsolation")
            || w.contains("spec.io")
            || w.contains("spec.compaction")
            || w.contains("spec.storage")),
        "{warnings:#?}"
    );
}

/// Copies the examples and one broken file into a fresh folder.
fn with_examples(broken: &Path) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    gpuslice_testcluster::copy_dir(&repo_path("examples/gitops"), &tmp.path().join("gitops"));
    std::fs::copy(broken, tmp.path().join(broken.file_name().unwrap())).unwrap();
    tmp
}

/// `# expect: <field path> | <text in the message>` lines at the top of a corpus file.
fn expectations(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# expect:"))
        .map(|l| {
            let (path, message) = l
                .split_once('|')
                .expect("expect lines are `path | message`");
            (path.trim().to_string(), message.trim().to_string())
        })
        .collect()
}

#[derive(serde::Deserialize)]
struct JsonProblem {
    file: String,
    line: usize,
    path: String,
    message: String,
    severity: String,
}

#[derive(serde::Deserialize)]
struct JsonReport {
    errors: usize,
    problems: Vec<JsonProblem>,
}

#[test]
fn every_broken_document_fails_with_its_field_and_reason() {
    let corpus = repo_path("tests/corpus/invalid");
    let mut files: Vec<_> = std::fs::read_dir(&corpus)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(files.len() >= 30, "the corpus has {} files", files.len());
    for file in files {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&file).unwrap();
        let expected = expectations(&text);
        assert!(!expected.is_empty(), "{name} has no `# expect:` line");
        let tmp = with_examples(&file);
        let out = validate(&[tmp.path().to_str().unwrap(), "--output", "json"]);
        let report: JsonReport = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{name}: {e}: {}", stdout(&out)));
        let only_warnings = expected.iter().all(|(_, m)| m.starts_with("warning:"));
        assert_eq!(
            out.status.success(),
            only_warnings,
            "{name}: exit status {:?}",
            out.status
        );
        assert_eq!(report.errors == 0, only_warnings, "{name}");
        let lines: Vec<&str> = text.lines().collect();
        for problem in report
            .problems
            .iter()
            .filter(|p| !p.message.contains(INERT))
        {
            assert!(
                problem.file.ends_with(&name),
                "{name}: a problem outside the broken file: {} {}: {}",
                problem.file,
                problem.path,
                problem.message
            );
            assert!(
                (1..=lines.len()).contains(&problem.line),
                "{name}: line {} out of range",
                problem.line
            );
        }
        for (path, message) in &expected {
            let (severity, message) = match message.strip_prefix("warning:") {
                Some(m) => ("warning", m.trim()),
                None => ("error", message.as_str()),
            };
            let hit = report
                .problems
                .iter()
                .find(|p| &p.path == path && p.message.contains(message) && p.severity == severity);
            let Some(hit) = hit else {
                let got: Vec<String> = report
                    .problems
                    .iter()
                    .map(|p| format!("{}: {}", p.path, p.message))
                    .collect();
                panic!("{name}: expected {path}: {message}; got {got:#?}");
            };
            // The line shown is where the field (or its nearest parent) is written.
            if let Some(key) = path
                .rsplit('.')
                .next()
                .filter(|k| !k.is_empty() && !k.ends_with(']') && !hit.message.contains("missing"))
            {
                let key = key.rsplit('/').next().unwrap_or(key);
                assert!(
                    lines[hit.line - 1].contains(key),
                    "{name}: line {} ({:?}) does not show {key}",
                    hit.line,
                    lines[hit.line - 1]
                );
            }
        }
    }
}

#[test]
fn all_problems_of_a_repository_are_reported_in_one_run() {
    let tmp = tempfile::tempdir().unwrap();
    gpuslice_testcluster::copy_dir(&repo_path("examples/gitops"), &tmp.path().join("gitops"));
    let corpus = repo_path("tests/corpus/invalid");
    for name in [
        "pool-unknown-time-zone.yaml",
        "policy-unknown-pool.yaml",
        "checkpoint-uncatchable-signal.yaml",
    ] {
        std::fs::copy(corpus.join(name), tmp.path().join(name)).unwrap();
    }
    let out = validate(&[tmp.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert!(text.contains("pool-unknown-time-zone.yaml:13: GpuPool/p6: spec.windows[0].timeZone: \"Mars/Olympus\" is not an IANA time zone"), "{text}");
    assert!(
        text.contains("policy-unknown-pool.yaml:8: GpuSlicePolicy/g2: spec.pool:"),
        "{text}"
    );
    assert!(
        text.contains("checkpoint-uncatchable-signal.yaml:9: CheckpointPolicy/c2: spec.signal:"),
        "{text}"
    );
    assert!(text.contains("FAILED: 3 errors"), "{text}");
}

#[test]
fn a_missing_source_is_a_usage_error() {
    let out = validate(&["/nonexistent/gitops"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("/nonexistent/gitops: no such file, folder or Git repository")
    );
}

fn git(dir: &Path, args: &[&str]) {
    let status = Command::new("git")
        .current_dir(dir)
        .args([
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@example.com",
            "-c",
            "init.defaultBranch=main",
        ])
        .args(args)
        .status()
        .expect("git runs");
    assert!(status.success(), "git {args:?}");
}

#[test]
fn reads_a_ref_and_sub_folder_of_a_git_repository_locally_and_by_url() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("config");
    gpuslice_testcluster::copy_dir(&repo_path("examples/gitops"), &repo.join("clusters/prod"));
    std::fs::write(repo.join("README.md"), "not yaml\n").unwrap();
    git(&repo, &["init", "-q"]);
    git(&repo, &["add", "."]);
    git(&repo, &["commit", "-qm", "good"]);
    git(&repo, &["tag", "v1"]);
    // Break the working tree and a later commit; the tag stays good.
    std::fs::copy(
        repo_path("tests/corpus/invalid/policy-unknown-pool.yaml"),
        repo.join("clusters/prod/broken.yaml"),
    )
    .unwrap();
    git(&repo, &["add", "."]);
    git(&repo, &["commit", "-qm", "broken"]);

    let repo_str = repo.to_str().unwrap();
    let good = validate(&[repo_str, "--ref", "v1", "--path", "clusters/prod"]);
    assert!(good.status.success(), "{}", stdout(&good));
    let bad = validate(&[
        repo_str,
        "--ref",
        "main",
        "--path",
        "clusters/prod",
        "--output",
        "json",
    ]);
    assert_eq!(bad.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&bad.stdout).unwrap();
    assert_eq!(report["problems"][0]["file"], "clusters/prod/broken.yaml");
    assert_eq!(report["revision"].as_str().map(str::len), Some(40));

    let url = format!("file://{repo_str}");
    let remote_good = validate(&[&url, "--ref", "v1", "--path", "clusters/prod"]);
    assert!(
        remote_good.status.success(),
        "{}{}",
        stdout(&remote_good),
        String::from_utf8_lossy(&remote_good.stderr)
    );
    let remote_bad = validate(&[&url, "--ref", "main", "--path", "clusters/prod"]);
    assert_eq!(remote_bad.status.code(), Some(1), "{}", stdout(&remote_bad));

    let no_ref = validate(&[repo_str, "--ref", "v9"]);
    assert_eq!(no_ref.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&no_ref.stderr).contains("ref \"v9\" not found"));
}

#[test]
fn a_policy_that_only_an_elastic_shape_holds_is_a_warning_not_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(
        tmp.path().join("pool.yaml"),
        r#"apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata:
  name: elastic-a100
spec:
  nodeSelector:
    matchLabels: {gpuslice.io/pool: elastic-a100}
  gpuSelector: {models: ["NVIDIA A100-SXM4-80GB"]}
  layout:
    software: {slices: 4, memory: 20Gi, compute: 25}
  elastic:
    shapes:
    - name: quarters
      layout:
        software: {slices: 4, memory: 20Gi, compute: 25}
    - name: whole
      layout: {exclusive: {}}
    drain: Checkpointable
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata:
  name: training
spec:
  pool: elastic-a100
  memory: 70Gi
"#,
    )
    .unwrap();
    let out = validate(&[tmp.path().to_str().unwrap()]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(
            "spec.memory: warning: the default layout of pool \"elastic-a100\" does not hold it"
        ) && text.contains("it runs once the elastic set re-cuts a GPU to whole"),
        "{text}"
    );
    // The operator acts on the elastic set: nothing about it is inert.
    assert!(!text.contains("not enforced yet"), "{text}");
}
