//! The node-local dataset cache (`GpuPool.spec.io.localCache`): a read-through cache on the
//! node's disk shared by the slices of the node. A workload asks the agent for a source — a file
//! path (a network file system's mount, say) or an `http://` URL — and gets back a local file
//! holding the same bytes: from the cache when it has them, else fetched once, however many ask
//! at the same time. Files are stored by the SHA-256 of their content (`objects/<hex>`, read-only),
//! so two sources with the same bytes share one; an index maps each source to its object and
//! when it was last used. When the objects pass the size bound, the least recently used go. The
//! index is kept on disk, so the cache survives an agent restart. The agent is the only writer;
//! a workload reads (an evicted file stays readable to whoever has it open).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

use serde::{Deserialize, Serialize};

/// Why a source cannot be given.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{0:?} is neither an absolute path (without `..`) nor an http:// URL: name a file on the node (a mounted dataset) or a URL"
    )]
    BadSource(String),
    #[error("fetching {url}: {reason}")]
    Http { url: String, reason: String },
    #[error("{source_name}: {reason}")]
    Refused { source_name: String, reason: String },
    #[error(
        "{source_name} is {size} bytes, more than the cache holds ({capacity} bytes); raise the cache's size or read it directly"
    )]
    TooBig {
        source_name: String,
        size: u64,
        capacity: u64,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CacheError + '_ {
    move |source| CacheError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Where a dataset file comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Path(PathBuf),
    Http(String),
}

impl Source {
    pub fn parse(text: &str) -> Result<Source, CacheError> {
        if text.starts_with("http://") {
            Ok(Source::Http(text.to_string()))
        } else if text.starts_with('/') {
            let path = PathBuf::from(text);
            if path
                .components()
                .any(|c| c == std::path::Component::ParentDir)
            {
                return Err(CacheError::BadSource(text.to_string()));
            }
            Ok(Source::Path(path))
        } else {
            Err(CacheError::BadSource(text.to_string()))
        }
    }

    /// What identifies the bytes: a file by its path, size and modification time (a changed
    /// file is fetched again); a URL by itself (URLs of datasets are taken to be immutable).
    fn key(&self) -> Result<String, CacheError> {
        match self {
            Source::Path(path) => {
                let (_, meta) = open_regular(path)?;
                let modified = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_nanos());
                Ok(format!("{}@{}:{modified}", path.display(), meta.len()))
            }
            Source::Http(url) => Ok(url.clone()),
        }
    }

    fn name(&self) -> String {
        match self {
            Source::Path(path) => path.display().to_string(),
            Source::Http(url) => url.clone(),
        }
    }
}

/// One source in the index.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Entry {
    object: String,
    size: u64,
    /// Milliseconds since the epoch.
    last_used: u64,
}

/// What a fetch gave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fetched {
    /// The local file (read-only).
    pub path: PathBuf,
    /// Its name under `objects/` (the content's SHA-256).
    pub object: String,
    pub size: u64,
    /// Whether the cache had it.
    pub hit: bool,
}

/// Counters for the agent's metrics.
#[derive(Debug, Default)]
pub struct Stats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub evictions: AtomicU64,
    pub fetched_bytes: AtomicU64,
}

