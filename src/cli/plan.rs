//! `gpuslice plan`: what the pools of a source do to an inventory, or what a change does.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use gpuslice_source::SourceSpec;
use gpuslice_source::validate::read_repository;

#[derive(Clone, Copy, PartialEq, clap::ValueEnum)]
pub enum PlanOutput {
    Text,
    Json,
    Markdown,
}

/// Plan every GPU of an inventory against the pools of a source: layout now, operations, next
/// change. With --against, what a change does: the GPUs it re-cuts, the busy slices that would
/// block it and whose workloads they are, the windows it changes (exit 2 when it would wait
/// for running work, 1 when it cannot be planned).
#[derive(clap::Args)]
pub struct Args {
    /// A folder, a YAML file, a local Git repository or a Git URL (as for validate).
    pub source: String,
    /// A node (NodeInventory: name, labels, GPUs with model and current state), a YAML list
    /// of them, or the cluster's GpuNodes (`kubectl get gpunodes -o yaml`).
    #[arg(long)]
    pub nodes: PathBuf,
    /// The instant to plan for (RFC 3339, e.g. 2026-12-02T21:00:00+08:00); now by default.
    #[arg(long)]
    pub at: Option<chrono::DateTime<chrono::FixedOffset>>,
    /// The revision to plan (the folder as it is on disk when omitted).
    #[arg(long = "ref")]
    pub git_ref: Option<String>,
    /// Compare with this Git revision of the same repository (the pull request's base,
    /// e.g. origin/main): only what differs is shown.
    #[arg(long)]
    pub against: Option<String>,
    #[arg(long)]
    pub path: Option<String>,
    /// Output format; markdown (with --against) is for a pull-request comment.
    #[arg(long, short, value_enum, default_value_t = PlanOutput::Text)]
    pub output: PlanOutput,
    /// Show what compaction would move in each pool with `spec.compaction` (from the
    /// GpuNodes' claims: who holds which software slice), instead of the layouts.
    #[arg(long, conflicts_with = "against")]
    pub compaction: bool,
    /// Show what the elastic set of each pool that has one in force would decide now (the
    /// shapes it would re-cut GPUs to, and why), from the GpuNodes' spec and claims and the
    /// pods `--waiting` names, instead of the layouts. The forecast a cluster has learned lives
    /// in its pools' status and is not read here.
    #[arg(long, conflicts_with_all = ["against", "compaction"])]
    pub elastic: bool,
    /// With --elastic: pods waiting for a policy, `POLICY=COUNT` (repeat for several).
    #[arg(long, value_parser = parse_waiting, requires = "elastic")]
    pub waiting: Vec<(String, u32)>,
}

