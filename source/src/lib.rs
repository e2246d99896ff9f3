//! The source plane: reads configuration from a folder or a Git repository (local path or URL,
//! a ref and a sub-folder, through git2) and splits YAML files into documents that remember
//! where each field was written, so every problem can be reported as `file:line`.

pub mod follow;
pub mod last_good;
pub mod validate;
pub mod yaml;

use std::path::{Path, PathBuf};

pub use follow::{Follower, Poll, source_key};
pub use yaml::{Document, ParsedFile, Position, SyntaxError, parse};

/// Where configuration comes from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceSpec {
    /// A folder, a local Git repository, or a Git URL.
    pub location: String,
    /// Branch, tag or commit to read; a folder's files on disk are read when omitted, the
    /// remote's default branch for a URL.
    pub git_ref: Option<String>,
    /// Sub-folder of the source to read.
    pub sub_path: Option<String>,
}

/// A YAML file read from a source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceFile {
    /// Path shown to users: relative to the source root, sub-folder included.
    pub path: String,
    pub text: String,
}

/// What was read, and from which revision when it came from Git.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub files: Vec<SourceFile>,
    /// The commit the files were read from (Git sources only).
    pub revision: Option<String>,
}

/// Why a source cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{0}: no such file, folder or Git repository")]
    NotFound(String),
    #[error("{path}: cannot read: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not UTF-8 text")]
    NotText { path: String },
    #[error("{location}: {message}")]
    Git { location: String, message: String },
    #[error("{location}: ref {git_ref:?} not found ({message})")]
    UnknownRef {
        location: String,
        git_ref: String,
        message: String,
    },
    #[error("{location}: sub-folder {sub_path:?} does not exist")]
    NoSubPath { location: String, sub_path: String },
}

fn is_yaml(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml")
    )
}

fn looks_like_url(location: &str) -> bool {
    location.contains("://")
        || (location.contains('@') && location.contains(':') && !Path::new(location).exists())
}

/// Reads every YAML file of a source, sorted by path.
pub fn load(spec: &SourceSpec) -> Result<Snapshot, SourceError> {
    let mut snapshot = if looks_like_url(&spec.location) {
        load_remote(spec)?
    } else {
        let root = PathBuf::from(&spec.location);
        if !root.exists() {
            return Err(SourceError::NotFound(spec.location.clone()));
        }
        if root.is_file() {
            let text = read_text(&root)?;
            return Ok(Snapshot {
                files: vec![SourceFile {
                    path: spec.location.clone(),
                    text,
                }],
                revision: None,
            });
        }
        match &spec.git_ref {
            Some(git_ref) => {
                let repo =
                    git2::Repository::open(&root).map_err(|e| git_error(&spec.location, e))?;
                load_tree(&repo, spec, git_ref)?
            }
            None => load_folder(&root, spec)?,
        }
    };
    snapshot.files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(snapshot)
}

fn read_text(path: &Path) -> Result<String, SourceError> {
    let bytes = std::fs::read(path).map_err(|source| SourceError::Io {
        path: path.display().to_string(),
        source,
    })?;
    String::from_utf8(bytes).map_err(|_| SourceError::NotText {
        path: path.display().to_string(),
    })
}

fn load_folder(root: &Path, spec: &SourceSpec) -> Result<Snapshot, SourceError> {
    let base = match &spec.sub_path {
        Some(sub) => {
            let base = root.join(sub);
            if !base.is_dir() {
                return Err(SourceError::NoSubPath {
                    location: spec.location.clone(),
                    sub_path: sub.clone(),
                });
            }
            base
        }
        None => root.to_path_buf(),
    };
    let mut files = Vec::new();
    let walker = walkdir::WalkDir::new(&base)
        .follow_links(false)
        .into_iter()
        .filter_entry(|e| e.depth() == 0 || !e.file_name().to_string_lossy().starts_with('.'));
    for entry in walker {
        let entry = entry.map_err(|e| SourceError::Io {
            path: e
                .path()
                .map_or_else(|| base.display().to_string(), |p| p.display().to_string()),
            source: e
                .into_io_error()
                .unwrap_or_else(|| std::io::Error::other("filesystem loop")),
        })?;
        if entry.file_type().is_file() && is_yaml(entry.path()) {
            let shown = entry.path().strip_prefix(root).unwrap_or(entry.path());
            let path = Path::new(&spec.location).join(shown).display().to_string();
            files.push(SourceFile {
                path,
                text: read_text(entry.path())?,
            });
        }
    }
    Ok(Snapshot {
        files,
        revision: None,
    })
}

