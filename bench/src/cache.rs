//! The dataset cache's benchmark: two epochs over a dataset whose source is an HTTP server held
//! to a fixed rate (an object store behind a slow link). The first epoch fetches every shard
//! through the cache at the source's speed; the second reads them from the cache, which should
//! be as fast as reading the same bytes from the local disk (measured with direct I/O, so the
//! page cache does not flatter it).

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use gpuslice_node::protections::cache::{Cache, Source};

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum CacheBenchError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Cache(#[from] gpuslice_node::protections::cache::CacheError),
    #[error("dd: {0}")]
    Dd(String),
}

/// The shape of the run.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub shards: usize,
    pub shard_bytes: usize,
    /// What the source serves, bytes per second.
    pub source_rate: u64,
}

/// Serves `/shard-N` (`shard_bytes` of N's pattern) at `rate` bytes per second, one connection
/// at a time, until the process ends.
fn serve(listener: TcpListener, shard_bytes: usize, rate: u64) {
    const CHUNK: usize = 64 << 10;
    for stream in listener.incoming().flatten() {
        let mut reader = BufReader::new(&stream);
        let mut request = String::new();
        let _ = reader.read_line(&mut request);
        loop {
            let mut header = String::new();
            match reader.read_line(&mut header) {
                Ok(0) | Err(_) => break,
                Ok(_) if header == "\r\n" => break,
                Ok(_) => {}
            }
        }
        let shard: u8 = request
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.strip_prefix("/shard-"))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let mut out: &TcpStream = &stream;
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {shard_bytes}\r\nConnection: close\r\n\r\n"
        );
        if out.write_all(head.as_bytes()).is_err() {
            continue;
        }
        let body = vec![shard; CHUNK];
        let started = Instant::now();
        let mut sent = 0usize;
        while sent < shard_bytes {
            let n = CHUNK.min(shard_bytes - sent);
            if out.write_all(&body[..n]).is_err() {
                break;
            }
            sent += n;
            // Hold to the rate: no faster than `sent` bytes take at `rate`.
            let due = Duration::from_secs_f64(sent as f64 / rate as f64);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                std::thread::sleep(wait);
            }
        }
    }
}

/// Reads a file to its end; returns the bytes read.
fn read_all(path: &Path) -> Result<u64, std::io::Error> {
    let mut file = std::fs::File::open(path)?;
    let mut buffer = vec![0u8; 1 << 20];
    let mut total = 0;
    loop {
        let n = file.read(&mut buffer)?;
        if n == 0 {
            return Ok(total);
        }
        total += n as u64;
    }
}

/// `dd`'s direct-I/O read rate of `path`, bytes per second.
fn direct_read(path: &Path) -> Result<f64, CacheBenchError> {
    let out = std::process::Command::new("dd")
        .arg(format!("if={}", path.display()))
        .args(["of=/dev/null", "bs=1M", "iflag=direct"])
        .output()?;
    let text = String::from_utf8_lossy(&out.stderr);
    let line = text
        .lines()
        .rfind(|l| l.contains(" bytes "))
        .ok_or_else(|| CacheBenchError::Dd(text.to_string()))?;
    let bytes: f64 = line
        .split(' ')
        .next()
        .and_then(|b| b.parse().ok())
        .ok_or_else(|| CacheBenchError::Dd(line.to_string()))?;
    let seconds: f64 = line
        .split(", ")
        .find_map(|p| p.strip_suffix(" s"))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| CacheBenchError::Dd(line.to_string()))?;
    Ok(bytes / seconds)
}

/// Runs the benchmark; returns the table and whether every row passed.
pub fn run(plan: Plan) -> Result<(String, bool), CacheBenchError> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    std::thread::spawn(move || serve(listener, plan.shard_bytes, plan.source_rate));
    let dir = tempfile::tempdir()?;
    let cache = Cache::open(dir.path(), 1 << 40)?;
    let sources: Vec<Source> = (0..plan.shards)
        .map(|i| Source::Http(format!("http://127.0.0.1:{port}/shard-{i}")))
        .collect();
    let total = (plan.shards * plan.shard_bytes) as f64;
    let epoch = || -> Result<(f64, Vec<std::path::PathBuf>), CacheBenchError> {
        let started = Instant::now();
        let mut paths = Vec::new();
        for source in &sources {
            let fetched = cache.fetch(source)?;
            read_all(&fetched.path)?;
            paths.push(fetched.path);
        }
        Ok((total / started.elapsed().as_secs_f64(), paths))
    };
    let (first, paths) = epoch()?;
    let (second, _) = epoch()?;
    let mut disk = 0.0;
    for path in &paths {
        disk += direct_read(path)?;
    }
    let disk = disk / paths.len() as f64;
    let mib = |r: f64| r / 1_048_576.0;
    let source = plan.source_rate as f64;
    let rows = [
        (
            "epoch 1 (fetched from the source)",
            first,
            format!("≤ source {:.0} MiB/s", mib(source)),
            first <= source * 1.1,
        ),
        (
            "epoch 2 (from the cache)",
            second,
            format!("≥ 0.8 × local disk {:.0} MiB/s", mib(disk)),
            second >= 0.8 * disk,
        ),
        (
            "local disk, direct I/O (reference)",
            disk,
            "—".to_string(),
            true,
        ),
    ];
    let hits = cache.stats.hits.load(std::sync::atomic::Ordering::Relaxed);
    let misses = cache
        .stats
        .misses
        .load(std::sync::atomic::Ordering::Relaxed);
    let mut table = format!(
        "dataset cache: {} shards × {} MiB from an HTTP source held to {:.0} MiB/s; {misses} misses, {hits} hits\n\n| read | MiB/s | target | result |\n|---|---:|---|---|\n",
        plan.shards,
        plan.shard_bytes >> 20,
        mib(source)
    );
    let mut ok = hits == plan.shards as u64 && misses == plan.shards as u64;
    for (what, rate, target, pass) in rows {
        ok &= pass;
        table.push_str(&format!(
            "| {what} | {:.1} | {target} | {} |\n",
            mib(rate),
            if pass { "PASS" } else { "FAIL" }
        ));
    }
    table.push_str(&format!(
        "\nepoch 2 / epoch 1: {:.1}×\n",
        second / first.max(1.0)
    ));
    Ok((table, ok))
}
