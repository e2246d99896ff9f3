//! Following a source over time, for the agent's loop. A Git source (a URL, or a path that is a
//! repository) is mirrored into a bare repository under the agent's state directory and fetched
//! on every poll with forced refspecs, so a force-push simply moves the branch. When a fetch
//! fails (the remote is unreachable or gone), the last fetched commit is still served, with a
//! warning. A folder is re-read on every poll.

use std::path::{Path, PathBuf};

use crate::{Snapshot, SourceError, SourceSpec, git_error, load, load_tree, looks_like_url};

/// What one poll read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Poll {
    pub snapshot: Snapshot,
    /// Set when the source could not be refreshed and an earlier fetch is served.
    pub warning: Option<String>,
}

/// A source followed over time.
pub struct Follower {
    spec: SourceSpec,
    /// The bare mirror of a Git source; `None` for a folder.
    mirror: Option<PathBuf>,
}

/// A name for a source that is safe as a file name and stable across runs.
pub fn source_key(spec: &SourceSpec) -> String {
    let key = format!(
        "{}\n{}\n{}",
        spec.location,
        spec.git_ref.as_deref().unwrap_or(""),
        spec.sub_path.as_deref().unwrap_or("")
    );
    git2::Oid::hash_object(git2::ObjectType::Blob, key.as_bytes())
        .map(|oid| oid.to_string())
        .unwrap_or_else(|_| key.chars().filter(char::is_ascii_alphanumeric).collect())
}

fn is_git(location: &str) -> bool {
    looks_like_url(location) || git2::Repository::open(location).is_ok()
}

impl Follower {
    /// Follows `spec`, keeping a Git mirror under `cache` when the source is a repository.
    pub fn new(spec: SourceSpec, cache: &Path) -> Follower {
        let mirror =
            is_git(&spec.location).then(|| cache.join(format!("{}.git", source_key(&spec))));
        Follower { spec, mirror }
    }

    /// Reads the source as it is now, or as last fetched when it cannot be reached.
    pub fn poll(&mut self) -> Result<Poll, SourceError> {
        let Some(mirror) = &self.mirror else {
            return Ok(Poll {
                snapshot: load(&self.spec)?,
                warning: None,
            });
        };
        let repo = open_mirror(mirror, &self.spec.location)?;
        let fetched = fetch(&repo, &self.spec.location);
        let snapshot = self.read(&repo);
        match (fetched, snapshot) {
            (Ok(()), snapshot) => Ok(Poll {
                snapshot: snapshot?,
                warning: None,
            }),
            (Err(e), Ok(snapshot)) => {
                let commit = snapshot.revision.clone().unwrap_or_default();
                Ok(Poll {
                    warning: Some(format!(
                        "{e}; keeping commit {} fetched earlier",
                        &commit[..commit.len().min(12)]
                    )),
                    snapshot,
                })
            }
            (Err(e), Err(_)) => Err(e),
        }
    }

    /// The tree the ref names in the mirror: a remote branch, a tag, a commit, or the remote's
    /// default branch when no ref is given.
    fn read(&self, repo: &git2::Repository) -> Result<Snapshot, SourceError> {
        let candidates: Vec<String> = match &self.spec.git_ref {
            Some(r) => vec![
                format!("refs/remotes/origin/{r}"),
                format!("refs/tags/{r}"),
                r.clone(),
            ],
            None => vec!["refs/remotes/origin/HEAD".into()],
        };
        let mut first = None;
        for name in &candidates {
            match load_tree(repo, &self.spec, name) {
                Ok(mut snapshot) => {
                    snapshot.files.sort_by(|a, b| a.path.cmp(&b.path));
                    return Ok(snapshot);
                }
                Err(e @ SourceError::UnknownRef { .. }) => {
                    first.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(SourceError::UnknownRef {
            location: self.spec.location.clone(),
            git_ref: self.spec.git_ref.clone().unwrap_or_else(|| "HEAD".into()),
            message: first.map_or_else(String::new, |e| match e {
                SourceError::UnknownRef { message, .. } => message,
                other => other.to_string(),
            }),
        })
    }
}

fn open_mirror(path: &Path, location: &str) -> Result<git2::Repository, SourceError> {
    let repo = match git2::Repository::open_bare(path) {
        Ok(repo) => repo,
        Err(_) => {
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|source| SourceError::Io {
                    path: parent.display().to_string(),
                    source,
                })?;
            }
            git2::Repository::init_bare(path).map_err(|e| git_error(location, e))?
        }
    };
    // A relative path is resolved against the agent's working directory, not the mirror's.
    let url = if looks_like_url(location) {
        location.to_string()
    } else {
        std::fs::canonicalize(location)
            .map_or_else(|_| location.to_string(), |p| p.display().to_string())
    };
    let current = repo
        .find_remote("origin")
        .ok()
        .and_then(|r| r.url().ok().map(str::to_string));
    match current {
        Some(u) if u == url => {}
        Some(_) => repo
            .remote_set_url("origin", &url)
            .map_err(|e| git_error(location, e))?,
        None => {
            repo.remote("origin", &url)
                .map_err(|e| git_error(location, e))?;
        }
    }
    Ok(repo)
}

fn fetch(repo: &git2::Repository, location: &str) -> Result<(), SourceError> {
    let mut remote = repo
        .find_remote("origin")
        .map_err(|e| git_error(location, e))?;
    let mut options = git2::FetchOptions::new();
    options.prune(git2::FetchPrune::On);
    remote
        .fetch(
            &[
                "+refs/heads/*:refs/remotes/origin/*",
                "+refs/tags/*:refs/tags/*",
                "+HEAD:refs/remotes/origin/HEAD",
            ],
            Some(&mut options),
            None,
        )
        .map_err(|e| SourceError::Git {
            location: location.to_string(),
            message: format!("fetch failed: {}", e.message()),
        })
}
