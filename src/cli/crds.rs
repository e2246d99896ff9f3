//! `gpuslice crds`: the CustomResourceDefinitions written from the API types, or checked.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use gpuslice_api::Kind;

/// Write the CustomResourceDefinitions, generated from the API types, into a folder.
#[derive(clap::Args)]
pub struct Args {
    /// Where to write them.
    #[arg(long, default_value = "crds")]
    pub dir: PathBuf,
    /// Do not write: fail if the folder differs from the types.
    #[arg(long)]
    pub check: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let Args { dir, check } = args;
    let mut drifted = Vec::new();
    for kind in Kind::ALL {
        let file = dir.join(gpuslice_api::crd::file_name(kind));
        let want = gpuslice_api::crd::crd_yaml(kind);
        if check {
            if std::fs::read_to_string(&file).ok().as_deref() != Some(want.as_str()) {
                drifted.push(file.display().to_string());
            }
        } else {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            std::fs::write(&file, want).with_context(|| format!("writing {}", file.display()))?;
            println!("wrote {}", file.display());
        }
    }
    if drifted.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        for f in &drifted {
            eprintln!("{f} differs from the API types; run `gpuslice crds` and commit the result");
        }
        Ok(ExitCode::FAILURE)
    }
}
