//! `gpuslice run`: ask the node's agent for a slice (waiting in line when none is
//! free), run the command on it under the shim, and give the slice back when the command ends.
//! The slice is held by the open connection to the agent, so a killed `gpuslice run` frees it.

use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;

use gpuslice_contract::socket::{self, Reply, Request, Want};
use gpuslice_contract::{StateDir, env};

/// Why a command could not run on a slice.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(
        "cannot reach the agent at {path}: {source} (is `gpuslice agent` running with --state {state}?)"
    )]
    Agent {
        path: String,
        state: String,
        source: std::io::Error,
    },
    #[error("the agent hung up: {0}")]
    Lost(String),
    #[error("no slice: {0}")]
    Refused(String),
    #[error("not cached: {0}")]
    NotCached(String),
    #[error("GPU reset not taken: {0}")]
    ResetRefused(String),
    #[error("the shim (libgpuslice.so) is not next to {0}; build the workspace or pass --shim")]
    NoShim(String),
    #[error("cannot start {command}: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
}

/// Where `libgpuslice.so` is: next to the running `gpuslice`, as cargo builds it, else where a
/// slice's CDI spec puts it in a container (`gpuslice run` inside a pod).
pub fn shim_library() -> Result<PathBuf, RunError> {
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().unwrap_or(Path::new("."));
    gpuslice_runtime::built::newest_built(dir, "libgpuslice.so")
        .or_else(|| {
            let mounted = PathBuf::from(gpuslice_node::kubelet::CONTAINER_SHIM);
            mounted.exists().then_some(mounted)
        })
        .ok_or_else(|| RunError::NoShim(exe.display().to_string()))
}

/// A dataset file through the node's local cache: the local path, and whether it was cached.
pub fn cache_fetch(
    state: &StateDir,
    source: &str,
    pool: Option<&str>,
) -> Result<(PathBuf, bool), RunError> {
    match ask(
        state,
        &Request::Cache {
            source: source.to_string(),
            pool: pool.map(str::to_string),
        },
    )? {
        Reply::Cached { path, hit, .. } => Ok((path, hit)),
        Reply::Refused { reason } => Err(RunError::NotCached(reason)),
        other => Err(RunError::Lost(format!("unexpected answer {other:?}"))),
    }
}

/// Tells the node's agent that `gpus` (`1`, `0,3` or `all`) were reset, so that it lifts their
/// XID quarantines; the agent takes it from root only.
pub fn gpu_reset(state: &StateDir, gpus: &str) -> Result<(), RunError> {
    match ask(
        state,
        &Request::GpuReset {
            gpus: gpus.to_string(),
        },
    )? {
        Reply::ResetTaken { .. } => Ok(()),
        Reply::Refused { reason } => Err(RunError::ResetRefused(reason)),
        other => Err(RunError::Lost(format!("unexpected answer {other:?}"))),
    }
}

/// One request to the agent's socket, and its one answer.
fn ask(state: &StateDir, request: &Request) -> Result<Reply, RunError> {
    let path = state.socket();
    let stream = UnixStream::connect(&path).map_err(|e| RunError::Agent {
        path: path.display().to_string(),
        state: state.root().display().to_string(),
        source: e,
    })?;
    let lost = |e: std::io::Error| RunError::Lost(e.to_string());
    (&stream).write_all(&socket::line(request)).map_err(lost)?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).map_err(lost)?;
    serde_json::from_str(&line).map_err(|e| RunError::Lost(e.to_string()))
}

