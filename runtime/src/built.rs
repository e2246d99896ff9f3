//! Libraries cargo built beside the running binary: the shim `gpuslice run` preloads, and the
//! emulated driver libraries of the developer build.

use std::path::{Path, PathBuf};

/// A library cargo built beside the binaries in `dir`: it leaves a workspace crate's cdylib in
/// `deps/`, and after a plain build beside the binaries too; the newer is the one just built.
pub fn newest_built(dir: &Path, file: &str) -> Option<PathBuf> {
    [dir.join(file), dir.join("deps").join(file)]
        .into_iter()
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
}