/// A cache directory.
pub struct Cache {
    root: PathBuf,
    capacity: u64,
    index: Mutex<BTreeMap<String, Entry>>,
    /// Sources being fetched now: others asking for them wait.
    fetching: Mutex<BTreeSet<String>>,
    fetched: Condvar,
    pub stats: Stats,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Cache {
    /// Opens (or makes) the cache at `root`, holding at most `capacity` bytes: reads its index,
    /// forgets sources whose object is gone and removes objects no source names (a fetch an
    /// earlier agent did not finish).
    pub fn open(root: &Path, capacity: u64) -> Result<Cache, CacheError> {
        for dir in [root.join("objects"), root.join("tmp")] {
            std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        }
        let tmp = root.join("tmp");
        for entry in std::fs::read_dir(&tmp).map_err(io(&tmp))?.flatten() {
            let _ = std::fs::remove_file(entry.path());
        }
        let index_path = root.join("index.json");
        let mut index: BTreeMap<String, Entry> = match std::fs::read(&index_path) {
            Ok(text) => serde_json::from_slice(&text).unwrap_or_else(|e| {
                tracing::warn!("{}: unreadable ({e}); starting empty", index_path.display());
                BTreeMap::new()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(io(&index_path)(e)),
        };
        let objects = root.join("objects");
        index.retain(|_, e| objects.join(&e.object).exists());
        let named: BTreeSet<&str> = index.values().map(|e| e.object.as_str()).collect();
        for entry in std::fs::read_dir(&objects).map_err(io(&objects))?.flatten() {
            if !named.contains(entry.file_name().to_string_lossy().as_ref()) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        let cache = Cache {
            root: root.to_path_buf(),
            capacity,
            index: Mutex::new(index),
            fetching: Mutex::new(BTreeSet::new()),
            fetched: Condvar::new(),
            stats: Stats::default(),
        };
        cache.save(&cache.lock_index())?;
        Ok(cache)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    fn lock_index(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn save(&self, index: &BTreeMap<String, Entry>) -> Result<(), CacheError> {
        let path = self.root.join("index.json");
        let tmp = tempfile::NamedTempFile::new_in(self.root.join("tmp")).map_err(io(&path))?;
        serde_json::to_writer(&tmp, index).map_err(|e| io(&path)(e.into()))?;
        tmp.persist(&path).map_err(|e| io(&path)(e.error))?;
        Ok(())
    }

    /// Bytes the objects take now.
    pub fn used(&self) -> u64 {
        distinct_size(&self.lock_index())
    }

    /// The local file for `source`: the cached one, else fetched now (once, for all who ask).
    pub fn fetch(&self, source: &Source) -> Result<Fetched, CacheError> {
        let key = source.key()?;
        loop {
            {
                let mut index = self.lock_index();
                if let Some(entry) = index.get_mut(&key) {
                    entry.last_used = now_ms();
                    let fetched = Fetched {
                        path: self.root.join("objects").join(&entry.object),
                        object: entry.object.clone(),
                        size: entry.size,
                        hit: true,
                    };
                    self.save(&index)?;
                    self.stats.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok(fetched);
                }
            }
            let mut fetching = self.fetching.lock().unwrap_or_else(|p| p.into_inner());
            if fetching.insert(key.clone()) {
                break;
            }
            // Someone else fetches it: wait, then look again.
            while fetching.contains(&key) {
                fetching = self
                    .fetched
                    .wait(fetching)
                    .unwrap_or_else(|p| p.into_inner());
            }
        }
        let result = self.fill(source, &key);
        self.fetching
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key);
        self.fetched.notify_all();
        result
    }

    /// Fetches `source` into an object and indexes it, evicting the least recently used.
    fn fill(&self, source: &Source, key: &str) -> Result<Fetched, CacheError> {
        let tmp = tempfile::NamedTempFile::new_in(self.root.join("tmp"))
            .map_err(io(&self.root.join("tmp")))?;
        let mut hasher = ring::digest::Context::new(&ring::digest::SHA256);
        let too_big = |size| CacheError::TooBig {
            source_name: source.name(),
            size,
            capacity: self.capacity,
        };
        let mut writer = std::io::BufWriter::new(tmp.as_file());
        // Never more than the cache holds, whatever the source turns out to be (a file that
        // grows, a server that does not stop).
        let mut taken = 0u64;
        let capacity = self.capacity;
        let mut sink = |chunk: &[u8]| -> std::io::Result<()> {
            taken += chunk.len() as u64;
            if taken > capacity {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::FileTooLarge,
                    "larger than the cache",
                ));
            }
            hasher.update(chunk);
            writer.write_all(chunk)
        };
        let copied = match source {
            Source::Path(path) => {
                let (file, meta) = open_regular(path)?;
                if meta.len() > self.capacity {
                    return Err(too_big(meta.len()));
                }
                copy_file(path, file, &mut sink)
            }
            Source::Http(url) => crate::protections::cache::http::get(url, &mut sink),
        };
        let size = match copied {
            Ok(size) => size,
            Err(_) if taken > self.capacity => return Err(too_big(taken)),
            Err(e) => return Err(e),
        };
        writer.flush().map_err(io(tmp.path()))?;
        drop(writer);
        let object: String = hasher
            .finish()
            .as_ref()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let path = self.root.join("objects").join(&object);
        if !path.exists() {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o444))
                .map_err(io(tmp.path()))?;
            tmp.persist(&path).map_err(|e| io(&path)(e.error))?;
        }
        let mut index = self.lock_index();
        index.insert(
            key.to_string(),
            Entry {
                object: object.clone(),
                size,
                last_used: now_ms(),
            },
        );
        self.evict(&mut index, key);
        self.save(&index)?;
        self.stats.misses.fetch_add(1, Ordering::Relaxed);
        self.stats.fetched_bytes.fetch_add(size, Ordering::Relaxed);
        Ok(Fetched {
            path,
            object,
            size,
            hit: false,
        })
    }

    /// Drops the least recently used sources (never `keep`) until the objects fit, removing
    /// each object no source names any more.
    fn evict(&self, index: &mut BTreeMap<String, Entry>, keep: &str) {
        while distinct_size(index) > self.capacity {
            let Some(oldest) = index
                .iter()
                .filter(|(k, _)| k.as_str() != keep)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone())
            else {
                return;
            };
            let Some(gone) = index.remove(&oldest) else {
                return;
            };
            if !index.values().any(|e| e.object == gone.object) {
                let _ = std::fs::remove_file(self.root.join("objects").join(&gone.object));
                self.stats.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The bytes of the distinct objects the index names.
fn distinct_size(index: &BTreeMap<String, Entry>) -> u64 {
    let mut seen = BTreeSet::new();
    index
        .values()
        .filter(|e| seen.insert(e.object.as_str()))
        .map(|e| e.size)
        .sum()
}

/// What a pool asks of its cache (`io.localCache`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheSpec {
    pub path: PathBuf,
    /// Bytes; half the file system when `None`.
    pub size: Option<u64>,
    /// Directories and URL prefixes it may read.
    pub sources: Vec<String>,
}

/// Who asks for a source (the socket's peer credentials).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
}

/// The caches of the node's pools (`io.localCache`), opened as the pass finds them.
pub struct Caches {
    /// Where `/var/lib/gpuslice/cache` ([`gpuslice_api::CACHE_ROOT`]) is on this machine.
    root: PathBuf,
    /// Pool → the path it was refused for, said once.
    refused: Mutex<BTreeMap<String, String>>,
    open: Mutex<BTreeMap<String, std::sync::Arc<Cache>>>,
    /// Pool → the sources its cache may read.
    allowed: Mutex<BTreeMap<String, Vec<String>>>,
    /// GPU index → its pool, for the GPUs whose pool has a cache.
    gpus: Mutex<BTreeMap<u32, String>>,
}

impl Default for Caches {
    fn default() -> Self {
        Caches::under(PathBuf::from(gpuslice_api::CACHE_ROOT))
    }
}

impl Caches {
    /// Caches whose folders are under `root`, which stands for `/var/lib/gpuslice/cache` (the
    /// chart mounts the host's there; tests and demos put it elsewhere).
    pub fn under(root: PathBuf) -> Caches {
        Caches {
            root,
            refused: Mutex::default(),
            open: Mutex::default(),
            allowed: Mutex::default(),
            gpus: Mutex::default(),
        }
    }

    /// Opens the caches `wanted` names (pool → path and size; `None`: half the file system),
    /// keeping those already open at the same place and size. A cache that cannot be opened, or
    /// whose path is not a folder directly under the cache root, is logged and left out.
    pub fn set(&self, wanted: &BTreeMap<String, CacheSpec>, gpus: BTreeMap<u32, String>) {
        let mut refused = self.refused.lock().unwrap_or_else(|p| p.into_inner());
        let wanted: BTreeMap<String, CacheSpec> = wanted
            .iter()
            .filter_map(|(pool, spec)| {
                let declared = spec.path.display().to_string();
                match gpuslice_api::cache_folder(&declared) {
                    Ok(folder) => {
                        refused.remove(pool);
                        Some((
                            pool.clone(),
                            CacheSpec {
                                path: self.root.join(folder),
                                ..spec.clone()
                            },
                        ))
                    }
                    Err(why) => {
                        if refused.insert(pool.clone(), declared.clone()).as_ref()
                            != Some(&declared)
                        {
                            tracing::warn!("pool {pool}: no dataset cache: {why}");
                        }
                        None
                    }
                }
            })
            .collect();
        drop(refused);
        let gpus = gpus
            .into_iter()
            .filter(|(_, pool)| wanted.contains_key(pool))
            .collect();
        *self.gpus.lock().unwrap_or_else(|p| p.into_inner()) = gpus;
        *self.allowed.lock().unwrap_or_else(|p| p.into_inner()) = wanted
            .iter()
            .map(|(pool, spec)| (pool.clone(), spec.sources.clone()))
            .collect();
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|pool, cache| {
            wanted.get(pool).is_some_and(|spec| {
                cache.root() == spec.path && spec.size.is_none_or(|s| s == cache.capacity())
            })
        });
        for (pool, CacheSpec { path, size, .. }) in &wanted {
            if open.contains_key(pool) {
                continue;
            }
            let capacity = size.unwrap_or_else(|| half_of_file_system(path));
            match Cache::open(path, capacity) {
                Ok(cache) => {
                    tracing::info!(
                        "pool {pool}: dataset cache at {} ({capacity} bytes)",
                        path.display()
                    );
                    open.insert(pool.clone(), std::sync::Arc::new(cache));
                }
                Err(e) => tracing::warn!("pool {pool}: the dataset cache is not available: {e}"),
            }
        }
    }

    /// The directory of the cache of GPU `gpu`'s pool, if it has one.
    pub fn root_for_gpu(&self, gpu: u32) -> Option<PathBuf> {
        let pool = self
            .gpus
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&gpu)
            .cloned()?;
        self.all().get(&pool).map(|c| c.root().to_path_buf())
    }

