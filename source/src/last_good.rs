//! A followed source's last good config (the standalone agent's view of its source): what is in force now. Each poll reads the source
//! (fetching Git), validates it, and when it is good makes it the last good config, saved under
//! the state directory so that it outlives restarts. When the source is bad or cannot be read,
//! the last good config stays in force and the problems are reported.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::{Follower, SourceFile, SourceSpec};
use chrono::{DateTime, Utc};
use gpuslice_api::{CheckpointPolicySpec, GpuPool, GpuSlicePolicySpec};
use serde::{Deserialize, Serialize};

use crate::validate::read_repository;

/// The configuration in force.
#[derive(Clone, Debug, Default)]
pub struct Config {
    pub pools: Vec<GpuPool>,
    pub checkpoints: BTreeMap<String, CheckpointPolicySpec>,
    pub policies: BTreeMap<String, GpuSlicePolicySpec>,
    /// The commit it came from (Git sources).
    pub revision: Option<String>,
}

/// How the last poll of the source went.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SourceStatus {
    /// The commit in force (Git sources).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// The commit just read, when it is not the one in force (it was rejected).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rejected: Option<String>,
    /// Why the source as read now is not used: validation problems, or why it could not be read.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
    /// Served from an earlier fetch (remote unreachable).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
    /// Whether a config is in force at all (none until the source has once been good).
    pub in_force: bool,
}

impl SourceStatus {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct SavedFile {
    path: String,
    text: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Saved {
    revision: Option<String>,
    files: Vec<SavedFile>,
}

/// A source followed by the agent, with its last good config.
pub struct Source {
    follower: Follower,
    saved_path: PathBuf,
    last_good: Option<Saved>,
}

impl Source {
    /// Follows `spec`; Git mirrors and the last good config live under `dir`.
    pub fn new(spec: SourceSpec, dir: &Path) -> Source {
        let dir = dir.to_path_buf();
        let saved_path = dir.join(format!("{}.last-good.json", crate::source_key(&spec)));
        // A saved config that cannot be read is as good as none: the source is read afresh.
        let last_good = std::fs::read(&saved_path)
            .ok()
            .and_then(|t| serde_json::from_slice(&t).ok());
        Source {
            follower: Follower::new(spec, &dir),
            saved_path,
            last_good,
        }
    }

    /// Reads the source and returns the config in force, with how the read went.
    pub fn refresh(&mut self, now: DateTime<Utc>) -> (Option<Config>, SourceStatus) {
        let mut status = SourceStatus::default();
        match self.follower.poll() {
            Err(e) => status.problems.push(e.to_string()),
            Ok(poll) => {
                status.warning = poll.warning;
                let (report, _) = read_repository(&poll.snapshot.files, now);
                if report.ok() {
                    let saved = Saved {
                        revision: poll.snapshot.revision.clone(),
                        files: poll
                            .snapshot
                            .files
                            .into_iter()
                            .map(|f| SavedFile {
                                path: f.path,
                                text: f.text,
                            })
                            .collect(),
                    };
                    if self.last_good.as_ref() != Some(&saved) {
                        if let Err(e) = self.save(&saved) {
                            status.warning = Some(format!(
                                "cannot save the config as last good ({e}); it is in force until the agent restarts"
                            ));
                        }
                        self.last_good = Some(saved);
                    }
                } else {
                    status.rejected = poll.snapshot.revision;
                    status
                        .problems
                        .extend(report.problems.iter().map(ToString::to_string));
                    status.problems.push(report.summary());
                }
            }
        }
        let config = self.last_good.as_ref().map(|saved| {
            let files: Vec<SourceFile> = saved
                .files
                .iter()
                .map(|f| SourceFile {
                    path: f.path.clone(),
                    text: f.text.clone(),
                })
                .collect();
            let (_, repo) = read_repository(&files, now);
            Config {
                pools: repo.pools.into_iter().map(|p| p.object).collect(),
                checkpoints: repo
                    .checkpoints
                    .into_iter()
                    .filter_map(|c| Some((c.object.metadata.name?, c.object.spec)))
                    .collect(),
                policies: repo
                    .policies
                    .into_iter()
                    .filter_map(|p| Some((p.object.metadata.name?, p.object.spec)))
                    .collect(),
                revision: saved.revision.clone(),
            }
        });
        status.in_force = config.is_some();
        status.revision = config.as_ref().and_then(|c| c.revision.clone());
        (config, status)
    }

    fn save(&self, saved: &Saved) -> std::io::Result<()> {
        let dir = self.saved_path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)?;
        let tmp = tempfile::NamedTempFile::new_in(dir)?;
        serde_json::to_writer(&tmp, saved)?;
        tmp.persist(&self.saved_path).map_err(|e| e.error)?;
        Ok(())
    }
}