/// `POLICY=COUNT`.
fn parse_waiting(text: &str) -> Result<(String, u32), String> {
    let (policy, count) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?}: expected POLICY=COUNT, e.g. training=3"))?;
    let count = count
        .parse()
        .map_err(|_| format!("{text:?}: the count {count:?} is not a whole number"))?;
    Ok((policy.to_string(), count))
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let Args {
        source,
        nodes,
        at,
        git_ref,
        against,
        path,
        output,
        compaction,
        elastic,
        waiting,
    } = args;
    let at = at.map_or_else(chrono::Utc::now, |t| t.with_timezone(&chrono::Utc));
    let text =
        std::fs::read_to_string(&nodes).with_context(|| format!("reading {}", nodes.display()))?;
    let inventory = gpuslice::plan::parse_inventory(&nodes.display().to_string(), &text)?;
    let head_name = git_ref.clone().unwrap_or_else(|| "the working tree".into());
    let Some((head, policies, checkpoints)) =
        config_of(&source, git_ref, path.clone(), at, &head_name)?
    else {
        return Ok(ExitCode::FAILURE);
    };
    if elastic {
        let waiting = waiting.into_iter().collect();
        let plan = gpuslice::plan::elastic(
            &gpuslice::plan::Declared {
                pools: &head,
                policies: &policies,
                checkpoints: &checkpoints,
            },
            &inventory,
            &waiting,
            at,
        );
        match output {
            PlanOutput::Json => println!("{}", serde_json::to_string_pretty(&plan)?),
            _ => print!("{}", gpuslice::plan::render_elastic(&plan)),
        }
        return Ok(ExitCode::SUCCESS);
    }
    if compaction {
        let plan = gpuslice_planning::cluster::plan_cluster(&head, &inventory.nodes, at);
        let plans = gpuslice::plan::compaction(&head, &policies, &plan, &inventory);
        match output {
            PlanOutput::Json => println!("{}", serde_json::to_string_pretty(&plans)?),
            _ => print!("{}", gpuslice::plan::render_compaction(&plans)),
        }
        return Ok(ExitCode::SUCCESS);
    }
    let Some(base_ref) = against else {
        let plan = gpuslice_planning::cluster::plan_cluster(&head, &inventory.nodes, at);
        match output {
            PlanOutput::Text => print!("{}", gpuslice::plan::render(&plan)),
            PlanOutput::Json => println!("{}", serde_json::to_string_pretty(&plan)?),
            PlanOutput::Markdown => {
                eprintln!("--output markdown shows a change: give --against <base revision>");
                return Ok(ExitCode::FAILURE);
            }
        }
        return Ok(if gpuslice::plan::has_errors(&plan) {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        });
    };
    let Some(base) = pools_of(&source, Some(base_ref.clone()), path, at, &base_ref)? else {
        return Ok(ExitCode::FAILURE);
    };
    let diff = gpuslice_planning::diff::diff(&base, &head, &inventory.nodes, at);
    match output {
        PlanOutput::Text => print!(
            "{}",
            gpuslice::plan::render_diff(&diff, &inventory, &base_ref, &head_name)
        ),
        PlanOutput::Json => println!("{}", serde_json::to_string_pretty(&diff)?),
        PlanOutput::Markdown => print!(
            "{}",
            gpuslice::plan::render_diff_markdown(&diff, &inventory, &base_ref, &head_name)
        ),
    }
    Ok(if diff.head_errors().next().is_some() {
        ExitCode::FAILURE
    } else if diff.blocks_on_running_work() {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    })
}

/// The pools of one revision of a source, or `None` (after printing why) when it does not
/// validate: a plan of a broken revision would mislead.
fn pools_of(
    location: &str,
    git_ref: Option<String>,
    sub_path: Option<String>,
    at: chrono::DateTime<chrono::Utc>,
    revision: &str,
) -> anyhow::Result<Option<Vec<gpuslice_api::GpuPool>>> {
    Ok(config_of(location, git_ref, sub_path, at, revision)?.map(|(pools, ..)| pools))
}

/// The pools and policies of a source's revision; `None` (after saying why) when it does not
/// validate.
/// A revision's pools, policies and CheckpointPolicies.
type Objects = (
    Vec<gpuslice_api::GpuPool>,
    Vec<gpuslice_api::GpuSlicePolicy>,
    Vec<gpuslice_api::CheckpointPolicy>,
);

fn config_of(
    location: &str,
    git_ref: Option<String>,
    sub_path: Option<String>,
    at: chrono::DateTime<chrono::Utc>,
    revision: &str,
) -> anyhow::Result<Option<Objects>> {
    let spec = SourceSpec {
        location: location.to_string(),
        git_ref,
        sub_path,
    };
    let snapshot = gpuslice_source::load(&spec)
        .with_context(|| format!("reading {revision} of {location}"))?;
    let (report, repo) = read_repository(&snapshot.files, at);
    if !report.ok() {
        for p in &report.problems {
            eprintln!("{p}");
        }
        eprintln!(
            "{revision}: {}; fix the source before planning",
            report.summary()
        );
        return Ok(None);
    }
    Ok(Some((
        repo.pools.into_iter().map(|p| p.object).collect(),
        repo.policies.into_iter().map(|p| p.object).collect(),
        repo.checkpoints.into_iter().map(|p| p.object).collect(),
    )))
}