    /// Pool → its cache, as open now.
    pub fn all(&self) -> BTreeMap<String, std::sync::Arc<Cache>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// `source` through `pool`'s cache (the node's only one when `pool` is not given), for
    /// `caller`: only a source the pool's `sources` allow, and a file only if the caller could
    /// read it itself.
    pub fn fetch(
        &self,
        source: &str,
        pool: Option<&str>,
        caller: Caller,
    ) -> Result<Fetched, String> {
        let all = self.all();
        let (pool, cache) = match pool {
            Some(pool) => (
                pool.to_string(),
                all.get(pool)
                    .ok_or_else(|| format!("pool {pool} has no dataset cache on this node"))?,
            ),
            None => match all.iter().collect::<Vec<_>>().as_slice() {
                [(pool, one)] => (pool.to_string(), *one),
                [] => return Err("no pool of this node has a dataset cache (io.localCache)".into()),
                _ => {
                    return Err(format!(
                        "this node has the caches of pools {}: name one",
                        all.keys().cloned().collect::<Vec<_>>().join(", ")
                    ));
                }
            },
        };
        let source = Source::parse(source).map_err(|e| e.to_string())?;
        let allowed = self
            .allowed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&pool)
            .cloned()
            .unwrap_or_default();
        if !allowed_by(&source, &allowed) {
            return Err(format!(
                "{}: not under any of GpuPool {pool}'s spec.io.localCache.sources ({}); add its directory or URL prefix there",
                source.name(),
                if allowed.is_empty() {
                    "none listed".to_string()
                } else {
                    allowed.join(", ")
                }
            ));
        }
        if let Source::Path(path) = &source {
            let (_, meta) = open_regular(path).map_err(|e| e.to_string())?;
            if !readable_by(&meta, caller.uid, caller.gid) {
                return Err(format!(
                    "{}: user {} cannot read it, so the agent will not either",
                    path.display(),
                    caller.uid
                ));
            }
        }
        cache.fetch(&source).map_err(|e| e.to_string())
    }
}