fn git_error(location: &str, e: git2::Error) -> SourceError {
    SourceError::Git {
        location: location.to_string(),
        message: e.message().to_string(),
    }
}

fn load_remote(spec: &SourceSpec) -> Result<Snapshot, SourceError> {
    let dir = tempfile::tempdir().map_err(|source| SourceError::Io {
        path: "temporary directory".into(),
        source,
    })?;
    let repo = git2::build::RepoBuilder::new()
        .bare(true)
        .clone(&spec.location, dir.path())
        .map_err(|e| git_error(&spec.location, e))?;
    let git_ref = spec.git_ref.clone().unwrap_or_else(|| "HEAD".to_string());
    // A bare clone keeps remote branches as origin/<name>; try that spelling too.
    load_tree(&repo, spec, &git_ref).or_else(|first| match &spec.git_ref {
        Some(r) => load_tree(&repo, spec, &format!("origin/{r}")).map_err(|_| first),
        None => Err(first),
    })
}

fn load_tree(
    repo: &git2::Repository,
    spec: &SourceSpec,
    git_ref: &str,
) -> Result<Snapshot, SourceError> {
    let unknown = |e: git2::Error| SourceError::UnknownRef {
        location: spec.location.clone(),
        git_ref: git_ref.to_string(),
        message: e.message().to_string(),
    };
    let commit = repo
        .revparse_single(git_ref)
        .and_then(|o| o.peel_to_commit())
        .map_err(unknown)?;
    let mut tree = commit.tree().map_err(|e| git_error(&spec.location, e))?;
    let prefix = spec
        .sub_path
        .as_deref()
        .map(|s| s.trim_matches('/'))
        .filter(|s| !s.is_empty());
    if let Some(sub) = prefix {
        let entry = tree
            .get_path(Path::new(sub))
            .map_err(|_| SourceError::NoSubPath {
                location: spec.location.clone(),
                sub_path: sub.to_string(),
            })?;
        tree = entry
            .to_object(repo)
            .and_then(|o| o.peel_to_tree())
            .map_err(|_| SourceError::NoSubPath {
                location: spec.location.clone(),
                sub_path: sub.to_string(),
            })?;
    }
    let mut files = Vec::new();
    let mut failure = None;
    tree.walk(git2::TreeWalkMode::PreOrder, |dir, entry| {
        let name = entry.name().unwrap_or_default();
        if name.starts_with('.') {
            return git2::TreeWalkResult::Skip;
        }
        let rel = format!(
            "{}{dir}{name}",
            prefix.map(|p| format!("{p}/")).unwrap_or_default()
        );
        if entry.kind() == Some(git2::ObjectType::Blob) && is_yaml(Path::new(name)) {
            match entry
                .to_object(repo)
                .map(|o| o.peel_to_blob().map(|b| b.content().to_vec()))
            {
                Ok(Ok(bytes)) => match String::from_utf8(bytes) {
                    Ok(text) => files.push(SourceFile { path: rel, text }),
                    Err(_) => {
                        failure = Some(SourceError::NotText { path: rel });
                        return git2::TreeWalkResult::Abort;
                    }
                },
                Ok(Err(e)) | Err(e) => {
                    failure = Some(git_error(&spec.location, e));
                    return git2::TreeWalkResult::Abort;
                }
            }
        }
        git2::TreeWalkResult::Ok
    })
    .map_err(|e| {
        failure
            .take()
            .unwrap_or_else(|| git_error(&spec.location, e))
    })?;
    if let Some(e) = failure {
        return Err(e);
    }
    Ok(Snapshot {
        files,
        revision: Some(commit.id().to_string()),
    })
}
