//! `gpuslice validate`: a GitOps folder or repository checked as the operator would.

use std::process::ExitCode;

use gpuslice_source::SourceSpec;
use gpuslice_source::validate::validate_files;

use super::Output;

/// Check a GitOps folder or repository: every error as file:line: Kind/name: field: reason.
#[derive(clap::Args)]
pub struct Args {
    /// A folder, a YAML file, a local Git repository or a Git URL.
    pub source: String,
    /// Git branch, tag or commit to read (a local folder is read from disk when omitted).
    #[arg(long = "ref")]
    pub git_ref: Option<String>,
    /// Sub-folder of the source to read.
    #[arg(long)]
    pub path: Option<String>,
    /// Output format.
    #[arg(long, short, value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let Args {
        source,
        git_ref,
        path,
        output,
    } = args;
    let spec = SourceSpec {
        location: source,
        git_ref,
        sub_path: path,
    };
    let snapshot = gpuslice_source::load(&spec)?;
    let mut report = validate_files(&snapshot.files, chrono::Utc::now());
    report.revision = snapshot.revision;
    match output {
        Output::Text => {
            for p in &report.problems {
                println!("{p}");
            }
            println!("{}", report.summary());
        }
        Output::Json => println!("{}", serde_json::to_string_pretty(&report)?),
    }
    Ok(if report.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