/// Half the size of the file system `path` is on (or would be, once made): the default bound.
fn half_of_file_system(path: &Path) -> u64 {
    let existing = path
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("/"));
    rustix::fs::statvfs(existing)
        .map(|s| s.f_blocks.saturating_mul(s.f_frsize) / 2)
        .unwrap_or(0)
}

/// Opens a source file for reading as the agent must: no symbolic link anywhere on the path
/// (nor `/proc`'s magic links), and only a regular file (a FIFO, a device such as `/dev/zero` or
/// a directory is refused without reading).
fn open_regular(path: &Path) -> Result<(std::fs::File, std::fs::Metadata), CacheError> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let refused = |reason: &str| CacheError::Refused {
        source_name: path.display().to_string(),
        reason: reason.to_string(),
    };
    let fd = rustix::fs::openat2(
        rustix::fs::CWD,
        path,
        // Non-blocking: opening a FIFO must not wait for a writer.
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK,
        Mode::empty(),
        ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(|e| match e {
        rustix::io::Errno::LOOP | rustix::io::Errno::XDEV => {
            refused("the path goes through a symbolic link; name the file itself")
        }
        e => io(path)(e.into()),
    })?;
    let file = std::fs::File::from(fd);
    let meta = file.metadata().map_err(io(path))?;
    if !meta.file_type().is_file() {
        return Err(refused(
            "not a regular file (a device, FIFO, socket or directory is never cached)",
        ));
    }
    Ok((file, meta))
}