/// Runs `command` on a slice; returns its exit code (128 + signal when killed).
pub fn run(
    state: &StateDir,
    want: &Want,
    shim: &Path,
    command: &[String],
) -> Result<i32, RunError> {
    let path = state.socket();
    let stream = UnixStream::connect(&path).map_err(|source| RunError::Agent {
        path: path.display().to_string(),
        state: state.root().display().to_string(),
        source,
    })?;
    let lost = |e: std::io::Error| RunError::Lost(e.to_string());
    let mut writer = stream.try_clone().map_err(lost)?;
    let mut send = |request: &Request| writer.write_all(&socket::line(request)).map_err(lost);
    send(&Request::Want(want.clone()))?;
    let mut replies = BufReader::new(stream);
    let (slice, config, device_uuid, checkpoint, mps_share) = loop {
        let mut line = String::new();
        if replies.read_line(&mut line).map_err(lost)? == 0 {
            return Err(RunError::Lost("no answer".into()));
        }
        match serde_json::from_str(&line).map_err(|e| RunError::Lost(e.to_string()))? {
            Reply::Queued { position } => {
                eprintln!("gpuslice run: no free slice fits; waiting, {position} in line");
            }
            Reply::Granted {
                slice,
                config,
                device_uuid,
                checkpoint,
                mps_share,
            } => break (slice, config, device_uuid, checkpoint, mps_share),
            Reply::Refused { reason } => return Err(RunError::Refused(reason)),
            other => return Err(RunError::Lost(format!("unexpected answer {other:?}"))),
        }
    };
    eprintln!("gpuslice run: on slice {slice} ({device_uuid})");
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(existing) if !existing.is_empty() => format!("{}:{existing}", shim.display()),
        _ => shim.display().to_string(),
    };
    // An MPS slice's workload is told its GPU's daemon, its SM share and its memory limit.
    let mps = std::fs::read(&config)
        .ok()
        .and_then(|b| serde_json::from_slice::<gpuslice_contract::SliceConfig>(&b).ok())
        .filter(|c| c.kind == gpuslice_contract::SliceKind::Mps)
        .map(|c| {
            let given = gpuslice_contract::SliceConfig {
                compute_percent: mps_share.unwrap_or(c.compute_percent),
                ..c
            };
            gpuslice_node::gpu::mps::client_env(
                &given,
                &state.mps_pipe(gpuslice_contract::slice::mps_device_of(&given.id)),
                0,
                given.memory_bytes,
            )
        })
        .unwrap_or_default();
    let mut child = Command::new(&command[0])
        .args(&command[1..])
        .envs(mps)
        .env("LD_PRELOAD", preload)
        .env("CUDA_VISIBLE_DEVICES", &device_uuid)
        .env("NVIDIA_VISIBLE_DEVICES", &device_uuid)
        .env(env::SLICE_CONFIG, &config)
        .env(env::SLICE, &slice)
        // How the agent will ask it to checkpoint, and where it says it has.
        .envs(
            checkpoint
                .iter()
                .flat_map(|c| c.env(&state.checkpoint_done(&slice))),
        )
        .spawn()
        .map_err(|source| RunError::Spawn {
            command: command[0].clone(),
            source,
        })?;
    // The agent drains the workload itself, not this process, when it needs the slice back.
    let _ = send(&Request::Running { pid: child.id() });
    let (again, pid) = (
        Want {
            slice: Some(slice.clone()),
            no_wait: false,
            ..want.clone()
        },
        child.id(),
    );
    let state = state.clone();
    std::thread::spawn(move || keep_claim(&state, &again, pid, replies));
    let status = child.wait().map_err(lost)?;
    use std::os::unix::process::ExitStatusExt as _;
    Ok(status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)))
}

/// How long a client waits between tries to reach an agent that went away.
const RECONNECT: std::time::Duration = std::time::Duration::from_millis(250);
/// How long it keeps trying while the agent refuses the slice (a restarted agent refuses
/// policies until it has read its source).
const REFUSALS_FOR: std::time::Duration = std::time::Duration::from_secs(30);

/// Holds the claim while the workload runs: when the agent hangs up (it restarted under the
/// workload), connects again and claims the workload's slice (`again`) once more, so that the
/// workload never runs on a slice the agent thinks free (where its watchdog would stop it).
fn keep_claim(state: &StateDir, again: &Want, pid: u32, mut replies: BufReader<UnixStream>) {
    let slice = again.slice.clone().unwrap_or_default();
    loop {
        let mut line = String::new();
        while matches!(replies.read_line(&mut line), Ok(n) if n > 0) {
            line.clear();
        }
        eprintln!("gpuslice run: the agent hung up; claiming slice {slice} again once it is back");
        let mut refused_since = None;
        replies = loop {
            std::thread::sleep(RECONNECT);
            match claim_again(state, again, pid) {
                Ok(replies) => break replies,
                Err(Some(reason)) => {
                    let since = *refused_since.get_or_insert_with(std::time::Instant::now);
                    if since.elapsed() > REFUSALS_FOR {
                        eprintln!(
                            "gpuslice run: slice {slice} not claimed again: {reason}; the workload runs without a claim"
                        );
                        return;
                    }
                }
                Err(None) => {}
            }
        };
        eprintln!("gpuslice run: slice {slice} held again");
    }
}

/// One try at claiming a workload's slice again; `Err(Some(reason))` when the agent refused it.
fn claim_again(
    state: &StateDir,
    again: &Want,
    pid: u32,
) -> Result<BufReader<UnixStream>, Option<String>> {
    let stream = UnixStream::connect(state.socket()).map_err(|_| None)?;
    (&stream)
        .write_all(&socket::line(&Request::Want(again.clone())))
        .map_err(|_| None)?;
    let mut replies = BufReader::new(stream.try_clone().map_err(|_| None)?);
    loop {
        let mut line = String::new();
        if replies.read_line(&mut line).map_err(|_| None)? == 0 {
            return Err(None);
        }
        match serde_json::from_str(&line) {
            Ok(Reply::Granted { .. }) => break,
            Ok(Reply::Queued { .. }) => {}
            Ok(Reply::Refused { reason }) => return Err(Some(reason)),
            _ => return Err(None),
        }
    }
    (&stream)
        .write_all(&socket::line(&Request::Running { pid }))
        .map_err(|_| None)?;
    Ok(replies)
}