/// Whether the user `uid` (group `gid`) may read a file with these owner and mode bits, so the
/// root agent never hands a caller what it could not read itself.
fn readable_by(meta: &std::fs::Metadata, uid: u32, gid: u32) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    let mode = meta.mode();
    uid == 0
        || (meta.uid() == uid && mode & 0o400 != 0)
        || (meta.gid() == gid && mode & 0o040 != 0)
        || mode & 0o004 != 0
}

/// Whether `source` is one `allowed` lists: a file under a listed directory (whole components),
/// a URL under a listed prefix.
fn allowed_by(source: &Source, allowed: &[String]) -> bool {
    allowed.iter().any(|a| match source {
        Source::Path(path) => a.starts_with('/') && path.starts_with(a),
        Source::Http(url) => a.starts_with("http://") && a.ends_with('/') && url.starts_with(a),
    })
}

fn copy_file(
    path: &Path,
    mut file: std::fs::File,
    sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
) -> Result<u64, CacheError> {
    let mut buffer = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = file.read(&mut buffer).map_err(io(path))?;
        if n == 0 {
            return Ok(total);
        }
        sink(&buffer[..n]).map_err(io(path))?;
        total += n as u64;
    }
}

mod http {
    use super::CacheError;

    /// How long a connection to the server may take.
    const CONNECT: std::time::Duration = std::time::Duration::from_secs(10);
    /// How long the server may stay silent (before its answer, between parts of the body).
    const IDLE: std::time::Duration = std::time::Duration::from_secs(60);

    /// GETs `url` (HTTP/1.1), handing the body to `sink` as it comes.
    pub fn get(
        url: &str,
        sink: &mut (dyn FnMut(&[u8]) -> std::io::Result<()> + Send),
    ) -> Result<u64, CacheError> {
        let fail = |reason: String| CacheError::Http {
            url: url.to_string(),
            reason,
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| fail(e.to_string()))?;
        let timeouts = gpuslice_runtime::http::Timeouts {
            connect: CONNECT,
            idle: IDLE,
        };
        runtime
            .block_on(gpuslice_runtime::http::get(url, timeouts, sink))
            .map_err(|e| fail(e.reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(dir: &Path, name: &str, bytes: &[u8]) -> Source {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        Source::Path(path)
    }

    #[test]
    fn a_second_read_is_a_hit_and_equal_contents_share_one_object() {
        let data = tempfile::tempdir().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::open(dir.path(), 1 << 20).unwrap();
        let a = file(data.path(), "a", b"same bytes");
        let b = file(data.path(), "b", b"same bytes");
        let first = cache.fetch(&a).unwrap();
        assert!(!first.hit);
        assert_eq!(std::fs::read(&first.path).unwrap(), b"same bytes");
        assert!(cache.fetch(&a).unwrap().hit);
        let other = cache.fetch(&b).unwrap();
        assert_eq!(other.object, first.object, "content-addressed");
        assert_eq!(cache.used(), 10);
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&first.path).unwrap().permissions(),
        );
        assert_eq!(mode & 0o222, 0, "read-only");
        // A changed source is fetched again.
        std::thread::sleep(std::time::Duration::from_millis(10));
        file(data.path(), "a", b"new bytes!");
        assert!(!cache.fetch(&a).unwrap().hit);
    }

    #[test]
    fn the_least_recently_used_go_when_the_bound_is_passed_and_the_rest_survive_a_restart() {
        let data = tempfile::tempdir().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::open(dir.path(), 30).unwrap();
        let sources: Vec<Source> = (0..3)
            .map(|i| file(data.path(), &format!("f{i}"), &[i as u8; 12]))
            .collect();
        cache.fetch(&sources[0]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        cache.fetch(&sources[1]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        cache.fetch(&sources[0]).unwrap(); // 0 is now more recent than 1
        std::thread::sleep(std::time::Duration::from_millis(5));
        cache.fetch(&sources[2]).unwrap(); // 36 bytes > 30: 1 goes
        assert_eq!(cache.stats.evictions.load(Ordering::Relaxed), 1);
        assert_eq!(cache.used(), 24);
        drop(cache);
        let again = Cache::open(dir.path(), 30).unwrap();
        assert!(
            again.fetch(&sources[0]).unwrap().hit,
            "kept across a restart"
        );
        assert!(again.fetch(&sources[2]).unwrap().hit);
        assert!(!again.fetch(&sources[1]).unwrap().hit, "evicted");
        let big = file(data.path(), "big", &[9; 64]);
        assert!(matches!(again.fetch(&big), Err(CacheError::TooBig { .. })));
    }

    #[test]
    fn many_readers_of_one_source_fetch_it_once() {
        let data = tempfile::tempdir().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let cache = std::sync::Arc::new(Cache::open(dir.path(), 1 << 30).unwrap());
        let source = file(data.path(), "shard", &vec![3u8; 8 << 20]);
        let readers: Vec<_> = (0..8)
            .map(|_| {
                let cache = cache.clone();
                let source = source.clone();
                std::thread::spawn(move || cache.fetch(&source).unwrap())
            })
            .collect();
        let got: Vec<Fetched> = readers.into_iter().map(|r| r.join().unwrap()).collect();
        assert!(got.iter().all(|f| f.object == got[0].object));
        assert_eq!(cache.stats.misses.load(Ordering::Relaxed), 1);
        assert_eq!(cache.stats.hits.load(Ordering::Relaxed), 7);
    }

    /// A pool that points its cache at a folder of other things (`/`, `/tmp`, a data folder):
    /// the root agent opens no cache there, so it removes nothing; under the cache root it does.
    #[test]
    fn a_cache_path_outside_the_cache_root_is_refused_and_nothing_there_is_removed() {
        let root = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        for sub in ["objects", "tmp"] {
            std::fs::create_dir_all(elsewhere.path().join(sub)).unwrap();
            std::fs::write(elsewhere.path().join(sub).join("precious"), b"keep").unwrap();
        }
        let caches = Caches::under(root.path().to_path_buf());
        let spec = |path: &Path| CacheSpec {
            path: path.to_path_buf(),
            size: Some(1 << 20),
            sources: Vec::new(),
        };
        for path in [
            elsewhere.path(),
            Path::new("/"),
            Path::new("/var/lib/gpuslice/cache/../../../../tmp"),
        ] {
            caches.set(
                &BTreeMap::from([("lab".to_string(), spec(path))]),
                BTreeMap::from([(0, "lab".to_string())]),
            );
            assert!(caches.all().is_empty(), "{}", path.display());
            assert_eq!(caches.root_for_gpu(0), None);
        }
        for sub in ["objects", "tmp"] {
            assert!(elsewhere.path().join(sub).join("precious").exists());
        }
        caches.set(
            &BTreeMap::from([(
                "lab".to_string(),
                spec(Path::new("/var/lib/gpuslice/cache/datasets")),
            )]),
            BTreeMap::from([(0, "lab".to_string())]),
        );
        assert_eq!(caches.root_for_gpu(0), Some(root.path().join("datasets")));
    }

    /// What a hostile caller asks the root agent for: a link to a secret, `/proc`'s magic links,
    /// a device that never ends, a FIFO, a file outside the allowed directories, a file it
    /// cannot read itself, a host not allowed. Each is refused with the reason, nothing read.
    #[test]
    fn the_cache_reads_only_allowed_regular_files_the_caller_could_read() {
        use std::os::unix::fs::PermissionsExt as _;
        let data = tempfile::tempdir().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let caches = Caches::under(dir.path().to_path_buf());
        let allowed = data.path().join("datasets");
        std::fs::create_dir_all(&allowed).unwrap();
        caches.set(
            &BTreeMap::from([(
                "lab".to_string(),
                CacheSpec {
                    path: PathBuf::from("/var/lib/gpuslice/cache/cache"),
                    size: Some(1 << 20),
                    sources: vec![
                        allowed.display().to_string(),
                        "http://datasets.internal/".into(),
                    ],
                },
            )]),
            BTreeMap::new(),
        );
        let nobody = Caller {
            uid: 65534,
            gid: 65534,
        };
        let ask = |source: &Path| caches.fetch(source.to_str().unwrap(), None, nobody);
        let shard = allowed.join("shard-0");
        std::fs::write(&shard, b"tokens").unwrap();
        assert!(ask(&shard).is_ok());

        let secret = data.path().join("secret");
        std::fs::write(&secret, b"root only").unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        let refused = |source: &Path, why: &str| {
            let err = ask(source).unwrap_err();
            assert!(err.contains(why), "{}: {err}", source.display());
        };
        refused(
            &secret,
            "not under any of GpuPool lab's spec.io.localCache.sources",
        );
        refused(Path::new("/etc/shadow"), "not under any of");
        refused(Path::new("/proc/1/root/etc/shadow"), "not under any of");
        // Inside an allowed directory: a link to the secret, a link up the tree, a device, a
        // FIFO, a directory, a file only its owner may read.
        std::os::unix::fs::symlink(&secret, allowed.join("link")).unwrap();
        refused(&allowed.join("link"), "symbolic link");
        std::os::unix::fs::symlink(data.path(), allowed.join("up")).unwrap();
        refused(&allowed.join("up/secret"), "symbolic link");
        std::os::unix::fs::symlink("/dev/zero", allowed.join("zero")).unwrap();
        refused(&allowed.join("zero"), "symbolic link");
        let fifo = allowed.join("fifo");
        assert!(
            std::process::Command::new("mkfifo")
                .arg(&fifo)
                .status()
                .unwrap()
                .success()
        );
        refused(&fifo, "not a regular file");
        std::fs::create_dir(allowed.join("sub")).unwrap();
        refused(&allowed.join("sub"), "not a regular file");
        let private = allowed.join("private");
        std::fs::write(&private, b"mine").unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o600)).unwrap();
        if rustix::process::getuid().is_root() {
            refused(&private, "user 65534 cannot read it");
        }
        assert!(
            caches
                .fetch(&format!("{}/../secret", allowed.display()), None, nobody)
                .unwrap_err()
                .contains("without `..`")
        );
        assert!(
            caches
                .fetch("http://elsewhere.example/x", None, nobody)
                .unwrap_err()
                .contains("not under any of")
        );
    }

    #[test]
    fn a_file_larger_than_the_cache_is_refused_before_it_is_read() {
        let data = tempfile::tempdir().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::open(dir.path(), 1 << 10).unwrap();
        let big = file(data.path(), "big", &vec![1u8; 4 << 10]);
        assert!(matches!(
            cache.fetch(&big),
            Err(CacheError::TooBig { size, .. }) if size == 4 << 10
        ));
        assert_eq!(cache.stats.fetched_bytes.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn sources_are_paths_or_urls() {
        assert!(matches!(Source::parse("/data/x"), Ok(Source::Path(_))));
        assert!(matches!(Source::parse("http://h/x"), Ok(Source::Http(_))));
        assert!(
            Source::parse("data/x")
                .unwrap_err()
                .to_string()
                .contains("absolute path")
        );
    }
}
